"""GGUF files served from their blocks (``--quantization gguf``, model/gguf_quant.py): every block format radixserve
reads decodes to the values gguf's own dequantization gives; a Q4_K_M-style file of every architecture read from
blocks (Llama, Qwen2, Qwen3, Gemma 2, Gemma 3, Phi-3) has layers holding exactly the weights transformers dequantizes
from it, and greedy tokens those of the dequantized model; the native decode step reads the same blocks; and what
is not read is refused by tensor name and type, or by architecture."""
from __future__ import annotations

import ctypes
import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import bundled_gguf, random_blocks, write_gguf
from torch import nn

from radixserve import Engine
from radixserve.kernels import cpu_native
from radixserve.kernels.cpu_quant import QuantLinear
from radixserve.model.config import FAMILIES, ModelConfig
from radixserve.model.gguf_quant import ARCHITECTURES, AS_SHIPPED, Blocks, _as_layer, decode_blocks, gguf_quant_linears
from radixserve.model.loader import load_configs

FORMATS = sorted(set(AS_SHIPPED["gguf"][0]))
PROMPTS = [[11, 12, 13, 14, 15, 16, 17, 18, 19, 20], [11, 12, 13, 99, 98], [5, 4000, 77]]
GREEDY = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}


@pytest.mark.parametrize("kind", FORMATS)
def test_every_format_decodes_to_ggufs_own_values(kind):
    """Random blocks (every bit pattern of the integers, scales and packed high bits) of each format: equal to
    gguf.quants.dequantize, value for value (a zero's sign aside: Q4_0's (q - 8) d is -0 where d < 0, our
    q d - 8 d is +0), and the int8 / int4 layer built from them dequantizes to the same float32 weights."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    raw = random_blocks(kind, 16, 512, seed=len(kind))
    want = dequantize(raw, GGMLQuantizationType[kind]).reshape(16, 512)
    blocks = decode_blocks(raw, kind)
    assert np.array_equal(blocks.dequantized(), want)
    layer = _as_layer([blocks], torch.float32)
    assert layer.bits == blocks.bits
    assert torch.equal(layer.dequantized(), torch.from_numpy(want))


NATIVE_FORMAT = {"Q8_0": "Q8H", "Q4_0": "Q4", "Q4_1": "Q4", "Q5_0": "Q5", "Q5_1": "Q5", "Q4_K": "Q4K",
                 "Q5_K": "Q5K", "Q6_K": "Q6K"}


@pytest.mark.parametrize("kind", FORMATS)
def test_the_native_step_reads_every_format_in_its_own_bits(kind):
    """Random blocks of each format, as a layer (40 rows: no whole 16-row block at the end) beside a Q6_K shard
    (two parts), through the native kernel's product of 1, 3 and 5 rows: its layout for that format (the integers
    in no more bytes than the file's blocks), equal to the formula on gguf's weights with the
    activations quantized as the kernel does (per 32; per 256 where every part is a K-quant) -- sum over blocks of
    dx sum_k xq w (float64)."""
    if cpu_native.unavailable_reason("float32"):
        pytest.skip(cpu_native.unavailable_reason("float32"))
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from radixserve.model.native_decode import pack_gguf

    lib = cpu_native.load(cpu_native.default_cache_dir())
    k = 512
    shards = [decode_blocks(random_blocks(kind, 40, k, seed=3), kind),
              decode_blocks(random_blocks("Q6_K", 16, k, seed=4), "Q6_K")]
    layer = _as_layer(shards, torch.float32)
    q = layer.q if layer.bits == 8 else torch.stack([layer.nibbles & 15, layer.nibbles >> 4], -1).view(56, k)
    lins, keep, row = [], [], 0
    for fb in layer.file_blocks:
        rows = fb.d.shape[0]
        form, tensors = pack_gguf(q[row : row + rows], fb)
        keep += tensors
        lins.append(cpu_native.Linear(form, rows, k, 0, *(None if t is None else t.data_ptr() for t in tensors[:3]),
                                      None, *(None if t is None else t.data_ptr() for t in tensors[3:])))
        row += rows
    assert lins[0].format == getattr(cpu_native, NATIVE_FORMAT[kind])
    # the integers in no more bytes than the file's blocks (rows padded to 16s); with their scales, no more than a
    # 16th of a byte a weight more (Q4_0's and Q5_0's stored offsets, the K-quants' 8-bit sc and mn), Q8_0's and
    # Q6_K's none
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[kind]]
    weights = (lins[0].n + 15) // 16 * 16 * k
    assert keep[0].numel() / weights <= size / block
    whole = sum(t.numel() * t.element_size() for t in keep[:5] if t is not None) / weights  # the first shard's
    assert whole <= size / block + (0 if kind in ("Q8_0", "Q6_K") else 1 / 16)
    parts = (cpu_native.Linear * len(lins))(*lins)
    whole = cpu_native.Linear(cpu_native.PARTS, 56, k, len(lins), ctypes.addressof(parts), None, None, None)
    w = torch.from_numpy(np.concatenate([s.dequantized() for s in shards])).double()
    g = torch.Generator().manual_seed(len(kind))
    span = 256 if kind.endswith("_K") else 32  # every part a K-quant: the activations per super-block
    for m in (1, 3, 5):
        x = torch.randn(m, k, generator=g)
        xb = x.view(m, -1, span)
        amax = xb.abs().amax(-1)
        xq = torch.round(xb * torch.where(amax > 0, 127 / amax, 0)[..., None]).double()  # nearest, ties to even
        want = torch.einsum("mbk,nbk->mnb", xq, w.view(56, -1, span)) @ (amax.double() / 127)[..., None]
        got = cpu_native.product(lib, whole, x.contiguous()).double()
        torch.testing.assert_close(got, want[..., 0], rtol=1e-5, atol=1e-6)


def test_shards_in_different_formats_fuse_into_one_layer_holding_each_ones_weights():
    """A Q4_K_M file's q and k in Q4_K beside v in Q6_K: one 8-bit layer with a scale and offset per 16 weights."""
    shards = [decode_blocks(random_blocks(kind, rows, 256, seed=rows), kind)
              for kind, rows in (("Q4_K", 32), ("Q4_K", 16), ("Q6_K", 16))]
    layer = _as_layer(shards, torch.float32)
    assert (layer.bits, layer.group) == (8, 16) and layer.offset is not None
    want = np.concatenate([s.dequantized() for s in shards])
    assert torch.equal(layer.dequantized(), torch.from_numpy(want))


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3", "gemma2", "gemma3", "phi3"])
def q4_k_m(request, tmp_path_factory) -> Path:
    """A Q4_K_M-style file of each architecture read from blocks: Llama (q/k rows reordered by llama.cpp's
    converter), Qwen2 (rows as HF has them, q/k/v biases), Qwen3 and Gemma 3 (head_dim 128 != hidden / heads, q/k
    norms), Gemma 2 (tied: the output projection is token_embd's Q8_0 blocks) and Phi-3 (q/k/v in one Q5_K
    attn_qkv, gate and up in one ffn_up)."""
    return write_gguf(tmp_path_factory.mktemp("gguf") / f"tiny-{request.param}-Q4_K_M.gguf", {}, request.param)


@pytest.fixture(scope="module")
def engines(q4_k_m):
    kwargs = dict(dtype="float32", decode_kernel="eager", max_total_tokens=600, chunked_prefill_size=7,
                  check_invariants=True)
    quantized, reference = Engine(str(q4_k_m), quantization="gguf", **kwargs), Engine(str(q4_k_m), **kwargs)
    yield quantized, reference
    quantized.shutdown()
    reference.shutdown()


def test_a_q4_k_m_file_is_served_from_its_blocks(engines):
    """Every linear layer is a quantized one holding bit for bit the weights transformers dequantized from the
    file (q/k rows put back in HF order), the layers in Q4_K as int4, Q6_K as int8 per 16 weights."""
    quantized, reference = engines
    layers = {n: m for n, m in quantized.runner.model.named_modules() if isinstance(m, QuantLinear)}
    assert not any(isinstance(m, nn.Linear) for m in quantized.runner.model.modules())
    assert len(layers) == 4 * 2 + 1
    assert (layers["model.layers.0.mlp.gate_up_proj"].bits, layers["model.layers.0.mlp.down_proj"].group) == (4, 16)
    want = dict(reference.runner.model.named_parameters(remove_duplicate=False))  # a tied lm_head too
    for name, layer in layers.items():
        assert torch.equal(layer.dequantized(), want[name + ".weight"]), name


def test_greedy_tokens_are_the_dequantized_models(engines):
    """Cache on, prefill chunked by 7 tokens, invariants checked each step; twice (the second on cached prefixes)."""
    quantized, reference = engines
    for _ in range(2):
        got = [r["output_ids"] for r in quantized.generate(input_ids=PROMPTS, sampling_params=GREEDY)]
        want = [r["output_ids"] for r in reference.generate(input_ids=PROMPTS, sampling_params=GREEDY)]
        assert got == want
    assert len({t for ids in want for t in ids}) > 3, "a model this degenerate would show nothing"


def test_the_native_step_reads_the_same_blocks(q4_k_m, engines):
    """The native step on the file's blocks (Q4_K and Q6_K in their own bits, the fused q/k/v -- Q4_K beside Q6_K
    -- in two parts, one of each;
    activations quantized per 32 as llama.cpp does) prefills a prompt and decodes 8 tokens, and a prompt too long
    for it goes through torch's step with the same kernel's products; the eager path, fed the same tokens, gives
    each of them nearly the same log-probability (its activations stay float). Llama, Qwen2 and Phi-3 (its q/k/v
    one Q5_K tensor): the other files' layers have what the native step refuses (q/k norms, Gemma's block;
    model/arch.py)."""
    if cpu_native.unavailable_reason("float32"):
        pytest.skip(cpu_native.unavailable_reason("float32"))
    model_type = engines[0].runner.model.config.model_type
    if model_type not in ("llama", "qwen2", "phi3"):
        pytest.skip("checked on the Llama, Qwen2 and Phi-3 files")
    prompt = PROMPTS[0] + [400, 500, 600, 700, 800, 900]
    with Engine(str(q4_k_m), quantization="gguf", dtype="float32", decode_kernel="native") as native:
        layer = native.runner.native.desc.layer[0]
        qkv = cpu_native.Q5K if model_type == "phi3" else cpu_native.PARTS
        assert (layer.qkv.format, layer.gate_up.format, layer.down.format) == (qkv, cpu_native.Q4K, cpu_native.Q6K)
        if qkv == cpu_native.PARTS:
            parts = ctypes.cast(layer.qkv.w, ctypes.POINTER(cpu_native.Linear))
            cfg = native.runner.model.config
            v_rows = cfg.num_kv_heads * cfg.head_dim
            assert [(parts[i].format, parts[i].n) for i in range(layer.qkv.parts)] == [
                (cpu_native.Q4K, layer.qkv.n - v_rows), (cpu_native.Q6K, v_rows)]
        out = native.generate(input_ids=prompt, sampling_params=GREEDY, return_logprob=True, logprob_start_len=0)
        # a prompt too long for the native step's prefill: torch's step, its products through the same kernel
        layers = [m for m in native.runner.model.modules() if isinstance(m, QuantLinear)]
        assert all(m.native is not None and m.handed_over for m in layers)  # the kernel's copy, held once
        assert not any(b is not None for m in layers for b in (m.scale, m.offset, getattr(m, "q", None),
                                                               getattr(m, "nibbles", None)))
        long = [int(t) for t in np.random.default_rng(1).integers(100, 40000, 320)]
        long_out = native.generate(input_ids=long, sampling_params={"max_new_tokens": 1}, return_logprob=True,
                                   logprob_start_len=0)
    ids = prompt + out["output_ids"]
    got = [lp for lp, _, _ in out["meta_info"]["input_token_logprobs"][1:] + out["meta_info"]["output_token_logprobs"]]
    scored = engines[0].generate(input_ids=ids, sampling_params={"max_new_tokens": 1}, return_logprob=True,
                                 logprob_start_len=0)
    want = [lp for lp, _, _ in scored["meta_info"]["input_token_logprobs"][1:]]
    assert np.abs(np.array(got) - np.array(want)).max() < 0.5, (got, want)
    scored = engines[0].generate(input_ids=long, sampling_params={"max_new_tokens": 1}, return_logprob=True,
                                 logprob_start_len=0)
    got, want = ([lp for lp, _, _ in o["meta_info"]["input_token_logprobs"][1:]] for o in (long_out, scored))
    assert np.abs(np.array(got) - np.array(want)).max() < 0.5
    assert np.mean(want[: len(prompt) - 1]) < -11.5, "logits spread enough to tell tokens apart (uniform: -10.8)"


def test_what_is_not_read_is_refused_by_tensor_and_type(tmp_path):
    path = write_gguf(tmp_path / "q2.gguf", {"blk.1.ffn_up": "Q2_K"})
    with pytest.raises(ValueError, match=r"blk\.1\.ffn_up\.weight is Q2_K"):
        Engine(str(path), quantization="gguf", dtype="float32")


def test_gguf_needs_a_gguf_file(tiny_models):
    with pytest.raises(ValueError, match="not a GGUF file"):
        Engine(str(tiny_models["llama"]), quantization="gguf", dtype="float32")


def test_every_architecture_radixserve_runs_and_transformers_converts_is_read_from_blocks():
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    converted = {"gemma3_text" if a == "gemma3" else a for a in GGUF_SUPPORTED_ARCHITECTURES}  # text-only, as read
    assert set(FAMILIES) & converted == set(ARCHITECTURES)


def test_an_architecture_without_a_layout_is_refused_under_gguf_and_left_to_int8(smollm2_path):
    """One radixserve would run with no layout here (a family added later): refused by name under gguf; under int8
    its layers take the general path."""
    cfg = dataclasses.replace(ModelConfig.from_hf(*load_configs(smollm2_path)), model_type="falcon")
    with pytest.raises(ValueError, match="this one is falcon: serve it without --quantization"):
        gguf_quant_linears(bundled_gguf(), cfg, torch.float32, "gguf")
    assert gguf_quant_linears(bundled_gguf(), cfg, torch.float32, "int8") == {}
