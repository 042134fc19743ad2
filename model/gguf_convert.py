"""A GGUF file's tensors as a HF checkpoint's (float32 safetensors), written a tensor at a time.

transformers reads a GGUF file whole: every tensor dequantized to float32 and held at once, then the model built
from them -- memory that grows with the model (5.5 GB peak for Llama-3.2-1B's shape in Q4_K_M, a 0.67 GB file:
1.3 times its 4.1 GB of float32; by that ratio some 40 GB for an 8B file). Here the same reading -- transformers'
map from GGUF names to the HF model's and its per-architecture tensor processors (Llama's q/k rows put back in HF
order, Gemma's norms stored as 1 + w), gguf's own dequantization -- goes one tensor at a time into shards of about
``SHARD_BYTES``, so converting holds about two shards whatever the model's size (2.4 GB peak for the same file).
The tensors are the ones transformers' reading gives, bit for bit (tests/test_gguf_convert.py).

Converted for ``--quantization gguf`` (``blocks``), the folder leaves out the linear layers served from the file's
blocks: a Q4_K_M file's conversion is then its embeddings and norms (and any dense layer), not 4 bytes a weight.

    model.safetensors                  one file, when everything fits one shard
    model-00001.safetensors ...        else shards, named in model.safetensors.index.json (as HF checkpoints are)
"""
from __future__ import annotations

import copy
import json
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

SHARD_BYTES = 1 << 30
INDEX = "model.safetensors.index.json"


@contextmanager
def read_once(gguf: Path) -> Iterator:
    """While converting ``gguf``: its metadata parsed once, and that reader (gguf's GGUFReader) yielded. Parsing
    takes a Python step per token string (~4 s for a 49k-token vocabulary, the bundled model's), and transformers
    parses the whole file for the config, again for the tokenizer and the generation config, then this module
    for the tensors' names and data: here every ``GGUFReader(gguf)`` is the one reader and every metadata-only
    ``load_gguf_checkpoint(gguf)`` a copy of one result. transformers imports both where it calls them, from
    their modules, so those modules' names are the ones wrapped; should a release import them otherwise, a
    wrapper goes unused and that call parses the file, as before."""
    import gguf as gguf_py
    import transformers.modeling_gguf_pytorch_utils as utils

    original_reader, original_load = gguf_py.GGUFReader, utils.load_gguf_checkpoint
    reader, parsed, target = original_reader(gguf), {}, gguf.resolve()

    def reader_of(path, *args, **kwargs):
        if args or kwargs or Path(path).resolve() != target:
            return original_reader(path, *args, **kwargs)
        return reader

    def load_once(path, return_tensors=False, **kwargs):
        if return_tensors or kwargs or Path(path).resolve() != target:
            return original_load(path, return_tensors=return_tensors, **kwargs)
        if not parsed:
            parsed.update(original_load(path, return_tensors=False))
        return copy.deepcopy(parsed)  # callers may change what they get

    gguf_py.GGUFReader, utils.load_gguf_checkpoint = reader_of, load_once
    try:
        yield reader
    finally:
        gguf_py.GGUFReader, utils.load_gguf_checkpoint = original_reader, original_load


def left_to_blocks(gguf: Path, reader, config) -> set[str]:
    """The tensors of ``gguf`` (``reader``: its GGUFReader) that ``--quantization gguf`` serves from their blocks
    (gguf_quant.layers_as_shipped), so a conversion for it need not hold them; never the embedding (a tied output
    projection's blocks are its)."""
    from radixserve.model.gguf_quant import layers_as_shipped, reader_tensors

    plan = layers_as_shipped(gguf, reader_tensors(reader), config.model_type, config.tie_word_embeddings, "gguf")
    return {tensor for shards in plan.values() for tensor in shards.values()} - {"token_embd.weight"}


def dequantized_tensors(gguf: Path, reader, config, skip: Collection[str] = ()) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, float32 tensor) of every tensor of ``gguf`` (``reader``: its GGUFReader) the HF model of ``config``
    (transformers' config of the file) has, in the file's order, but those named in ``skip``; the output projection
    of a tied model is left out (it is the embedding)."""
    from gguf import dequantize
    from transformers import AutoModelForCausalLM
    from transformers import modeling_gguf_pytorch_utils as utils
    from transformers.modeling_gguf_pytorch_utils import (TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map,
                                                          read_field)

    parsed = utils.load_gguf_checkpoint(str(gguf), return_tensors=False)  # the metadata only
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)  # only its parameter names: no memory
    processor = TENSOR_PROCESSORS.get(read_field(reader, "general.architecture")[0], TensorProcessor)(
        config=parsed["config"])
    names = get_gguf_hf_weights_map(model, processor)
    for tensor in tqdm(reader.tensors, desc=f"converting {gguf.name}", unit="tensor", leave=False):
        if tensor.name in skip:
            continue
        result = processor.process(weights=dequantize(tensor.data, tensor.tensor_type), name=tensor.name,
                                   tensor_key_mapping=names, parsed_parameters=parsed)
        name = names.get(result.name)
        if name is None or (name == "lm_head.weight" and config.tie_word_embeddings):
            continue
        yield name, torch.from_numpy(np.array(result.weights, dtype=np.float32))  # a copy: the file is read-only


def write_shards(tensors: Iterator[tuple[str, torch.Tensor]], out: Path, metadata: dict[str, str],
                 shard_bytes: int = SHARD_BYTES) -> list[Path]:
    """``tensors`` into safetensors files in ``out``: a shard is written once it holds ``shard_bytes`` (one
    tensor bigger than that is a shard of its own). Returns the files written."""
    from safetensors.torch import save_file

    files: list[Path] = []
    held: dict[str, torch.Tensor] = {}
    size = total = 0
    weight_map: dict[str, str] = {}

    def flush() -> None:
        nonlocal held, size
        if held:
            file = out / f"model-{len(files) + 1:05d}.safetensors"
            save_file(held, file, metadata=metadata)
            files.append(file)
            weight_map.update(dict.fromkeys(held, file.name))
        held, size = {}, 0

    for name, tensor in tensors:
        if held and size + tensor.nbytes > shard_bytes:
            flush()
        held[name] = tensor
        size += tensor.nbytes
        total += tensor.nbytes
    flush()
    if len(files) == 1:  # one file, named as a one-file HF checkpoint is
        single = files[0].rename(out / "model.safetensors")
        return [single]
    (out / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return files
