"""Prefill and decode speed of radixserve's model runner vs HF transformers' forward, same weights, same dtype,
measured side by side in one run (alternating, median of repeats: this machine is shared and noisy).

    python benchmarks/forward_speed.py [--dtype bfloat16] [--model-path P] [--prefill 128,512,1024,2048]
                                       [--decode-batch 1,8,32] [--repeats 3]

radixserve is driven through its real scheduler (so slot planning is included); HF runs `model(...)` with its
KV cache, logits for the last position only, greedy feeding -- what `generate` does without the extras.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from tqdm import tqdm

from radixserve import Engine
from radixserve.sampling_params import SamplingParams

VOCAB_LO, VOCAB_HI = 1000, 40000  # ordinary tokens: no special ids in the synthetic prompts


def prompt_ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(VOCAB_LO, VOCAB_HI, (n,), generator=g).tolist()


class Ours:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.sched, self.runner = engine.scheduler, engine.runner
        self.n = 0

    def _add(self, ids: list[int], max_new: int) -> None:
        self.n += 1
        self.sched.add_request(f"b{self.n}", ids, SamplingParams(max_new_tokens=max_new, temperature=0,
                                                                   ignore_eos=True))

    def _drain(self) -> None:
        while self.sched.has_work:
            self.sched.process(self.runner.forward(self.sched.schedule()))
        self.engine.flush_cache()

    def prefill(self, n: int, seed: int) -> float:
        self._add(prompt_ids(n, seed), 1)
        plan = self.sched.schedule()
        start = time.perf_counter()
        result = self.runner.forward(plan)
        elapsed = time.perf_counter() - start
        self.sched.process(result)
        self._drain()
        return elapsed

    def decode(self, batch: int, prompt: int, steps: int, seed: int, shared_prefix: int = 0) -> float:
        """Median seconds per decode step of ``batch`` requests (``shared_prefix`` tokens common to all)."""
        common = prompt_ids(shared_prefix, seed - 1)
        for i in range(batch):
            self._add(common + prompt_ids(prompt, seed + i), steps + 2)
        while len(self.sched.running) < batch:  # prefill everyone first
            self.sched.process(self.runner.forward(self.sched.schedule()))
        times = []
        for _ in range(steps):
            plan = self.sched.schedule()
            assert plan.mode == "decode"
            start = time.perf_counter()
            result = self.runner.forward(plan)
            times.append(time.perf_counter() - start)
            self.sched.process(result)
        self._drain()
        return statistics.median(times)


class HF:
    def __init__(self, model) -> None:
        self.model = model

    @torch.inference_mode()
    def prefill(self, n: int, seed: int) -> float:
        ids = torch.tensor([prompt_ids(n, seed)])
        start = time.perf_counter()
        self.model(ids, use_cache=True, logits_to_keep=1)
        return time.perf_counter() - start

    @torch.inference_mode()
    def decode(self, batch: int, prompt: int, steps: int, seed: int) -> float:
        ids = torch.tensor([prompt_ids(prompt, seed + i) for i in range(batch)])
        out = self.model(ids, use_cache=True, logits_to_keep=1)
        cache, nxt = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            out = self.model(nxt, past_key_values=cache, use_cache=True)
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            times.append(time.perf_counter() - start)
            cache = out.past_key_values
        return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--prefill", default="128,512,1024,2048")
    ap.add_argument("--decode-batch", default="1,8,32")
    ap.add_argument("--decode-prompt", type=int, default=128)
    ap.add_argument("--decode-steps", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results/forward_speed.json")
    args = ap.parse_args()

    prefill_lens = [int(x) for x in args.prefill.split(",")]
    batches = [int(x) for x in args.decode_batch.split(",")]
    engine = Engine(args.model_path, dtype=args.dtype, max_total_tokens=max(4096, max(prefill_lens) * 2,
                    max(batches) * (args.decode_prompt + args.decode_steps + 4)), chunked_prefill_size=8192)
    ours = Ours(engine)
    from transformers import AutoModelForCausalLM

    hf = HF(AutoModelForCausalLM.from_pretrained(engine.model_files.path, dtype=engine.runner.dtype).eval())
    ours.prefill(64, 0), hf.prefill(64, 0)  # warm-up

    rows = []
    jobs = [("prefill", n) for n in prefill_lens] + [("decode", b) for b in batches]
    for kind, size in tqdm(jobs, desc="benchmark"):
        ours_t, hf_t = [], []
        for r in range(args.repeats):  # alternate, so drifting machine load hits both alike
            if kind == "prefill":
                ours_t.append(ours.prefill(size, r))
                hf_t.append(hf.prefill(size, r))
            else:
                ours_t.append(ours.decode(size, args.decode_prompt, args.decode_steps, 100 * r))
                hf_t.append(hf.decode(size, args.decode_prompt, args.decode_steps, 100 * r))
        o, h = statistics.median(ours_t), statistics.median(hf_t)
        tokens = size  # prefill: tokens of one prompt; decode: one token per request
        rows.append({"kind": kind, "size": size, "radixserve_tok_s": tokens / o, "hf_tok_s": tokens / h,
                     "speedup": h / o})

    print(f"\n{'':8} {'size':>6} {'radixserve tok/s':>17} {'HF tok/s':>10} {'ratio':>6}   ({args.dtype}, "
          f"{torch.get_num_threads()} threads)")
    for row in rows:
        print(f"{row['kind']:8} {row['size']:>6} {row['radixserve_tok_s']:>17.1f} {row['hf_tok_s']:>10.1f} "
              f"{row['speedup']:>5.2f}x")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"dtype": args.dtype, "rows": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
