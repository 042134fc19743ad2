"""Constrained decoding in the runner: one llguidance matcher per constrained request, beside the sampler.

Each step, before sampling, every constrained row's logits lose the tokens its grammar forbids; after sampling,
the row's matcher consumes the chosen token. Unconstrained rows in the same batch are not touched. The masks
depend only on the tokens consumed so far, so they are filled on a helper thread while the model computes the
step (llguidance releases the GIL, as torch does): on a CPU the fill mostly hides behind the forward.

Ownership of a matcher's state (the scheduler decides, the runner follows, as with KV slots):

    plan.new_grammars[rid]       the request's first sampling step: compile (cached by source) and start
    rows of sampling.constraints mask, sample, consume -- consumed tokens == the request's output tokens
    plan.released                the request ended (finished, aborted, failed): drop the matcher

``consumed`` is checked against the row's ``output_index`` every step: a matcher that ever disagrees with the
scheduler about a request's output fails that request alone instead of constraining it wrongly.
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from radixserve.structured import grammar, limits
from radixserve.wire.plans import GrammarSpec

log = logging.getLogger(__name__)

COMPILED_CACHE = 256  # compiled grammars kept (by source); a new request copies one in microseconds


@dataclass
class _Live:
    matcher: object  # llguidance.LLMatcher
    consumed: int = 0


@dataclass
class Masks:
    """One step's masks: ``forbidden[j, t]`` is set where sampling row j may not take token t (None: no row is
    constrained); ``errors``: row -> why it cannot be constrained (it must not be sampled)."""

    forbidden: torch.Tensor | None = None  # bool [S, vocab]
    errors: dict[int, str] = field(default_factory=dict)


class Constraints:
    def __init__(self, tokenizer_path: Path, vocab_size: int) -> None:
        self.tokenizer_path = tokenizer_path
        self.vocab_size = vocab_size
        self._tokenizer = None  # llguidance's view of the tokenizer: built on the first constrained request
        self._compiled: OrderedDict[tuple[str, str], object] = OrderedDict()
        self.live: dict[str, _Live] = {}
        self._filler: ThreadPoolExecutor | None = None  # one thread: fills masks while the model runs

    def update(self, new: dict[str, GrammarSpec], released: list[str]) -> dict[str, str]:
        """Drop the released requests' matchers, start the new ones'. Returns rid -> error for a grammar that
        cannot be started (that request fails alone)."""
        for rid in released:
            self.live.pop(rid, None)
        errors = {}
        for rid, spec in new.items():
            try:
                self.live[rid] = _Live(self._compile(spec).deep_copy())
            except Exception as exc:
                log.exception("could not start the grammar of request %s", rid)
                errors[rid] = f"{type(exc).__name__}: {exc}"
        return errors

    def fill(self, rows: list[str | None], output_index: list[int]) -> Masks:
        """The masks of this step's constrained rows, from their matchers' states (reads only)."""
        out = Masks()
        forbidden = np.zeros((len(rows), self.vocab_size), dtype=bool)
        for j, rid in enumerate(rows):
            if rid is None:
                continue
            live = self.live.get(rid)
            if live is None or live.consumed != output_index[j]:
                out.errors[j] = "grammar state lost" if live is None else (
                    f"grammar consumed {live.consumed} tokens, the request has {output_index[j]}")
                continue
            bits = np.unpackbits(np.frombuffer(live.matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
            allowed = bits[: self.vocab_size]
            if not allowed.any():
                out.errors[j] = f"the grammar allows no token: {live.matcher.get_error() or 'it has ended'}"
                continue
            np.equal(allowed, 0, out=forbidden[j])
        out.forbidden = torch.from_numpy(forbidden)
        return out

    def fill_async(self, rows: list[str | None], output_index: list[int]) -> Future[Masks]:
        """``fill`` on the helper thread; nothing may touch the matchers until its result is taken."""
        if self._filler is None:
            self._filler = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")
        return self._filler.submit(self.fill, rows, output_index)

    @staticmethod
    def apply(logits: torch.Tensor, masks: Masks) -> None:
        """Set the logits of the tokens each constrained row may not take to -inf (in place)."""
        if masks.forbidden is not None:
            logits.masked_fill_(masks.forbidden.to(logits.device), float("-inf"))

    def advance(self, rows: list[str | None], next_ids: list[int | None]) -> tuple[list[int], dict[int, str]]:
        """Feed each constrained row its sampled token. Returns the rows whose grammar is now complete (the
        request ends there) and row -> error for a token the grammar refused."""
        done, errors = [], {}
        for j, (rid, token) in enumerate(zip(rows, next_ids)):
            if rid is None or token is None or rid not in self.live:
                continue
            live = self.live[rid]
            if not live.matcher.consume_token(token):
                errors[j] = f"token {token} is outside the grammar: {live.matcher.get_error()}"
                continue
            live.consumed += 1
            if live.matcher.is_stopped():
                done.append(j)
        return done, errors

    def _compile(self, spec: GrammarSpec):
        import llguidance

        key = (spec.kind, spec.source)
        if key in self._compiled:
            self._compiled.move_to_end(key)
            return self._compiled[key]
        # the same lexer limits as validation: a grammar that outgrows them fails its own request, quickly
        matcher = llguidance.LLMatcher(self._llg_tokenizer(), grammar(spec.kind, spec.source), log_level=0,
                                       limits=limits())
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        self._compiled[key] = matcher
        if len(self._compiled) > COMPILED_CACHE:
            self._compiled.popitem(last=False)
        return matcher

    def _llg_tokenizer(self):
        if self._tokenizer is None:
            import llguidance.hf
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(self.tokenizer_path)
            self._tokenizer = llguidance.hf.from_tokenizer(tok, n_vocab=self.vocab_size)
        return self._tokenizer
