"""kernels/cpu_linear.py: bf16 linears packed for oneDNN where this CPU multiplies bf16 natively; where it does not
(an AVX2-only CPU: oneDNN refuses to reorder a bf16 weight, and the server must still start) left unpacked, with
large products widened to float32 where that is faster here."""
from __future__ import annotations

import pytest
import torch
from torch import nn


def test_packing_happens_only_where_onednn_multiplies_bf16_and_never_changes_a_small_product():
    from radixserve.kernels.cpu_linear import (F32_MIN_ROWS, PackedLinear, WidenedLinear, can_pack,
                                               float32_gemm_pays, pack_linears)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 96), nn.Linear(96, 32, bias=False)).to(torch.bfloat16)
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    big = torch.randn(F32_MIN_ROWS + 3, 64, dtype=torch.bfloat16)
    want, want_big = model(x), model(big)
    supported = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    assert can_pack(torch.bfloat16, torch.device("cpu")) == supported
    widened = not supported and float32_gemm_pays(torch.bfloat16, packed=False)
    done = pack_linears(model)
    kind = PackedLinear if supported else WidenedLinear if widened else nn.Linear
    assert all(type(m) is kind for m in model), (done, [type(m) for m in model])
    assert (done is None) == (kind is nn.Linear)
    assert torch.equal(model(x), want)  # below F32_MIN_ROWS: the bf16 product itself
    # large products: float32 (PackedLinear's copy, or WidenedLinear's cast) or bf16, to bf16's rounding
    torch.testing.assert_close(model(big), want_big, rtol=2e-2, atol=2e-2)
    assert not can_pack(torch.float32, torch.device("cpu"))


@pytest.mark.parametrize("outputs", [80, 2 * 512 + 36])
def test_a_widened_product_is_the_float32_product_of_the_same_weights(outputs):
    """One block of output rows, and several (the weight widened WIDEN_ROWS rows at a time, the last one short)."""
    from radixserve.kernels.cpu_linear import F32_MIN_ROWS, WIDEN_ROWS, WidenedLinear

    assert WIDEN_ROWS == 512
    torch.manual_seed(1)
    layer = nn.Linear(48, outputs).to(torch.bfloat16)
    wide = WidenedLinear(layer)
    x = torch.randn(F32_MIN_ROWS, 48, dtype=torch.bfloat16)
    want = torch.nn.functional.linear(x.float(), layer.weight.float(), layer.bias.float()).to(torch.bfloat16)
    assert torch.equal(wide(x), want)
    assert torch.equal(wide(x[:5]), layer(x[:5]))
    assert wide.weight is layer.weight  # no copy kept
