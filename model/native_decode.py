"""Steps through the native CPU kernel (``kernels/native/``): the whole step, every layer and the output projection,
in one call -- every decode step, and the prefill steps whose attention is small enough (``NativeDecode.applies``).

Per step Python does three things: the embedding lookup, filling one ``Step`` structure (pointers to this step's
tensors: rows' cos/sin, new slots, each row's context, logit rows), and one call. The ``Model`` structure
(pointers into the model's weights and the KV pool) is built once; this object keeps every tensor it points into
alive. A prefill step is the same call with a row per new token, whose context is its request's row up to itself.

The linear layers' weights are packed once into the kernel's layout (``pack_dense``), from the plain weights, so
the runner builds this before it swaps in oneDNN's packed linears (which longer prefills keep using). Its speed
against the eager and compiled steps: the ``compile`` stage of ``make bench`` (docs/performance.md). A quantized
layer's blocks are packed in their own bits (``pack_gguf``, ``pack_q8``, ``pack_q4``), and the layer hands its own
copy over as soon as its pack is made (``QuantLinear.hand_over``): every later product of it, torch's steps' too, is
the kernel's, and a quantized model is held once.
"""
from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import numpy as np

import torch
from torch import nn

from radixserve.kernels import cpu_native as native
from radixserve.kernels.bounds import check_indices, check_ranges
from radixserve.kernels.cpu_quant import FileBlocks, QuantLinear
from radixserve.model.forward_batch import ForwardBatch, KVPool
from radixserve.model.kv_codes import KV_CODES, code_values
from radixserve.model.prefix_groups import StepContexts, budget, prefix_groups, step_cost
from radixserve.model.causal_lm import CausalLM

log = logging.getLogger(__name__)

MAX_GROUP, MAX_HEAD_DIM = 16, 256  # the kernel's bounds (kMaxGroup, kMaxHeadDim)
AMX_SHARED_DIM = 64  # the head dim whose shared prefixes AMX tiles score (kSharedDim)
BLOCK = 32  # weights per quantization block (kBlock)


def pack_dense(w: torch.Tensor) -> torch.Tensor:
    """[N, K] -> the kernel's blocks of 16 output rows (N padded with zero rows): bf16 ``[N/16, K/2, 16, 2]`` (each
    lane of a vector holds one row's pair of k), float32 ``[N/16, K, 16]``."""
    n, k = w.shape
    if k % 2:
        raise native.NativeUnavailable(f"a linear layer's input dimension ({k}) is odd")
    padded = torch.zeros((n + 15) // 16 * 16, k, dtype=w.dtype)
    padded[:n] = w
    if w.dtype == torch.bfloat16:
        return padded.view(-1, 16, k // 2, 2).permute(0, 2, 1, 3).contiguous()
    return padded.view(-1, 16, k).permute(0, 2, 1).contiguous()


def _blocks(x: torch.Tensor, n16: int, fill: float = 0) -> torch.Tensor:
    """[N, K/group] per-block values -> [N/16, K/group, 16] (the 16 rows of a block side by side), N padded."""
    out = torch.full((n16, x.shape[1]), fill, dtype=torch.float32)
    out[: x.shape[0]] = x
    return out.view(n16 // 16, 16, -1).transpose(1, 2).contiguous()


def _halves(x: torch.Tensor, n16: int) -> torch.Tensor:
    """``_blocks`` of values a GGUF file holds in fp16 (its scales), as fp16 again: exact."""
    out = _blocks(x, n16)
    if not torch.allclose(out.half().float(), out, rtol=0, atol=0, equal_nan=True):
        raise native.NativeUnavailable("a quantized layer's scales are not fp16 values, as a GGUF file's are")
    return out.half()


def pack_q8(q: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 q [N, K] with a scale per 32 or 16 k ([N, K/group]) -> (q + 128 as u8 in groups of 4 k:
    [N/16, K/32, 8, 16, 4], fp32 scales [N/16, K/group, 16])."""
    n16 = (q.shape[0] + 15) // 16 * 16
    return _q8_bytes(q, n16), _blocks(scale, n16)


def _q8_bytes(q: torch.Tensor, n16: int) -> torch.Tensor:
    n, k = q.shape
    u = torch.full((n16, k), 128, dtype=torch.uint8)
    u[:n] = (q.to(torch.int16) + 128).to(torch.uint8)
    return u.view(n16 // 16, 16, k // BLOCK, 8, 4).permute(0, 2, 3, 1, 4).contiguous()


def _nibble_groups(u: torch.Tensor, n16: int) -> torch.Tensor:
    """u [N, K] (bytes) -> [N/16, K/32, 4, 16, 4, 2]: per block of 16 rows and 32 k, groups of 8 k, each lane's
    byte b holding k0 + b (low) and k0 + 4 + b (high), as the q4 layout reads them; N padded with zeros."""
    n, k = u.shape
    v = torch.zeros(n16, k, dtype=torch.uint8)
    v[:n] = u.to(torch.uint8)
    return v.view(n16 // 16, 16, k // BLOCK, 4, 2, 4).permute(0, 2, 3, 1, 5, 4)  # [.., group, lane, b, half]


def pack_q4(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [N, K] in 0..15 with w = d q + m per 32 k -> (nibbles in groups of 8 k: [N/16, K/32, 4, 16, 4], byte b of
    a lane holding k0 + b low and k0 + 4 + b high; fp16 d and m [N/16, K/32, 16])."""
    n16 = (q.shape[0] + 15) // 16 * 16
    return _q4_bytes(q, n16), _blocks(d, n16).half(), _blocks(m, n16).half()


def _q4_bytes(q: torch.Tensor, n16: int) -> torch.Tensor:
    v = _nibble_groups(q, n16)
    return (v[..., 0] | (v[..., 1] << 4)).contiguous()


def _q5_bytes(q: torch.Tensor, n16: int) -> torch.Tensor:
    """q [N, K] in 0..31 -> per 16 rows and 32 k, q4's nibbles of its low four bits, then its fifth bits: 16 lanes x
    4 bytes, byte b of a lane holding in bit 2g + h the fifth bit of group g's k0 + 4h + b: [N/16, K/32, 320]."""
    low = _q4_bytes(q & 15, n16)
    v = _nibble_groups(q >> 4, n16)  # [.., group, lane, b, half]: 0 or 1
    shifts = (2 * torch.arange(4)[:, None] + torch.arange(2)).to(torch.uint8).view(4, 1, 1, 2)
    bits = (v << shifts).sum(dim=(2, 5), dtype=torch.uint8)  # [.., lane, b]: no two share a bit
    return torch.cat([low.flatten(2), bits.flatten(2)], dim=-1).contiguous()


def pack_q4k(q: torch.Tensor, fb: FileBlocks) -> tuple[torch.Tensor, ...]:
    """A Q4_K or Q5_K layer in its own bits: (q4's nibbles, Q5_K's with its fifth bits (``_q5_bytes``); u8 sc and
    mn [N/16, K/32, 16]; the file's fp16 d and -dmin [N/16, K/256, 16]) -- w = d sc q - dmin mn."""
    n16 = (q.shape[0] + 15) // 16 * 16
    as_u8 = lambda t: _blocks(t.float(), n16).to(torch.uint8)  # noqa: E731 (0..63: exact through float)
    data = _q4_bytes(q, n16) if fb.kind == "Q4_K" else _q5_bytes(q, n16)
    return data, as_u8(fb.sc), as_u8(fb.mn), _halves(fb.d, n16), _halves(-fb.dmin, n16)


def pack_q6k(q: torch.Tensor, fb: FileBlocks) -> tuple[torch.Tensor, ...]:
    """A Q6_K layer (q in -32..31) in its own bits: (per 16 rows and 32 k, q4's nibbles of u = q + 32 then its top
    two bits, two groups of 8 k to 64 bytes (quant_tiles.h): [N/16, K/32, 384]; i8 sc [N/16, K/16, 16]; the file's fp16 d
    [N/16, K/256, 16]) -- w = d sc (u - 32)."""
    n16 = (q.shape[0] + 15) // 16 * 16
    v = _nibble_groups(q.to(torch.int16) + 32, n16)
    low = (v[..., 0] & 15) | ((v[..., 1] & 15) << 4)  # [.., group, lane, b]
    top = (v >> 4).reshape(*v.shape[:2], 2, 2, 16, 4, 2)  # [.., p, s, lane, b, half]
    shifts = torch.tensor([[0, 2], [4, 6]], dtype=torch.uint8)[None, None, None, :, None, None, :]  # 4s + 2 half
    bits = (top << shifts).sum(dim=(3, 6), dtype=torch.uint8)  # [.., p, lane, b]: no two share a bit
    data = torch.cat([low.reshape(*v.shape[:2], 256), bits.reshape(*v.shape[:2], 128)], dim=-1).contiguous()
    return data, _blocks(fb.sc.float(), n16).to(torch.int8), _halves(fb.d, n16)


def pack_gguf(q: torch.Tensor, fb: FileBlocks) -> tuple[int, tuple[torch.Tensor | None, ...]]:
    """Rows of a GGUF layer in one format (q [rows, K] as model/gguf_quant.py decodes it) in the kernel's layout of
    that format, in the file's own bits: (Linear.format, its (w, scale, zero, super_scale, super_zero))."""
    if fb.kind in ("Q4_K", "Q5_K"):
        return native.Q4K if fb.kind == "Q4_K" else native.Q5K, pack_q4k(q, fb)
    if fb.kind == "Q6_K":
        data, sc, d = pack_q6k(q, fb)
        return native.Q6K, (data, sc, None, d, None)
    n16 = (q.shape[0] + 15) // 16 * 16
    if fb.kind in ("Q4_0", "Q4_1", "Q5_0", "Q5_1"):  # fp16 d and m: the file's, or 8 d / 16 d of one (exact)
        m = -fb.dmin
        if torch.equal(m.half().float(), m):
            data = _q4_bytes(q, n16) if fb.kind[1] == "4" else _q5_bytes(q, n16)
            return native.Q4 if fb.kind[1] == "4" else native.Q5, (
                data, _blocks(fb.d, n16).half(), _blocks(m, n16).half(), None, None)
        data, scale = pack_q8(q, fb.d)  # (a d so large that 16 d overflows fp16: as 8-bit blocks, float offsets)
        return native.Q8, (data, scale, _blocks(m, n16), None, None)
    if fb.kind == "Q8_0":  # the file's fp16 d: 8.5 bits a weight
        return native.Q8H, (_q8_bytes(q, n16), _halves(fb.d, n16), None, None, None)
    raise native.NativeUnavailable(f"no native layout for {fb.kind} blocks")


class NativeDecode:
    """``applies(batch)``: a step this kernel takes; ``__call__(batch)``: its logits, its new tokens' K/V stored."""

    def __init__(self, model: CausalLM, kv: KVPool, dtype: torch.dtype, cache_dir: Path) -> None:
        cfg = model.config
        if cfg.native_refusal:
            raise native.NativeUnavailable(cfg.native_refusal)
        if dtype not in (torch.bfloat16, torch.float32):
            raise native.NativeUnavailable(f"the native decode step runs bfloat16 and float32 models, not {dtype}")
        group = cfg.num_heads // cfg.num_kv_heads
        if cfg.num_heads % cfg.num_kv_heads or group > MAX_GROUP or cfg.head_dim > MAX_HEAD_DIM or cfg.head_dim % 2:
            raise native.NativeUnavailable(f"{cfg.num_heads} heads over {cfg.num_kv_heads} kv heads of {cfg.head_dim}"
                                           f" dims: the kernel takes up to {MAX_GROUP} heads per kv head and even "
                                           f"head dims up to {MAX_HEAD_DIM}")
        self.lib = native.load(cache_dir)
        self.model, self.dtype = model, dtype
        self.pool_slots = kv.k.shape[1]
        self._keep: list = []  # every tensor (and ctypes array) a structure points into
        layers = (native.Layer * cfg.num_layers)()
        for i, layer in enumerate(model.model.layers):
            attn, mlp = layer.self_attn, layer.mlp
            scales = (None, None) if kv.codes is None else (kv.k_scale[i].data_ptr(), kv.v_scale[i].data_ptr())
            layers[i] = native.Layer(self._dense(layer.attn_norm.weight), self._dense(layer.mlp_norm.weight),
                                     self._linear(attn.qkv_proj), self._linear(attn.o_proj),
                                     self._linear(mlp.gate_up_proj), self._linear(mlp.down_proj),
                                     kv.k[i].data_ptr(), kv.v[i].data_ptr(), *scales)
        self._layers = layers
        kv_codes = {}
        if kv.codes is not None:  # the pools hold 8-bit codes: the kernel encodes and decodes them as torch does
            values = code_values(kv.codes)
            self._keep.append(values)
            top = int(torch.nonzero(values[:128] == KV_CODES[kv.codes][1])[0])
            kv_codes = dict(kv_codes=native.KV_FORMAT[kv.codes], kv_top=top,
                            kv_limit=KV_CODES[kv.codes][1], kv_values=values.data_ptr())
        self.desc = native.Model(
            bf16=int(dtype == torch.bfloat16), layers=cfg.num_layers, hidden=cfg.hidden_size, heads=cfg.num_heads,
            kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, inter=cfg.intermediate_size, vocab=cfg.vocab_size,
            amx=int(dtype == torch.bfloat16 and self.lib.rs_request_amx() == 1),
            eps=cfg.rms_norm_eps, scale=cfg.attn_scale, layer=layers, norm=self._dense(model.model.norm.weight),
            lm_head=self._linear(model.lm_head), **kv_codes)
        code = self.lib.rs_check(ctypes.byref(self.desc))
        if code:
            raise native.NativeUnavailable(f"the kernel refuses this model's {'heads' if code == 1 else 'linear layers'}")
        self.amx = bool(self.desc.amx)
        self.isa = native.isa(self.lib)  # avx512 or avx2: what the library was built for
        self._scratch = torch.empty(0, dtype=torch.uint8)
        self.steps = 0  # steps that ran native
        self.prefill_steps = 0  # of which prefill steps
        self.shared_steps = 0  # of which steps that scored shared prefixes once for all their rows
        self.shared_prefill_steps = 0  # of which prefill steps (rows: new tokens on a cached or long prefix)
        self.shared_groups = 0  # the groups of rows those steps scored a prefix for (prefix_groups)
        self.last_groups = 0  # of which in the last step
        # the kernel's shared-prefix path (attention_shared.h): AMX tiles or vector registers, head dims that are
        # multiples of 16, a pool in the model's dtype; False: every row scores its whole context itself
        self.shares = cfg.head_dim % 16 == 0 and not self.desc.kv_codes
        self._head_dim = cfg.head_dim
        # AMX tiles score the shared slots (attention_shared.h's tile path: bf16, head dim AMX_SHARED_DIM)
        self.amx_shared = self.amx and self.shares and cfg.head_dim == AMX_SHARED_DIM
        # a long prompt's or continuation's rows score their own slots in causal tiles (prefix_groups(tiled=True))
        # where AVX-512 scores shared slots: AMX tiles or a vector's lanes (the AVX2 build keeps them row by row:
        # its budget was measured so, on a Zen 3)
        self.tiled = self.isa == "avx512"  # (without shares, _groups makes no groups at all)
        # a prefill step's most cost; a shared pair's gain (prefix_groups.budget: by build, dtype and AMX)
        self.extend_keys, self.shared_gain = budget(self.isa, dtype, self.amx_shared)
        self.window = cfg.arch.windows[0] if cfg.arch.windows else None  # one for every layer (native_refusal)

    def _product(self, lin: native.Linear, x: torch.Tensor) -> torch.Tensor:
        """One quantized layer's product through the kernel (this object keeps the packed blocks alive)."""
        return native.product(self.lib, lin, x)

    def _dense(self, t: torch.Tensor) -> int:
        t = t.detach()
        if t.dtype != self.dtype or not t.is_contiguous():
            raise native.NativeUnavailable(f"a weight is {t.dtype}, {'' if t.is_contiguous() else 'not '}contiguous;"
                                           f" the native step reads contiguous {self.dtype}")
        self._keep.append(t)
        return t.data_ptr()

    def _linear(self, layer: nn.Module) -> native.Linear:
        if isinstance(layer, QuantLinear):
            return self._quantized(layer)
        if not isinstance(layer, nn.Linear):
            raise native.NativeUnavailable(f"{type(layer).__name__} layers decode through torch's kernels")
        bias, weight = layer.bias, layer.weight
        n, k = weight.shape
        packed = pack_dense(weight.detach())
        self._keep.append(packed)
        return native.Linear(native.DENSE, n, k, 0, packed.data_ptr(), None, None,
                             None if bias is None else self._dense(bias))

    def _quantized(self, layer: QuantLinear) -> native.Linear:
        n, k = layer.out_features, layer.in_features
        if k % BLOCK:
            raise native.NativeUnavailable(f"a quantized layer's input dimension ({k}) is not a multiple of {BLOCK}")
        bias = None if layer.bias is None else self._dense(layer.bias)
        q = layer.q if layer.bits == 8 else torch.stack([layer.nibbles & 15, layer.nibbles >> 4], dim=-1).view(n, k)
        if layer.file_blocks:  # a GGUF layer in its file's own bits: one part, or a part per run of one format
            lins, row = [], 0
            for fb in layer.file_blocks:
                rows = fb.d.shape[0]
                form, tensors = pack_gguf(q[row : row + rows], fb)
                self._keep += [t for t in tensors if t is not None]
                w, scale, zero, super_scale, super_zero = (None if t is None else t.data_ptr() for t in tensors)
                part_bias = None if bias is None else bias + row * layer.bias.element_size()
                lins.append(native.Linear(form, rows, k, 0, w, scale, zero, part_bias, super_scale, super_zero))
                row += rows
            lin = lins[0]
            if len(lins) > 1:
                parts = (native.Linear * len(lins))(*lins)
                self._keep.append(parts)
                lin = native.Linear(native.PARTS, n, k, len(lins), ctypes.addressof(parts), None, None, None)
        elif layer.bits == 8:
            scale = layer.scale.float() if layer.block_scales else layer.scale.float()[:, None].expand(n, k // BLOCK)
            group = k // scale.shape[1]
            if group not in (BLOCK, BLOCK // 2):
                raise native.NativeUnavailable(f"int8 scales per {group} weights; the native step reads one per "
                                               f"{BLOCK} or {BLOCK // 2}, or one per row")
            data, scale = pack_q8(q, scale)
            zero = None if layer.offset is None else _blocks(layer.offset, scale.shape[0] * 16)
            self._keep += [t for t in (data, scale, zero) if t is not None]
            lin = native.Linear(native.Q8 if group == BLOCK else native.Q8G16, n, k, 0, data.data_ptr(),
                                scale.data_ptr(), None if zero is None else zero.data_ptr(), bias)
        else:
            if layer.group != BLOCK:
                raise native.NativeUnavailable(f"int4 groups of {layer.group}; the native step reads groups of {BLOCK}")
            packed = pack_q4(q, layer.scale, layer.offset)
            self._keep += list(packed)
            lin = native.Linear(native.Q4, n, k, 0, *(t.data_ptr() for t in packed), bias)
        # from now on every product of the layer is the kernel's, on these blocks (torch's steps too: long prefills,
        # or every step should the model be refused below); its own copy goes now, so the two never all coexist
        layer.hand_over(functools.partial(self._product, lin))
        return lin

    def applies(self, batch: ForwardBatch) -> bool:
        """Every decode step; a prefill step while its attention's ``cost`` is at most ``extend_keys``. A prefill
        step it takes without metadata keeps what was worked out here as its metadata (StepContexts)."""
        if batch.attn.mode == "decode":
            return True
        slots, first, length = batch.attn.tree_contexts(self.window)
        groups = self._groups(slots, first, length)
        if self.cost(length, groups) > self.extend_keys:
            return False
        if batch.attn.backend_data is None:
            batch.attn.backend_data = StepContexts(slots, first, length, groups)
        return True

    def cost(self, length: np.ndarray, groups: native.PrefixGroups) -> float:
        """A prefill step's attention in pairs visited row by row, shared ones at 1 / shared_gain (step_cost)."""
        return step_cost(length, groups, self.shared_gain)

    def _groups(self, slots: torch.Tensor, first: np.ndarray, length: np.ndarray) -> native.PrefixGroups:
        if not self.shares:
            return native.PrefixGroups(len(length))
        return prefix_groups(slots, first, length, tiled=self.tiled)

    def __call__(self, batch: ForwardBatch) -> torch.Tensor:
        rows, logit_rows = len(batch.input_ids), len(batch.logit_rows)
        known = batch.attn.backend_data if isinstance(batch.attn.backend_data, StepContexts) else None
        slots, first, length = ((known.slots, known.first, known.length) if known is not None
                                else batch.attn.tree_contexts(self.window))
        h = self.model.model.embed_tokens(batch.input_ids).contiguous()
        cos, sin = batch.cos.reshape(rows, -1).contiguous(), batch.sin.reshape(rows, -1).contiguous()
        starts, lens = torch.from_numpy(first), torch.from_numpy(length)
        slots, out_slot = slots.contiguous(), batch.attn.out_slots.contiguous()
        logit_row = batch.logit_rows.contiguous()
        # the kernel indexes raw memory with these: a bad index fails this step, never corrupts memory
        check_indices("context slots", slots, self.pool_slots)
        check_indices("new K/V slots", out_slot, self.pool_slots)
        check_ranges("row contexts", starts, lens, len(slots), rows)
        check_indices("logit rows", logit_row, rows)
        if out_slot.shape != (rows,) or cos.shape != (rows, self._head_dim) or sin.shape != cos.shape:
            raise IndexError(f"{rows} rows with {tuple(out_slot.shape)} new slots and {tuple(cos.shape)} RoPE rows")
        groups = known.groups if known is not None else self._groups(slots, first, length)
        need = self.lib.rs_scratch_bytes(ctypes.byref(self.desc), rows, len(groups), groups.slots())
        if self._scratch.numel() < need:
            self._scratch = torch.empty(need, dtype=torch.uint8)
        logits = torch.empty(logit_rows, self.model.config.vocab_size, dtype=torch.float32)
        step = native.Step(rows=rows, logit_rows=logit_rows, **groups.fields(), h=h.data_ptr(), cos=cos.data_ptr(),
                           sin=sin.data_ptr(), out_slot=out_slot.data_ptr(), slots=slots.data_ptr(),
                           starts=starts.data_ptr(), lens=lens.data_ptr(), logit_row=logit_row.data_ptr(),
                           logits=logits.data_ptr(), scratch=self._scratch.data_ptr(),
                           scratch_bytes=self._scratch.numel())
        code = self.lib.rs_decode_step(ctypes.byref(self.desc), ctypes.byref(step))
        if code == 3:
            raise RuntimeError(f"native decode step: its scratch ({self._scratch.numel()} bytes) is smaller than "
                               f"it needs with {torch.get_num_threads()} threads (the count changed after sizing)")
        if code != 0:
            raise RuntimeError(f"native decode step refused its input (code {code})")
        self.steps += 1
        self.prefill_steps += batch.attn.mode != "decode"
        self.shared_steps += len(groups) > 0
        self.shared_prefill_steps += len(groups) > 0 and batch.attn.mode != "decode"
        self.shared_groups += len(groups)
        self.last_groups = len(groups)
        return logits
