"""Batch-invariant attention over the slot pool (``--deterministic``): a query row's output depends only on its own
query and its own keys -- never on what else is in the batch, how long the other rows are, whether its prefix came
from the cache or was computed in this step, or where a chunked prefill was cut.

Every row is one query token reading its context, found the same way in extend and decode (``AttentionBatch.
contexts``: a request's row in the pool up to the token itself, or the last ``window`` positions of it), and the
ops (kernels/invariant.py) reduce each (row, head) over its keys in an order fixed by the key count alone. The new
tokens' K/V are stored in the pool before any row reads them, so a prefix read from the cache and one computed in
this step are the same bytes read the same way.
"""
from __future__ import annotations

import torch

from radixserve.kernels.base import AttentionBatch
from radixserve.kernels.invariant import InvariantOps


# window (None: all) -> (slots, each row's first key in them, its number of keys)
Contexts = dict[int | None, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


class BatchInvariantAttention:
    name = "batch-invariant"

    def __init__(self, ops: InvariantOps) -> None:
        self.ops = ops

    def prepare(self, batch: AttentionBatch) -> Contexts:
        # each row's keys as (slots, start, length); a draft tree's rows read lists of their own (tree_contexts)
        return {w: (slots, torch.from_numpy(first), torch.from_numpy(length))
                for w in (None, *batch.windows) for slots, first, length in [batch.tree_contexts(w)]}

    def store_kv(self, k_pool, v_pool, batch, k, v) -> None:
        k_pool.index_copy_(0, batch.out_slots, k)
        v_pool.index_copy_(0, batch.out_slots, v)

    def extend(self, q, k, v, k_pool, v_pool, batch, scale, window=None, softcap=None):
        # the new K/V are in the pool already: read them there, as a later step will
        return self.decode(q, k_pool, v_pool, batch, scale, window, softcap)

    def decode(self, q, k_pool, v_pool, batch, scale, window=None, softcap=None):
        slots, first, length = batch.backend_data[window]
        return self.ops.attention(q, k_pool, v_pool, slots, first, length, scale, softcap)
