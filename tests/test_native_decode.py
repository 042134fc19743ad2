"""The native CPU decode step (kernels/native/ via model/native_decode.py) against the eager model on the
same decode batches: logits and the K/V it stores, float32 (to rounding) and bfloat16 (to bf16 noise, greedy
choices the same), ragged and shared contexts, batches across the kernel's tile sizes, shapes that fill no tile
evenly, and both product paths (AMX tiles and AVX-512). HF parity of whole generations: test_engine_parity.py
(``decode=native``). Building: a failing compiler is reported, never half-loaded."""
from __future__ import annotations

import ctypes
import random
import shutil
import subprocess
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from conftest import save_random
from radixserve import Engine
from radixserve.kernels import cpu_native
from radixserve.kernels.base import AttentionBatch
from radixserve.kernels.cpu_native import NativeUnavailable, unavailable_reason
from radixserve.kernels.cpu_quant import QuantLinear
from radixserve.model.forward_batch import ForwardBatch
from radixserve.model.kv_codes import KV_CODES, ScaledPool, encode
from radixserve.model.prefix_groups import StepContexts
from radixserve.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(unavailable_reason("bfloat16") is not None,
                                reason=f"no native decode step here: {unavailable_reason('bfloat16')}")


@pytest.fixture(scope="module")
def odd_model(tmp_path_factory, smollm2_path):
    """Dimensions that fill no 16-row block or 32-wide k step evenly: hidden 48 (3 heads of 16), q/k/v 80 rows,
    intermediate 88, qkv bias."""
    from transformers import AutoTokenizer, Qwen2Config

    tok = AutoTokenizer.from_pretrained(smollm2_path)
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=48, intermediate_size=88, num_hidden_layers=2,
                      num_attention_heads=3, num_key_value_heads=1, max_position_embeddings=2048,
                      initializer_range=0.25, tie_word_embeddings=False, eos_token_id=None, bos_token_id=None)
    return save_random(cfg, tok, tmp_path_factory.mktemp("odd") / "qwen2-odd", seed=1)


def _rows(n: int, seed: int, shared: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    common = [rng.randrange(1000, 40000) for _ in range(shared)]
    return [common + [rng.randrange(1000, 40000) for _ in range(rng.randrange(2, 60))] for _ in range(n)]


@torch.inference_mode()
def _eager_and_native(runner, plan, per_row: bool = False):
    """The eager model, then the native step, on the same batch of ``plan``: (eager logits, native logits, eager
    K/V at the new slots, native K/V there; each side stores into slots the other's were wiped from). ``per_row``:
    the native step's logits with no shared-prefix groups on the same batch appended (run before its own)."""
    batch = ForwardBatch.from_plan(plan, runner.kv, runner.rope, runner.attn, runner.dtype, runner.device,
                                   runner._group, runner.table)  # with the torch backend's metadata
    slots = batch.attn.out_slots
    eager = runner.model(batch)
    kv_eager = (runner.kv.k[:, slots].clone(), runner.kv.v[:, slots].clone())
    alone = []
    if per_row:  # first, so that the step's own run is the last (its K/V stored, its groups counted)
        runner.kv.k[:, slots] = 0
        runner.kv.v[:, slots] = 0
        shares, runner.native.shares = runner.native.shares, False
        try:
            alone.append(runner.native(batch))
        finally:
            runner.native.shares = shares
    runner.kv.k[:, slots] = 0
    runner.kv.v[:, slots] = 0
    native = runner.native(batch)
    return eager, native, kv_eager, (runner.kv.k[:, slots].clone(), runner.kv.v[:, slots].clone()), *alone


def _compare_steps(engine: Engine, prompts: list[list[int]], steps: int, per_row: bool = False):
    """``steps`` decode steps of ``prompts``; on each the eager model, then the native step, run the same batch.
    Yields (eager logits, native logits, eager K/V at the new slots, native K/V there[, with ``per_row`` the native
    step's logits without shared-prefix groups on the same batch]), rows in the order of
    ``prompts`` (a batch's own order follows admission, which the cache changes: a request deferred to reuse a
    prefix another computes joins later); the step itself then runs as the runner runs it (native)."""
    runner, sched = engine.runner, engine.scheduler
    for i, ids in enumerate(prompts):
        sched.add_request(f"c{i}", ids, SamplingParams(max_new_tokens=steps + 1, temperature=0, ignore_eos=True))
    while len(sched.running) < len(prompts):
        sched.process(runner.forward(sched.schedule()))
    for _ in range(steps):
        plan = sched.schedule()
        assert plan.mode == "decode" and len(plan.input_ids) == len(prompts)
        by_prompt = torch.argsort(torch.tensor([int(r.rid[1:]) for r in sched.running]))  # rows are c0, c1, ...
        eager, native, kv_e, kv_n, *alone = _eager_and_native(runner, plan, per_row)
        yield (eager[by_prompt], native[by_prompt], *(tuple(t[:, by_prompt] for t in kv) for kv in (kv_e, kv_n)),
               *(a[by_prompt] for a in alone))
        sched.process(runner.forward(plan))  # writes the same slots of the table again: the same values
    while sched.has_work:
        sched.process(runner.forward(sched.schedule()))
    sched.check()  # pool accounting (check_invariants also checks after every step)


def _engine(path, dtype: str, **kw) -> Engine:
    return Engine(str(path), dtype=dtype, decode_kernel="native", check_invariants=True,
                  **{"max_total_tokens": 8192, **kw})


@pytest.fixture(autouse=True)
def _native_allowed(monkeypatch):
    monkeypatch.delenv("RADIXSERVE_DISABLE_COMPILE", raising=False)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_float32_step_equals_eager_to_rounding(kind, tiny_models):
    engine = _engine(tiny_models[kind], "float32")
    for batch, shared in ((1, 0), (5, 0), (19, 40)):  # 19 rows: a full 16-row tile and a partial one
        for eager, native, kv_e, kv_n in _compare_steps(engine, _rows(batch, seed=batch, shared=shared), steps=3):
            torch.testing.assert_close(native, eager, rtol=1e-4, atol=1e-4)
            for a, b in zip(kv_n, kv_e):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert engine.runner.native.steps > 0
    engine.shutdown()


@pytest.mark.parametrize("amx", [True, False])
def test_bfloat16_step_agrees_with_eager(amx, tiny_models):
    engine = _engine(tiny_models["llama"], "bfloat16")
    if amx and not engine.runner.native.amx:
        pytest.skip("this CPU or kernel grants no AMX tiles")
    engine.runner.native.desc.amx = int(amx)  # the same weights through the other product path
    agree = total = 0
    for eager, native, kv_e, kv_n in _compare_steps(engine, _rows(18, seed=3, shared=20), steps=4):
        scale = eager.abs().max()
        assert (native - eager).abs().max() <= 0.05 * scale, "beyond bf16 rounding noise"
        agree += int((native.argmax(-1) == eager.argmax(-1)).sum())
        total += len(eager)
        for a, b in zip(kv_n, kv_e):  # K after RoPE and V: one bf16 rounding step apart at most
            assert (a.float() - b.float()).abs().max() <= 0.02 * b.float().abs().max() + 1e-3
    assert agree >= 0.9 * total
    engine.shutdown()


def _grouped_rows(prefixes: list[int], per_group: int, loners: int, seed: int) -> list[list[int]]:
    """``per_group`` prompts on each prefix of the given lengths and ``loners`` on none, interleaved."""
    rng = random.Random(seed)
    tail = lambda: [rng.randrange(1000, 40000) for _ in range(rng.randrange(2, 60))]  # noqa: E731
    heads = [[rng.randrange(1000, 40000) for _ in range(n)] for n in prefixes]
    rows = [head + tail() for head in heads for _ in range(per_group)] + [tail() for _ in range(loners)]
    rng.shuffle(rows)
    return rows


@pytest.mark.parametrize("path", ["amx", "vector"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_shared_prefixes_are_scored_once_per_group(smollm2_path, dtype, path):
    """SmolLM2 (head dim 64): decode rows in one, two or three groups sharing prefixes (lengths that fill no whole
    16- or 32-key block) beside rows in none take the shared-prefix path -- each group's prefix keys scored for
    its rows' queries at once, as AMX tile products (bf16, where granted) or in vector registers (every CPU) --
    and give the logits of the per-row path (float32: to float32 rounding, the same tokens; bf16: to bf16
    rounding noise) and of eager; rows with too short a common prefix take the per-row path."""
    engine = _engine(smollm2_path, dtype)
    native = engine.runner.native
    if path == "amx" and not (native.amx and dtype == "bfloat16"):
        pytest.skip("AMX tiles score bf16 only, where the CPU and kernel grant them")
    native.desc.amx = int(path == "amx")
    agree = agree_alone = total = 0
    for prefixes, loners, groups in (([200], 0, 1), ([200, 150], 1, 2), ([130, 260, 200], 2, 3), ([100], 0, 0)):
        rows = _grouped_rows(prefixes, per_group=2, loners=loners, seed=sum(prefixes))
        native.shares = False
        per_row = [(eager, out) for eager, out, _, _ in _compare_steps(engine, rows, steps=3)]
        native.shares = True
        steps = _compare_steps(engine, rows, steps=3, per_row=True)
        for (eager, out, _, _, same), (eager_alone, alone) in zip(steps, per_row):
            assert native.last_groups == groups
            if dtype == "float32":
                torch.testing.assert_close(out, alone, rtol=1e-4, atol=1e-4)
                assert torch.equal(out.argmax(-1), alone.argmax(-1))
            # the per-row path on the same batch (same inputs: only the attention's rounding differs), and eager no
            # further than the per-row path is from it, both to bf16 rounding noise: eager's own bf16 rounding
            # differs by CPU (AMD EPYC, no AMX: one row 6.4% of the scale from float32's logits, the native step's 2.4%)
            noise = 0.05 * eager.abs().max()
            assert (out - same).abs().max() <= noise, "beyond bf16 rounding noise of the per-row path"
            assert (out - eager).abs().max() <= noise + (same - eager).abs().max(), "further from eager than per-row"
            agree += int((out.argmax(-1) == eager.argmax(-1)).sum())
            agree_alone += int((alone.argmax(-1) == eager_alone.argmax(-1)).sum())  # each against its own run's
            total += len(eager)
    # bf16: random-token prompts on the real model leave near ties, where either path's rounding picks the other
    # token (AMX per-row 20/24 against eager on three groups, grouped 4/6 on one, on a Xeon): the argmax agreement
    # with eager on the same batch is pooled over all cases and held to the per-row path's own (against eager in
    # its run), less one row in ten; the two runs' logits are not compared in bf16: a near tie taken the other way
    # sends their tokens apart
    assert agree >= 0.8 * total and agree >= agree_alone - total // 10, (agree, agree_alone, total)
    engine.shutdown()


@pytest.mark.parametrize("path", ["vector", "amx"])
def test_large_groups_take_runs_of_query_tiles(smollm2_path, path):
    """Decode groups of 8 to 44 rows (24 to 132 queries). Vector path, float32: a group's query tiles are split
    over several tasks (runs of kVecRun tiles on AVX-512 and on AVX2), each widening the prefix's blocks for its
    own run -- the per-row path's logits to float32 rounding and its tokens. AMX tiles (bf16, where granted): a
    group of up to kAmxRun tiles of 16 queries is scored by one task packing the prefix itself, a larger one (44
    rows) by the step's packing and a task per tile -- eager's logits to bf16 rounding noise, its tokens for most
    rows (near ties aside, as in test_shared_prefixes_are_scored_once_per_group)."""
    dtype = "float32" if path == "vector" else "bfloat16"
    engine = _engine(smollm2_path, dtype, max_total_tokens=32768)
    native = engine.runner.native
    if path == "amx" and not native.amx:
        pytest.skip("AMX tiles are not granted here")
    native.desc.amx = int(path == "amx")
    agree = total = 0
    for prefixes, per_group, loners in (([200], 44, 0), ([300, 150], 17, 1), ([130, 260, 200], 8, 2)):
        rows = _grouped_rows(prefixes, per_group=per_group, loners=loners, seed=sum(prefixes) + per_group)
        native.shares = False
        per_row = [out for _, out, _, _ in _compare_steps(engine, rows, steps=2)]
        native.shares = True
        for (eager, out, _, _), alone in zip(_compare_steps(engine, rows, steps=2), per_row):
            assert native.last_groups == len(prefixes)
            if dtype == "float32":
                torch.testing.assert_close(out, alone, rtol=1e-4, atol=1e-4)
                assert torch.equal(out.argmax(-1), alone.argmax(-1))
            assert (out - eager).abs().max() <= 0.05 * eager.abs().max(), "beyond bf16 rounding noise"
            agree += int((out.argmax(-1) == eager.argmax(-1)).sum())
            total += len(eager)
    assert agree >= 0.8 * total, (agree, total)
    engine.shutdown()


@pytest.mark.parametrize("path", ["amx", "vector"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_extend_rows_on_shared_prefixes_are_scored_once_per_group(smollm2_path, dtype, path):
    """A prefill step of requests adding their own tokens to one, two or three cached prefixes, beside requests on
    none: each prefix is scored once for every new token of the requests on it (a row per token), and every
    token's logits (prompt logprobs asked for) are the per-row path's (float32: to float32 rounding, the same
    argmax) and eager's (bf16: to its rounding noise); the K/V stored are the same."""
    engine = _engine(smollm2_path, dtype)
    native, runner, sched = engine.runner.native, engine.runner, engine.scheduler
    if path == "amx" and not (native.amx and dtype == "bfloat16"):
        pytest.skip("AMX tiles score bf16 only, where the CPU and kernel grant them")
    native.desc.amx = int(path == "amx")
    one = SamplingParams(max_new_tokens=1, temperature=0, ignore_eos=True)
    for n, (prefixes, loners) in enumerate((([200], 0), ([200, 150], 1), ([130, 260, 200], 2))):
        rows = _grouped_rows(prefixes, per_group=2, loners=loners, seed=7 + n)
        heads = {tuple(r[:p]) for p in prefixes for r in rows if sum(o[:p] == r[:p] for o in rows) > 1}
        for i, head in enumerate(heads):  # the prefixes cached first
            sched.add_request(f"w{n}.{i}", list(head), one)
        while sched.has_work:
            sched.process(runner.forward(sched.schedule()))
        for i, ids in enumerate(rows):  # prompt logprobs past its cached prefix (which then holds its logits' row)
            start = max((len(h) + 1 for h in heads if tuple(ids[:len(h)]) == h), default=0)
            sched.add_request(f"e{n}.{i}", ids, one, top_logprobs=0, logprob_start=start)
        plan = sched.schedule()
        assert plan.mode == "extend" and len(plan.extend_lens) == len(rows)
        assert sorted(int(p) for p in plan.prefix_lens if p) == sorted(prefixes * 2)
        outs = {}
        for shares in (False, True):
            native.shares = shares
            outs[shares] = _eager_and_native(runner, plan)
        # (where AVX-512 scores shared slots, a fresh prompt's rows are a causal tile too, 16 or more of them)
        fresh = [ids for ids in rows if not any(tuple(ids[:len(h)]) == h for h in heads)]
        tiles = sum(len(ids) >= 16 for ids in fresh) if native.tiled else 0
        assert native.last_groups == len(prefixes) + tiles
        (eager, alone, kv_e, kv_alone), (_, grouped, _, kv_grouped) = outs[False], outs[True]
        assert len(grouped) == sum(plan.extend_lens)  # every new token's logits
        if dtype == "float32":
            torch.testing.assert_close(grouped, alone, rtol=1e-4, atol=1e-4)
            assert torch.equal(grouped.argmax(-1), alone.argmax(-1))
            for a, b in zip(kv_grouped, kv_alone):  # a later layer's from the earlier's rounding-apart sums
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
        # bf16: a few hundred token rows through 30 layers, where the per-row path is itself up to 2 logits from
        # eager at the worst; both paths 0.6-1.0% from it in norm, the same argmax for >= 90% of rows
        assert (grouped - eager).norm() <= 0.02 * eager.norm(), "beyond bf16 rounding noise"
        assert (grouped.argmax(-1) == eager.argmax(-1)).float().mean() >= 0.85
        sched.process(runner.forward(plan))
        while sched.has_work:
            sched.process(runner.forward(sched.schedule()))
        sched.check()
        engine.flush_cache()
    engine.shutdown()


def test_groups_keep_the_tokens_under_chunked_prefill_eviction_and_retraction(smollm2_path):
    """float32, three prefix groups beside rows in none, prefilled in chunks of 64 tokens into a pool too small
    for the batch (cached prefixes evicted, running requests retracted and resumed): the greedy tokens with the
    shared-prefix path are those with it off, and groups were scored in decode steps and in prefill chunks."""
    rows = _grouped_rows([200, 150, 260], per_group=3, loners=2, seed=11)
    params = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}
    outs, stats = {}, {}
    for shares in (False, True):
        engine = _engine(smollm2_path, "float32", max_total_tokens=900, chunked_prefill_size=64)
        engine.runner.native.shares = shares
        outs[shares] = [r["output_ids"] for r in engine.generate(input_ids=rows, sampling_params=params)]
        native = engine.runner.native
        stats[shares] = (native.shared_steps - native.shared_prefill_steps, native.shared_prefill_steps,
                         engine.scheduler.stats.retractions)
        engine.shutdown()
    assert outs[True] == outs[False]
    assert all(n > 0 for n in stats[True]), stats  # grouped decode steps, grouped prefill chunks, retractions


def test_tiles_keep_the_tokens_under_chunked_prefill_eviction_and_retraction(smollm2_path, monkeypatch):
    """float32, prompts long enough for tiles (prefixes of 420, 300 and 150 tokens), prefilled in chunks of 512
    into a pool too small for the batch, every prefill step native with its rows in tiles (forced on the vector
    path): the greedy tokens are those of the per-row path, and tiles were split off."""
    from radixserve.model import prefix_groups as pg

    split = []
    plain_tiled = pg._tiled

    def counted(members, shared, first, length):
        out = plain_tiled(members, shared, first, length)
        split.append(len(out[0]) - len(members))
        return out

    monkeypatch.setattr(pg, "_tiled", counted)
    rows = _grouped_rows([420, 300, 150], per_group=3, loners=2, seed=13)
    params = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}
    outs, stats = {}, {}
    for shares in (False, True):
        engine = _engine(smollm2_path, "float32", max_total_tokens=1100, chunked_prefill_size=512)
        native = engine.runner.native
        native.shares, native.tiled, native.extend_keys = shares, shares, float("inf")
        outs[shares] = [r["output_ids"] for r in engine.generate(input_ids=rows, sampling_params=params)]
        stats[shares] = (native.shared_prefill_steps, engine.scheduler.stats.retractions)
        engine.shutdown()
    assert outs[True] == outs[False]
    assert all(n > 0 for n in stats[True]) and max(split) > 0, (stats, split)


def test_prefix_groups_are_the_runs_rows_share():
    """prefix_groups: rows grouped by the slots their contexts start with, each group's shared run the shortest
    any member has in common with its first row; members sharing under SHARED_MIN slots with it are grouped among
    themselves the same way, and rows alone on their prefix get no group. In a prefill step a row is a token: the rows of requests extending one cached
    prefix form one group, and a long new prompt's later tokens share its first SHARED_MIN."""
    from radixserve.kernels.base import AttentionBatch
    from radixserve.model.prefix_groups import SHARED_MIN, prefix_groups

    def grouped(groups) -> dict:
        return {tuple(groups.rows[groups.start[i]: groups.start[i + 1]].tolist()): int(groups.shared[i])
                for i in range(len(groups))}

    a, b = list(range(1000, 1000 + 300)), list(range(5000, 5000 + 200))
    contexts = [a + [1], b + [2], a[:250] + [3], [9] * 10, b + [4, 5], a[:SHARED_MIN - 1] + [6], a + [7], [8] * 400]
    flat = torch.tensor([s for c in contexts for s in c])
    length = np.array([len(c) for c in contexts])
    first = np.concatenate([[0], np.cumsum(length)[:-1]])
    groups = prefix_groups(flat, first, length)
    assert grouped(groups) == {(0, 2, 6): 250, (1, 4): 200}
    assert groups.row_shared.tolist() == [250, 200, 250, 0, 200, 0, 250, 0]

    # prompts that begin alike (a chat template's first slots) share those in the radix tree: one bucket, split into
    # a group per prompt; a row sharing only the common head with the others is in none
    head = list(range(20_000, 20_010))
    p, q = head + list(range(21_000, 21_300)), head + list(range(22_000, 22_300))
    contexts = [p + [1], q + [2], p + [3], q + [4], head + list(range(23_000, 23_300)), q + [5]]
    flat = torch.tensor([s for c in contexts for s in c])
    length = np.array([len(c) for c in contexts])
    first = np.concatenate([[0], np.cumsum(length)[:-1]])
    groups = prefix_groups(flat, first, length)
    assert grouped(groups) == {(0, 2): 310, (1, 3, 5): 310}
    assert groups.row_shared.tolist() == [310, 310, 310, 310, 0, 310]

    # extend: requests 0 and 1 add 3 and 2 tokens to a's 300 cached slots, request 2 its 250, request 3 (nothing
    # cached) 200 tokens of its own, request 4 one token to b
    rows_of = [a + [1, 2, 3], a + [4, 5], a[:250] + [6], list(range(9000, 9200)), b + [7]]
    prefix, extend = [300, 300, 250, 0, 200], [3, 2, 1, 200, 1]
    flat = torch.tensor([s for r in rows_of for s in r])
    first, length = AttentionBatch(mode="extend", prefix_lens=prefix, extend_lens=extend, slots=flat,
                                   out_slots=flat[:sum(extend)]).contexts()
    groups = prefix_groups(flat, first, length)
    assert grouped(groups) == {(0, 1, 2, 3, 4, 5): 250, tuple(range(6 + SHARED_MIN - 1, 206)): SHARED_MIN}
    assert groups.row_shared[:7].tolist() == [250] * 6 + [0] and groups.row_shared[-1] == 0


def _extend_contexts(rows_of: list[list[int]], prefix: list[int]):
    """(flat slots, first, length) of a prefill step whose request i holds ``rows_of[i]``, ``prefix[i]`` cached."""
    flat = torch.tensor([s for r in rows_of for s in r])
    extend = [len(r) - p for r, p in zip(rows_of, prefix)]
    first, length = AttentionBatch(mode="extend", prefix_lens=prefix, extend_lens=extend, slots=flat,
                                   out_slots=flat[:sum(extend)]).contexts()
    return flat, first, length


def test_long_requests_split_off_in_tiles():
    """prefix_groups(tiled=True): a request's rows TILE or more slots past their group's shared run form groups of
    their own, one per TILE-slot step, each a causal tile: its run the request's context up to its furthest row
    (listed first), each row seeing its own context through it, so that only the rows left in a group score their
    own slots row by row; a request's rows alone in a group (a long prompt on its first slots) split near the run
    too, and a fresh prompt's first rows (shorter than SHARED_MIN: in no group untiled) form one more; the steps
    longer where more would pack more than TILES x the rows' span in all (a long prompt, a long cached prefix); a
    step with fewer than TILE_ROWS rows stays in the group; requests sharing a cached prefix keep
    sharing it in one group for their rows near it, and decode rows (one a request) are never split."""
    from radixserve.model.prefix_groups import SHARED_MIN, TILE, TILE_ROWS, TILES, prefix_groups

    def causal(groups, length):  # every split-off group: its longest row first, each row seeing its whole context
        for i in range(len(groups)):
            rows = groups.rows[groups.start[i]: groups.start[i + 1]]
            assert length[rows[0]] == groups.shared[i] == length[rows].max()
            assert groups.row_shared[rows].tolist() == length[rows].tolist()

    assert SHARED_MIN == TILE == 128 and TILE_ROWS == 16  # the figures below
    # a fresh 700-token prompt: rows 127.. (on its first 128 slots) in causal tiles of 128 rows, its first 127
    # rows (in no group untiled) a causal tile of their own
    flat, first, length = _extend_contexts([list(range(1000, 1700))], [0])
    plain, tiled = prefix_groups(flat, first, length), prefix_groups(flat, first, length, tiled=True)
    assert plain.shared.tolist() == [128] and plain.row_shared.tolist() == [0] * 127 + [128] * 573
    assert sorted(tiled.shared.tolist()) == [127, 255, 383, 511, 639, 700]
    assert tiled.row_shared.tolist() == length.tolist()
    causal(tiled, length)
    # 650 tokens: the last step would hold 11 rows (lengths 640..650): they stay on the first 128
    flat, first, length = _extend_contexts([list(range(1000, 1650))], [0])
    tiled = prefix_groups(flat, first, length, tiled=True)
    assert sorted(tiled.shared.tolist()) == [127, 128, 255, 383, 511, 639]
    assert tiled.row_shared[-11:].tolist() == [128] * 11 and tiled.row_shared[-12] == 639
    # 5000 tokens: 4872 past the shared run, in 15 steps (16 x 4872 // 5000) of 336 (a multiple of 16)
    flat, first, length = _extend_contexts([list(range(10_000, 15_000))], [0])
    tiled = prefix_groups(flat, first, length, tiled=True)
    assert len(tiled) == 16 and sorted(tiled.shared.tolist())[:3] == [127, 128 + 335, 128 + 671]
    assert tiled.row_shared.tolist() == length.tolist()
    assert tiled.slots() - 127 <= TILES * 4872
    causal(tiled, length)
    # 2048 new tokens on a cached 6000-slot prefix: 4 steps (16 x 2048 // 8048) of 512, not 16 of 128
    cached = list(range(20_000, 26_000))
    flat, first, length = _extend_contexts([cached + list(range(30_000, 32_048))], [6000])
    tiled = prefix_groups(flat, first, length, tiled=True)
    assert sorted(tiled.shared.tolist()) == [6512, 7024, 7536, 8048]  # the first row reaches 6001
    assert tiled.slots() - 4 * 6001 <= TILES * 2048
    causal(tiled, length)
    # two requests of 300 new tokens on a cached 200-slot prefix, one of 20: the rows less than 128 past it
    # (all 20 of the short one's) one group seeing just the prefix, each long request's later rows causal tiles on
    # its own slots
    a = list(range(1000, 1200))
    rows_of = [a + list(range(2000, 2300)), a + list(range(3000, 3300)), a + list(range(4000, 4020))]
    flat, first, length = _extend_contexts(rows_of, [200, 200, 200])
    tiled = prefix_groups(flat, first, length, tiled=True)
    groups = {int(tiled.shared[i]): tiled.rows[tiled.start[i]: tiled.start[i + 1]].tolist()
              for i in range(len(tiled))}
    assert groups[200] == [*range(127), *range(300, 427), *range(600, 620)]
    assert tiled.row_shared.tolist() == [200 if n - 200 < 128 else n for n in length]
    assert sorted(tiled.shared.tolist()) == [200, 455, 455, 500, 500]
    # decode rows: one a request, each 600 past a shared 300-slot prefix -- no tiles
    b = list(range(5000, 5300))
    flat = torch.tensor([s for i in range(20) for s in b + list(range(10_000 * (i + 1), 10_000 * (i + 1) + 600))])
    length = np.full(20, 900)
    first = np.arange(20) * 900
    tiled = prefix_groups(flat, first, length, tiled=True)
    assert tiled.shared.tolist() == [300] and len(tiled.rows) == 20


@pytest.mark.parametrize("path", ["amx", "vector"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_long_prompts_are_scored_in_tiles(smollm2_path, dtype, path):
    """A prefill step of long new prompts -- a fresh one, two long continuations of one cached prefix, a short one
    on it -- with the request's rows in tiles (tiled groups: forced on the vector path, where the budget does not
    take them) gives every token the logits of the per-row path (float32: to float32 rounding, the same argmax;
    the same K/V) and eager's (bf16: to its rounding noise)."""
    engine = _engine(smollm2_path, dtype, chunked_prefill_size=4096)
    native, runner, sched = engine.runner.native, engine.runner, engine.scheduler
    if path == "amx" and not (native.amx and dtype == "bfloat16"):
        pytest.skip("AMX tiles score bf16 only, where the CPU and kernel grant them")
    native.desc.amx = int(path == "amx")
    native.tiled = True  # rows in tiles (prefix_groups(tiled=True)), on either path (and on an AVX2 build)
    one = SamplingParams(max_new_tokens=1, temperature=0, ignore_eos=True)
    rng = random.Random(5)
    ids = lambda n: [rng.randrange(1000, 40000) for _ in range(n)]  # noqa: E731
    head = ids(150)
    sched.add_request("head", head, one)
    while sched.has_work:
        sched.process(runner.forward(sched.schedule()))
    prompts = [ids(530), head + ids(300), head + ids(290), head + ids(20)]
    for i, p in enumerate(prompts):
        sched.add_request(f"p{i}", p, one, top_logprobs=0, logprob_start=151 if i else 0)
    plan = sched.schedule()
    assert plan.mode == "extend" and len(plan.extend_lens) == 4
    outs = {}
    for shares in (False, True):
        native.shares = shares
        outs[shares] = _eager_and_native(runner, plan)
    assert native.last_groups >= 8  # the fresh prompt's 4 tiles (128 .. 512), the continuations' 2 each, the prefix
    (eager, alone, _, kv_alone), (_, tiled, _, kv_tiled) = outs[False], outs[True]
    if dtype == "float32":
        torch.testing.assert_close(tiled, alone, rtol=1e-4, atol=1e-4)
        assert torch.equal(tiled.argmax(-1), alone.argmax(-1))
        for a, b in zip(kv_tiled, kv_alone):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    assert (tiled - eager).norm() <= 0.02 * eager.norm(), "beyond bf16 rounding noise"
    assert (tiled.argmax(-1) == eager.argmax(-1)).float().mean() >= 0.85
    sched.process(runner.forward(plan))
    sched.check()
    engine.shutdown()


def test_shapes_that_fill_no_tile_evenly(odd_model):
    for dtype, tol in (("float32", 1e-4), ("bfloat16", None)):
        engine = _engine(odd_model, dtype)
        for eager, native, _, _ in _compare_steps(engine, _rows(7, seed=11, shared=5), steps=3):
            if tol:
                torch.testing.assert_close(native, eager, rtol=tol, atol=tol)
            else:
                assert (native - eager).abs().max() <= 0.05 * eager.abs().max()
        engine.shutdown()


def test_a_failing_compiler_is_reported(tmp_path, monkeypatch):
    monkeypatch.setenv("CXX", "false")  # a "compiler" that fails: a new build key, and the build fails
    with pytest.raises(NativeUnavailable, match="compiling decode.cpp with false failed"):
        cpu_native.build(tmp_path)
    assert not list(tmp_path.glob("*.so")), "no half-written library is left for the next start to load"


def test_the_library_is_built_once_and_reused(tmp_path):
    first = cpu_native.build(tmp_path)
    stamp = first.stat().st_mtime_ns
    assert cpu_native.build(tmp_path) == first and first.stat().st_mtime_ns == stamp


@pytest.mark.parametrize("march, isa", [("x86-64-v3", "avx2"), ("sapphirerapids", "avx512"),
                                        ("skylake-avx512", "avx2")])
def test_one_source_builds_for_each_instruction_set(march, isa, tmp_path, monkeypatch):
    """AVX2 (x86-64-v3), AVX-512 with BF16/VNNI (and AMX), and AVX-512 without BF16 (which takes the AVX2 code):
    each build compiles on any machine, whichever of them this one can run; the library names what it uses."""
    monkeypatch.setenv("RADIXSERVE_MARCH", march)
    try:
        lib = cpu_native.build(tmp_path)
    except NativeUnavailable as exc:
        if "march" in str(exc) and "bad value" in str(exc):
            pytest.skip(f"this compiler has no -march={march}")
        raise
    names = {name for name in ("avx2", "avx512") if f"{name}\0".encode() in lib.read_bytes()}  # rs_isa's string
    assert names == {isa}


def test_the_library_shows_only_its_c_functions(tmp_path):
    """Two builds of the kernel in one process (benchmarks/kernel_ab.py: a git revision's and the working tree's)
    each run their own tiles: the library exports its rs_ functions and nothing else -- a template's static
    (TileTable's table) would be a process-wide unique symbol, and the second build would run the first's tiles."""
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("no nm (binutils) to list the library's symbols")
    lines = subprocess.run([nm, "-D", "--defined-only", str(cpu_native.build(tmp_path))], capture_output=True,
                           text=True, check=True).stdout.splitlines()
    names = {line.split()[-1] for line in lines}
    assert {"rs_decode_step", "rs_linear", "rs_abi_version"} <= names
    assert all(name.startswith("rs_") for name in names), sorted(names)


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_quantized_weights_decode_from_their_blocks(quantization, tiny_models):
    """int8 (per-channel scales as 32-weight blocks) and int4 (groups of 32 with offsets) through the kernel's
    integer products, the activations quantized per 32 values as llama.cpp does: the logits stay within a few
    percent of the eager quantized model's (float activations) and greedy choices mostly agree."""
    for path in (tiny_models["qwen2"], tiny_models["llama"]):
        engine = _engine(path, "float32", quantization=quantization)
        layer = engine.runner.native.desc.layer[0]
        assert layer.qkv.format == (cpu_native.Q8 if quantization == "int8" else cpu_native.Q4)
        assert all(m.handed_over for m in engine.runner.model.modules() if isinstance(m, QuantLinear))
        agree = total = 0
        for eager, native, kv_e, kv_n in _compare_steps(engine, _rows(6, seed=5, shared=10), steps=4):
            assert (native - eager).abs().max() <= 0.08 * eager.abs().max()
            agree += int((native.argmax(-1) == eager.argmax(-1)).sum())
            total += len(eager)
            for a, b in zip(kv_n, kv_e):
                assert (a - b).abs().max() <= 0.08 * b.abs().max() + 1e-3
        assert agree >= 0.75 * total
        engine.shutdown()


def _quantize_rows(x: torch.Tensor, span: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's activation quantization, in torch: per ``span`` values (32; 256 for K-quant layers),
    xq = rint(x * 127 / max|x|), dx = max|x| / 127 (dx: one per 32 values, repeated over a span)."""
    rows, k = x.shape
    xb = x.float().view(rows, k // span, span)
    amax = xb.abs().amax(-1)
    inv = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros(()))
    xq = torch.round(xb * inv[..., None]).view(rows, k // 32, 32)  # torch.round: nearest, ties to even
    return xq, (amax / 127.0).repeat_interleave(span // 32, dim=1)


def _draw(values: str, low: int, high: int, size: tuple, generator, dtype=torch.int64) -> torch.Tensor:
    """torch.randint, or ("extreme") its largest value everywhere: where a product's integer sums are largest."""
    if values == "extreme":
        return torch.full(size, high - 1, dtype=dtype)
    return torch.randint(low, high, size, generator=generator, dtype=dtype)


def _activations(values: str, rows: int, k: int, generator) -> torch.Tensor:
    """Gaussian rows, or ("extreme") rows of +-1 alternating in sign: quantized to +-127 everywhere."""
    if values == "extreme":
        return torch.ones(rows, k) * (1 - 2 * (torch.arange(rows) % 2))[:, None]
    return torch.randn(rows, k, generator=generator)


def _run_linear(lib, lin, x: torch.Tensor, amx: bool) -> torch.Tensor:
    rows = x.shape[0]
    y = torch.empty(rows, lin.n, dtype=x.dtype)
    scratch = torch.empty(cpu_native.linear_scratch_bytes(rows, lin.k), dtype=torch.uint8)
    lib.rs_linear(ctypes.byref(lin), int(x.dtype == torch.bfloat16), x.data_ptr(), rows, y.data_ptr(), int(amx),
                  scratch.data_ptr())
    return y


@pytest.mark.parametrize("values", ["random", "extreme"])
@pytest.mark.parametrize("n,k", [(40, 64), (80, 96), (1000, 576)])
def test_each_product_format_computes_what_it_promises(n, k, values):
    """One linear product through every format, against the formula the kernel documents, on shapes whose rows
    fill no 16-row block or tile evenly and 1..19 rows of input; "extreme": every quantized weight at its largest
    and the activations at +-127, where the integer sums are largest (AVX2 adds a block's nibble products as int16)."""
    from radixserve.model.native_decode import _blocks, pack_dense, pack_q4, pack_q8

    lib = cpu_native.load(cpu_native.default_cache_dir())
    amx_ok = lib.rs_request_amx() == 1
    g = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=g) * 0.1
    bias = torch.randn(n, generator=g)
    for rows in (1, 3, 16, 19):
        x = _activations(values, rows, k, g)
        for dtype in (torch.float32, torch.bfloat16):
            wt, bt, xt = w.to(dtype), bias.to(dtype), x.to(dtype)
            packed = pack_dense(wt)
            lin = cpu_native.Linear(cpu_native.DENSE, n, k, 0, packed.data_ptr(), None, None, bt.data_ptr())
            want = (xt.double() @ wt.double().T + bt.double()).to(dtype)
            for amx in ([False, True] if dtype == torch.bfloat16 and amx_ok and k % 32 == 0 else [False]):
                got = _run_linear(lib, lin, xt, amx)
                torch.testing.assert_close(got.float(), want.float(), rtol=1e-5 if dtype == torch.float32 else 8e-3,
                                           atol=1e-4 if dtype == torch.float32 else 8e-3)
        # quantized: int8 blocks of 32 (scale per block), int4 blocks with scale and offset (fp16, as stored)
        xq, dx = _quantize_rows(x)
        q8 = _draw(values, -127, 128, (n, k), g, dtype=torch.int8)
        d8 = torch.rand(n, k // 32, generator=g) * 0.01 + 1e-3
        data, scale = pack_q8(q8, d8)
        lin = cpu_native.Linear(cpu_native.Q8, n, k, 0, data.data_ptr(), scale.data_ptr(), None, None)
        dots = torch.einsum("rbk,nbk->rnb", xq.double(), q8.double().view(n, k // 32, 32))
        want = (dots * d8.double()[None] * dx.double()[:, None]).sum(-1)
        torch.testing.assert_close(_run_linear(lib, lin, x, False).double(), want, rtol=1e-5, atol=1e-5)
        # the same with fp16 scales (GGUF's Q8_0 in its own bits)
        halves = _blocks(d8.half().float(), scale.shape[0] * 16).half()
        lin = cpu_native.Linear(cpu_native.Q8H, n, k, 0, data.data_ptr(), halves.data_ptr(), None, None)
        want = (dots * d8.half().double()[None] * dx.double()[:, None]).sum(-1)
        torch.testing.assert_close(_run_linear(lib, lin, x, False).double(), want, rtol=1e-5, atol=1e-5)
        # int8 blocks of 32 or 16 (GGUF's Q5_K / Q6_K) with an offset per block: w = d q + m
        sums16 = xq.double().view(rows, k // 16, 16).sum(-1)
        for group, form in ((32, cpu_native.Q8), (16, cpu_native.Q8G16)):
            d, m = torch.rand(n, k // group, generator=g) * 0.01 + 1e-3, torch.randn(n, k // group, generator=g) * 0.05
            data, scale = pack_q8(q8, d)
            zero = _blocks(m, scale.shape[0] * 16)
            lin = cpu_native.Linear(form, n, k, 0, data.data_ptr(), scale.data_ptr(), zero.data_ptr(), None)
            dots = torch.einsum("rbk,nbk->rnb", xq.double().view(rows, -1, group), q8.double().view(n, -1, group))
            sums = sums16.view(rows, -1, group // 16).sum(-1)[:, None, :]
            dx_g = dx.double().repeat_interleave(32 // group, dim=1)[:, None, :]
            want = ((dots * d.double()[None] + m.double()[None] * sums) * dx_g).sum(-1)
            torch.testing.assert_close(_run_linear(lib, lin, x, False).double(), want, rtol=1e-5, atol=1e-5)
        q4 = _draw(values, 0, 16, (n, k), g)
        d4, m4 = torch.rand(n, k // 32, generator=g) * 0.01 + 1e-3, torch.randn(n, k // 32, generator=g) * 0.05
        data, d16, m16 = pack_q4(q4, d4, m4)
        lin = cpu_native.Linear(cpu_native.Q4, n, k, 0, data.data_ptr(), d16.data_ptr(), m16.data_ptr(), None)
        d4, m4 = d4.half().double(), m4.half().double()  # what the kernel stores
        dots = torch.einsum("rbk,nbk->rnb", xq.double(), q4.double().view(n, k // 32, 32))
        sums = xq.double().sum(-1)[:, None, :]
        want = ((dots * d4[None] + m4[None] * sums) * dx.double()[:, None]).sum(-1)
        torch.testing.assert_close(_run_linear(lib, lin, x, False).double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("values", ["random", "extreme"])
@pytest.mark.parametrize("n,k", [(40, 256), (200, 768)])
def test_k_quant_formats_compute_what_they_promise(n, k, values):
    """GGUF's Q4_K, Q5_K and Q6_K in their own bits (a 6- or 8-bit scale per 32 or 16 weights times the
    super-block's float; Q5_K's fifth bits and Q6_K's top two beside the nibbles), against the formula: the same
    sums as int8 blocks whose scale is d sc, exact in float32, with the activations quantized per super-block.
    "extreme": every weight and scale at its largest and every activation at +-127 (rows alternating in sign),
    where the integer sums are largest (the AVX2 tiles add a run of groups' pair sums as int16)."""
    from radixserve.kernels.cpu_quant import FileBlocks
    from radixserve.model.native_decode import pack_q4k, pack_q6k

    lib = cpu_native.load(cpu_native.default_cache_dir())
    g = torch.Generator().manual_seed(n + k)
    supers = k // 256
    fp16 = lambda t: t.half().float()  # noqa: E731 (a file's super-block scales are fp16)
    for rows in (1, 3, 16, 19):
        x = _activations(values, rows, k, g)
        xq, dx = _quantize_rows(x, 256)  # K-quant layers: one scale per super-block
        dx = dx.double()
        # Q4_K / Q5_K: w = d sc q - dmin mn per 32, q 0..15 / 0..31, sc and mn 0..63
        for kind, top, form in (("Q5_K", 32, cpu_native.Q5K), ("Q4_K", 16, cpu_native.Q4K)):
            q = _draw(values, 0, top, (n, k), generator=g)
            sb = FileBlocks(kind, fp16(torch.rand(n, supers, generator=g) * 1e-3),
                             _draw(values, 0, 64, (n, k // 32), generator=g, dtype=torch.uint8),
                             fp16(torch.rand(n, supers, generator=g) * 1e-3),
                             _draw(values, 0, 64, (n, k // 32), generator=g, dtype=torch.uint8))
            packed = pack_q4k(q, sb)
            lin = cpu_native.Linear(form, n, k, 0, *(t.data_ptr() for t in packed[:3]), None,
                                    *(t.data_ptr() for t in packed[3:]))
            scale = sb.d.double().repeat_interleave(8, dim=1) * sb.sc.double()
            offset = -sb.dmin.double().repeat_interleave(8, dim=1) * sb.mn.double()
            dots = torch.einsum("rbk,nbk->rnb", xq.double().view(rows, -1, 32), q.double().view(n, -1, 32))
            sums = xq.double().view(rows, -1, 32).sum(-1)[:, None, :]
            want = ((dots * scale[None] + offset[None] * sums) * dx[:, None]).sum(-1)
            torch.testing.assert_close(_run_linear(lib, lin, x, False).double(), want, rtol=1e-5, atol=1e-5)
        q4k, q4k_tensors, want_q4k = lin, packed, want  # (the tensors kept: the parts below point into them)
        # Q6_K: w = d sc q per 16, q -32..31, sc int8
        q = _draw(values, -32, 32, (n, k), generator=g, dtype=torch.int8)
        sb = FileBlocks("Q6_K", fp16(torch.rand(n, supers, generator=g) * 1e-3),
                         _draw(values, -128, 128, (n, k // 16), generator=g, dtype=torch.int8))
        data, sc, d = packed = pack_q6k(q, sb)
        lin = cpu_native.Linear(cpu_native.Q6K, n, k, 0, data.data_ptr(), sc.data_ptr(), None, None, d.data_ptr(),
                                None)
        scale = sb.d.double().repeat_interleave(16, dim=1) * sb.sc.double()
        dots = torch.einsum("rbk,nbk->rnb", xq.double().view(rows, -1, 16), q.double().view(n, -1, 16))
        want = (dots * scale[None] * dx.repeat_interleave(2, dim=1)[:, None]).sum(-1)
        torch.testing.assert_close(_run_linear(lib, lin, x, False).double(), want, rtol=1e-5, atol=1e-5)
        # one layer in two parts (a fused q/k/v: Q4_K rows, then Q6_K rows), each emitted where its rows sit
        parts = (cpu_native.Linear * 2)(q4k, lin)
        whole = cpu_native.Linear(cpu_native.PARTS, 2 * n, k, 2, ctypes.addressof(parts), None, None, None)
        torch.testing.assert_close(_run_linear(lib, whole, x, False).double(), torch.cat([want_q4k, want], 1),
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kv", ["plain", *KV_CODES])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim,heads,kv_heads", [(64, 9, 3), (128, 8, 2), (64, 4, 4), (16, 4, 2), (96, 6, 2)])
def test_attention_is_softmax_over_each_rows_slots(dtype, head_dim, heads, kv_heads, kv):
    """The attention phase alone against float64 softmax(q k^T / sqrt(d)) v over each row's slots: head dims
    with their own paths (64, 128) and the generic one, one row of 700 keys and three rows (a row's keys
    split among threads), twenty and eight rows sharing a 160-key prefix (on 2 threads a group's query tiles too
    few for a task per thread are cut into shorter runs: shared_groups.h run_split), and fourteen rows in three
    groups sharing prefixes of 160, 200 and 144 keys with two rows in none, interleaved (each group's prefix scored
    for its rows at once: AMX tiles where bf16 head dim 64 has them, else vector registers where the head dim is a
    multiple of 16 and the pool holds the model's dtype, else row by row), and groups whose rows see different
    amounts of their prefix (reach: a causal tile's rows, each through its own context; here with own slots after
    it too), slots scattered over the pool; the pool in the model's dtype or in 8-bit codes (model/kv_codes.py:
    the reference reads the values the codes stand for)."""
    lib = cpu_native.load(cpu_native.default_cache_dir())
    g = torch.Generator().manual_seed(head_dim + heads)
    prefixes = [160, 200, 144]
    # (each row's own slots, or random; each row's group, -1: none; whether rows see only part of their prefix)
    cases = [([700], [-1], False), ([5, 300, 129], [-1] * 3, False), (None, [0] * 20, False), (None, [0] * 8, False),
             (None, [0, 1, 2, -1, 0, 1, 2, 2, 1, 0, -1, 0, 1, 2], False), (None, [0] * 40 + [1, 2, 1, 2, -1], True),
             (None, [0] * 60 + [1, 2], True)]
    for own, member, partial in cases:
        own = own or [int(x) for x in torch.randint(1, 120, (len(member),), generator=g)]
        seen = [prefixes[x] if x >= 0 else 0 for x in member]
        if partial:  # each group's first row sees all of it (the kernel reads the prefix from its context)
            seen = [n if m == member.index(x) else int(torch.randint(1, n + 1, (), generator=g))
                    for m, (n, x) in enumerate(zip(seen, member))]
            own = [n if m % 3 else 0 for m, n in enumerate(own)]  # some rows end where their reach does
        total = sum(own) + sum(prefixes) + 1
        k_pool = torch.randn(total + 1, kv_heads, head_dim, generator=g).to(dtype)
        v_pool = torch.randn(total + 1, kv_heads, head_dim, generator=g).to(dtype)
        order = torch.randperm(total, generator=g) + 1  # slot 0: the dummy
        starts_at = torch.tensor([0, *prefixes]).cumsum(0)
        prefix = [order[starts_at[i]: starts_at[i + 1]] for i in range(len(prefixes))]
        rows, at = [], int(starts_at[-1])
        for n, grp, reach in zip(own, member, seen):
            rows.append(torch.cat([prefix[grp][:reach] if grp >= 0 else order[:0], order[at: at + n]]))
            at += n
        lens = [len(r) for r in rows]
        used = sorted({x for x in member if x >= 0})
        members = [[m for m, x in enumerate(member) if x == i] for i in used]
        groups = cpu_native.PrefixGroups(len(rows), members, [prefixes[i] for i in used],
                                         [[seen[m] for m in rows_of] for rows_of in members])
        slots = torch.cat(rows).to(torch.int64)
        lengths = torch.tensor(lens, dtype=torch.int64)
        starts = lengths.cumsum(0) - lengths
        width = (heads + 2 * kv_heads) * head_dim
        qkv = torch.randn(len(lens), width, generator=g).to(dtype)
        codes = {}
        if kv == "plain":
            layer = cpu_native.Layer(k_pool=k_pool.data_ptr(), v_pool=v_pool.data_ptr())
        else:  # the kernel reads the codes; the reference their values
            (kc, ks), (vc, vs) = encode(k_pool, kv), encode(v_pool, kv)
            k_pool, v_pool = (ScaledPool(c, sc, kv, torch.float64).index_select(0, torch.arange(total + 1))
                              for c, sc in ((kc, ks), (vc, vs)))
            layer = cpu_native.Layer(k_pool=kc.data_ptr(), v_pool=vc.data_ptr(), k_scale=ks.data_ptr(),
                                     v_scale=vs.data_ptr())
            codes = dict(kv_codes=cpu_native.KV_FORMAT[kv], kv_limit=KV_CODES[kv][1])
        layers = (cpu_native.Layer * 1)(layer)
        model = cpu_native.Model(bf16=int(dtype == torch.bfloat16), layers=1, hidden=heads * head_dim, heads=heads,
                                 kv_heads=kv_heads, head_dim=head_dim, inter=32, vocab=16, eps=1e-6,
                                 scale=head_dim**-0.5, layer=layers, **codes)
        model.amx = lib.rs_request_amx()
        out = torch.empty(len(lens), heads * head_dim, dtype=dtype)
        threads = torch.get_num_threads()
        torch.set_num_threads(2)  # the threads the split of runs is planned for, whatever this machine has
        try:  # (the scratch sized for them: per thread partials)
            need = lib.rs_scratch_bytes(ctypes.byref(model), len(lens), len(groups), groups.slots())
            scratch = torch.empty(need, dtype=torch.uint8)
            step = cpu_native.Step(rows=len(lens), **groups.fields(), slots=slots.data_ptr(),
                                   starts=starts.data_ptr(), lens=lengths.data_ptr(), scratch=scratch.data_ptr(),
                                   scratch_bytes=need)
            assert lib.rs_attention(ctypes.byref(model), 0, ctypes.byref(step), qkv.data_ptr(), out.data_ptr()) == 0
            torch.set_num_threads(1)  # sized for fewer threads than run it: refused
            few = lib.rs_scratch_bytes(ctypes.byref(model), len(lens), len(groups), groups.slots())
            torch.set_num_threads(2)
            step.scratch_bytes = few
            assert few < need and lib.rs_attention(ctypes.byref(model), 0, ctypes.byref(step), qkv.data_ptr(),
                                                   out.data_ptr()) == 3
        finally:
            torch.set_num_threads(threads)
        group = heads // kv_heads
        for m, row in enumerate(rows):
            q = qkv[m, : heads * head_dim].double().view(heads, head_dim)
            k = k_pool[row].double()[:, torch.arange(heads) // group]  # [L, heads, d]
            v = v_pool[row].double()[:, torch.arange(heads) // group]
            p = torch.softmax(torch.einsum("hd,lhd->hl", q, k) * head_dim**-0.5, -1)
            want = torch.einsum("hl,lhd->hd", p, v).reshape(-1)
            tol = 1e-5 if dtype == torch.float32 else 1e-2
            torch.testing.assert_close(out[m].double(), want, rtol=tol, atol=tol)


def _corrupt(batch, what: str, pool: int) -> None:
    if what == "context slot":
        batch.attn.slots[0] = pool  # one past the pool
    elif what == "new slot":
        batch.attn.out_slots[0] = -1
    elif what == "logit row":
        batch.logit_rows = batch.logit_rows + len(batch.input_ids)
    else:  # a context longer than the slots given: its range leaves the slot array
        batch.attn.slots = batch.attn.slots[:-1]


@pytest.mark.parametrize("what", ["context slot", "new slot", "logit row", "context range"])
def test_an_index_outside_its_buffer_fails_the_step_not_the_process(tiny_models, what):
    """The kernel indexes raw memory with the step's indices, so the Python side checks every one against its
    buffer first: a plan with one outside fails that step (the scheduler fails its requests), the runner goes on."""
    engine = _engine(tiny_models["llama"], "float32")
    runner, sched = engine.runner, engine.scheduler
    sched.add_request("r", [5, 6, 7], SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True))
    sched.process(runner.forward(sched.schedule()))
    plan = sched.schedule()
    assert plan.mode == "decode"
    with torch.inference_mode():
        batch = ForwardBatch.from_plan(plan, runner.kv, runner.rope, runner.attn, runner.dtype, runner.device,
                                       runner._group, runner.table, prepare_attention=False)
        _corrupt(batch, what, runner.kv.k.shape[1])
        with pytest.raises(IndexError, match="outside|reaches outside"):
            runner.native(batch)
    sched.process(runner.forward(plan))  # the real step still runs
    while sched.has_work:
        sched.process(runner.forward(sched.schedule()))
    engine.shutdown()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_prefill_step_equals_eager(dtype, tiny_models):
    """A prefill step through the kernel (a row per new token, its context its request's row up to itself): one
    request continuing a cached prompt, one fresh, one with its prompt's logprobs asked for -- the logits of every
    logit row and the K/V stored equal the eager model's (float32 to rounding, bf16 to its noise)."""
    engine = _engine(tiny_models["qwen2"], dtype)
    runner, sched = engine.runner, engine.scheduler
    rng = random.Random(21)
    rows = [[rng.randrange(1000, 40000) for _ in range(n)] for n in (30, 25, 17)]
    first = SamplingParams(max_new_tokens=1, temperature=0, ignore_eos=True)
    sched.add_request("warm", rows[0], first)
    while sched.has_work:
        sched.process(runner.forward(sched.schedule()))
    sched.add_request("cont", rows[0] + rows[1][:9], first)
    sched.add_request("fresh", rows[2], first)
    sched.add_request("scored", rows[1], first, top_logprobs=0, logprob_start=2)
    plan = sched.schedule()
    assert plan.mode == "extend" and len(plan.extend_lens) == 3 and max(plan.prefix_lens) > 0
    step = runner._batch(plan)
    assert runner.native.applies(step) and isinstance(step.attn.backend_data, StepContexts)  # the step runs on them
    eager, native, kv_eager, kv_native = _eager_and_native(runner, plan)
    assert len(native) == len(eager) > 3, "the prompt's logprob rows come out too"
    if dtype == "float32":
        torch.testing.assert_close(native, eager, rtol=1e-4, atol=1e-4)
        for a, b in zip(kv_native, kv_eager):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    else:
        assert (native - eager).abs().max() <= 0.05 * eager.abs().max()
    sched.process(runner.forward(plan))
    while sched.has_work:
        sched.process(runner.forward(sched.schedule()))
    sched.check()
    engine.shutdown()


def _step(mode: str, rows: list[list[int]], extend: list[int]) -> SimpleNamespace:
    """A step's attention over requests' rows of slots (their last ``extend[i]`` new), as ``applies`` reads it."""
    slots = torch.tensor([s for row in rows for s in row], dtype=torch.int64)
    ends = np.cumsum([len(row) for row in rows])
    out = torch.from_numpy(np.concatenate([np.arange(end - e, end) for end, e in zip(ends, extend)]))
    return SimpleNamespace(attn=AttentionBatch(mode=mode, prefix_lens=[len(r) - e for r, e in zip(rows, extend)],
                                               extend_lens=extend, slots=slots, out_slots=slots[out]))


def test_prefill_steps_are_taken_while_their_attention_is_small(tiny_models):
    """NativeDecode.applies: every decode step; a prefill step while its attention's cost fits the budget: the
    (row, key) pairs, a group's shared slots at 1 / shared_gain -- a request's tokens on its cached prefix, several
    requests' tokens on one prefix (one token each too), a long prompt's rows on its first SHARED_MIN slots. The
    budget and the gain are larger where the kernel is built for AVX2 (torch multiplies bf16 through float32 there,
    and its float32 SDPA over a gathered prefix is slow), for bf16 on AVX-512 without AMX (measured on Zen 4) and
    where AMX tiles score the shared slots."""
    from radixserve.model.prefix_groups import (EXTEND_KEYS, EXTEND_KEYS_AMX, EXTEND_KEYS_AVX2, SHARED_GAIN,
                                                SHARED_GAIN_AMX, SHARED_GAIN_AVX2, SHARED_MIN, TILE,
                                                TILE_ROWS)

    for dtype in ("float32", "bfloat16"):
        engine = _engine(tiny_models["llama"], dtype)
        native = engine.runner.native
        want = ((EXTEND_KEYS_AVX2[native.dtype], SHARED_GAIN_AVX2) if native.isa == "avx2" else
                (EXTEND_KEYS_AMX, SHARED_GAIN_AMX) if native.amx_shared else
                (EXTEND_KEYS[native.dtype], SHARED_GAIN[native.dtype]))
        assert (native.extend_keys, native.shared_gain) == want
        engine.shutdown()
    # the figures below: rows untiled (as the AVX2 build groups them), 40,000 pairs and a shared one at 1/2
    native.tiled = False
    native.extend_keys = EXTEND_KEYS[torch.float32]
    gain = native.shared_gain = SHARED_GAIN[torch.float32]
    fresh = iter(range(100_000, 200_000))  # new slots
    prefix = list(range(1500))

    def cost(step):
        slots, first, length = step.attn.tree_contexts()
        return native.cost(length, native._groups(slots, first, length))

    assert native.applies(_step("decode", [prefix + [next(fresh)] for _ in range(64)], [1] * 64))
    # a fresh prompt: rows 0..e-1 see 1..e slots; from row SHARED_MIN - 1 on they are a group on its first slots
    for e, taken in ((320, True), (330, False)):
        step = _step("extend", [[next(fresh) for _ in range(e)]], [e])
        grouped = (e - SHARED_MIN + 1) * SHARED_MIN
        assert cost(step) == e * (e + 1) // 2 - grouped + grouped / gain
        assert native.applies(step) == taken  # 39,008 / 41,623
    # 30 tokens on a 1500-slot cached prefix: every row's first 1501 slots shared (45,465 pairs)
    on_cached = _step("extend", [prefix + [next(fresh) for _ in range(30)]], [30])
    assert cost(on_cached) == 45_465 - 30 * 1501 + 30 * 1501 / gain
    assert native.applies(on_cached)
    # 30 requests of one token each on that prefix: one group across the requests (45,030 pairs, 45,000 shared)
    one_each = _step("extend", [prefix + [next(fresh)] for _ in range(30)], [1] * 30)
    assert cost(one_each) == 45_030 - 45_000 + 45_000 / gain and native.applies(one_each)
    # ... sharing only their first SHARED_MIN - 1 slots: no group (each request's one row alone)
    apart = _step("extend", [prefix[: SHARED_MIN - 1] + [next(fresh) for _ in range(1501 - SHARED_MIN + 1)]
                             for _ in range(30)], [1] * 30)
    assert cost(apart) == 45_030 and not native.applies(apart)
    native.shares = False  # no groups: every pair row by row
    assert cost(on_cached) == 45_465 and not native.applies(on_cached)
    assert not native.applies(one_each)
    native.shares = True
    native.extend_keys = cost(on_cached)  # the budget itself is taken
    assert native.applies(on_cached)
    native.extend_keys -= 1
    assert not native.applies(on_cached)
    # where AVX-512 scores shared slots, a long prompt's rows are causal tiles: fewer rows than make a tile score
    # TILE slots or more row by row (here the last one, alone at its level), and bf16's budget takes the step
    # (18,297 of 400,000; 2,098,176 pairs)
    native.tiled, native.extend_keys = True, EXTEND_KEYS[torch.bfloat16]
    gain = native.shared_gain = SHARED_GAIN[torch.bfloat16]
    long = _step("extend", [[next(fresh) for _ in range(2048)]], [2048])
    slots, first, length = long.attn.tree_contexts()
    alone = length - native._groups(slots, first, length).row_shared
    assert (alone >= TILE).sum() < TILE_ROWS and cost(long) == (length.sum() - alone.sum()) / gain + alone.sum()
    assert native.applies(long)


def test_prefill_steps_turned_down_run_on_torch_with_its_metadata(tiny_models):
    """The runner builds a step without torch's attention metadata and prepares it only when the native step turns
    the step down: with no prefill budget every prefill step runs on torch (fresh prompts, prompts on a cached
    prefix, several on one), decode steps stay native, and the greedy tokens are those of an all-native run."""
    rng = random.Random(5)
    common = [rng.randrange(1000, 40000) for _ in range(150)]
    rows = [common + [rng.randrange(1000, 40000) for _ in range(n)] for n in (3, 20, 41)]
    rows.append([rng.randrange(1000, 40000) for _ in range(60)])
    params = SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True)
    outs, counts = {}, {}
    for budget in ("default", 0):
        engine = _engine(tiny_models["llama"], "float32")
        native = engine.runner.native
        if budget == 0:
            native.extend_keys = 0
        outs[budget] = [r["output_ids"] for r in engine.generate(input_ids=rows[:1], sampling_params=params)]
        outs[budget] += [r["output_ids"] for r in engine.generate(input_ids=rows[1:], sampling_params=params)]
        counts[budget] = (native.steps, native.prefill_steps)
        engine.scheduler.check()
        engine.shutdown()
    assert outs[0] == outs["default"]
    assert counts["default"][1] > 0 and counts[0][1] == 0  # the prefills: native by default, torch with no budget
    assert counts[0][0] > 0  # decode steps native either way


def test_a_layer_whose_scales_are_not_fp16_values_is_refused_by_the_native_step():
    """GGUF's scales are fp16, and the kernel reads them so: a super-block d that fp16 does not hold exactly
    (no file has one) makes the native step unavailable for the model, with the reason, instead of rounding it."""
    from radixserve.kernels.cpu_quant import FileBlocks
    from radixserve.model.native_decode import pack_q6k

    q = torch.zeros(16, 256, dtype=torch.int8)
    sc = torch.ones(16, 16, dtype=torch.int8)
    pack_q6k(q, FileBlocks("Q6_K", torch.full((16, 1), 0.5), sc))  # an fp16 value: packed
    with pytest.raises(NativeUnavailable, match="not fp16 values"):
        pack_q6k(q, FileBlocks("Q6_K", torch.full((16, 1), 0.1), sc))
