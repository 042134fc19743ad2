"""A request as the scheduler sees it: the minimum state, the rest derived."""
from __future__ import annotations

from dataclasses import dataclass, field

from radixserve.actors.messages import FinishReason, Logprob
from radixserve.cache.invariants import require
from radixserve.cache.manager import KVHandle
from radixserve.sampling_params import SamplingParams


@dataclass(eq=False, slots=True)
class Req:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    max_new_tokens: int  # resolved: never None, prompt + max_new_tokens fits the context and the pool
    stop_ids: frozenset[int]  # EOS (unless ignore_eos) and stop_token_ids
    arrival: float
    top_logprobs: int | None = None  # None: no logprobs; else how many alternatives come with each token's
    priority: int = 0  # larger = more important (priority schedule / eviction policies)
    first_token_at: float | None = None
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[Logprob] = field(default_factory=list)  # one per output token, when asked for
    kv: KVHandle | None = None  # set while the request holds KV (running or mid-prefill)
    cached_tokens: int | None = None  # prefix reused from the cache when first admitted
    finish_reason: FinishReason | None = None

    def __post_init__(self) -> None:
        require(len(self.prompt_ids) >= 1 and self.max_new_tokens >= 0, "a request needs a prompt and a budget")

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
    def kv_len(self) -> int:
        return self.kv.kv_len if self.kv else 0

    @property
    def extend_len(self) -> int:
        """Tokens still to compute before the next token can be sampled (1 while decoding)."""
        return self.seq_len - self.kv_len

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

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
