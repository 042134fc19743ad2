#!/usr/bin/env python
"""The comparison behind radixserve's choice of grammar library (docs/structured-output.md): llguidance vs
xgrammar on the CPU, with SmolLM2's tokenizer: import, tokenizer set-up, compile time of a few regexes and JSON
schemas, and the per-step cost of filling, applying and advancing a mask at batch 1 and 8.

Each library in its own target folder (xgrammar is not a radixserve dependency), e.g.:
  .venv/bin/pip install --no-deps --target /tmp/gram/llg llguidance
  .venv/bin/pip install --no-deps --target /tmp/gram/xg xgrammar apache-tvm-ffi   # pydantic: in the venv
  PYTHONPATH=/tmp/gram/llg .venv/bin/python benchmarks/grammar_libraries.py llg
  PYTHONPATH=/tmp/gram/xg  .venv/bin/python benchmarks/grammar_libraries.py xg
Prints medians (ms / us).
"""
import json
import os
import random
import statistics
import sys
import time

LIB = sys.argv[1]
TOK_DIR = os.environ.get("TOK_DIR") or str(__import__("radixserve.model.loader", fromlist=["x"]).resolve_model(None).path)
V = 49152
EOS = 2  # <|im_end|>
REPS = int(os.environ.get("REPS", "5"))
STEPS = int(os.environ.get("STEPS", "50"))

# ---------------------------------------------------------------- import
t0 = time.perf_counter()
import torch  # noqa: E402  (already in venv; timed separately)
t_torch = time.perf_counter() - t0
import transformers  # noqa: E402
t0 = time.perf_counter()
if LIB == "llg":
    import llguidance
    import llguidance.hf
    import llguidance.torch as llt
else:
    import xgrammar as xgr
t_imp = time.perf_counter() - t0
print(f"import torch {t_torch*1e3:.0f} ms; import {LIB} (torch+transformers already loaded) "
      f"{t_imp*1e3:.0f} ms")

tok = transformers.AutoTokenizer.from_pretrained(TOK_DIR)

REGEXES = {
    "yesno": r"(yes|no)",
    "date": r"\d{4}-\d{2}-\d{2}",
    "email": r"[a-zA-Z0-9._%+-]+@[a-zA-Z0-9.-]+\.[a-zA-Z]{2,}",
}
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
    },
    "required": ["name", "age", "color", "tags"],
    "additionalProperties": False,
}
ANY_OBJ = {"type": "object"}


def med(fn, n=REPS):
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


# ---------------------------------------------------------------- adapters
class LLG:
    def __init__(self):
        self.ti = None

    def tokinfo(self):
        return llguidance.hf.from_tokenizer(tok, n_vocab=V)

    def grammar(self, kind, src, compact=True):
        M = llguidance.LLMatcher
        if kind == "regex":
            return M.grammar_from_regex(src)
        opts = {"whitespace_flexible": False} if compact else None
        return M.grammar_from_json_schema(src, overrides=opts)

    def compile(self, kind, src, compact=True):
        # "compiled object" = an LLMatcher template; per request: template.deep_copy()
        m = llguidance.LLMatcher(self.ti, self.grammar(kind, src, compact), log_level=0)
        assert not m.is_error(), m.get_error()
        return m

    def new_matcher(self, compiled):
        return compiled.deep_copy()

    def alloc(self, b):
        return llt.allocate_token_bitmask(b, V)

    def fill(self, m, bm, i=0):
        llt.fill_next_token_bitmask(m, bm, i)

    def fill_batch(self, ms, bm):
        llt.fill_next_token_bitmask_par(self.ex, [(m, i) for i, m in enumerate(ms)], bm)

    def apply(self, logits, bm):
        llt.apply_token_bitmask_inplace(logits, bm)

    def advance(self, m, t):
        ok = m.consume_token(t)
        assert ok, m.get_error()

    def done(self, m):
        return m.is_stopped()


class XG:
    def tokinfo(self):
        return xgr.TokenizerInfo.from_huggingface(tok, vocab_size=V, stop_token_ids=[EOS])

    def compile(self, kind, src, compact=True):
        if kind == "regex":
            return self.comp.compile_regex(src)
        return self.comp.compile_json_schema(json.dumps(src), any_whitespace=not compact)

    def new_matcher(self, compiled):
        return xgr.GrammarMatcher(compiled)

    def alloc(self, b):
        return xgr.allocate_token_bitmask(b, V)

    def fill(self, m, bm, i=0):
        m.fill_next_token_bitmask(bm, i)

    def fill_batch(self, ms, bm):
        self.bgm.batch_fill_next_token_bitmask(ms, bm)

    def apply(self, logits, bm):
        xgr.apply_token_bitmask_inplace(logits, bm)

    def advance(self, m, t):
        assert m.accept_token(t)

    def done(self, m):
        # xgrammar: after the grammar is complete and nothing else fits, only stop tokens
        return m.is_terminated()


def plain_torch_apply(logits, bm, _bits=torch.arange(32, dtype=torch.int32)):
    """Library-agnostic fallback: unpack int32 bitmask with torch ops."""
    b = ((bm.unsqueeze(-1) >> _bits) & 1).view(bm.shape[0], -1)[:, : logits.shape[1]]
    logits.masked_fill_(b == 0, float("-inf"))


L = LLG() if LIB == "llg" else XG()
R = {}

# ---------------------------------------------------------------- tokenizer info
ts = []
for _ in range(3):
    t = time.perf_counter()
    ti = L.tokinfo()
    ts.append(time.perf_counter() - t)
L.ti = ti
R["tokinfo_ms"] = round(statistics.median(ts) * 1e3, 1)
if LIB == "xg":
    t = time.perf_counter()
    L.comp = xgr.GrammarCompiler(ti, max_threads=2)
    R["compiler_ctor_ms"] = round((time.perf_counter() - t) * 1e3, 1)
    L.bgm = xgr.BatchGrammarMatcher(max_threads=2)
    R["stop_token_ids"] = ti.stop_token_ids
else:
    L.ex = llguidance.LLExecutor(num_threads=2)
    R["eos_token"] = ti.eos_token

# ---------------------------------------------------------------- compile
cases = [("regex", k, v) for k, v in REGEXES.items()] + [
    ("json", "schema4", SCHEMA), ("json", "any_object", ANY_OBJ)]
bm1 = L.alloc(1)
comp = {}
for kind, name, src in cases:
    if LIB == "xg":
        L.comp.clear_cache()
    t = time.perf_counter()
    c = L.compile(kind, src)
    first = time.perf_counter() - t
    m = L.new_matcher(c)
    t = time.perf_counter()
    L.fill(m, bm1)
    first_mask = time.perf_counter() - t
    t = time.perf_counter()
    L.compile(kind, src)
    second = time.perf_counter() - t
    # cold medians (xgrammar: cache cleared each time)
    def cold():
        if LIB == "xg":
            L.comp.clear_cache()
        L.compile(kind, src)
    cold_med = med(cold)
    t_copy = med(lambda: L.new_matcher(c), 20)
    comp[name] = c
    R[f"compile_{name}"] = dict(first_ms=round(first * 1e3, 2), cold_median_ms=round(cold_med * 1e3, 2),
                                second_ms=round(second * 1e3, 3),
                                first_mask_ms=round(first_mask * 1e3, 2),
                                new_matcher_us=round(t_copy * 1e6, 1))


# ---------------------------------------------------------------- per-step
def unpack(bm_row):
    return ((bm_row.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).view(-1)[:V].bool()


def drive(compiled, batch, steps, seed=0, batched_fill=False, apply_fn=None):
    rng = random.Random(seed)
    apply_fn = apply_fn or L.apply
    ms = [L.new_matcher(compiled) for _ in range(batch)]
    bm = L.alloc(batch)
    logits = torch.zeros(batch, V, dtype=torch.float32)
    tf = ta = tv = 0.0
    n = 0
    outs = [[] for _ in range(batch)]
    finished = []
    for _ in range(steps):
        t = time.perf_counter()
        if batched_fill and batch > 1:
            L.fill_batch(ms, bm)
        else:
            for i, m in enumerate(ms):
                L.fill(m, bm, i)
        t1 = time.perf_counter()
        logits.zero_()
        t2 = time.perf_counter()
        apply_fn(logits, bm)
        t3 = time.perf_counter()
        # choose a random allowed token per row (not timed), prefer non-EOS
        picks = []
        for i in range(batch):
            allowed = torch.nonzero(logits[i] == 0).view(-1).tolist()
            assert allowed, "empty mask"
            non_eos = [a for a in allowed if a != EOS]
            picks.append(rng.choice(non_eos) if non_eos else EOS)
        t4 = time.perf_counter()
        for i, m in enumerate(ms):
            L.advance(m, picks[i])
            outs[i].append(picks[i])
        t5 = time.perf_counter()
        tf += t1 - t
        ta += t3 - t2
        tv += t5 - t4
        n += 1
        for i, m in enumerate(ms):  # restart requests that emitted EOS with a fresh matcher
            if picks[i] == EOS:
                finished.append(outs[i])
                outs[i] = []
                ms[i] = L.new_matcher(compiled)
    return dict(fill_us=tf / n * 1e6, apply_us=ta / n * 1e6, advance_us=tv / n * 1e6,
                total_us=(tf + ta + tv) / n * 1e6), finished


# warm the apply fn (llguidance.torch uses @torch.compile(dynamic=True): first call compiles)
for b in (1, 8, 3):
    t = time.perf_counter()
    L.apply(torch.zeros(b, V), L.alloc(b))
    R[f"apply_first_call_b{b}_ms"] = round((time.perf_counter() - t) * 1e3, 1)

for name in ["schema4", "any_object"]:
    for batch, bf in [(1, False), (8, False), (8, True)]:
        runs = [drive(comp[name], batch, STEPS, seed=s, batched_fill=bf)[0] for s in range(REPS)]
        R[f"step_{name}_b{batch}{'_par' if bf else ''}"] = {
            k: round(statistics.median(r[k] for r in runs), 1) for k in runs[0]}

# sample output of the schema walk (validity check)
_, fin = drive(comp["schema4"], 1, 400, seed=1)
samples = [tok.decode(f) for f in fin[:3]]
R["schema_samples"] = samples
R["schema_samples_valid_json"] = [
    (lambda s: isinstance(json.loads(s[: -len("<|im_end|>")]), dict))(s) if s.endswith("<|im_end|>") else "unfinished"
    for s in samples]

# apply cost alone, [8, V] float32, library fn vs plain torch; and bf16
bm8 = L.alloc(8)
bm8[:, ::3] = 0
lg = torch.randn(8, V)
L.apply(lg.clone(), bm8)  # warm (llguidance uses torch.compile -> first call compiles)
R["apply_b8_lib_us"] = round(med(lambda: L.apply(lg.clone(), bm8), 50) * 1e6 - med(lambda: lg.clone(), 50) * 1e6, 1)
R["apply_b8_plaintorch_us"] = round(med(lambda: plain_torch_apply(lg.clone(), bm8), 50) * 1e6 - med(lambda: lg.clone(), 50) * 1e6, 1)
a, b = lg.clone(), lg.clone()
L.apply(a, bm8)
plain_torch_apply(b, bm8)
R["apply_lib_equals_plaintorch"] = bool(torch.equal(a, b))
try:
    x = lg.to(torch.bfloat16)
    L.apply(x, bm8)
    R["apply_bf16"] = f"ok, masked={int(torch.isinf(x).sum())}"
except Exception as e:  # noqa: BLE001
    R["apply_bf16"] = f"ERROR {type(e).__name__}: {str(e)[:200]}"

print(json.dumps(R, indent=1))
