"""What the scheduler and the model runner say to each other, once a step: the plan (``ForwardPlan``: which tokens
to compute, into which KV slots, how to sample) and its result (``ForwardResult``), and the lower KV tiers' share
(``TierOps``, ``Prefetch``/``Prefetched``). The model side (model/, cache/tiers.py) imports these and nothing
else of the protocol; radixserve/wire/messages.py holds the rest."""
from __future__ import annotations

from typing import Any, Literal

import msgspec
import numpy as np


class Logprob(msgspec.Struct, array_like=True):
    """The sampled token's log-probability and the ``top_logprobs`` most likely tokens, most likely first."""

    logprob: float
    top_ids: list[int] = []
    top_logprobs: list[float] = []


# -- scheduler -> runner ------------------------------------------------------------------------------------
class SamplingBatch(msgspec.Struct, frozen=True):
    """How to pick the next token of each request that samples this step (the plan's ``sample`` rows, in batch
    order). Every value is explicit: ``top_k`` is the vocabulary size when there is no limit."""

    temperature: np.ndarray  # float32 [S]; 0 = greedy
    top_p: np.ndarray  # float32 [S]
    top_k: np.ndarray  # int32 [S], 1 ..= vocab
    min_p: np.ndarray  # float32 [S]
    seeds: list[int | None]  # [S] None: unseeded
    output_index: np.ndarray  # int32 [S]: the position of the token being sampled in the request's output
    top_logprobs: list[int | None]  # [S] None: no logprobs; else how many alternatives to return
    all_greedy: bool = False
    constraints: list[str | None] = []  # [S] the request id of a row under a grammar (None: free); empty: none
    penalized: list[str | None] = []  # [S] the request id of a row whose logits are adjusted (PenaltySpec)
    processed: list[str | None] = []  # [S] the request id of a row a named logit processor changes (ProcessorSpec)


class PromptLogprobs(msgspec.Struct, array_like=True, frozen=True):
    """Log-probabilities wanted for part of one request's prompt: the new tokens at offsets ``first ..
    first + len(targets) - 1`` of this step predict ``targets`` (int32); ``top`` alternatives come with each."""

    first: int
    targets: np.ndarray
    top: int


class GrammarSpec(msgspec.Struct, array_like=True, frozen=True):
    """A request's output constraint, sent to the runner once, with the request's first sampling step."""

    kind: Literal["regex", "json_schema", "ebnf"]
    source: str


class PenaltySpec(msgspec.Struct, array_like=True, frozen=True):
    """A request's logit adjustments, sent to the runner once, with the request's first sampling step; from then
    on the runner counts the request's output tokens itself (one increment per sampled token)."""

    frequency: float
    presence: float
    repetition: float
    min_new_tokens: int
    suppressed: list[int]  # banned while the output is shorter than min_new_tokens: EOS and stop_token_ids
    bias_ids: list[int]
    bias_values: list[float]


class ProcessorSpec(msgspec.Struct, array_like=True, frozen=True):
    """A request's named logit processor and its custom_params, sent to the runner once, with the request's first
    sampling step (radixserve/logit_processors.py)."""

    name: str
    params: dict[str, Any]


class PageLoad(msgspec.Struct, array_like=True, frozen=True):
    """Pages a request's read-back brought into the runner, copied into the pool before the step's forward: the
    tokens from ``skip`` into the first page on, into ``slots`` (one per token, in order)."""

    fetch: int  # the read-back's id (Prefetch.fetch)
    keys: list[bytes]
    skip: int
    slots: np.ndarray


class TierOps(msgspec.Struct, array_like=True, frozen=True):
    """The lower KV tiers' share of a step, done before its forward: ``writes`` (pages of the pool, a key and
    page_size slots each, ``write_slots`` back to back: copied out now, since the step may reuse their slots) go
    below; ``loads`` come back into the pool; ``drops``: requests whose read-back will not be used (its pages are
    no longer held for them): read-backs by id."""

    write_keys: list[bytes] = []
    write_slots: np.ndarray | None = None
    loads: list[PageLoad] = []
    drops: list[int] = []


class Prefetch(msgspec.Struct, tag="prefetch", frozen=True):
    """Read a waiting request's pages back from the lower tiers (in the runner's background, in order, stopping
    at the first page found nowhere); the runner answers ``Prefetched``. Sent to the runner's tier thread's own
    inbox, not with the plans (the runner reads those only between steps)."""

    fetch: int  # an id of its own (a request's rid may be asked for again, and its drop must not end the new one)
    keys: list[bytes]
    flush: int = 0  # 2: forget every page in host memory first; 3: in storage too (then keys is empty)


class ForwardPlan(msgspec.Struct, tag="forward", frozen=True):
    """One model step over a ragged batch. Per request i (B requests), in batch order:

    ``prefix_lens[i]`` tokens are already in the pool, ``extend_lens[i]`` new tokens are computed now; the new
    tokens' K/V go to row positions prefix_lens[i] .. prefix_lens[i] + extend_lens[i] - 1 of the request's row of
    slot indices. The runner keeps every request's row (``rows[i]``: its row number, assigned by the scheduler);
    the plan sends only what changed: the slots of positions ``row_writes[i]`` .. prefix + extend of each row,
    back to back in ``new_slots`` (a decode step: one slot per request). ``sample[i]`` is 1 when request i samples
    its next token this step (0: a prefill chunk that is not its last, or a prefill-only request).
    """

    step: int
    mode: Literal["extend", "decode"]  # decode: every extend_len is 1
    input_ids: np.ndarray  # [sum(extend_lens)] the new tokens
    prefix_lens: np.ndarray  # [B]
    extend_lens: np.ndarray  # [B]
    rows: np.ndarray  # [B] the runner's row of each request's slot indices
    row_writes: np.ndarray  # [B] the first row position new_slots writes, per request
    new_slots: np.ndarray  # [sum(prefix + extend - row_writes)]
    sample: np.ndarray  # uint8 [B]
    sampling: SamplingBatch
    prompt_logprobs: dict[int, PromptLogprobs] = {}  # batch index -> the prompt logprobs it wants this step
    new_grammars: dict[str, GrammarSpec] = {}  # rid -> its constraint, from this step on
    new_penalties: dict[str, PenaltySpec] = {}  # rid -> its logit adjustments, from this step on
    new_processors: dict[str, ProcessorSpec] = {}  # rid -> its named logit processor, from this step on
    released: list[str] = []  # requests that ended: the runner drops their grammars, penalty counts, processors
    tiers: TierOps | None = None  # --enable-hierarchical-cache: pages written below and loaded back
    # speculative decoding (an extend plan that verifies drafts): [B] the last drafts[i] input tokens of request i
    # are a draft; the runner also returns the draft's tokens its check kept (``drafted``)
    drafts: np.ndarray | None = None
    # ... a draft tree's: each draft token's parent (an index into its request's draft, -1: its last token), all
    # drafts back to back; None when every draft is a chain (parents -1, 0, 1, ...)
    draft_parents: np.ndarray | None = None
    # overlap (a decode step planned while the step before it computed): input_ids[i] is the token step
    # ``follows`` sampled in its row ``follow_rows[i]`` (the runner fills them in; the scheduler did not know them)
    follows: int | None = None
    follow_rows: np.ndarray | None = None

    @property
    def batch_size(self) -> int:
        return len(self.prefix_lens)

    def filled(self, sampled: tuple[int, list[int | None]] | None) -> ForwardPlan:
        """This plan with its input tokens, where it ``follows`` a step: ``sampled`` is the runner's last step
        and the tokens it sampled (a row whose sampling failed gives token 0: its request has failed)."""
        if self.follows is None:
            return self
        if sampled is None or sampled[0] != self.follows:
            raise RuntimeError(f"step {self.step} takes its tokens from step {self.follows}, which sampled none")
        ids = [sampled[1][j] for j in self.follow_rows.tolist()]
        return msgspec.structs.replace(self, input_ids=np.asarray([t or 0 for t in ids], dtype=np.int32))


# -- runner -> scheduler ------------------------------------------------------------------------------------
class ForwardResult(msgspec.Struct, tag="result", frozen=True):
    """``next_ids[j]``: the token sampled for the j-th sampling row of the plan, None where sampling it failed
    (``errors[j]`` says why). ``error``: the whole step failed (nothing in it was computed)."""

    step: int
    next_ids: list[int | None] = []
    logprobs: dict[int, Logprob] = {}  # sampling row -> logprobs (only the requests that asked)
    prompt_logprobs: dict[int, list[Logprob]] = {}  # batch index -> one per target of the plan's PromptLogprobs
    grammar_done: list[int] = []  # sampling rows whose grammar is complete with this token: the request ends
    errors: dict[int, str] = {}
    error: str | None = None
    drafted: dict[int, list[int]] = {}  # batch index -> the tokens of its draft's path the check kept (the model's
    # own choices); the token after them is its next_ids row


class Prefetched(msgspec.Struct, tag="prefetched", frozen=True):
    """A ``Prefetch`` is done: ``tiers[i]`` is where page i was found (2: host memory, 3: storage); the pages
    after the last one listed were found nowhere (or were damaged, and dropped). ``counters``: the runner's tier
    totals so far (bytes read and written, pages dropped as damaged, ...)."""

    fetch: int
    tiers: list[int]
    seconds: float
    counters: dict[str, float] = {}


RunnerInbox = ForwardPlan  # what the runner's inbox accepts
