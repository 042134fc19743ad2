"""The ``draft-model`` draft policy (SGLang's STANDALONE): a second, smaller causal LM with the served model's
tokenizer guesses each request's next tokens greedily; the served model verifies them (actors/scheduler/speculate.py),
so the answer is the served model's whatever the draft model says.

The draft model is a Hugging Face checkpoint folder (``--speculative-draft-model-path``), run by transformers in the
scheduler's process on ``DraftOptions.threads`` threads (1 by default: it runs between the served model's steps,
and a single thread never spins at a barrier on a core the runner needs). Each request keeps the draft model's own
KV cache (a ``DynamicCache``): a proposal feeds only the tokens the cache has not seen (the prompt once, then the
tokens kept since) and drops what a rejected draft left in it (``crop``), so a draft of k tokens costs k small
steps, not a pass over the whole sequence.
"""
from __future__ import annotations

import inspect
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from radixserve.policies.draft_trees import accepted_prefix
from radixserve.policies.drafts import DraftCache, DraftOptions

log = logging.getLogger(__name__)


@dataclass
class Seen:
    """One request's tokens in the draft model's KV cache, and that cache."""

    tokens: list[int] = field(default_factory=list)
    kv: object = None


class DraftModel:
    name = "draft-model"

    def __init__(self, options: DraftOptions | None = None) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        path = options.model_path if options is not None else None
        if not path:
            raise ValueError("the draft-model policy needs a draft model: start with --speculative-draft-model-path")
        if not (Path(path) / "config.json").is_file():
            raise ValueError(f"--speculative-draft-model-path {path}: not a Hugging Face checkpoint folder (no "
                             "config.json)")
        self.torch, self.threads = torch, options.threads
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, options.dtype),
                                                          local_files_only=True).eval()
        self.seen: dict[str, Seen] = {}
        params = inspect.signature(self.model.forward).parameters  # transformers renamed it (5.2x: ``cache``)
        self.cache_arg = "cache" if "cache" in params else "past_key_values"
        log.info("draft model %s (%.1fM parameters, %s, %d thread(s))", path,
                 sum(p.numel() for p in self.model.parameters()) / 1e6, options.dtype, options.threads)

    def propose(self, rid: str, tokens: Sequence[int], k: int, cache: DraftCache) -> list[int]:
        from transformers import DynamicCache

        torch = self.torch
        seen = self.seen.setdefault(rid, Seen())
        keep = min(accepted_prefix(seen.tokens, tokens), len(tokens) - 1)  # shared with the cache; >= 1 to feed
        if seen.kv is None or keep == 0:
            seen.kv, keep = DynamicCache(), 0
        elif len(seen.tokens) > keep:
            seen.kv.crop(keep - len(seen.tokens))  # negative: drop that many (transformers 5.x takes only those)
        seen.tokens = list(tokens[:keep])
        feed, draft = list(tokens[keep:]), []
        threads = torch.get_num_threads()  # the caller's (an Engine's runner shares this thread): given back
        torch.set_num_threads(self.threads)
        try:
            with torch.inference_mode():
                for _ in range(k):
                    out = self.model(input_ids=torch.tensor([feed]), use_cache=True, **{self.cache_arg: seen.kv})
                    seen.tokens += feed
                    feed = [int(out.logits[0, -1].argmax())]
                    draft.append(feed[0])
        finally:
            torch.set_num_threads(threads)
        return draft  # the cache holds the draft's first k-1 tokens: kept ones are not fed again

    def release(self, rid: str, tokens: Sequence[int]) -> None:
        self.seen.pop(rid, None)
