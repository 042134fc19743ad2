"""kernels/cpu_linear.py: bf16 linears packed for oneDNN where this CPU multiplies bf16 natively, left as they are
where it does not (an AVX2-only CPU: oneDNN refuses to reorder a bf16 weight, and the server must still start)."""
from __future__ import annotations

import torch
from torch import nn


def test_packing_happens_only_where_onednn_multiplies_bf16_and_never_changes_a_product():
    from radixserve.kernels.cpu_linear import PackedLinear, can_pack, pack_linears

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 96), nn.Linear(96, 32, bias=False)).to(torch.bfloat16)
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    want = model(x)
    supported = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    assert can_pack(torch.bfloat16, torch.device("cpu")) == supported
    assert pack_linears(model) == (2 if supported else 0)
    assert all(isinstance(m, PackedLinear) == supported for m in model)
    assert torch.equal(model(x), want)
    assert not can_pack(torch.float32, torch.device("cpu"))
