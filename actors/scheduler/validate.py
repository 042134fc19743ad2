"""Whether a request can ever run on this model and this pool: the scheduler's own check (the offline Engine has
no API in front of it, and the API's checks must not be the only ones)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from radixserve.errors import InvalidRequest
from radixserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from radixserve.actors.scheduler.scheduler import SchedulerConfig

DEFAULT_MAX_NEW_TOKENS = 128
MAX_TOP_LOGPROBS = 20


def check_request(config: SchedulerConfig, capacity: int, prompt_ids: list[int], params: SamplingParams,
                  top_logprobs: int | None = None, logprob_start: int | None = None) -> int:
    """The resolved max_new_tokens, or InvalidRequest naming the field that is wrong."""
    if not isinstance(params, SamplingParams):
        raise InvalidRequest(f"sampling params must be SamplingParams, got {type(params).__name__}",
                             param="sampling_params")
    params.check_model(config.vocab_size)
    if top_logprobs is not None and not 0 <= top_logprobs <= MAX_TOP_LOGPROBS:
        raise InvalidRequest(f"top_logprobs={top_logprobs} must be in [0, {MAX_TOP_LOGPROBS}]", param="top_logprobs")
    n, ctx, cap = len(prompt_ids), config.context_length, capacity
    if n == 0:
        raise InvalidRequest("the prompt is empty; give at least one token", param="prompt")
    vocab = config.vocab_size
    if not 0 <= min(prompt_ids) <= max(prompt_ids) < vocab:
        bad = next(t for t in prompt_ids if not 0 <= t < vocab)
        raise InvalidRequest(f"token id {bad} is outside the vocabulary [0, {vocab})", param="prompt")
    if logprob_start is not None and not 0 <= logprob_start <= n:
        raise InvalidRequest(f"logprob_start_len={logprob_start} must be in [0, {n}] (the prompt has {n} tokens)",
                             param="logprob_start_len")
    limit = min(ctx, cap)
    if n >= ctx:
        raise InvalidRequest(f"the prompt has {n} tokens; this model's context is {ctx} tokens and at least one "
                             "token must be generated", param="prompt")
    if n >= cap:
        raise InvalidRequest(f"the prompt has {n} tokens; the KV pool holds only {cap} (--max-total-tokens)",
                             param="prompt")
    if params.max_new_tokens is None:
        return min(DEFAULT_MAX_NEW_TOKENS, limit - n)
    if n + params.max_new_tokens > limit:
        what = f"the context length {ctx}" if ctx <= cap else f"the KV pool size {cap} (--max-total-tokens)"
        raise InvalidRequest(
            f"prompt ({n} tokens) + max_new_tokens ({params.max_new_tokens}) = {n + params.max_new_tokens} "
            f"exceeds {what}; lower max_new_tokens to at most {limit - n}", param="max_new_tokens")
    return params.max_new_tokens
