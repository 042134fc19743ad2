"""One layer's decode attention through the native kernel, 32 rows in G groups (default 1), each group's rows
sharing its own 860-slot prefix (+ 1..39 own slots each, slots scattered over the pool, the groups' rows
interleaved), SmolLM2's heads (9 over 3 of 64), bf16 and float32: the shared-prefix path (Step.groups: each
prefix scored once for its group, AMX tiles where granted, else vector registers) against every row on its own
(no groups), best of 5 rounds of 20 calls, and the largest difference between their outputs.

    python benchmarks/shared_attention.py [groups] [heads]
"""
import ctypes, sys, time, torch
from radixserve.kernels import cpu_native
lib = cpu_native.load(cpu_native.default_cache_dir())
print("isa", cpu_native.isa(lib))
n_groups = int(sys.argv[1]) if len(sys.argv) > 1 else 1
heads, kv_heads, hd, rows, prefix = int(sys.argv[2]) if len(sys.argv) > 2 else 9, 3, 64, 32, 860
member = [m % n_groups for m in range(rows)]  # row m in group m mod G
for dtype in (torch.bfloat16, torch.float32):
    g = torch.Generator().manual_seed(0)
    own = [int(x) for x in torch.randint(1, 40, (rows,), generator=g)]
    total = sum(own) + n_groups * prefix + 1
    k_pool = torch.randn(total + 1, kv_heads, hd, generator=g).to(dtype)
    v_pool = torch.randn(total + 1, kv_heads, hd, generator=g).to(dtype)
    order = torch.randperm(total, generator=g) + 1
    rws, at = [], n_groups * prefix
    for n, grp in zip(own, member):
        rws.append(torch.cat([order[grp * prefix: (grp + 1) * prefix], order[at: at + n]])); at += n
    lens = [len(r) for r in rws]
    slots = torch.cat(rws).to(torch.int64); lengths = torch.tensor(lens); starts = lengths.cumsum(0) - lengths
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * hd, generator=g).to(dtype)
    layers = (cpu_native.Layer * 1)(cpu_native.Layer(k_pool=k_pool.data_ptr(), v_pool=v_pool.data_ptr()))
    model = cpu_native.Model(bf16=int(dtype == torch.bfloat16), layers=1, hidden=heads * hd, heads=heads,
                             kv_heads=kv_heads, head_dim=hd, inter=32, vocab=16, eps=1e-6, scale=hd**-0.5, layer=layers)
    model.amx = lib.rs_request_amx()
    outs = {}
    for name, grouped in (("per row", False), ("shared", True)):
        members = [[m for m in range(rows) if member[m] == i] for i in range(n_groups)] if grouped else []
        groups = cpu_native.PrefixGroups(rows, members, [prefix] * len(members))
        need = lib.rs_scratch_bytes(ctypes.byref(model), rows, len(groups), groups.slots())
        scratch = torch.empty(need, dtype=torch.uint8)
        step = cpu_native.Step(rows=rows, **groups.fields(), slots=slots.data_ptr(), starts=starts.data_ptr(),
                               lens=lengths.data_ptr(), scratch=scratch.data_ptr(), scratch_bytes=need)
        out = torch.empty(rows, heads * hd, dtype=dtype)
        run = lambda: lib.rs_attention(ctypes.byref(model), 0, ctypes.byref(step), qkv.data_ptr(), out.data_ptr())
        if run() != 0:
            raise RuntimeError("the attention refused its scratch")
        best = 1e9
        for _ in range(5):
            t = time.perf_counter()
            for _ in range(20): run()
            best = min(best, (time.perf_counter() - t) / 20)
        outs[name] = (best, out.clone())
        print(f"{dtype} {n_groups} group(s) {name:8s} {best*1e3:.3f} ms per layer", flush=True)
    print(f"  speedup {outs['per row'][0] / outs['shared'][0]:.2f}x, max diff {(outs['per row'][1].float() - outs['shared'][1].float()).abs().max():.2e}")
