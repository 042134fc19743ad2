"""Qwen3, Gemma 2, Gemma 3 (text) and Phi-3 on tiny random fp32 checkpoints: greedy output identical to HF
transformers (eager attention) token for token, radix cache on and off, in 5-token prefill chunks, and a second
pass through the cache; windows of 5-6 tokens under ~20-token prompts, soft-caps small enough to bite, norms and
biases drawn at random. A request continuing another's cached prefix (longer than the window) matches too. Each
checkpoint is checked to exercise its features: HF's own output changes without them. Phi-3's LongRoPE: short
factors under a context within the original window, long ones beyond it, both equal to HF where HF is in that
mode. The native decode step runs a Phi-3 (one window for all layers) and refuses the others by feature, auto
taking the compiled path. Other paths for these models: test_compiled.py, test_triton_kernels.py,
test_deterministic.py, test_tensor_parallel.py; windows and soft-caps per kernel: test_kernels_torch.py."""
from __future__ import annotations

import pytest
import torch

from conftest import SMALL, save_random
from radixserve import Engine

MAX_NEW = 10
SHARED = "You are a helpful assistant. Answer briefly and politely, and never make things up. "
QUESTIONS = ["What is the capital of France?", "Name three colors.", "How do bees make honey?"]
MODES = {"radix": {}, "no-radix": {"disable_radix_cache": True}, "chunked": {"chunked_prefill_size": 5}}
GREEDY = {"temperature": 0, "max_new_tokens": MAX_NEW, "ignore_eos": True}

# config changes that must change HF's own greedy output on these prompts: the features are exercised
FEATURES = {
    "qwen3": [{"sliding_window": 256}],
    "gemma2": [{"sliding_window": 256}, {"attn_logit_softcapping": None}, {"query_pre_attn_scalar": 16}],
    "gemma3": [{"sliding_window": 256}, {"rope_parameters": {  # without the global layer's linear scaling
        "full_attention": {"rope_type": "default", "rope_theta": 100000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}}}, {"rope_parameters": {  # local base
        "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 100000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 100000.0}}}],
    "mistral": [{"sliding_window": None}],
    "phi3": [{"sliding_window": None},
             {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0}}],
}


def _hf(path, **overrides):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager",
                                                **overrides).eval()


def _hf_greedy(model, prompts, max_new=MAX_NEW) -> list[list[int]]:
    out = []
    for p in prompts:
        with torch.no_grad():
            out.append(model.generate(torch.tensor([p]), max_new_tokens=max_new, do_sample=False)[0, len(p):].tolist())
    return out


@pytest.fixture(scope="module")
def tok(smollm2_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_path)


@pytest.fixture(scope="module")
def prompts(tok):
    ids = [tok(SHARED + q).input_ids for q in QUESTIONS]
    ids.append(tok("Unrelated: the mitochondria is").input_ids)
    return ids


@pytest.fixture(scope="module")
def hf_reference(arch_models, prompts):
    return {kind: _hf_greedy(_hf(path), prompts) for kind, path in arch_models.items()}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("kind", ["qwen3", "gemma2", "gemma3", "phi3", "mistral"])
def test_greedy_matches_hf(kind, mode, arch_models, prompts, hf_reference):
    with Engine(str(arch_models[kind]), dtype="float32", check_invariants=True, **MODES[mode]) as engine:
        assert engine.model_config.arch.sliding_windows, "the window is smaller than the prompts"
        first = engine.generate(input_ids=prompts, sampling_params=GREEDY)
        second = engine.generate(input_ids=prompts, sampling_params=GREEDY)
    assert [r["output_ids"] for r in first] == hf_reference[kind]
    assert [r["output_ids"] for r in second] == hf_reference[kind]
    cached = [r["meta_info"]["cached_tokens"] for r in second]
    assert cached == ([0] * len(prompts) if mode == "no-radix" else [len(p) - 1 for p in prompts])


@pytest.mark.parametrize("kind", ["gemma2", "phi3"])
def test_a_request_continuing_a_cached_prefix_matches_hf(kind, arch_models, prompts, hf_reference):
    """The second request reuses the first one's prompt and answer (far longer than the window) from the cache and
    attends to the cached part through its window."""
    turn = prompts[0] + hf_reference[kind][0] + prompts[1][-6:]
    with Engine(str(arch_models[kind]), dtype="float32", check_invariants=True) as engine:
        engine.generate(input_ids=prompts[0], sampling_params=GREEDY)
        out = engine.generate(input_ids=turn, sampling_params=GREEDY)
    assert out["meta_info"]["cached_tokens"] >= len(prompts[0]) + MAX_NEW - 1 > 3 * 6
    assert out["output_ids"] == _hf_greedy(_hf(arch_models[kind]), [turn])[0]


@pytest.mark.parametrize("kind", list(FEATURES))
def test_the_checkpoints_exercise_their_features(kind, arch_models, prompts, hf_reference):
    assert all(len(set(out)) > MAX_NEW // 2 for out in hf_reference[kind]), "outputs that are not one token repeated"
    for overrides in FEATURES[kind]:
        assert _hf_greedy(_hf(arch_models[kind], **overrides), prompts) != hf_reference[kind], overrides


def test_gemma_final_softcap_is_in_the_logprobs(arch_models, prompts):
    """Capping the logits keeps their order (greedy tokens cannot show it): the logprobs do."""
    path = arch_models["gemma2"]
    with torch.no_grad():
        gen = _hf(path).generate(torch.tensor([prompts[3]]), max_new_tokens=4, do_sample=False, output_logits=True,
                                 return_dict_in_generate=True)
    want = [torch.log_softmax(step[0], -1).max().item() for step in gen.logits]
    with Engine(str(path), dtype="float32") as engine:
        out = engine.generate(input_ids=prompts[3], sampling_params={**GREEDY, "max_new_tokens": 4},
                              return_logprob=True)
    got = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
    assert got == pytest.approx(want, abs=1e-4)


@pytest.fixture(scope="module")
def longrope_phi3(tmp_path_factory, tok):
    """Phi-3 with LongRoPE: original window 16, context 64; full rotary and one sliding window (6) for every layer,
    so the native decode step takes it too."""
    from transformers import Phi3Config

    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0, 1.5, 2.0, 4.0, 1.0, 1.2, 3.0, 8.0],
            "long_factor": [2.0, 4.0, 8.0, 16.0, 3.0, 5.0, 20.0, 40.0]}
    cfg = Phi3Config(num_attention_heads=4, num_key_value_heads=2, original_max_position_embeddings=16,
                     sliding_window=6, rope_parameters=rope, tie_word_embeddings=False, vocab_size=len(tok),
                     **dict(SMALL, max_position_embeddings=64))
    return save_random(cfg, tok, tmp_path_factory.mktemp("longrope") / "phi3", seed=4, norms=True)


def test_phi3_longrope_short_and_long_factors_match_hf(longrope_phi3, tok):
    """HF runs a sequence within the original 16 positions with the short factors and recomputes it with the long
    ones once it grows past them. radixserve picks one set per server, from the context it admits."""
    hf = _hf(longrope_phi3)
    short = [tok("The capital of").input_ids, tok("One two").input_ids]
    with Engine(str(longrope_phi3), dtype="float32", context_length=16) as engine:
        out = engine.generate(input_ids=short, sampling_params={**GREEDY, "max_new_tokens": 8})
    got = [r["output_ids"] for r in out]
    assert got == _hf_greedy(hf, short, 8)
    long = [tok(SHARED + "What is the capital of France?").input_ids]
    assert len(long[0]) > 16
    with Engine(str(longrope_phi3), dtype="float32", chunked_prefill_size=5) as engine:  # context 64: long factors
        first = engine.generate(input_ids=long, sampling_params=GREEDY)
        again = engine.generate(input_ids=long, sampling_params=GREEDY)
    assert [r["output_ids"] for r in first] == [r["output_ids"] for r in again] == _hf_greedy(hf, long)


@pytest.mark.parametrize("kind", ["phi3-longrope", "mistral"])
def test_one_window_for_every_layer_runs_on_the_native_step(kind, longrope_phi3, arch_models, tok, monkeypatch):
    """Models the native step takes, their window as shorter row contexts: Mistral, and a Phi-3 (fused checkpoint
    weights, LongRoPE's long factors in the per-row cos/sin). Decode and short prefill steps run native, and the
    tokens equal HF's, again through the cache."""
    from radixserve.kernels.cpu_native import unavailable_reason

    if unavailable_reason("float32"):
        pytest.skip(f"no native decode step here: {unavailable_reason('float32')}")
    monkeypatch.delenv("RADIXSERVE_DISABLE_COMPILE", raising=False)
    path = longrope_phi3 if kind == "phi3-longrope" else arch_models[kind]
    long = [tok(SHARED + q).input_ids for q in QUESTIONS[:2]]
    with Engine(str(path), dtype="float32", check_invariants=True) as engine:
        assert engine.runner.decode_kernel == "native", "auto picks the native step for a Llama-style model"
        got = [r["output_ids"] for r in engine.generate(input_ids=long, sampling_params=GREEDY)]
        again = [r["output_ids"] for r in engine.generate(input_ids=long, sampling_params=GREEDY)]
        assert engine.runner.native.steps >= MAX_NEW and engine.runner.native.prefill_steps > 0
    assert got == again == _hf_greedy(_hf(path), long)


def test_the_native_decode_step_refuses_what_it_cannot_run(arch_models, monkeypatch):
    from radixserve.kernels.cpu_native import unavailable_reason
    from radixserve.prepare import prepare
    from radixserve.server_args import ServerArgs

    if unavailable_reason("float32"):
        pytest.skip(f"no native decode step here: {unavailable_reason('float32')}")
    monkeypatch.delenv("RADIXSERVE_DISABLE_COMPILE", raising=False)
    expected = {"qwen3": "q/k norms", "gemma2": "attention soft-capping", "gemma3": "a second RoPE table",
                "phi3": "partial rotary embeddings"}
    for kind, feature in expected.items():
        args = ServerArgs(model_path=str(arch_models[kind]), dtype="float32")
        assert prepare(args).args.decode_kernel == "compiled", "auto takes the compiled path instead"
        with pytest.raises(ValueError, match=f"--decode-kernel native: the native decode step runs Llama-style "
                                             f"layers; this model has .*{feature}"):
            Engine(str(arch_models[kind]), dtype="float32", decode_kernel="native")


def test_unsupported_configs_are_refused_clearly(tmp_path, tok):
    from transformers import Gemma3TextConfig

    from radixserve.model.config import ModelConfig

    cfg = Gemma3TextConfig(num_attention_heads=4, num_key_value_heads=1, head_dim=16, vocab_size=len(tok),
                           use_bidirectional_attention=True, **SMALL)
    with pytest.raises(ValueError, match="attends bidirectionally"):
        ModelConfig.from_hf(cfg)
    cfg = Gemma3TextConfig(num_attention_heads=4, num_key_value_heads=1, head_dim=16, vocab_size=len(tok),
                           hidden_activation="relu", **SMALL)
    with pytest.raises(ValueError, match="MLP activation 'relu' is not implemented"):
        ModelConfig.from_hf(cfg)
