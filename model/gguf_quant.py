"""A GGUF file's quantized linear weights, taken as they ship: under ``--quantization int4`` Q4_0 and Q4_1 blocks
become radixserve's int4 layers, under ``int8`` Q8_0 blocks its int8 layers (one scale per 32 weights), and a
Q8_0 output projection is taken under both -- the same values, scales and offsets llama.cpp computes with --
instead of being dequantized and quantized again.

GGUF block layouts (ggml), 32 weights of one row per block:

    Q4_0  | d: f16 | 16 bytes: weight j in the low nibble of byte j, weight 16 + j in the high one |   w = (q - 8) * d
    Q4_1  | d: f16 | m: f16 | 16 bytes, as Q4_0                                                    |   w = q * d + m
    Q8_0  | d: f16 | 32 int8                                                                       |   w = q * d

Q4 blocks fit int4's ``w = (q - 8) * scale + zero`` exactly: Q4_0 with zero 0, Q4_1 with zero = m + 8 d. llama.cpp's
converter reorders the rows of Llama's q/k projections for its rotary layout; that is undone here (rows only, so
the blocks inside a row are untouched), as transformers undoes it when it dequantizes.
"""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch

from radixserve.kernels.cpu_quant import QuantLinear, int4_weight
from radixserve.model.config import ModelConfig

BLOCK = 32
LAYER_TENSORS = {  # GGUF tensor -> (our module, its shard of a fused projection)
    "attn_q": ("self_attn.qkv_proj", "q"), "attn_k": ("self_attn.qkv_proj", "k"),
    "attn_v": ("self_attn.qkv_proj", "v"), "attn_output": ("self_attn.o_proj", None),
    "ffn_gate": ("mlp.gate_up_proj", "gate"), "ffn_up": ("mlp.gate_up_proj", "up"),
    "ffn_down": ("mlp.down_proj", None),
}
SHARD_ORDER = {"self_attn.qkv_proj": ("q", "k", "v"), "mlp.gate_up_proj": ("gate", "up")}


def q4_blocks(data: np.ndarray, kind: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Raw Q4_0 / Q4_1 rows (uint8 [N, blocks * bytes]) -> (q [N, K] 0..15, scale [N, K/32], zero [N, K/32])."""
    size = 18 if kind == "Q4_0" else 20
    n = data.shape[0]
    blocks = data.reshape(n, -1, size)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    qs = blocks[..., size - 16 :]
    q = np.concatenate([qs & 15, qs >> 4], axis=-1).reshape(n, -1)
    zero = np.zeros_like(d) if kind == "Q4_0" else blocks[..., 2:4].copy().view(np.float16)[..., 0] + 8 * d
    return q, d, zero.astype(np.float32)


def unpermute_rows(x: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row order: per head, its two rotary halves back from interleaved pairs."""
    rows = x.shape[0]
    return x.reshape(heads, rows // heads // 2, 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)


def q8_blocks(data: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Raw Q8_0 rows (uint8 [N, blocks * 34]) -> (q int8 [N, K], scale float32 [N, K/32])."""
    n = data.shape[0]
    blocks = data.reshape(n, -1, 34)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    return blocks[..., 2:].copy().view(np.int8).reshape(n, -1), d


# what each --quantization takes as it ships: the decoder layers' formats, and the output projection's
AS_SHIPPED = {8: (("Q8_0",), ("Q8_0",)), 4: (("Q4_0", "Q4_1"), ("Q8_0",))}


def gguf_quant_linears(path: Path, cfg: ModelConfig, dtype: torch.dtype, bits: int) -> dict[str, QuantLinear]:
    """Our int8 / int4 layers for every linear whose GGUF tensors are all in a format ``bits`` takes as it ships
    (``AS_SHIPPED``; the others are quantized from the dequantized weights as usual). Keys are module names
    (``model.layers.3.mlp.down_proj``, ``lm_head``)."""
    from gguf import GGUFReader

    if cfg.model_type not in ("llama", "mistral"):
        return {}  # the q/k row order is Llama's; other architectures take the general path
    layer_kinds, head_kinds = AS_SHIPPED[bits]
    parts: dict[str, dict[str | None, tuple[np.ndarray, ...] | None]] = {}
    for t in GGUFReader(path).tensors:
        kind = t.tensor_type.name
        match = re.fullmatch(r"blk\.(\d+)\.(\w+)\.weight", t.name)
        if match and match.group(2) in LAYER_TENSORS:
            module, shard = LAYER_TENSORS[match.group(2)]
            name = f"model.layers.{match.group(1)}.{module}"
        elif t.name == "output.weight" or (t.name == "token_embd.weight" and cfg.tie_word_embeddings):
            name, shard = "lm_head", None
        else:
            continue
        if kind not in (head_kinds if name == "lm_head" else layer_kinds):
            parts.setdefault(name, {})[shard] = None  # one shard in another format: the whole layer is
            continue
        arrays = q8_blocks(np.asarray(t.data)) if kind == "Q8_0" else q4_blocks(np.asarray(t.data), kind)
        if shard in ("q", "k"):
            heads = cfg.num_heads if shard == "q" else cfg.num_kv_heads
            arrays = tuple(unpermute_rows(x, heads) for x in arrays)
        parts.setdefault(name, {})[shard] = arrays
    layers = {}
    for name, shards in parts.items():
        order = SHARD_ORDER.get(name.split(".", 3)[-1], (None,))
        if any(shards.get(s) is None for s in order):
            continue
        arrays = [torch.from_numpy(np.concatenate([shards[s][i] for s in order])) for i in range(len(shards[order[0]]))]
        n, k = arrays[0].shape
        if len(arrays) == 2:  # Q8_0: q, a scale per block
            layers[name] = QuantLinear(n, k, None, dtype, int8=(arrays[0], arrays[1]))
        else:
            layers[name] = QuantLinear(n, k, None, dtype, int4=int4_weight(*arrays, dtype))
    return layers
