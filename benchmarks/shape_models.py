"""The shapes benchmarks/real_shapes.py measures: their configs, the random-weight checkpoint and GGUF files of each
(made here, kept under the radixserve cache), and which of them this machine's disk and memory hold.

A shape runs where the disk holds the files still to be made (the bf16 checkpoint, the BF16 GGUF and each
quantized one), and each precision where the memory available holds radixserve loading it and then both servers
serving it (``memory_need``), from the bytes per weight each holds, measured on the 1B shape.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import llama_cpp

from radixserve.model.loader import resolve_model

SHAPES = {  # name: (transformers config class, its arguments); vocab: the tokenizer's
    "llama-3.2-1b": ("LlamaConfig", dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                                         num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                                         tie_word_embeddings=True, rope_theta=500000.0)),
    "qwen2.5-1.5b": ("Qwen2Config", dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                                         num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=True,
                                         rope_theta=1000000.0)),
    "llama-3.1-8b": ("LlamaConfig", dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                         num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                                         tie_word_embeddings=False, rope_theta=500000.0)),
}
PRECISIONS = ("bf16", "q8_0", "q4_k_m")
ROOT = llama_cpp.ROOT.parent / "shapes"
VOCAB = 49152  # SmolLM2's tokenizer
GIB = 2**30
FILE_BYTES = {"bf16": 2.002, "q8_0": 1.064, "q4_k_m": 0.623}  # a GGUF file's bytes per parameter (the 1B shape's)
# what radixserve holds per byte of the file's weights, serving and at its load's peak (Engine on the 1B shape;
# model/process_memory.py): bf16 two copies (the native step's and oneDNN's for long prefills); a GGUF file's
# blocks once, the load peaking while its layers are decoded (Q4_K_M: torch's copy of Q6_K blocks is wider)
OURS_HELD = {"bf16": 2.0, "q8_0": 1.0, "q4_k_m": 1.0}
OURS_PEAK = {"bf16": 2.9, "q8_0": 2.2, "q4_k_m": 3.4}
PROCESS = 1.5 * GIB  # each server's Python, torch, tokenizer and buffers (more than measured: 0.5-0.6)
OURS_KV_TOKENS = 8192  # --max-total-tokens
MEMORY_MARGIN = 0.9  # of the memory available, what the estimate may take


def products_of(args: dict, vocab: int) -> list[tuple[int, int, int]]:
    """A decode step's linear products of a shape's config: (n, k, how many) for the fused q/k/v, o, the fused
    gate/up, down and the output projection."""
    h, i, layers = args["hidden_size"], args["intermediate_size"], args["num_hidden_layers"]
    hd = args.get("head_dim", h // args["num_attention_heads"])
    q, kv = args["num_attention_heads"] * hd, args["num_key_value_heads"] * hd
    return [(q + 2 * kv, h, layers), (h, q, layers), (2 * i, h, layers), (h, i, layers), (vocab, h, 1)]


def params_of(kind: str, args: dict, vocab: int) -> int:
    embed = vocab * args["hidden_size"] * (0 if args["tie_word_embeddings"] else 1)  # the input embedding's own
    return sum(n * k * times for n, k, times in products_of(args, vocab)) + embed


def checkpoint(name: str) -> Path:
    """The shape's random bf16 checkpoint with SmolLM2's tokenizer (made once, kept under ~/.cache)."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = ROOT / name / "hf"
    if (out / "config.json").exists():
        return out
    tokenizer_from = resolve_model(None).path
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_from)
    kind, args = SHAPES[name]
    cfg = getattr(transformers, kind)(vocab_size=len(tokenizer), max_position_embeddings=8192,
                                      bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                                      **args)
    torch.manual_seed(0)
    with torch.device("cpu"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    tmp = out.with_name("hf.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, max_shard_size="2GB")  # (an 8B shape: no 16 GB shard serialized at once)
    tokenizer.save_pretrained(tmp)
    del model
    tmp.rename(out)
    return out


def files(name: str) -> dict[str, Path]:
    """precision -> the GGUF file llama.cpp serves (and radixserve too, but for BF16)."""
    llama_cpp.build()
    bf16 = llama_cpp.converted(checkpoint(name), ROOT / name / "model-bf16.gguf", pre="smollm")  # its tokenizer
    return {"bf16": bf16, **{p: llama_cpp.quantized(bf16, ROOT / name / f"model-{p}.gguf", p) for p in PRECISIONS[1:]}}


def linear_bytes(gguf: Path) -> int:
    """Bytes of the linear layers' weights in a GGUF file: what one decode step reads at least (the output
    projection whole; with tied embeddings that is token_embd)."""
    from gguf import GGUFReader

    tensors = {t.name: int(t.n_bytes) for t in GGUFReader(gguf).tensors}
    head = tensors.get("output.weight", tensors["token_embd.weight"])
    return head + sum(n for name, n in tensors.items() if name.startswith("blk.") and name.endswith(".weight")
                      and any(part in name for part in ("attn_q", "attn_k", "attn_v", "attn_output", "attn_qkv",
                                                         "ffn_gate", "ffn_up", "ffn_down")))


def memory_need(name: str, precision: str, llama_tokens: int) -> float:
    """Bytes of memory a precision of a shape takes: radixserve's load peak (it starts first), or both servers
    serving (llama.cpp with a KV cache of ``llama_tokens``)."""
    args = SHAPES[name][1]
    params = params_of(SHAPES[name][0], args, VOCAB)
    weights = params * FILE_BYTES[precision]
    head_dim = args.get("head_dim", args["hidden_size"] // args["num_attention_heads"])
    kv_token = 2 * 2 * args["num_hidden_layers"] * args["num_key_value_heads"] * head_dim  # K and V, 16 bits
    embedding = 0 if precision == "bf16" else 2 * VOCAB * args["hidden_size"]  # ours in bf16 beside the blocks
    ours = PROCESS + OURS_HELD[precision] * weights + embedding + OURS_KV_TOKENS * kv_token
    theirs = PROCESS + weights + llama_tokens * kv_token
    return max(PROCESS + OURS_PEAK[precision] * weights, ours + theirs)


def memory_available() -> int:
    """MemAvailable (what the kernel can give without swapping: free plus reclaimable cache), else all memory."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def disk_need(name: str) -> int:
    """Bytes of the files still to be made for a shape: its bf16 checkpoint, the BF16 GGUF, the quantized ones."""
    params = params_of(SHAPES[name][0], SHAPES[name][1], VOCAB)
    missing = [("bf16", ROOT / name / "hf" / "config.json")] + [(p, ROOT / name / f"model-{p}.gguf") for p in PRECISIONS]
    return int(sum(params * FILE_BYTES[p] for p, path in missing if not path.exists()))


def plan(name: str, precisions: tuple[str, ...], llama_tokens: dict[bool, int]) -> tuple[dict[str, bool],
                                                                                    dict[str, str]]:
    """(precision -> whether llama.cpp shares one KV pool among its slots, for those that fit; precision -> why
    not, for the rest), ``llama_tokens`` its KV cache's tokens with a context per slot (False) or one shared pool
    (True). A shape whose files do not fit the disk has none."""
    free = shutil.disk_usage(next(p for p in (ROOT, *ROOT.parents) if p.exists())).free
    if disk_need(name) > free:
        why = f"its files need {disk_need(name) / GIB:.0f} GiB of disk, {free / GIB:.0f} GiB free"
        return {}, {p: why for p in precisions}
    runs, skipped = {}, {}
    have = memory_available()
    for precision in precisions:
        for unified in (False, True):
            if memory_need(name, precision, llama_tokens[unified]) <= MEMORY_MARGIN * have:
                runs[precision] = unified
                break
        else:
            skipped[precision] = (f"needs about {memory_need(name, precision, llama_tokens[True]) / GIB:.0f} GiB of memory, "
                                  f"{have / GIB:.0f} GiB available")
    return runs, skipped
