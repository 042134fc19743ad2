"""A request as the scheduler sees it: the minimum state, the rest derived."""
from __future__ import annotations

from array import array
from dataclasses import dataclass, field

from radixserve.cache.invariants import require
from radixserve.cache.manager import KVHandle
from radixserve.sampling_params import SamplingParams
from radixserve.wire.messages import FinishReason, ScoredPrompt
from radixserve.wire.plans import Logprob


@dataclass(eq=False, slots=True)
class Req:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    max_new_tokens: int  # resolved: never None, prompt + max_new_tokens fits the context and the pool
    stop_ids: frozenset[int]  # EOS (unless ignore_eos) and stop_token_ids
    arrival: float
    top_logprobs: int | None = None  # None: no logprobs; else how many alternatives come with each token's
    priority: int = 0  # the rank: larger = more important, whatever the client's convention (priority.py)
    logprob_start: int | None = None  # with top_logprobs: the prompt's logprobs from this position on
    admitted_at: float | None = None  # when it first left the queue (its queue wait ends; kept across retraction)
    first_token_at: float | None = None
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[Logprob] = field(default_factory=list)  # one per output token, when asked for
    prompt_logprobs: list[Logprob] = field(default_factory=list)  # computed so far, for prompt tokens from
    # max(logprob_start, 1) on (token t's comes from the logits at position t - 1)
    kv: KVHandle | None = None  # set while the request holds KV (running or mid-prefill)
    cached_tokens: int | None = None  # prefix reused from the cache when first admitted
    cached_tiers: tuple[int, int, int] | None = None  # ... of which from the pool (L1), host memory, storage
    finish_reason: FinishReason | None = None
    sampler_state: bool = False  # the runner holds this request's grammar matcher and/or penalty counts
    table_row: int | None = None  # the runner's row of this request's slot indices, while it holds KV
    preemptions: int = 0  # times it was retracted for a more important arrival (preempt.py)
    fresh: int = 0  # output tokens its last step added (more than 1: a verified draft)
    output_interval: int = 1  # new tokens go to the tokenizer with the first, every this many, and with the end
    sent: int = 0  # output tokens already handed to the tokenizer
    drafted: int = 0  # speculative decoding: draft tokens verified for it, and how many of them were accepted
    accepted: int = 0
    _key: array = field(init=False, repr=False)  # fill_ids packed (fill_key), extended as the output grows

    def __post_init__(self) -> None:
        require(len(self.prompt_ids) >= 1 and self.max_new_tokens >= 0, "a request needs a prompt and a budget")
        require(self.logprob_start is None or 0 <= self.logprob_start <= len(self.prompt_ids),
                "logprob_start lies within the prompt")
        self._key = array("i", self.prompt_ids)

    @property
    def ttft(self) -> float | None:
        """Arrival to first token (None before it); a prefill-only request's ends when its prompt is cached."""
        return None if self.first_token_at is None else self.first_token_at - self.arrival

    @property
    def queue_wait(self) -> float | None:
        """Arrival to first admission (None while it has never run)."""
        return None if self.admitted_at is None else self.admitted_at - self.arrival

    @property
    def due(self) -> bool:
        """Its new tokens go to the tokenizer now: its first token, then every ``output_interval`` tokens, and
        whatever it has when it ends."""
        new = len(self.output_ids) - self.sent
        return self.finished or (new > 0 and (self.sent == 0 or new >= self.output_interval))

    @property
    def seq_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def max_seq_len(self) -> int:
        return len(self.prompt_ids) + self.max_new_tokens

    @property
    def fill_ids(self) -> list[int]:
        """Every token whose KV the request needs: the prompt and the output so far. Read-only."""
        return self.prompt_ids + self.output_ids if self.output_ids else self.prompt_ids

    @property
    def fill_key(self) -> array:
        """``fill_ids`` as int32 (the radix tree's key format, so its lookups pack nothing): the prompt is packed
        once, each output token when it is first asked for. Read-only."""
        have = len(self._key)
        if have > self.seq_len:  # output was taken back: repack
            self._key = array("i", self.fill_ids)
        elif have < self.seq_len:
            self._key.extend(self.output_ids[have - len(self.prompt_ids) :])
        return self._key

    @property
    def kv_len(self) -> int:
        return self.kv.kv_len if self.kv else 0

    @property
    def extend_len(self) -> int:
        """Tokens still to compute before the next token can be sampled (1 while decoding)."""
        return self.seq_len - self.kv_len

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def prefill_only(self) -> bool:
        """max_new_tokens 0: compute (and cache) the prompt, generate nothing."""
        return self.max_new_tokens == 0

    # Prompt logprobs. Positions p in [first, n - 1) of the prompt must be computed, not matched from the cache:
    #   prompt  | t0 | t1 | ... | t(L-1) | tL ...... t(n-1) |
    #   logits                    p=L-1 -> tL      p=n-2 -> t(n-1)      (p = n-1 predicts the first output)
    @property
    def _logprob_first(self) -> int:
        return max(self.logprob_start or 0, 1) - 1

    @property
    def prompt_logprobs_pending(self) -> bool:
        return self.logprob_start is not None and (
            self._logprob_first + len(self.prompt_logprobs) < len(self.prompt_ids) - 1)

    @property
    def match_limit(self) -> int:
        """The most tokens a cache match may cover: one token is always computed (its logits give the next),
        and the prompt positions whose logprobs are still wanted are computed too."""
        limit = self.seq_len - 1
        if self.prompt_logprobs_pending:
            limit = min(limit, self._logprob_first + len(self.prompt_logprobs))
        return limit

    def prompt_logprob_span(self, start: int, end: int) -> tuple[int, list[int]] | None:
        """For a step computing positions [start, end): the offset of the first position whose logits are
        wanted and the prompt tokens they predict; None if none are."""
        if not self.prompt_logprobs_pending:
            return None
        first = self._logprob_first + len(self.prompt_logprobs)
        last = min(end, len(self.prompt_ids) - 1)
        require(first >= start, "the positions whose prompt logprobs are wanted were computed")
        if first >= last:
            return None
        return first - start, self.prompt_ids[first + 1 : last + 1]

    def prompt_logprobs_out(self) -> ScoredPrompt:
        """Everything from logprob_start on, once computed: None for the first token (nothing precedes it)."""
        start = self.logprob_start or 0
        return ScoredPrompt(self.prompt_ids[start:], ([None] if start == 0 else []) + self.prompt_logprobs)

    def tokens(self, start: int, end: int) -> list[int]:
        """fill_ids[start:end] without building fill_ids."""
        n = len(self.prompt_ids)
        if end <= n:
            return self.prompt_ids[start:end]
        if start >= n:
            return self.output_ids[start - n : end - n]
        return self.prompt_ids[start:] + self.output_ids[: end - n]

    def check_finished(self) -> FinishReason | None:
        """After a token was appended: does the request end here?"""
        last = self.output_ids[-1]
        if last in self.stop_ids:
            return FinishReason("stop", matched=last)
        if len(self.output_ids) >= self.max_new_tokens:
            return FinishReason("length", matched=None)
        return None
