"""The attention interface every backend implements (torch and the C++ kernels on CPU, Triton on GPUs).

Layout: the pool holds K and V per layer as ``[num_slots, kv_heads, head_dim]``; a request's row of slot
indices (``slots``, concatenated over the batch) lists where each of its tokens lives. Queries are ragged and
unpadded: ``q`` is ``[num_new_tokens, heads, head_dim]`` with requests back to back.

Per layer, beyond ``scale``: ``window`` W (a query at position i reads keys i - W + 1 .. i; None: all of them, as
ordinary causal attention) and ``softcap`` c (scores s = scale * q.k become c * tanh(s / c) before the mask and the
softmax, as Gemma 2 does). Every position's K/V stays in the pool either way: a window only masks.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch


@dataclass
class AttentionBatch:
    """Per-step layout, built once by the runner and shared by every layer (tensors on the model's device)."""

    mode: str  # "extend" | "decode"
    prefix_lens: list[int]  # per request: tokens already in the pool
    extend_lens: list[int]  # per request: new tokens in this step
    slots: torch.Tensor  # int64 [sum(prefix_lens + extend_lens)]: every request's whole row
    out_slots: torch.Tensor  # int64 [sum(extend_lens)]: where the new tokens' K/V go
    dtype: torch.dtype = torch.float32  # of queries and the pool
    group: int = 1  # query heads per kv head
    windows: tuple[int, ...] = ()  # the sliding windows some layer attends within: prepare() builds their masks
    backend_data: Any = None  # whatever the backend's prepare() precomputes (or, for a prefill step the native
    # kernel takes, what its NativeDecode.applies worked out: StepContexts)
    # a verified draft tree (speculative decoding): per request, each new token's parent among its new tokens (-1:
    # none, the prefix only); a new token sees the prefix, its ancestors and itself. None (or a request's None):
    # causal, each new token's parent is the one before it
    tree: list[np.ndarray | None] | None = None

    def seen(self, i: int) -> np.ndarray:
        """Request i's new tokens: [e, e] bool, whether new token a sees new token b (b is a or an ancestor)."""
        e = self.extend_lens[i]
        parents = self.tree[i] if self.tree is not None else None
        if parents is None:
            return np.tri(e, dtype=bool)
        out = np.eye(e, dtype=bool)
        for a, p in enumerate(parents.tolist()):
            if p >= 0:
                out[a] |= out[p]
        return out

    def tree_contexts(self, window: int | None = None) -> tuple[torch.Tensor, np.ndarray, np.ndarray]:
        """``contexts`` for a step with a draft tree: (slots, start, length) where a tree request's rows read
        their own lists appended to ``slots`` -- the prefix, the ancestors and the token itself, in position
        order (so a window is again the last ``window`` of them). Without a tree: (self.slots, *contexts())."""
        first, length = self.contexts(window)
        if self.tree is None or all(t is None for t in self.tree):
            return self.slots, first, length
        slots = self.slots.cpu().numpy()
        extra, at, row, seq_at = [], len(slots), 0, 0
        first, length = first.copy(), length.copy()
        for i, (p, e) in enumerate(zip(self.prefix_lens, self.extend_lens)):
            if self.tree[i] is not None:
                for a, sees in enumerate(self.seen(i)):
                    keys = np.concatenate([slots[seq_at : seq_at + p], slots[seq_at + p + np.flatnonzero(sees)]])
                    if window is not None:
                        keys = keys[-window:]
                    extra.append(keys)
                    first[row + a], length[row + a] = at, len(keys)
                    at += len(keys)
            row, seq_at = row + e, seq_at + p + e
        return torch.from_numpy(np.concatenate([slots, *extra])).to(self.slots.device), first, length

    @property
    def seq_lens(self) -> list[int]:
        return [p + e for p, e in zip(self.prefix_lens, self.extend_lens)]

    def contexts(self, window: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Each row's context as (start, length) in ``self.slots`` (every request's row back to back): in decode a
        row is a request and its whole row; in a prefill a row is a token and its request's row up to itself. With a
        sliding ``window`` (the same on every layer: Mistral, Phi-3), only its last ``window`` positions.

            request r's row in slots:  | prefix (cached) | token 0 | token 1 | ... |
            token i's context:         |<------- prefix + i + 1 -------->|
            ... within a window:                 |<---- window ---->|
        """
        seq = np.asarray(self.seq_lens, dtype=np.int64)
        first = np.cumsum(seq) - seq
        if self.mode == "decode":
            first, length = first, seq
        else:
            ext = np.asarray(self.extend_lens, dtype=np.int64)
            ends = np.cumsum(ext)
            within = np.arange(int(ends[-1]), dtype=np.int64) - np.repeat(ends - ext, ext)  # token i of its request
            first, length = np.repeat(first, ext), np.repeat(seq - ext, ext) + within + 1
        if window is not None:
            cut = np.maximum(length - window, 0)
            first, length = first + cut, length - cut
        return first, length


class AttentionBackend(Protocol):
    name: str

    def prepare(self, batch: AttentionBatch) -> Any:
        """Precompute what every layer reuses this step (masks, index matrices). Called once per step."""
        ...

    def store_kv(self, k_pool: torch.Tensor, v_pool: torch.Tensor, batch: AttentionBatch,
                 k: torch.Tensor, v: torch.Tensor) -> None:
        """Write the new tokens' K/V ``[num_new, kv_heads, head_dim]`` into one layer's pool at ``out_slots``."""
        ...

    def extend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_pool: torch.Tensor,
               v_pool: torch.Tensor, batch: AttentionBatch, scale: float, window: int | None = None,
               softcap: float | None = None) -> torch.Tensor:
        """Each request's new tokens attend to its cached prefix (read from the pool through its slots) and
        causally to themselves. ``k``/``v`` are the new tokens' K/V, already stored. Returns ``[num_new, heads,
        head_dim]``. A ``window`` must be one of ``batch.windows``."""
        ...

    def decode(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, batch: AttentionBatch,
               scale: float, window: int | None = None, softcap: float | None = None) -> torch.Tensor:
        """One new token per request attends to the request's whole row (its own K/V already stored), or to its
        last ``window`` positions."""
        ...
