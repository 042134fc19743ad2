"""Pages of KV for the lower tiers (L2 host, L3 storage), and the keys they are stored under.

Below the paged pool, KV moves in pages of ``page_size`` tokens aligned from a sequence's first token: page i holds
the KV of tokens ``[i * page_size, (i + 1) * page_size)``. A page's KV depends on every token before it, so its key
is a chained hash: the previous page's key, then this page's token ids. The chain starts from the namespace, a
hash of what else the KV depends on (the model's weights, the dtype, quantization and kernels it is computed with,
the page size, the stored format, the tensor-parallel shard): pages of another model or dtype have other keys and
are never found, whatever store they share.

    namespace ──▶ key0 = H(namespace, tokens[0:64]) ──▶ key1 = H(key0, tokens[64:128]) ──▶ ...

Only full pages are stored: the last partial page of a sequence is recomputed.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

KEY_BYTES = 16  # blake2b-128: collisions are out of reach for any number of pages a store can hold
SAMPLE_BYTES = 1 << 16
SAMPLES = 8  # spots sampled in each weight file: two checkpoints that differ anywhere differ in all of them


def namespace(model_id: bytes, compute: str, page_size: int, kv_format: str, shard: str = "0/1",
              tenant: str | None = None) -> bytes:
    """The chain's start: every input the stored KV depends on besides the tokens. ``compute``: how it is computed
    (the dtype, weight quantization, batch-invariant kernels or not)."""
    spec = json.dumps({"model": model_id.hex(), "compute": compute, "page": page_size, "format": kv_format,
                       "shard": shard, "tenant": tenant}, sort_keys=True)
    return hashlib.blake2b(spec.encode(), digest_size=KEY_BYTES).digest()


def page_keys(packed: bytes, page_size: int, seed: bytes, pages: int | None = None) -> list[bytes]:
    """The keys of the first ``pages`` full pages (default: every full page) of the token ids ``packed`` (int32,
    native order: what the radix tree keeps)."""
    step = page_size * 4
    n = len(packed) // step if pages is None else min(pages, len(packed) // step)
    keys, prev = [], seed
    for i in range(n):
        prev = hashlib.blake2b(prev + packed[i * step : (i + 1) * step], digest_size=KEY_BYTES).digest()
        keys.append(prev)
    return keys


def model_fingerprint(folder: Path) -> bytes:
    """The identity of the weights in an HF folder, without reading all of them: the config, and per weight file
    its size, its header (safetensors: every tensor's name, dtype, shape and offsets) and samples spread over it.
    Two checkpoints of one architecture but other weights (a fine-tune, another quantization) differ in the
    samples."""
    h = hashlib.blake2b(digest_size=KEY_BYTES)
    config = folder / "config.json"
    if config.exists():
        h.update(config.read_bytes())
    for file in sorted(folder.glob("*.safetensors")):
        size = file.stat().st_size
        h.update(f"{file.name}:{size}".encode())
        with open(file, "rb") as f:
            for i in range(SAMPLES + 1):  # the first sample holds the header
                f.seek(size * i // (SAMPLES + 1))
                h.update(f.read(SAMPLE_BYTES))
    return h.digest()


def pages_within(start: int, end: int, page_size: int) -> range:
    """The pages whose last token lies in ``[start, end)``: a token run's own pages (a page is attributed to the
    node, or run, holding its last token, so each page is written once)."""
    return range(start // page_size, end // page_size)
