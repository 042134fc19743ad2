"""radixserve against llama.cpp's ``llama-server`` on this CPU, whole server against whole server, at the same
precision, side by side in one run (servers of a pair up together and taking turns; an idle server costs no CPU):

- one stream: a streamed completion of 200 tokens (ignore_eos), tokens/s from the first streamed token to the last
  (prefill out of it), three runs each, alternating;
- 8 concurrent streams: 8 different prompts at once, 200 tokens each, output tokens / wall time (prefill in it);
- perplexity of benchmarks/data/perplexity.txt as llama.cpp's ``llama-perplexity`` computes it (chunks of 256 tokens,
  each scoring its last 128), and radixserve's over the same chunks of its own tokenization: through prefill, and
  through teacher-forced decode steps of its default decode kernel (what generating computes).

Pairs: radixserve bf16 (its default native decode step, and the torch paths: --decode-kernel compiled, and eager with
--disable-compile) / llama.cpp BF16 (a GGUF made by its own converter from our dequantized checkpoint);
``--quantization int8`` on the very Q8_0 file llama.cpp runs (llama-quantize from the BF16 one), its blocks served
as they ship / Q8_0; ``--quantization int4`` / the bundled GGUF's Q4_1 (both read the same blocks). Both servers on
2 threads. llama.cpp comes from ``benchmarks/llama_cpp.py``; where it cannot be built the stage says why and is
skipped.

    python benchmarks/cpu_peer.py [--quick]
"""
from __future__ import annotations

import json
import math
import re
import statistics
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
from tqdm import tqdm

import llama_cpp
from decode_score import chunked_perplexity
from harness import stage_cli, write_json

from radixserve import Engine
from radixserve.model.loader import resolve_model
from radixserve.server_process import ServerProcess

PROMPT = "Write a long story about a lighthouse keeper and the sea."
PROMPTS = [f"Write a long story about {topic}." for topic in
           ("a lighthouse keeper and the sea", "a dragon who collects clocks", "two rival bakers in Paris",
            "a robot learning to paint", "a lost map of the Andes", "a chess game that lasted a century",
            "an orchestra of street musicians", "the last bookshop on Mars")]
CHUNK = 256  # llama-perplexity -c: each chunk scores its second half
TEXT = Path(__file__).parent / "data" / "perplexity.txt"
STREAMS = 8


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


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class LlamaServer:
    """llama-server on 2 threads with ``slots`` parallel slots of ``slot_tokens`` each (prompt caching on, as it
    ships: the bench's shared-prefix and multi-turn stages measure it; the speed runs here ask it not to)."""

    path = "/completion"

    def __init__(self, gguf, slot_tokens: int = 4096, slots: int = STREAMS, unified: int | None = None) -> None:
        """``unified``: one KV pool of that many tokens the slots share (--kv-unified), instead of ``slot_tokens``
        for each."""
        self.url = f"http://127.0.0.1:{free_port()}"
        context = ["-c", str(unified), "-kvu"] if unified else ["-c", str(slot_tokens * slots)]
        self.proc = subprocess.Popen([str(llama_cpp.binary("llama-server")), "-m", str(gguf), "--port",
                                      self.url.rsplit(":", 1)[1], "-t", "2", "-tb", "2", *context, "-np", str(slots)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for _ in range(600):
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError("llama-server did not start")

    @staticmethod
    def body(prompt: str, tokens: int, stream: bool) -> dict:
        return {"prompt": prompt, "n_predict": tokens, "ignore_eos": True, "stream": stream, "temperature": 0,
                "cache_prompt": False}

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


class Ours:
    """``radixserve serve`` on 2 threads; the radix cache is flushed before every measurement (no reuse between
    runs: llama.cpp is asked not to cache prompts either)."""

    path = "/v1/completions"

    def __init__(self, flags: list[str]) -> None:
        self.server = ServerProcess("--num-threads", "2", "--served-model-name", "m", "--max-total-tokens", "16384",
                                    *flags)
        self.url = self.server.url

    @staticmethod
    def body(prompt: str, tokens: int, stream: bool) -> dict:
        return {"model": "m", "prompt": prompt, "max_tokens": tokens, "ignore_eos": True, "stream": stream,
                "temperature": 0}

    def stop(self) -> None:
        self.server.stop()


def one_stream(system, tokens: int) -> float:
    if isinstance(system, Ours):
        httpx.post(system.url + "/flush_cache", timeout=60)
    return stream_rate(system.url, system.body(PROMPT, tokens, True), system.path)


def concurrent(system, tokens: int) -> float:
    """Output tokens / wall time of STREAMS different prompts sent at once (prefill included)."""
    if isinstance(system, Ours):
        httpx.post(system.url + "/flush_cache", timeout=60)

    def one(prompt: str) -> None:
        httpx.post(system.url + system.path, json=system.body(prompt, tokens, False), timeout=900).raise_for_status()

    start = time.perf_counter()
    with ThreadPoolExecutor(STREAMS) as pool:
        list(pool.map(one, PROMPTS[:STREAMS]))
    return STREAMS * tokens / (time.perf_counter() - start)


def llama_perplexity(gguf) -> float:
    proc = subprocess.run([str(llama_cpp.binary("llama-perplexity")), "-m", str(gguf), "-f", TEXT, "-c", str(CHUNK),
                           "-b", str(CHUNK), "-t", "2"], capture_output=True, text=True, check=True)
    return float(re.search(r"Final estimate: PPL = ([0-9.]+)", proc.stdout + proc.stderr).group(1))


def our_perplexity(quantization: str | None, model_path: str | None) -> dict[str, float]:
    """llama-perplexity's method on our tokenization (chunks of CHUNK tokens, each scoring its last CHUNK / 2),
    twice: through prefill (the engine's prompt logprobs) and through teacher-forced decode steps of the default
    decode kernel -- what generating computes (the native step quantizes activations under --quantization)."""
    engine = Engine(model_path, quantization=quantization, max_total_tokens=4096)
    ids = engine.tokenizer.encode(TEXT.read_text())
    total, count = 0.0, 0
    for start in range(0, len(ids) - CHUNK + 1, CHUNK):
        out = engine.generate(input_ids=ids[start : start + CHUNK], sampling_params={"max_new_tokens": 0},
                              return_logprob=True, logprob_start_len=CHUNK // 2)
        lps = [lp for lp, _, _ in out["meta_info"]["input_token_logprobs"]]
        total, count = total + sum(lps), count + len(lps)
    decode = chunked_perplexity(engine, ids, CHUNK)
    engine.shutdown()
    return {"prefill": math.exp(-total / count), "decode": decode}


PAIRS = {  # precision: (radixserve systems, llama.cpp GGUF key); the first system of each is the default one
    "bf16": ({"radixserve bf16": [], "radixserve bf16, compiled": ["--decode-kernel", "compiled"],
              "radixserve bf16, eager": ["--disable-compile"]}, "bf16"),
    # the Q8_0 file llama.cpp runs, served as it ships ({gguf}: the pair's file); the bundled model is the Q4_1 one
    "int8 / Q8_0": ({"radixserve int8": ["--model-path", "{gguf}", "--quantization", "int8"]}, "q8_0"),
    "int4 / Q4_1": ({"radixserve int4": ["--quantization", "int4"]}, "q4_1"),
    # the K-quant file people download most, every tensor as it ships (SmolLM2's rows of 576 do not fill Q4_K's
    # 256-weight super-blocks, so llama-quantize writes Q5_0 and Q8_0 for those tensors, as it would for any user)
    "gguf / Q4_K_M": ({"radixserve gguf": ["--model-path", "{gguf}", "--quantization", "gguf"]}, "q4_k_m"),
}
QUANT = {"bf16": None, "int8 / Q8_0": "int8", "int4 / Q4_1": "int4", "gguf / Q4_K_M": "gguf"}


def measure(quick: bool = False, model_path: str | None = None, runs: int = 3, tokens: int = 200) -> dict:
    """{"rows": [...]} or {"skipped": why}."""
    try:
        files = llama_cpp.gguf_files(resolve_model(model_path).path)
        llama_cpp.build_tool("llama-perplexity")
    except llama_cpp.Unavailable as exc:
        return {"skipped": str(exc)}
    tokens = 100 if quick else tokens
    rows = []
    for precision, (ours_flags, key) in tqdm(PAIRS.items(), desc="vs llama.cpp", leave=False):
        flags_of = {label: [f.replace("{gguf}", str(files[key])) for f in flags] for label, flags in ours_flags.items()}
        systems = {label: Ours(flags) for label, flags in flags_of.items()}
        systems["llama.cpp " + key.upper()] = LlamaServer(files[key])
        try:
            for system in systems.values():  # warm-up: first requests set up kernels
                one_stream(system, 16)
            rates: dict[str, dict[str, list[float]]] = {label: {"one": [], "eight": []} for label in systems}
            for r in range(2 if quick else runs):
                order = list(systems.items())[:: 1 if r % 2 == 0 else -1]
                for label, system in order:
                    rates[label]["one"].append(one_stream(system, tokens))
                for label, system in order if r < 2 else ():
                    rates[label]["eight"].append(concurrent(system, tokens))
        finally:
            for system in systems.values():
                system.stop()
        theirs = "llama.cpp " + key.upper()
        default = next(iter(ours_flags))
        for label, rate in rates.items():
            rows.append({"precision": precision, "system": label, "judged": label == default,
                         "one_stream_tok_s": statistics.median(rate["one"]),
                         "one_stream_runs": rate["one"], "eight_streams_tok_s": statistics.median(rate["eight"]),
                         "eight_streams_runs": rate["eight"]})
        peer = next(r for r in rows if r["system"] == theirs)
        default_flags = flags_of[default]
        path = default_flags[default_flags.index("--model-path") + 1] if "--model-path" in default_flags else model_path
        ours_ppl, theirs_ppl = our_perplexity(QUANT[precision], path), llama_perplexity(files[key])
        for r in rows[-len(systems):]:
            r["one_stream_vs_llama_cpp"] = r["one_stream_tok_s"] / peer["one_stream_tok_s"]
            r["eight_streams_vs_llama_cpp"] = r["eight_streams_tok_s"] / peer["eight_streams_tok_s"]
            # llama-perplexity evaluates chunks batched, through the same quantized kernels it decodes with
            r["perplexity"] = theirs_ppl if r is peer else ours_ppl["prefill"]
            r["perplexity_decode"] = None if r is peer else ours_ppl["decode"] if r["judged"] else None
    return {"tokens": tokens, "streams": STREAMS, "chunk": CHUNK, "rows": rows}


def main() -> None:
    args = stage_cli(__doc__, "benchmarks/results/cpu_peer.json")
    res = measure(args.quick, args.model_path, args.repeats)
    if "skipped" in res:
        raise SystemExit(f"llama.cpp unavailable: {res['skipped']}")
    print(f"\n{'system':28} {'1 stream tok/s':>15} {'vs llama.cpp':>13} {'8 streams tok/s':>16} {'vs llama.cpp':>13} "
          f"{'perplexity':>11}")
    for r in res["rows"]:
        print(f"{r['system']:28} {r['one_stream_tok_s']:>15.1f} {r['one_stream_vs_llama_cpp']:>12.2f}x "
              f"{r['eight_streams_tok_s']:>16.1f} {r['eight_streams_vs_llama_cpp']:>12.2f}x {r['perplexity']:>11.3f}")
    write_json(res, args.out)


if __name__ == "__main__":
    main()
