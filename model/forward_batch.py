"""Everything one forward needs, built once per step from the scheduler's plan and handed to the model
(no global context)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from radixserve.kernels.base import AttentionBackend, AttentionBatch
from radixserve.model.kv_codes import ScaledPool
from radixserve.model.slot_table import SlotTable
from radixserve.policies.draft_trees import is_chain, tree_depths
from radixserve.wire.plans import ForwardPlan


class KVPool:
    """K and V for every layer: ``[num_layers, num_slots, kv_heads, head_dim]``. Slot 0 is the dummy.

    ``codes`` (``--kv-cache-dtype int8 | fp8_e4m3 | fp8_e5m2``): K and V held as 8-bit codes (uint8) with a float32
    scale per slot and head (``k_scale``/``v_scale`` ``[num_layers, num_slots, kv_heads]``; model/kv_codes.py);
    ``layer(i)`` then hands out ScaledPools, which encode on store and decode on gather. None: the model's dtype."""

    def __init__(self, num_layers: int, num_slots: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, codes: str | None = None) -> None:
        shape = (num_layers, num_slots, kv_heads, head_dim)
        self.dtype, self.codes = dtype, codes
        stored = dtype if codes is None else torch.uint8
        # zero_() touches every page now: otherwise the first requests pay the page faults of a fresh pool
        self.k = torch.empty(shape, dtype=stored, device=device).zero_()
        self.v = torch.empty(shape, dtype=stored, device=device).zero_()
        self.k_scale = self.v_scale = None
        if codes is None:
            self._layers = [(self.k[i], self.v[i]) for i in range(num_layers)]
            return
        self.k_scale = torch.zeros(shape[:3], dtype=torch.float32, device=device)
        self.v_scale = torch.zeros(shape[:3], dtype=torch.float32, device=device)
        self._layers = [(ScaledPool(self.k[i], self.k_scale[i], codes, dtype),
                         ScaledPool(self.v[i], self.v_scale[i], codes, dtype)) for i in range(num_layers)]

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor] | tuple[ScaledPool, ScaledPool]:
        return self._layers[i]

    @property
    def tensors(self) -> list[torch.Tensor]:
        """Every tensor the pool holds, each indexed [layer, slot, ...]: K, V (and, for codes, their scales)."""
        return [self.k, self.v] if self.codes is None else [self.k, self.v, self.k_scale, self.v_scale]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)


class RopeTable:
    """cos/sin for every position: computed in float32 and then cast to the model's dtype, once (the reference
    does both per call; the values are the same)."""

    def __init__(self, inv_freq: torch.Tensor, scaling: float, max_positions: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq.float()[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = (emb.cos() * scaling).to(dtype).to(device)
        sin = (emb.sin() * scaling).to(dtype)
        half = sin.shape[-1] // 2
        self.sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1).to(device)  # the rotate_half sign, folded in

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # [tokens, 1, head_dim]: broadcast over heads
        return self.cos[positions][:, None, :], self.sin[positions][:, None, :]


def draft_tree(draft_parents: np.ndarray, drafts: np.ndarray, extend: np.ndarray) -> list[np.ndarray | None]:
    """Per request, each new token's parent among its new tokens (AttentionBatch.tree), None for one that drafts
    a chain or nothing: its tokens before the draft are a chain, and the draft's roots hang off the last of them."""
    out: list[np.ndarray | None] = []
    at = 0
    for e, d in zip(extend.tolist(), drafts.tolist()):
        mine = draft_parents[at : at + d]
        at += d
        if d == 0 or is_chain(mine.tolist()):
            out.append(None)
            continue
        parents = np.arange(-1, e - 1)
        parents[e - d :] = np.where(mine < 0, e - d - 1, e - d + mine)
        out.append(parents)
    return out


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # int64 [T]
    positions: torch.Tensor  # int64 [T]
    logit_rows: torch.Tensor  # int64 [S + P + D]: rows whose next-token logits are wanted: the S sampling rows,
    # then the P prompt rows whose logprobs were asked for (the plan's prompt_logprobs, in batch order), then the
    # D draft positions a speculative step verifies (plan.drafts)
    cos: torch.Tensor
    sin: torch.Tensor
    attn: AttentionBatch
    attn_backend: AttentionBackend
    kv: KVPool
    local_cos: torch.Tensor | None = None  # the sliding layers' own RoPE (Gemma 3), None where there is none
    local_sin: torch.Tensor | None = None

    @classmethod
    def from_plan(cls, plan: ForwardPlan, kv: KVPool, rope: RopeTable, backend: AttentionBackend,
                  dtype: torch.dtype, device: torch.device, group: int, table: SlotTable,
                  prepare_attention: bool = True, local_rope: RopeTable | None = None,
                  windows: tuple[int, ...] = ()) -> ForwardBatch:
        """``table``: the runner's rows of slot indices; the plan's new slots are written into it here.
        ``prepare_attention``: build the backend's per-step metadata (not when the native step runs it).
        ``local_rope``: the sliding layers' RoPE table, if they have their own; ``windows``: the model's sliding
        windows (the backend prepares each one's masks)."""
        prefix, extend = plan.prefix_lens, plan.extend_lens
        slots = torch.from_numpy(table.apply(plan)).to(device)
        ext_ends = np.cumsum(extend)
        # positions: prefix_len .. prefix_len + extend_len - 1 for each request, back to back
        positions = np.arange(int(ext_ends[-1])) - np.repeat(ext_ends - extend - prefix, extend)
        seq_ends = np.cumsum(prefix + extend)
        out_idx = np.arange(int(ext_ends[-1])) + np.repeat(seq_ends - ext_ends, extend)
        sampled = plan.sample.astype(bool)
        rows = [(ext_ends - 1)[sampled]]
        for i, want in sorted(plan.prompt_logprobs.items()):
            first = int(ext_ends[i] - extend[i]) + want.first
            rows.append(np.arange(first, first + len(want.targets)))
        if plan.drafts is not None:  # then each draft's positions but its last (whose row is the sampling row)
            rows += [np.arange(end - 1 - d, end - 1) for end, d in zip(ext_ends.tolist(), plan.drafts.tolist()) if d]
        tree = None
        if plan.draft_parents is not None:  # a draft tree: its tokens' positions are their depths, and a tree mask
            tree = draft_tree(plan.draft_parents, plan.drafts, extend)
            for i, parents in enumerate(tree):
                if parents is not None:
                    at = int(ext_ends[i] - extend[i])
                    positions[at : at + extend[i]] = prefix[i] - 1 + np.asarray(tree_depths(parents.tolist()))
        positions_t = torch.from_numpy(positions).to(device)
        attn = AttentionBatch(
            mode=plan.mode,
            prefix_lens=prefix.tolist(),
            extend_lens=extend.tolist(),
            slots=slots,
            out_slots=slots[torch.from_numpy(out_idx).to(device)],
            dtype=dtype,
            group=group,
            windows=windows,
            tree=tree,
        )
        if prepare_attention:
            attn.backend_data = backend.prepare(attn)
        cos, sin = rope.lookup(positions_t)
        local_cos, local_sin = local_rope.lookup(positions_t) if local_rope is not None else (None, None)
        return cls(
            input_ids=torch.from_numpy(plan.input_ids.astype(np.int64)).to(device),
            positions=positions_t,
            logit_rows=torch.from_numpy(np.concatenate(rows).astype(np.int64)).to(device),
            cos=cos,
            sin=sin,
            attn=attn,
            attn_backend=backend,
            kv=kv,
            local_cos=local_cos,
            local_sin=local_sin,
        )

    def prepare_attention(self) -> None:
        """Build the backend's per-step metadata if ``from_plan`` did not (``prepare_attention=False``): a step
        that the native kernel turns down runs through the backend after all."""
        if self.attn.backend_data is None:
            self.attn.backend_data = self.attn_backend.prepare(self.attn)
