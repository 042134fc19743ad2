"""The whole inter-actor protocol: every message is a msgspec Struct, grouped by direction.

    client -HTTP-> api --GenerateReq/AbortReq--> tokenizer --AddReq/FinishReq--> scheduler --ForwardPlan--> runner
                   api <--TextBatch/RequestError-- tokenizer <--TokenBatch/--------- scheduler <-ForwardResult- runner
                                                                    RequestError
                   api <---------------------------Status/ControlReply--ControlReq--> scheduler
                   api <--ShadowReport-- shadow <--ShadowFeed-- scheduler <--PolicySwitch-- shadow   (--shadow-policies)
    every actor --Ready/Failed--> launcher; node k's launcher <--NodeReady/NodeDown/Heartbeat--> node 0's

Token and slot arrays are numpy arrays at both ends (``int32`` unless noted) and raw bytes on the wire
(radixserve/wire/codec.py). One message per hop per step carries the whole batch. The scheduler's plans for the
runner and the runner's results are in radixserve/wire/plans.py (the model side imports only those).
"""
from __future__ import annotations

from typing import Any, Literal

import msgspec
import numpy as np

from radixserve.sampling_params import SamplingParams
from radixserve.wire.plans import ForwardResult, Logprob, Prefetched


class FinishReason(msgspec.Struct, frozen=True, omit_defaults=True):
    """Why a request ended. ``matched``: the stop token id or stop string; ``message``: for aborts."""

    type: Literal["stop", "length", "abort"]
    matched: int | str | None = None
    message: str | None = None

    def to_dict(self) -> dict:
        return msgspec.to_builtins(self)


# -- api -> tokenizer ---------------------------------------------------------------------------------------
class GenerateReq(msgspec.Struct, tag="generate"):
    """Exactly one of text / input_ids / messages (chat: rendered with the model's template)."""

    rid: str
    params: SamplingParams
    text: str | None = None
    input_ids: list[int] | None = None
    messages: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None  # chat: the functions the template shows the model (OpenAI's shape)
    top_logprobs: int | None = None  # None: no logprobs; 0: the sampled token's; k > 0: also the k most likely
    priority: int | None = None  # the client's; None: it gave none (the scheduler ranks it, priority.py)
    logprob_start: int | None = None  # with top_logprobs: also the prompt's logprobs from this position on
    continue_final_message: bool = False  # chat: a last assistant message is continued (prefill), not closed
    stream: bool = True  # the client reads the output as it comes (False: whole, at the end; see AddReq)


class AbortReq(msgspec.Struct, tag="abort"):
    rid: str
    message: str = "aborted by the client"


# -- tokenizer -> scheduler ---------------------------------------------------------------------------------
class AddReq(msgspec.Struct, tag="add"):
    rid: str
    input_ids: np.ndarray
    params: SamplingParams
    top_logprobs: int | None = None
    priority: int | None = None
    logprob_start: int | None = None
    # the scheduler hands the request's new tokens on with its first one, then every this many, and with its end:
    # 1 for a stream (or --stream-interval) and wherever the tokenizer must see each token (stop strings); more
    # for a whole result, which nobody reads before its end (fewer messages, fewer wake-ups a token)
    output_interval: int = 1


class FinishReq(msgspec.Struct, tag="finish"):
    """End a request now (a stop string was found, or the client went away)."""

    rid: str
    reason: FinishReason


# -- scheduler -> tokenizer ---------------------------------------------------------------------------------
class ScoredPrompt(msgspec.Struct, array_like=True):
    """The prompt's tokens from logprob_start on, each with its logprob (None for the prompt's first token)."""

    token_ids: list[int]
    logprobs: list[Logprob | None]


class Finished(msgspec.Struct):
    """A request that ended without a new token: max_new_tokens 0, a prefill only (its prompt is now cached)."""

    rid: str
    reason: FinishReason
    prompt_tokens: int
    cached_tokens: int
    prompt_logprobs: ScoredPrompt | None = None
    cached_tiers: list[int] | None = None  # with KV tiers: cached_tokens from the pool, host memory, storage


class TokenBatch(msgspec.Struct, tag="tokens"):
    """The new tokens of B requests (one each, or a run: a verified draft's, or the tokens held back for
    ``AddReq.output_interval``); per-request arrays are in ``rids`` order."""

    rids: list[str]
    token_ids: np.ndarray  # [sum(counts)] every request's new tokens, back to back
    prompt_tokens: np.ndarray  # [B]
    cached_tokens: np.ndarray  # [B]
    finished: dict[int, FinishReason]  # batch index -> why it ended, with its last token (only the ones that did)
    logprobs: dict[int, list[Logprob]] = {}  # batch index -> one per new token (only the requests that asked)
    prompt_logprobs: dict[int, ScoredPrompt] = {}  # batch index -> with a request's first token, if it asked
    prefilled: list[Finished] = []  # requests that ended this step without a token (max_new_tokens 0)
    cached_tiers: dict[int, list[int]] = {}  # with KV tiers: batch index -> cached tokens from L1, L2, L3
    drafts: dict[int, list[int]] = {}  # speculative decoding, with a request's last token: [drafted, accepted]
    counts: np.ndarray | None = None  # [B] how many of token_ids are each request's; None: one each

    def runs(self) -> list[list[int]]:
        """Each request's new tokens, in ``rids`` order."""
        ids = self.token_ids.tolist()
        if self.counts is None:
            return [[t] for t in ids]
        ends = np.cumsum(self.counts).tolist()
        return [ids[end - n : end] for n, end in zip(self.counts.tolist(), ends)]


# -- scheduler -> tokenizer -> api --------------------------------------------------------------------------
class RequestError(msgspec.Struct, tag="request_error"):
    """One request failed (refused, timed out, or broke on our side); it is over and holds no KV.

    ``status`` is the HTTP status the client gets: 4xx for the client's mistakes, 429/503 for load, 500 for ours.
    """

    rid: str
    message: str
    status: int = 400
    param: str | None = None
    code: str | None = None


# -- tokenizer -> api ---------------------------------------------------------------------------------------
class TokenLogprob(msgspec.Struct, array_like=True):
    token: str
    token_id: int
    logprob: float | None  # None: the prompt's first token (nothing comes before it)
    top: list[tuple[str, int, float]]  # (token, id, logprob), most likely first


TIER_NAMES = ("device", "host", "storage")  # SGLang's names for where cached tokens came from (cached_tokens_details)


def tier_details(tiers: list[int] | None) -> dict[str, int] | None:
    """``cached_tokens_details`` (SGLang's meta_info field) of a request's L1 / L2 / L3 split, None without tiers."""
    return None if tiers is None else dict(zip(TIER_NAMES, tiers))


def prediction_details(drafts: list[list[int]]) -> dict[str, int]:
    """Speculative decoding's [draft tokens, accepted] of some requests as OpenAI's completion_tokens_details."""
    drafted, accepted = sum(d[0] for d in drafts), sum(d[1] for d in drafts)
    return {"accepted_prediction_tokens": accepted, "rejected_prediction_tokens": drafted - accepted}


class Delta(msgspec.Struct):
    rid: str
    text: str  # text that became final since the last delta
    token_ids: list[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    finish: FinishReason | None = None
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob] | None = None  # once, with the first delta, when asked for
    cached_tiers: list[int] | None = None  # with KV tiers: cached_tokens from the pool, host memory, storage
    drafts: list[int] | None = None  # speculative decoding, with the last delta: [draft tokens, accepted]
    # characters at the end of the text already handed out that the final text drops: a stop_regex match that
    # began there (its start streamed before the match was whole). Whole results drop them; a stream cannot.
    cut: int = 0


class TextBatch(msgspec.Struct, tag="text"):
    deltas: list[Delta]


# -- api <-> scheduler (control) ----------------------------------------------------------------------------
class ControlReq(msgspec.Struct, tag="control"):
    """Between two steps: flush the cache, read or switch the policies, read the per-policy statistics, read
    what the dashboard shows of the tree and the queues."""

    reply_id: int
    op: Literal["flush_cache", "get_policies", "set_policies", "cache_stats", "dashboard"]
    eviction: str | None = None
    schedule: str | None = None
    write: str | None = None  # the lower KV tiers' write and prefetch policies (--enable-hierarchical-cache)
    prefetch: str | None = None
    draft: str | None = None  # speculative decoding's draft policy (--speculative-algorithm)
    keep_storage: bool = False  # flush_cache: L3 keeps its pages


class TextReq(msgspec.Struct, tag="text_req"):
    """api -> tokenizer, for /tokenize and /detokenize (the tokenizer actor holds the only tokenizer); answered
    with a ControlReply: ``{"tokens": [[ids]...]}`` or ``{"texts": [...]}``, or ``error`` for a bad input."""

    reply_id: int
    op: Literal["tokenize", "detokenize"]
    texts: list[str] = []  # tokenize: each encoded
    messages: list[dict[str, Any]] | None = None  # tokenize: one chat, rendered with the chat template
    tools: list[dict[str, Any]] | None = None  # with messages: the functions the template shows
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    token_ids: list[list[int]] = []  # detokenize: each decoded
    skip_special_tokens: bool = True


class ControlReply(msgspec.Struct, tag="reply"):
    reply_id: int
    body: dict[str, Any]
    error: str | None = None  # the request was refused (e.g. an unknown policy); nothing changed


class Status(msgspec.Struct, tag="status"):
    """The scheduler's state, pushed to the api after steps (at most a few times a second) and when idle."""

    running: int
    waiting: int
    capacity: int
    free: int
    evictable: int
    protected: int
    retractions: int
    evicted_tokens: int
    steps: int
    eviction: str  # the policies in charge, and what finished under them (the current epoch)
    schedule: str
    epoch_requests: int
    epoch_prompt_tokens: int
    epoch_cached_tokens: int
    epoch_evicted_tokens: int
    queue_timeouts: int = 0
    failed_requests: int = 0
    replica: int = 0  # which data-parallel replica's scheduler (--dp)
    tiers: dict[str, float] = {}  # --enable-hierarchical-cache: the tiers' counts (cache/tiers.LowerTiers.counts)
    speculative: dict[str, Any] = {}  # --speculative-algorithm: Speculation.info() (draft policy, its totals)


# -- scheduler -> shadow (the live trace, --shadow-policies) ---------------------------------------------------
class ShadowArrival(msgspec.Struct, array_like=True):
    rid: str
    at: float  # the scheduler's clock when it was queued
    prompt: np.ndarray
    max_new_tokens: int
    priority: int = 0


class ShadowEnd(msgspec.Struct, array_like=True):
    rid: str
    at: float  # its arrival (with the rid, names the request: a client may reuse a rid)
    output: np.ndarray  # every token it generated (none if it ended before its first)
    admitted: bool  # False: it ended (aborted, timed out) before it ever ran
    greedy: bool = True  # its output is the model's argmax (the draft policies' shadows measure only those)


class StepTiming(msgspec.Struct, array_like=True):
    mode: Literal["extend", "decode"]
    tokens: int  # new tokens computed
    batch: int
    seconds: float  # plan sent to result back


class ShadowFeed(msgspec.Struct, tag="shadow_feed"):
    """What happened since the last feed: requests queued, requests ended, steps timed; and the live state."""

    now: float
    eviction: str
    schedule: str
    capacity: int
    arrivals: list[ShadowArrival]
    ends: list[ShadowEnd]
    steps: list[StepTiming]
    dropped: int = 0  # events the scheduler dropped since the last feed (the shadow's inbox stayed full)


# -- shadow -> scheduler, shadow -> api ---------------------------------------------------------------------
class PolicySwitch(msgspec.Struct, tag="policy_switch"):
    """--auto-policy: switch to these policies; ``reason`` is the evidence, logged and kept with the epoch."""

    eviction: str
    schedule: str
    reason: str


class ShadowReport(msgspec.Struct, tag="shadow_report"):
    """Every pair's windowed statistics, the leader, the switches (GET /policies/shadow shows ``body``)."""

    body: dict[str, Any]


# -- actors -> launcher -------------------------------------------------------------------------------------
class Ready(msgspec.Struct, tag="ready"):
    name: str
    pid: int
    info: dict[str, Any] = {}


class Failed(msgspec.Struct, tag="failed"):
    name: str
    message: str


# -- launcher <-> launcher, across nodes (actors/nodes.py) ----------------------------------------------------
class NodeReady(msgspec.Struct, tag="node_ready"):
    """A node's ranks are all up: their Ready infos, by actor name."""

    node: int
    actors: dict[str, dict[str, Any]]
    config: dict[str, Any] = {}  # what every node must agree on (the model's shape, dtype, tp, ...)


class NodeDown(msgspec.Struct, tag="node_down"):
    """A node is ending (one of its actors died, a signal, a failed start): every other node ends too."""

    node: int
    reason: str


class Heartbeat(msgspec.Struct, tag="heartbeat"):
    node: int


# What each inbox accepts (decoders are typed by these unions).
ApiInbox = TextBatch | RequestError | Status | ControlReply | ShadowReport
TokenizerInbox = GenerateReq | AbortReq | TokenBatch | RequestError | TextReq
SchedulerInbox = AddReq | FinishReq | ForwardResult | ControlReq | PolicySwitch | Prefetched
ShadowInbox = ShadowFeed
LauncherInbox = Ready | Failed
NodeInbox = NodeReady | NodeDown | Heartbeat
