"""One-stream decode through the whole server, radixserve vs llama.cpp's llama-server at the same precision: a
streamed completion of 200 tokens (ignore_eos), 2 threads each, tokens/s counted from the first streamed token to
the last (so prefill is out of it), three runs each, alternating.

Pairs: the bundled GGUF's Q4_1 weights (llama.cpp reads the file; radixserve ``--quantization int4`` takes the same
blocks) and bf16 (llama.cpp: a BF16 GGUF made by its own converter from our dequantized checkpoint; radixserve:
``--dtype bfloat16``). llama.cpp comes from ``benchmarks/llama_cpp.py``; without it the script says why and stops.

    python benchmarks/one_stream.py [--runs 3] [--tokens 200]
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time

import httpx

import llama_cpp

from radixserve.model.loader import resolve_model
from radixserve.server_process import ServerProcess

PROMPT = "Write a long story about a lighthouse keeper and the sea."


def stream_rate(url: str, body: dict, path: str) -> float:
    """Decode tokens/s of one streamed completion: tokens after the first / time after the first."""
    stamps = []
    with httpx.stream("POST", url + path, json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            event = json.loads(line[5:])
            text = event.get("content") if "content" in event else event["choices"][0].get("text", "")
            if text or event.get("tokens"):
                stamps.append(time.perf_counter())
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


class LlamaServer:
    def __init__(self, gguf, port: int) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.proc = subprocess.Popen([str(llama_cpp.binary("llama-server")), "-m", str(gguf), "--port", str(port),
                                      "-t", "2", "-tb", "2", "-c", "4096", "-np", "1"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for _ in range(600):
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError("llama-server did not start")

    def rate(self, tokens: int) -> float:
        return stream_rate(self.url, {"prompt": PROMPT, "n_predict": tokens, "ignore_eos": True, "stream": True,
                                      "temperature": 0, "cache_prompt": False}, "/completion")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


def ours_rate(server: ServerProcess, tokens: int) -> float:
    return stream_rate(server.url, {"model": "m", "prompt": PROMPT, "max_tokens": tokens, "ignore_eos": True,
                                    "stream": True, "temperature": 0}, "/v1/completions")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=200)
    args = ap.parse_args()
    try:
        files = llama_cpp.gguf_files(resolve_model(None).path)
    except llama_cpp.Unavailable as exc:
        raise SystemExit(f"llama.cpp unavailable: {exc}")
    pairs = {"q4_1 / int4": (files["q4_1"], ["--quantization", "int4"]), "bf16": (files["bf16"], [])}
    rows = []
    for label, (gguf, flags) in pairs.items():
        ours = ServerProcess("--num-threads", "2", "--served-model-name", "m", "--max-total-tokens", "8192", *flags)
        theirs = LlamaServer(gguf, 30187)
        try:
            ours_rate(ours, 16), theirs.rate(16)  # warm-up
            a, b = [], []
            for r in range(args.runs):
                for fn, out in ((lambda: ours_rate(ours, args.tokens), a), (lambda: theirs.rate(args.tokens), b))[
                        :: 1 if r % 2 == 0 else -1]:
                    out.append(fn())
        finally:
            ours.stop()
            theirs.stop()
        rows.append({"precision": label, "radixserve": a, "llama.cpp": b,
                     "ratio": statistics.median(a) / statistics.median(b)})
        print(f"{label}: radixserve {[round(x, 1) for x in a]} tok/s, llama.cpp {[round(x, 1) for x in b]} tok/s, "
              f"median ratio {rows[-1]['ratio']:.2f}x")


if __name__ == "__main__":
    main()
