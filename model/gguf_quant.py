"""A GGUF file's quantized linear weights, taken as they ship: the file's blocks become radixserve's int8 / int4
layers holding the same integers, scales and offsets llama.cpp computes with, instead of being dequantized (and
quantized again). Which formats each ``--quantization`` takes as they ship (``AS_SHIPPED``):

    gguf  every linear as the file has it: the formats below from their blocks, F32/F16/BF16 tensors dense
    int8  Q8_0, Q6_K, Q5_K, Q5_0, Q5_1 (8-bit integers fit them exactly); the rest quantized to int8 per channel
    int4  Q4_0, Q4_1, Q4_K; the output projection in an 8-bit format as it ships, else int8 per channel

GGUF block layouts (ggml), along a row; every block decodes to ``w = q * scale + offset`` per 32 (Q6_K: 16) weights:

    Q8_0  32 w | d: f16 | 32 int8                                                  scale d         offset -
    Q4_0  32 w | d: f16 | 16 bytes: w j in the low nibble of byte j, 16 + j high   scale d         offset -8 d
    Q4_1  32 w | d: f16 | m: f16 | 16 bytes, as Q4_0                               scale d         offset m
    Q5_0  32 w | d: f16 | 4 bytes: bit j the fifth bit of w j | 16 bytes as Q4_0   scale d         offset -16 d
    Q5_1  32 w | d: f16 | m: f16 | then as Q5_0                                    scale d         offset m
    Q4_K 256 w | d, dmin: f16 | 12 bytes: 8 x (6-bit sc, 6-bit mn) | 128 bytes: per 64 w, w j in the low nibble of
                 byte j, 32 + j in the high one                                    scale d sc      offset -dmin mn
    Q5_K 256 w | as Q4_K, then 32 bytes qh before the nibbles: bit i of qh[j] is the fifth bit of w 32 i + j
    Q6_K 256 w | 128 bytes low nibbles (per 128 w: j low / 64 + j high of byte j) | 64 bytes high 2 bits (per 128 w:
                 bits 2s of byte j for w 32 s + j) | 16 int8 sc | d: f16 | q - 32   scale d sc      offset -

Each product ``q * scale`` is exact in float32 (at most 6 + 19 bits), so ``q * scale + offset`` rounds once, as
gguf's own dequantization does: the decoded weights equal it bit for bit (tests/test_gguf_quant.py).

Architectures served from blocks (``ARCHITECTURES``, by the HF model type transformers converts the file to):
llama, mistral, qwen2, qwen3, gemma2, gemma3_text (a ``gemma3`` file) and phi3 -- every one radixserve runs that
transformers' GGUF reader converts. Their tensors map onto our fused modules in one of two layouts:

    split  attn_q | attn_k | attn_v -> qkv_proj (q, k, v)   ffn_gate | ffn_up -> gate_up_proj (gate, up)
    fused  attn_qkv -> qkv_proj whole                       ffn_up (gate rows, then up) -> gate_up_proj whole (Phi-3)

attn_output, ffn_down and output (or token_embd, tied) are one tensor each. llama.cpp's converter reorders the rows
of Llama's (and Mistral's) q/k projections for its rotary layout; that is undone here (rows only, so the blocks
inside a row are untouched), as transformers undoes it when it dequantizes. The others' rows ship in HF order
(their rotary layout is NeoX's); Qwen2's q/k/v biases, Qwen3's and Gemma 3's q/k norms and Gemma's norms (stored
as 1 + w) are dense and come with the dequantized checkpoint.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from radixserve.kernels.cpu_quant import FileBlocks, QuantLinear, int4_weight
from radixserve.model.config import ModelConfig

SPLIT = {  # GGUF tensor (blk.N.<name>.weight) -> (our module, its shard of a fused projection), shards in order
    "attn_q": ("self_attn.qkv_proj", "q"), "attn_k": ("self_attn.qkv_proj", "k"),
    "attn_v": ("self_attn.qkv_proj", "v"), "attn_output": ("self_attn.o_proj", None),
    "ffn_gate": ("mlp.gate_up_proj", "gate"), "ffn_up": ("mlp.gate_up_proj", "up"),
    "ffn_down": ("mlp.down_proj", None),
}
FUSED = {  # Phi-3: q/k/v in one tensor, and ffn_up holding gate and up, rows back to back as our modules have them
    "attn_qkv": ("self_attn.qkv_proj", None), "attn_output": ("self_attn.o_proj", None),
    "ffn_up": ("mlp.gate_up_proj", None), "ffn_down": ("mlp.down_proj", None),
}
DENSE_TYPES = ("F32", "F16", "BF16")
INT4_TYPES = ("Q4_0", "Q4_1", "Q4_K")
INT8_TYPES = ("Q8_0", "Q6_K", "Q5_K", "Q5_0", "Q5_1")
AS_SHIPPED = {  # --quantization -> (the decoder layers' formats taken as they ship, the output projection's)
    "gguf": (INT4_TYPES + INT8_TYPES, INT4_TYPES + INT8_TYPES),
    "int8": (INT8_TYPES, INT8_TYPES),
    "int4": (INT4_TYPES, INT8_TYPES),
}


@dataclass(frozen=True, slots=True)
class Layout:
    """How one architecture's GGUF tensors map onto our modules."""

    tensors: dict[str, tuple[str, str | None]]  # SPLIT or FUSED
    permuted: bool = False  # q/k rows reordered by llama.cpp's converter for its rotary layout

    def shards(self, module: str) -> tuple[str | None, ...]:
        """The shards a module's rows stack, in order; (None,) for a module one tensor fills."""
        return tuple(s for m, s in self.tensors.values() if m == module and s is not None) or (None,)


ARCHITECTURES = {  # HF model type (what transformers converts the file to) -> its layout
    "llama": Layout(SPLIT, permuted=True), "mistral": Layout(SPLIT, permuted=True), "qwen2": Layout(SPLIT),
    "qwen3": Layout(SPLIT), "gemma2": Layout(SPLIT), "gemma3_text": Layout(SPLIT), "phi3": Layout(FUSED),
}


@dataclass
class Blocks:
    """Decoded blocks of a [N, K] tensor: ``w = q * scale + offset`` per group of K."""

    q: np.ndarray  # int8 [N, K] (Q4 formats: 0..15, Q5 formats: 0..31, Q6_K: -32..31, Q8_0: -128..127)
    scale: np.ndarray  # float32 [N, K / group]
    offset: np.ndarray | None  # float32 [N, K / group], or None for 0
    bits: int  # 4: q fits a nibble (an int4 layer), else 8
    factors: FileBlocks | None = None  # the format, and scale and offset as the file factors them

    @property
    def group(self) -> int:
        return self.q.shape[1] // self.scale.shape[1]

    def rows(self, index: np.ndarray) -> Blocks:
        return Blocks(self.q[index], self.scale[index], None if self.offset is None else self.offset[index],
                      self.bits, None if self.factors is None else self.factors.rows(torch.from_numpy(index)))

    def regrouped(self, group: int) -> Blocks:
        """The same weights as 8-bit blocks of ``group`` (a divisor of this group), each with a scale and an offset."""
        times = self.group // group
        offset = np.zeros_like(self.scale) if self.offset is None else self.offset
        return Blocks(self.q, self.scale.repeat(times, axis=1), offset.repeat(times, axis=1), 8)

    def dequantized(self) -> np.ndarray:
        n, k = self.q.shape
        w = self.q.reshape(n, self.scale.shape[1], -1).astype(np.float32) * self.scale[..., None]
        if self.offset is not None:
            w = w + self.offset[..., None]
        return w.reshape(n, k)


def _f16(raw: np.ndarray) -> np.ndarray:
    """Two bytes per value (the last axis) as float32."""
    return raw.copy().view(np.float16)[..., 0].astype(np.float32)


def _nibbles(raw: np.ndarray) -> np.ndarray:
    """Bytes [..., B] -> [..., 2B]: every byte's low nibbles, then every byte's high nibbles."""
    return np.concatenate([raw & 15, raw >> 4], axis=-1)


def _k_scales(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's 12 bytes [..., 12] -> 8 six-bit scales and 8 six-bit mins: bytes 0-3 hold scales 0-3 (low 6
    bits), 4-7 mins 0-3; scales and mins 4-7 take their low 4 bits from bytes 8-11 (scale low nibble, min high) and
    their top 2 bits from the top bits of bytes 0-3 (scales) and 4-7 (mins)."""
    a, b, c = raw[..., 0:4], raw[..., 4:8], raw[..., 8:12]
    scales = np.concatenate([a & 63, (c & 15) | ((a >> 6) << 4)], axis=-1)
    mins = np.concatenate([b & 63, (c >> 4) | ((b >> 6) << 4)], axis=-1)
    return scales, mins


def decode_blocks(data: np.ndarray, kind: str) -> Blocks:
    """Raw rows of one GGUF tensor (uint8 [N, bytes per row]) in format ``kind`` -> its Blocks."""
    n = data.shape[0]
    t = torch.from_numpy
    if kind == "Q8_0":
        b = data.reshape(n, -1, 34)
        d = _f16(b[..., 0:2])
        return Blocks(b[..., 2:].copy().view(np.int8).reshape(n, -1), d, None, 8, FileBlocks(kind, t(d)))
    if kind in ("Q4_0", "Q4_1"):
        b = data.reshape(n, -1, 18 if kind == "Q4_0" else 20)
        d = _f16(b[..., 0:2])
        offset = -8 * d if kind == "Q4_0" else _f16(b[..., 2:4])
        return Blocks(_nibbles(b[..., -16:]).reshape(n, -1).astype(np.int8), d, offset, 4,
                      FileBlocks(kind, t(d), dmin=t(-offset)))
    if kind in ("Q5_0", "Q5_1"):
        b = data.reshape(n, -1, 22 if kind == "Q5_0" else 24)
        d = _f16(b[..., 0:2])
        high = b[..., -20:-16].copy().view("<u4")  # bit j: the fifth bit of weight j
        q = _nibbles(b[..., -16:]) | (((high >> np.arange(32, dtype=np.uint32)) & 1) << 4).astype(np.uint8)
        offset = -16 * d if kind == "Q5_0" else _f16(b[..., 2:4])
        return Blocks(q.reshape(n, -1).astype(np.int8), d, offset, 8, FileBlocks(kind, t(d), dmin=t(-offset)))
    if kind in ("Q4_K", "Q5_K"):
        b = data.reshape(n, -1, 144 if kind == "Q4_K" else 176)
        d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
        sc, mn = _k_scales(b[..., 4:16])
        q = _nibbles(b[..., -128:].reshape(n, -1, 4, 32)).reshape(n, -1, 8, 32)  # [n, super, sub-block, 32]
        if kind == "Q5_K":
            high = b[..., 16:48]  # [n, super, 32]: bit i of byte j for sub-block i
            q = q | (((high[..., None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1) << 4)
        factors = FileBlocks(kind, t(d), t(sc.reshape(n, -1)), t(dmin), t(mn.reshape(n, -1)))
        return Blocks(q.reshape(n, -1).astype(np.int8), (d[..., None] * sc.astype(np.float32)).reshape(n, -1),
                      -(dmin[..., None] * mn.astype(np.float32)).reshape(n, -1), 4 if kind == "Q4_K" else 8, factors)
    if kind == "Q6_K":
        b = data.reshape(n, -1, 210)
        low = _nibbles(b[..., 0:128].reshape(n, -1, 2, 64)).reshape(n, -1, 2, 4, 32)  # [n, super, half, s, 32]
        high = (b[..., 128:192].reshape(n, -1, 2, 1, 32) >> (2 * np.arange(4, dtype=np.uint8))[:, None]) & 3
        q = (low | (high << 4)).astype(np.int8) - 32
        sc, d = b[..., 192:208].copy().view(np.int8), _f16(b[..., 208:210])
        factors = FileBlocks(kind, t(d), t(sc.reshape(n, -1)))
        return Blocks(q.reshape(n, -1), (d[..., None] * sc.astype(np.float32)).reshape(n, -1), None, 8, factors)
    raise ValueError(f"no decoder for {kind} blocks")


def unpermute_rows(x: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row order: per head, its two rotary halves back from interleaved pairs."""
    rows = x.shape[0]
    return x.reshape(heads, rows // heads // 2, 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)


def _layer_name(tensor: str, tied: bool, layout: Layout) -> tuple[str, str | None] | None:
    """A GGUF tensor's module and shard, or None for one that is no linear layer's weight."""
    match = re.fullmatch(r"blk\.(\d+)\.(\w+)\.weight", tensor)
    if match and match.group(2) in layout.tensors:
        module, shard = layout.tensors[match.group(2)]
        return f"model.layers.{match.group(1)}.{module}", shard
    if tensor == "output.weight" or (tensor == "token_embd.weight" and tied):
        return "lm_head", None
    return None


def _as_layer(shards: list[Blocks], dtype: torch.dtype) -> QuantLinear:
    """One QuantLinear from the blocks of its shards, rows stacked (q, k and v; gate and up). Shards in different
    formats (a Q4_K_M file's Q6_K v beside Q4_K q and k) share the finer one: 8-bit blocks of the smaller group,
    each with an offset -- the same weights, in more bytes; the native step reads every shard in its own bits
    still, a part per run of one format (``file_blocks``)."""
    factors = FileBlocks.runs([s.factors for s in shards])
    groups = {s.group for s in shards}
    if len(groups) > 1 or len({s.bits for s in shards}) > 1 or len({s.offset is None for s in shards}) > 1:
        shards = [s.regrouped(min(groups)) for s in shards]
    q = torch.from_numpy(np.concatenate([s.q for s in shards]))
    scale = torch.from_numpy(np.concatenate([s.scale for s in shards]))
    offset = None if shards[0].offset is None else torch.from_numpy(np.concatenate([s.offset for s in shards]))
    n, k = q.shape
    if shards[0].bits == 4:
        return QuantLinear(n, k, None, dtype, int4=int4_weight(q, scale, offset), file_blocks=factors)
    return QuantLinear(n, k, None, dtype, int8=(q, scale, offset), file_blocks=factors)


TENSOR_TABLE = "gguf_tensors.json"  # in a converted folder: where each tensor of its GGUF file lies, and how


@dataclass(frozen=True)
class FileTensor:
    """A GGUF file's tensor as gguf's GGUFReader reads it: its name, its type's name (Q4_K, F32, ...) and its data
    (a view of the memory-mapped file: blocks as rows of bytes, dense types as their numbers)."""
    name: str
    kind: str
    data: np.ndarray


def reader_tensors(reader) -> list[FileTensor]:
    """The tensors of a GGUFReader."""
    return [FileTensor(t.name, t.tensor_type.name, t.data) for t in reader.tensors]


def tensor_table(reader) -> list[dict]:
    """What ``file_tensors`` needs to find a GGUFReader's tensors in its file without parsing it again: name, type,
    byte offset, numpy dtype (with its byte order) and shape of each."""
    return [{"name": t.name, "kind": t.tensor_type.name, "offset": int(t.data_offset), "dtype": t.data.dtype.str,
             "shape": list(t.data.shape)} for t in reader.tensors]


def file_tensors(path: Path, folder: Path | None = None) -> list[FileTensor]:
    """The tensors of GGUF file ``path``: from the table its converted ``folder`` recorded (``TENSOR_TABLE``; the
    folder is named by the file's path, size and mtime and its files checked against its manifest), else as
    GGUFReader reads them. The table spares a parse that takes seconds on every start: GGUFReader reads all the
    metadata first, a Python step per token string (~4 s for a 49k-token vocabulary)."""
    table = None if folder is None else folder / TENSOR_TABLE
    if table is None or not table.exists():
        from gguf import GGUFReader
        return reader_tensors(GGUFReader(path))
    data = np.memmap(path, mode="r")
    tensors = []
    for t in json.loads(table.read_text()):
        dtype, shape = np.dtype(t["dtype"]), tuple(t["shape"])
        end = t["offset"] + int(np.prod(shape)) * dtype.itemsize
        if end > len(data):
            raise ValueError(f"{path.name}: tensor {t['name']} ends at byte {end}, past the file's end ({len(data)}): "
                             f"the file changed after {folder} was converted from it")
        tensors.append(FileTensor(t["name"], t["kind"], data[t["offset"]:end].view(dtype).reshape(shape)))
    return tensors


def layers_as_shipped(path: Path, tensors: list[FileTensor], model_type: str, tied: bool,
                      quantization: str) -> dict[str, dict[str | None, str]]:
    """Every linear layer of GGUF file ``path`` (its ``tensors``) whose tensors are all in a format
    ``quantization`` takes as it ships (``AS_SHIPPED``): module name -> {shard: GGUF tensor name}. Under ``gguf`` a
    tensor in a format this module does not decode is refused by name (ValueError). Empty for an architecture
    without a layout."""
    layout = ARCHITECTURES.get(model_type)
    if layout is None:
        return {}
    layer_kinds, head_kinds = AS_SHIPPED[quantization]
    found: dict[str, dict[str | None, str]] = {}
    other: set[str] = set()  # layers with a shard in another format: the whole layer is
    for t in tensors:
        kind, where = t.kind, _layer_name(t.name, tied, layout)
        if where is None:
            continue
        name, shard = where
        takes = head_kinds if name == "lm_head" else layer_kinds
        if kind in takes:
            found.setdefault(name, {})[shard] = t.name
        elif quantization == "gguf" and kind not in DENSE_TYPES:
            raise ValueError(f"{path.name}: tensor {t.name} is {kind}, whose blocks radixserve does not read "
                             f"(it reads {', '.join(takes + DENSE_TYPES)}); serve the file without "
                             "--quantization gguf (dequantized at load) or pick a file in those formats")
        else:
            other.add(name)
    return {name: shards for name, shards in found.items()
            if name not in other and set(shards) == set(layout.shards(name.split(".", 3)[-1]))}


def gguf_quant_linears(path: Path, cfg: ModelConfig, dtype: torch.dtype, quantization: str,
                       folder: Path | None = None) -> dict[str, QuantLinear]:
    """Our int8 / int4 layers for every linear whose GGUF tensors are all in a format ``quantization`` takes as it
    ships (``layers_as_shipped``); keys are module names (``model.layers.3.mlp.down_proj``, ``lm_head``). Under
    ``gguf`` a tensor in a format this module does not decode is refused by name; under int8 / int4 such layers are
    quantized from the dequantized weights as usual. ``folder``: the file's conversion (its tensor table read, not
    the file's metadata)."""
    layout = ARCHITECTURES.get(cfg.model_type)
    if layout is None:
        if quantization == "gguf":
            raise ValueError(f"--quantization gguf reads the blocks of {', '.join(ARCHITECTURES)} GGUF files; this "
                             f"one is {cfg.model_type}: serve it without --quantization (dequantized) or with int8")
        return {}  # other architectures' tensors take the general path
    tensors = file_tensors(path, folder)
    plan = layers_as_shipped(path, tensors, cfg.model_type, cfg.tie_word_embeddings, quantization)
    wanted = {tensor: (name, shard) for name, shards in plan.items() for shard, tensor in shards.items()}
    parts: dict[str, dict[str | None, Blocks]] = {}  # a layer's shards until it has them all
    layers = {}
    for t in tensors:
        if t.name not in wanted:
            continue
        name, shard = wanted[t.name]
        blocks = decode_blocks(np.asarray(t.data), t.kind)
        if shard in ("q", "k") and layout.permuted:
            heads = cfg.num_heads if shard == "q" else cfg.num_kv_heads
            blocks = blocks.rows(unpermute_rows(np.arange(blocks.q.shape[0]), heads))
        got = parts.setdefault(name, {})
        got[shard] = blocks
        if len(got) == len(plan[name]):  # built as soon as complete: one layer's decoded blocks held at a time
            layers[name] = _as_layer([got[s] for s in layout.shards(name.split(".", 3)[-1])], dtype)
            del parts[name]
    return layers
