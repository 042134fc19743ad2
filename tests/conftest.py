"""Shared fixtures: the bundled SmolLM2 (converted once) and tiny random checkpoints built with transformers."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from radixserve.server_process import ServerProcess  # noqa: E402  (tests import it from here)

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# compiled decode costs seconds per start-up: tests run eager unless they ask for it (tests/test_compiled.py)
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


def save_random(cfg, tok, out: Path, seed: int) -> Path:
    """A random checkpoint of ``cfg`` with ``tok``'s tokenizer at ``out``; biases drawn too (from_config zeroes
    them, and a zero bias tests nothing)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
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


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory, smollm2_path) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {kind: build_tiny(kind, root, smollm2_path) for kind in ("llama", "qwen2", "mistral")}


@pytest.fixture(scope="session")
def hf_models(tiny_models):
    import torch
    from transformers import AutoModelForCausalLM

    return {k: AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32).eval() for k, p in tiny_models.items()}


def pytest_sessionfinish(session, exitstatus):
    shutil.rmtree(Path(os.environ.get("PYTEST_TINY_TMP", "/nonexistent")), ignore_errors=True)


@pytest.fixture(scope="session")
def tiny_server(tiny_models):
    """A server on the tiny fp32 Llama (context 2048, pool 1200): fast, and batched greedy output equals sequential."""
    server = ServerProcess("--model-path", str(tiny_models["llama"]), "--dtype", "float32",
                           "--max-total-tokens", "1200", "--served-model-name", "tiny", "--check-invariants")
    yield server
    server.stop()


@pytest.fixture(scope="session")
def smol_server():
    server = ServerProcess("--max-total-tokens", "8192")
    yield server
    server.stop()
