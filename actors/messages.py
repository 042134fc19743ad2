"""The whole inter-actor protocol: every message is a msgspec Struct, grouped by direction.

    client -HTTP-> api --GenerateReq/AbortReq--> tokenizer --AddReq/FinishReq--> scheduler --ForwardPlan--> runner
                   api <------TextBatch/ErrorOut-- tokenizer <--TokenBatch/Rejected-- scheduler <-ForwardResult- runner
                   api <---------------------------Status/ControlReply--ControlReq--> scheduler
    every actor --Ready/Failed--> launcher

Token and slot arrays travel as raw little-endian bytes (``int32`` unless noted) -- compact and copy-cheap --
viewed back as numpy arrays with ``array``. One message per hop per step carries the whole batch.
"""
from __future__ import annotations

from typing import Any, Literal

import msgspec
import numpy as np

from radixserve.sampling_params import SamplingParams


def array(buf: bytes, dtype: type = np.int32) -> np.ndarray:
    """A read-only numpy view of an array field."""
    return np.frombuffer(buf, dtype=dtype)


def to_bytes(values, dtype: type = np.int32) -> bytes:
    return np.asarray(values, dtype=dtype).tobytes()


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
    logprobs: int = -1  # -1: none; 0: the sampled token's logprob; k > 0: also the k most likely
    priority: int = 0


class AbortReq(msgspec.Struct, tag="abort"):
    rid: str
    message: str = "aborted by the client"


# -- tokenizer -> scheduler ---------------------------------------------------------------------------------
class AddReq(msgspec.Struct, tag="add"):
    rid: str
    input_ids: bytes
    params: SamplingParams
    logprobs: int = -1
    priority: int = 0


class FinishReq(msgspec.Struct, tag="finish"):
    """End a request now (a stop string was found, or the client went away)."""

    rid: str
    reason: FinishReason


# -- scheduler -> tokenizer ---------------------------------------------------------------------------------
class TokenBatch(msgspec.Struct, tag="tokens"):
    """One new token for each of B requests; per-request arrays are in ``rids`` order."""

    rids: list[str]
    token_ids: bytes  # [B]
    prompt_tokens: bytes  # [B]
    cached_tokens: bytes  # [B]
    finished: dict[int, FinishReason]  # batch index -> why it ended (only the ones that did)
    logprob: bytes = b""  # float32 [B] (NaN where not asked for); empty when nobody asked
    top_counts: bytes = b""  # [B] how many alternatives each request has in top_ids / top_logprobs
    top_ids: bytes = b""
    top_logprobs: bytes = b""  # float32


class Rejected(msgspec.Struct, tag="rejected"):
    rid: str
    message: str


# -- tokenizer -> api ---------------------------------------------------------------------------------------
class TokenLogprob(msgspec.Struct, array_like=True):
    token: str
    token_id: int
    logprob: float
    top: list[tuple[str, int, float]]  # (token, id, logprob), most likely first


class Delta(msgspec.Struct):
    rid: str
    text: str  # text that became final since the last delta
    token_ids: list[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    finish: FinishReason | None = None
    logprobs: list[TokenLogprob] | None = None


class TextBatch(msgspec.Struct, tag="text"):
    deltas: list[Delta]


class ErrorOut(msgspec.Struct, tag="error"):
    rid: str
    message: str
    param: str | None = None


# -- api <-> scheduler (control) ----------------------------------------------------------------------------
class ControlReq(msgspec.Struct, tag="control"):
    """Between two steps: flush the cache, read or switch the policies, read the per-policy statistics."""

    reply_id: int
    op: Literal["flush_cache", "get_policies", "set_policies", "cache_stats"]
    eviction: str | None = None
    schedule: str | None = None


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


# -- scheduler -> runner ------------------------------------------------------------------------------------
class ForwardPlan(msgspec.Struct, tag="forward", frozen=True):
    """One model step over a ragged batch. Per request i (B requests), in batch order:

    ``prefix_lens[i]`` tokens are already in the pool, ``extend_lens[i]`` new tokens are computed now, and
    ``slots`` holds the request's whole row -- prefix_lens[i] + extend_lens[i] slot indices, concatenated over
    requests. The new tokens' K/V go to the last extend_lens[i] slots of that row.
    """

    step: int
    mode: Literal["extend", "decode"]  # decode: every extend_len is 1
    input_ids: bytes  # [sum(extend_lens)] the new tokens
    prefix_lens: bytes  # [B]
    extend_lens: bytes  # [B]
    slots: bytes  # [sum(prefix_lens + extend_lens)]
    sample: bytes  # uint8 [B]: 1 = sample a next token (0 = a prefill chunk that is not the last)
    temperature: bytes  # float32 [B]
    top_p: bytes  # float32 [B]
    top_k: bytes  # int32 [B], -1 = no limit
    min_p: bytes  # float32 [B]
    seed: bytes  # int64 [B], -1 = unseeded
    sample_index: bytes  # int32 [B]: index of the token being sampled in the request's output (seeded noise)
    logprobs: bytes  # int32 [B]: -1 none, else how many top alternatives to return with the token's logprob
    all_greedy: bool = False

    @property
    def batch_size(self) -> int:
        return len(self.prefix_lens) // 4


# -- runner -> scheduler ------------------------------------------------------------------------------------
class ForwardResult(msgspec.Struct, tag="result", frozen=True):
    step: int
    next_ids: bytes  # int32 [B]; -1 where the plan did not sample
    logprob: bytes = b""  # float32 [B], NaN where not asked; empty when the plan asked for none
    top_ids: bytes = b""  # int32, the requested top-k of each request back to back
    top_logprobs: bytes = b""  # float32


# -- actors -> launcher -------------------------------------------------------------------------------------
class Ready(msgspec.Struct, tag="ready"):
    name: str
    pid: int
    info: dict[str, Any] = {}


class Failed(msgspec.Struct, tag="failed"):
    name: str
    message: str


# What each inbox accepts (decoders are typed by these unions).
ApiInbox = TextBatch | ErrorOut | Status | ControlReply
TokenizerInbox = GenerateReq | AbortReq | TokenBatch | Rejected
SchedulerInbox = AddReq | FinishReq | ForwardResult | ControlReq
RunnerInbox = ForwardPlan
LauncherInbox = Ready | Failed
