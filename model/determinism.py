"""``--deterministic``: the model made batch-invariant by construction, and the start-up check that guards it.

``make_invariant`` hands every row-mixing computation of the model to batch-invariant ops (kernels/invariant.py):
linear layers, RMSNorms (their mean of squares), the MLP's activation and the final soft-cap's tanh; attention is
the batch-invariant backend over the same ops. What stays torch's is exact whatever the batch: embeddings, RoPE and
residuals (products and sums of two numbers), casts, and the sampler's row-wise ops.

``check_batch_invariance`` then runs the loaded model as a guard: a request's logits must be bitwise the same
alone, batched with others of other lengths, after its prefix was cached by an earlier step, and decoding in a
batch of any size; a server that fails it refuses to start (it would be a bug, not a property of the CPU).
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from radixserve.kernels.invariant import ACTIVATIONS, InvariantLinear, InvariantOps
from radixserve.model.causal_lm import CausalLM
from radixserve.model.layers import MLP, RMSNorm
from radixserve.wire.plans import ForwardPlan, SamplingBatch

LENGTHS = (70, 3, 131, 9)  # prompts that cross chunk boundaries, and one shorter than any chunk


def make_invariant(model: CausalLM, ops: InvariantOps) -> int:
    """Swap ``model``'s row-mixing computations for ``ops``' (in place); returns how many linear layers it swapped.
    ValueError for an activation the ops do not compute."""
    linears = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
               if isinstance(child, nn.Linear)]
    for parent, name, child in linears:
        setattr(parent, name, InvariantLinear(child, ops))
    for module in model.modules():
        if isinstance(module, RMSNorm):
            module.normalize = ops.rms_normalize
        elif isinstance(module, MLP):
            if module.act not in ACTIVATIONS:
                raise ValueError(f"--deterministic has no batch-invariant {module.act!r} activation; run without it")
            module.act_mul = ops.act_mul
    model.tanh = lambda x: ops.tanh(x.float()).to(x.dtype)
    return len(linears)


def probe_plan(mode: str, rows: list[tuple[list[int], int, list[int]]]) -> ForwardPlan:
    """A plan over ``rows`` of (new tokens, prefix length, whole slot row); every row samples (greedily)."""
    def i32(values) -> np.ndarray:
        return np.asarray(values, dtype=np.int32)

    n = len(rows)
    zeros = np.zeros(n, dtype=np.float32)
    return ForwardPlan(
        step=0, mode=mode, input_ids=i32([t for new, _, _ in rows for t in new]),
        prefix_lens=i32([p for _, p, _ in rows]), extend_lens=i32([len(new) for new, _, _ in rows]),
        rows=i32(range(n)), row_writes=i32([0] * n), new_slots=i32([s for _, _, row in rows for s in row]),
        sample=np.ones(n, dtype=np.uint8),
        sampling=SamplingBatch(temperature=zeros, top_p=np.ones(n, dtype=np.float32), top_k=i32([1] * n),
                               min_p=zeros, seeds=[None] * n, output_index=i32([0] * n), top_logprobs=[None] * n,
                               all_greedy=True))


def check_batch_invariance(logits_of: Callable[[ForwardPlan], torch.Tensor], vocab_size: int, num_slots: int,
                           seed: int = 0) -> None:
    """RuntimeError naming the first case whose logits differ from the request computed alone.

    ``logits_of(plan)``: the model's next-token logits for the plan's rows (slots 1.. of the pool are scratch).
    """
    scale = min(1.0, (num_slots - 1) / (2 * (sum(LENGTHS) + len(LENGTHS))))
    lengths = [max(1, int(n * scale)) for n in LENGTHS]
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, vocab_size, (n + 1,), generator=g).tolist() for n in lengths]  # + a decode token

    def rows_at(base: int) -> list[list[int]]:
        out, at = [], base
        for p in prompts:
            out.append(list(range(at, at + len(p))))
            at += len(p)
        return out

    alone, alone_next = [], []
    for p, row in zip(prompts, rows_at(1)):
        alone.append(logits_of(probe_plan("extend", [(p[:-1], 0, row[:-1])]))[0])
        alone_next.append(logits_of(probe_plan("decode", [(p[-1:], len(p) - 1, row)]))[0])

    def expect(name: str, got: torch.Tensor, want: list[torch.Tensor]) -> None:
        for i, w in enumerate(want):
            if not torch.equal(got[i], w):
                raise RuntimeError(f"--deterministic: this machine's kernels are not batch-invariant ({name}: prompt "
                                   f"{i} of {lengths} differs by up to {(got[i] - w).abs().max().item():.3g}); run "
                                   "without --deterministic")

    rows = rows_at(1 + sum(len(p) for p in prompts))
    expect("a prefill batch", logits_of(probe_plan("extend", [(p[:-1], 0, r[:-1]) for p, r in zip(prompts, rows)])),
           alone)
    expect("a decode batch", logits_of(probe_plan("decode", [(p[-1:], len(p) - 1, r) for p, r in zip(prompts, rows)])),
           alone_next)
    for i, (p, r) in enumerate(zip(prompts, rows)):  # the prefix computed by the batch above, the rest now
        cut = len(p) // 2
        if len(p) > 2:
            got = logits_of(probe_plan("extend", [(p[cut:-1], cut, r[:-1])]))
            expect("a prefill after a cached prefix", got, [alone[i]])
    expect("a decode step alone in a batch of one", logits_of(probe_plan("decode", [(prompts[0][-1:],
                                                                                   len(prompts[0]) - 1, rows[0])])),
           alone_next[:1])
