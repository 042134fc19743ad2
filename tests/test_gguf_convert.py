"""A GGUF file converted a tensor at a time (model/gguf_convert.py) holds exactly what transformers' whole-file
reading gives, for Llama, Qwen2, Gemma 2, Gemma 3, Phi-3 and the bundled SmolLM2 (Qwen3 is read as Qwen2 is, its
q/k norms as Gemma 3's); shards beyond one file come with an index HF loaders follow; and ``--quantization gguf``
converts without the linears its blocks serve, and never reads their converted copies.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import bundled_gguf, write_gguf
from gguf import GGUFReader
from safetensors.torch import load_file

from radixserve.kernels.cpu_quant import QuantLinear
from radixserve.model.config import ModelConfig
from radixserve.model.gguf_convert import INDEX, dequantized_tensors, write_shards
from radixserve.model.loader import convert_gguf, load_configs
from radixserve.model.runner import build_model, iter_safetensors


def whole_file_reading(gguf: Path) -> tuple[dict[str, torch.Tensor], object]:
    """What transformers' own GGUF loading gives: the float32 model's tensors (a tied output projection left out,
    it is the embedding) and its config."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tensors = dict(model.state_dict())
    if model.config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    return tensors, model.config


def tiny_or_bundled(architecture: str, folder: Path) -> Path:
    if architecture == "bundled":
        return bundled_gguf()
    return write_gguf(folder / f"{architecture}.gguf", {}, architecture)


@pytest.mark.parametrize("architecture", ["llama", "qwen2", "gemma2", "gemma3", "phi3", "bundled"])
def test_a_tensor_at_a_time_is_transformers_reading_bit_for_bit(architecture, tmp_path):
    """Names, shapes and every value equal: Llama's q/k rows put back in HF order, Gemma's norms as w, Qwen2's
    biases, Phi-3's fused projections, a tied output projection left out."""
    gguf = tiny_or_bundled(architecture, tmp_path)
    want, config = whole_file_reading(gguf)
    got = dict(dequantized_tensors(gguf, GGUFReader(gguf), config))
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == torch.float32 and torch.equal(got[name], tensor), name


@pytest.mark.parametrize("architecture", ["gemma2", "bundled"])
def test_the_converted_folder_is_what_transformers_would_save(architecture, tmp_path):
    """The folder's config is the one transformers builds (less its quantization_config: the weights are plain
    float32), and its tensors the model's."""
    gguf = tiny_or_bundled(architecture, tmp_path)
    want, config = whole_file_reading(gguf)
    folder = convert_gguf(gguf)
    del config.quantization_config
    config.save_pretrained(tmp_path / "want")
    mine, theirs = (json.loads(p.read_text()) for p in (folder / "config.json", tmp_path / "want" / "config.json"))
    assert mine == theirs
    assert dict(iter_safetensors(folder)).keys() == want.keys()


def test_a_conversion_parses_the_files_metadata_once(tmp_path, monkeypatch):
    """Parsing a GGUF's metadata takes seconds (a Python step per token string): converting parses it once for the
    config, the tokenizer, the generation config and the tensors (model/gguf_convert.py read_once), then leaves
    gguf's and transformers' names as they were; the folder's tokenizer is the one transformers reads from the
    file."""
    import gguf as gguf_py
    import transformers.modeling_gguf_pytorch_utils as utils
    from transformers import AutoTokenizer

    gguf = write_gguf(tmp_path / "llama.gguf", {}, "llama")
    parsed, init = [], GGUFReader.__init__

    def counted(self, path, *args, **kwargs):
        parsed.append(Path(path).name)
        init(self, path, *args, **kwargs)

    monkeypatch.setattr(GGUFReader, "__init__", counted)
    names = gguf_py.GGUFReader, utils.load_gguf_checkpoint
    folder = convert_gguf(gguf)
    assert parsed == ["llama.gguf"]
    assert (gguf_py.GGUFReader, utils.load_gguf_checkpoint) == names
    mine, theirs = AutoTokenizer.from_pretrained(folder), AutoTokenizer.from_pretrained(tmp_path, gguf_file=gguf.name)
    assert mine.get_vocab() == theirs.get_vocab()
    assert (mine.bos_token, mine.eos_token, mine.chat_template) == (theirs.bos_token, theirs.eos_token,
                                                                    theirs.chat_template)


def test_shards_past_one_file_are_indexed_as_hf_checkpoints_are(tmp_path):
    """Shards of at most ``shard_bytes`` (but a tensor bigger alone), an index naming each tensor's file; one
    shard is a plain model.safetensors."""
    tensors = {f"t{i}": torch.full((n,), float(i)) for i, n in enumerate([100, 100, 300, 50, 50])}  # float32
    files = write_shards(iter(tensors.items()), tmp_path, {"format": "pt"}, shard_bytes=800)
    sizes = [sum(t.nbytes for t in load_file(f).values()) for f in files]
    assert sizes == [800, 1200, 400], "two fill one shard; 300 floats alone; the last two together"
    index = json.loads((tmp_path / INDEX).read_text())
    assert index["metadata"]["total_size"] == sum(sizes)
    assert {name: load_file(tmp_path / file)[name].tolist() for name, file in index["weight_map"].items()} == \
        {name: t.tolist() for name, t in tensors.items()}
    assert {n: t.tolist() for n, t in iter_safetensors(tmp_path)} == {n: t.tolist() for n, t in tensors.items()}
    one = tmp_path / "one"
    one.mkdir()
    assert write_shards(iter(tensors.items()), one, {"format": "pt"}) == [one / "model.safetensors"]
    assert not (one / INDEX).exists()


def test_served_from_blocks_without_the_converted_linears(tmp_path):
    """A Q4_K_M file under ``--quantization gguf``: its conversion for it leaves out the linears served from blocks
    (q/k/v, o and gate/up of each layer and the output projection; not the F16 down_proj, the biases, norms or the
    embedding), and the model built from it equals the one built from the whole conversion; without quantization
    the left-out weights are missed by name."""
    gguf = write_gguf(tmp_path / "tiny-Q4_K_M.gguf", {"ffn_down": "F16"}, "qwen2")  # down_proj: dense, loaded
    whole_folder, slim = convert_gguf(gguf), convert_gguf(gguf, blocks=True)
    assert slim != whole_folder
    left = dict(iter_safetensors(whole_folder)).keys() - dict(iter_safetensors(slim)).keys()
    assert left == {f"model.layers.{i}.{m}.weight" for i in range(2) for m in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
        "mlp.up_proj")} | {"lm_head.weight"}
    cfg = ModelConfig.from_hf(*load_configs(slim))
    cpu = torch.device("cpu")
    whole = build_model(cfg, whole_folder, torch.float32, cpu, "gguf", gguf)
    built = build_model(cfg, slim, torch.float32, cpu, "gguf", gguf)
    mine = dict(built.named_modules())
    shipped = [name for name, m in whole.named_modules() if isinstance(m, QuantLinear)]
    assert len(shipped) == 2 * 3 + 1, "q/k/v, o and gate/up of both layers, and the output projection"
    for name in shipped:
        assert torch.equal(mine[name].dequantized(), dict(whole.named_modules())[name].dequantized()), name
    assert whole.state_dict().keys() == built.state_dict().keys()
    for name, tensor in whole.state_dict().items():  # the rest: norms, embeddings, biases, the dense down_proj
        assert torch.equal(built.state_dict()[name], tensor), name
    with pytest.raises(ValueError, match="checkpoint is missing"):
        build_model(cfg, slim, torch.float32, cpu, None, gguf)


def test_a_start_finds_the_file_tensors_in_its_conversions_table(tmp_path, monkeypatch):
    """A conversion records where each tensor of its file lies (gguf_quant.TENSOR_TABLE), so a start under
    ``--quantization`` maps the blocks without GGUFReader's parse of the metadata (seconds); the tensors found are
    GGUFReader's byte for byte, the layers the same; a file shorter than its table says is refused."""
    from radixserve.model.gguf_quant import file_tensors, gguf_quant_linears, reader_tensors

    gguf = write_gguf(tmp_path / "tiny-Q4_K_M.gguf", {"ffn_down": "F16"}, "llama")  # block and dense types
    folder = convert_gguf(gguf, blocks=True)
    want, found = reader_tensors(GGUFReader(gguf)), file_tensors(gguf, folder)
    assert [(t.name, t.kind, t.data.dtype, t.data.shape) for t in found] == \
        [(t.name, t.kind, t.data.dtype, t.data.shape) for t in want]
    assert {t.kind for t in found} >= {"Q4_K", "Q6_K", "Q8_0", "F16", "F32"}
    assert all(np.array_equal(a.data, b.data) for a, b in zip(found, want))
    cfg = ModelConfig.from_hf(*load_configs(folder))
    parsed = {name: layer.dequantized() for name, layer in
              gguf_quant_linears(gguf, cfg, torch.float32, "gguf").items()}

    def refused(self, *args, **kwargs):
        raise AssertionError("the file's metadata parsed again")

    monkeypatch.setattr(GGUFReader, "__init__", refused)
    mapped = gguf_quant_linears(gguf, cfg, torch.float32, "gguf", folder)
    assert mapped.keys() == parsed.keys() and len(mapped) == 2 * 3 + 1, "but the F16 down_proj: dense"
    assert all(torch.equal(mapped[name].dequantized(), weights) for name, weights in parsed.items())
    short = tmp_path / "short.gguf"
    short.write_bytes(gguf.read_bytes()[:-1000])
    with pytest.raises(ValueError, match="past the file's end"):
        file_tensors(short, folder)


def test_an_engine_under_gguf_resolves_the_file_to_its_blocks_conversion(tmp_path, monkeypatch):
    """An Engine under ``--quantization gguf`` loads the conversion without the linears (they come from the blocks)
    and answers greedily as the whole conversion's dequantized model does; without quantization, the whole one."""
    from radixserve import Engine

    monkeypatch.setenv("RADIXSERVE_CACHE", str(tmp_path / "cache"))
    gguf = write_gguf(tmp_path / "tiny-llama-Q4_K_M.gguf", {}, "llama")
    greedy = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
    prompts = [[11, 12, 13, 14, 15, 16], [5, 4000, 77]]
    answers, folders = [], []
    for quantization in ("gguf", None):
        engine = Engine(str(gguf), quantization=quantization, dtype="float32", decode_kernel="eager",
                        max_total_tokens=256, check_invariants=True)
        try:
            folders.append(engine.model_files.path)
            answers.append([r["output_ids"] for r in engine.generate(input_ids=prompts, sampling_params=greedy)])
        finally:
            engine.shutdown()
    assert folders[0].name == folders[1].name + "-blocks"
    assert answers[0] == answers[1]
    assert len({t for ids in answers[0] for t in ids}) > 3, "a model this degenerate would show nothing"
