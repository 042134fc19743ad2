"""Decode steps as compiled graphs on the CPU: torch.compile (inductor's C++ backend) of one decoder layer's decode.

An eager decode step is hundreds of small ops (per layer: norm, projections, RoPE, KV store, gather, attention,
SiLU-mul, residuals), each paying Python and dispatcher time. Compiled, a layer is one call: the element-wise work
is fused into a few C++ loops, the KV store and attention run inside the graph, and only the linear layers stay
library calls (oneDNN's packed products; opaque to the compiler as ``radixserve::packed_linear``).

Why one layer and not the whole step: every layer has the same code, so one graph serves all of them (its weights
and KV pool are inputs); compiling takes seconds instead of minutes for the 30-layer graph, and a call per layer
costs little beside the layer's work (benchmarks/compile_cost.py measures the start-up). The embedding and the output projection stay eager (one op each).

Shapes: the context length is dynamic (one graph for every length). The batch size is specialised for 1, then
dynamic; products of 64 rows and more may switch kernels (``cpu_linear.F32_MIN_ROWS``), which is a third graph. All
of them are compiled at start-up (``warm_up``), and compiled code is cached on disk, so a restart mostly loads it.
A step that would need a new graph never compiles on a request's path: ``fail_on_recompile`` raises, and that
batch size runs eager from then on (logged).

Numerics: the fused code is told to round every intermediate to the model's dtype where eager ops round
(``emulate_precision_casts``), so bf16 greedy tokens almost always match eager's (the bench run: 1 of 16 prompts
differed within 48 tokens); float32 greedy output stays identical to HF in the parity tests.
``benchmarks/compile_cost.py`` counts the greedy tokens that flip against eager (bf16 and fp32).
"""
from __future__ import annotations

import logging
import os
import time
import types
from pathlib import Path

import torch

from radixserve.kernels.base import AttentionBatch
from radixserve.model.forward_batch import ForwardBatch, KVPool, RopeTable
from radixserve.model.causal_lm import CausalLM
from radixserve.trusted_cache import private_dir
from radixserve.model.layers import DecoderLayer

log = logging.getLogger(__name__)

BIG_BATCH = 64  # = cpu_linear.F32_MIN_ROWS: from here a linear may take another path, so another graph


def _decode_layer(layer: DecoderLayer, h: torch.Tensor, batch: ForwardBatch, k_pool: torch.Tensor,
                  v_pool: torch.Tensor) -> torch.Tensor:
    return layer(h, batch, k_pool, v_pool)


class CompiledDecode:
    """Runs the model's decode steps through a compiled layer where the attention backend allows it
    (``applies``); everything else (prefill, shared-prefix decode, other backends) stays eager."""

    def __init__(self, model: CausalLM, kv: KVPool, rope: RopeTable, cache_dir: Path,
                 local_rope: RopeTable | None = None) -> None:
        # inductor's on-disk cache of compiled graphs, kept across restarts with radixserve's other caches (inductor
        # reads the variable whenever it compiles, and fills it with a /tmp default on first use)
        # inductor loads the code it cached there: only from a folder no one else can write (UntrustedCache)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(private_dir(cache_dir))
        self.model, self.kv, self.rope, self.local_rope = model, kv, rope, local_rope
        # emulate_precision_casts: fused code rounds each intermediate to the model's dtype where eager ops do;
        # without it bf16 greedy tokens differed from eager in 2 of 8 prompts within 24 tokens here, with it in
        # 0 of 8 (and 1 of 16 within 48 tokens in the bench run), at the same speed
        # a code object of its own: dynamo keeps its graphs, and counts recompiles against its limit, per code
        # object, so runners in one process (tests) do not use up each other's (a model with sliding and global
        # layers takes a graph per kind of layer and batch size)
        own = types.FunctionType(_decode_layer.__code__.replace(), _decode_layer.__globals__, _decode_layer.__name__)
        self.layer = torch.compile(own, fullgraph=True, options={"emulate_precision_casts": True})
        self.eager_sizes: set[int] = set()  # batch sizes whose graph was missing: they run eager
        self.compile_seconds = 0.0
        self.steps = 0  # decode steps that ran compiled

    def applies(self, batch: ForwardBatch) -> bool:
        compilable = getattr(batch.attn_backend, "compilable", None)
        return (batch.attn.mode == "decode" and compilable is not None and compilable(batch.attn)
                and len(batch.input_ids) not in self.eager_sizes)

    def _compiled(self, batch: ForwardBatch) -> torch.Tensor:
        attn = batch.attn.backend_data
        torch._dynamo.mark_dynamic(attn.index, 1)  # the context length: one graph for every length
        for mask in (attn.mask, *attn.windowed.values()):
            torch._dynamo.mark_dynamic(mask, 3)
        return self.model(batch, run_layer=self.layer)

    def __call__(self, batch: ForwardBatch) -> torch.Tensor:
        try:
            with torch.compiler.set_stance("fail_on_recompile"):
                logits = self._compiled(batch)
            self.steps += 1
            return logits
        except Exception as exc:  # no graph for this shape (or a compiler bug): this batch size runs eager
            size = len(batch.input_ids)
            self.eager_sizes.add(size)
            log.warning("compiled decode: batch of %d runs eager from now on (%s: %s)", size, type(exc).__name__,
                        str(exc))
            return self.model(batch)  # rewrites the same K/V the compiled layers may have stored: same values

    def warm_up(self, backend, dtype: torch.dtype, device: torch.device, group: int, max_batch: int) -> float:
        """Compile every graph a decode step can need (batch 1, 2.., and >= BIG_BATCH if it can occur) on synthetic
        batches that write only the dummy slot; returns the seconds taken."""
        start = time.perf_counter()
        num_slots = self.kv.k.shape[1]
        for size in [1, 2] + ([BIG_BATCH] if max_batch >= BIG_BATCH else []):
            if 2 * size >= num_slots:  # the synthetic rows need 2 * size distinct slots
                break
            with torch.inference_mode():  # as the runner's steps: guards check a tensor's inference-mode keys
                batch = _synthetic_decode(size, self.kv, self.rope, self.local_rope, backend, dtype, device, group,
                                          self.model.config.arch.sliding_windows)
                if not self.applies(batch):
                    break
                self._compiled(batch)
        self.compile_seconds = time.perf_counter() - start
        return self.compile_seconds


def _synthetic_decode(size: int, kv: KVPool, rope: RopeTable, local_rope: RopeTable | None, backend,
                      dtype: torch.dtype, device: torch.device, group: int, windows: tuple[int, ...]) -> ForwardBatch:
    """``size`` decode rows of two tokens each: every row reads distinct slots (so the backend takes its plain
    decode path) and writes its new token's K/V to the dummy slot 0."""
    zeros = torch.zeros(size, dtype=torch.int64, device=device)
    attn = AttentionBatch(mode="decode", prefix_lens=[1] * size, extend_lens=[1] * size,
                          slots=torch.arange(1, 2 * size + 1, device=device), out_slots=zeros, dtype=dtype,
                          group=group, windows=windows)
    attn.backend_data = backend.prepare(attn)
    cos, sin = rope.lookup(zeros)
    local_cos, local_sin = local_rope.lookup(zeros) if local_rope is not None else (None, None)
    return ForwardBatch(input_ids=zeros, positions=zeros, logit_rows=torch.arange(size, device=device), cos=cos,
                        sin=sin, attn=attn, attn_backend=backend, kv=kv, local_cos=local_cos, local_sin=local_sin)
