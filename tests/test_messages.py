"""The wire format: array fields are numpy arrays at both ends (dtype kept through the msgpack extension code),
so no consumer parses bytes."""
from __future__ import annotations

import numpy as np
import pytest

from radixserve.wire.codec import array, decoder, encoder
from radixserve.wire.plans import ForwardPlan, RunnerInbox, SamplingBatch


def plan() -> ForwardPlan:
    n = 3
    return ForwardPlan(
        step=7, mode="decode", input_ids=array([5, 6, 7]), prefix_lens=array([10, 20, 30]), extend_lens=array([1] * n),
        rows=array([0, 1, 2]), row_writes=array([10, 20, 30]), new_slots=array([11, 21, 31]),
        sample=array([1, 1, 0], np.uint8),
        sampling=SamplingBatch(temperature=array([0.0, 0.7], np.float32), top_p=array([1.0, 0.9], np.float32),
                               top_k=array([1, 40]), min_p=array([0.0, 0.0], np.float32), seeds=[None, 3],
                               output_index=array([0, 4]), top_logprobs=[None, 2]))


def test_a_plan_arrives_as_typed_arrays():
    got = decoder(RunnerInbox).decode(encoder().encode(plan()))
    want = plan()
    for name in ("input_ids", "prefix_lens", "extend_lens", "rows", "row_writes", "new_slots", "sample"):
        a, b = getattr(got, name), getattr(want, name)
        assert isinstance(a, np.ndarray) and a.dtype == b.dtype and a.tolist() == b.tolist(), name
    assert got.sampling.temperature.dtype == np.float32 and got.sampling.top_p.tolist() == pytest.approx([1.0, 0.9])
    assert got.sampling.output_index.tolist() == [0, 4] and got.batch_size == 3
    got.new_slots[0] = 99  # the receiver owns its arrays (not views of the frame)


def test_an_array_of_a_dtype_the_protocol_does_not_carry_is_refused_when_sent():
    bad = plan()
    bad = ForwardPlan(**{**{f: getattr(bad, f) for f in bad.__struct_fields__}, "rows": np.arange(3)})  # int64
    with pytest.raises(TypeError, match="int64"):
        encoder().encode(bad)
