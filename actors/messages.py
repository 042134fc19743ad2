"""The whole inter-actor protocol: every message is a msgspec Struct, grouped by direction.

Token and slot arrays travel as raw little-endian bytes (``int32`` unless noted) -- compact and copy-cheap --
viewed back as numpy arrays with ``array``. One message per hop per step carries the whole batch.
"""
from __future__ import annotations

from typing import Literal

import msgspec
import numpy as np


def array(buf: bytes, dtype: type = np.int32) -> np.ndarray:
    """A read-only numpy view of an array field."""
    return np.frombuffer(buf, dtype=dtype)


# -- scheduler -> runner ------------------------------------------------------------------------------------
class ForwardPlan(msgspec.Struct, tag="forward", frozen=True):
    """One model step over a ragged batch. Per request i (B requests), in batch order:

    ``prefix_lens[i]`` tokens are already in the pool, ``extend_lens[i]`` new tokens are computed now, and
    ``slots`` holds the request's whole row -- prefix_lens[i] + extend_lens[i] slot indices, concatenated over
    requests. The new tokens' K/V go to the last extend_lens[i] slots of that row.
    """

    step: int
    mode: Literal["extend", "decode"]  # decode: every extend_len is 1
    input_ids: bytes  # [sum(extend_lens)] the new tokens
    prefix_lens: bytes  # [B]
    extend_lens: bytes  # [B]
    slots: bytes  # [sum(prefix_lens + extend_lens)]
    sample: bytes  # uint8 [B]: 1 = sample a next token (0 = a prefill chunk that is not the last)
    temperature: bytes  # float32 [B]
    top_p: bytes  # float32 [B]
    top_k: bytes  # int32 [B], -1 = no limit
    min_p: bytes  # float32 [B]
    seed: bytes  # int64 [B], -1 = unseeded
    sample_index: bytes  # int32 [B]: index of the token being sampled in the request's output (seeded noise)
    all_greedy: bool = False

    @property
    def batch_size(self) -> int:
        return len(self.prefix_lens) // 4


# -- runner -> scheduler ------------------------------------------------------------------------------------
class ForwardResult(msgspec.Struct, tag="result", frozen=True):
    step: int
    next_ids: bytes  # int32 [B]; -1 where the plan did not sample
