"""The trace format: one JSON object per line, one request each. Token ids, so a trace is model-agnostic as long
as its ids are below the model's vocabulary size.

    {"id": "g3-r7", "arrival": 1.25, "prompt": [1012, 4096, ...], "max_tokens": 16}
    {"id": "c0-t1", "after": "c0-t0", "delay": 2.0, "prompt": [...], "max_tokens": 32, "output": [...]}

- ``id`` (str, unique), ``prompt`` (token ids), ``max_tokens`` (output length; generation ignores EOS).
- ``arrival`` (seconds from the start, default 0) -- or ``after`` (the id of a request that must finish
  first) plus ``delay`` (seconds after it finished): a chat's next turn, a tree-of-thought branch.
- ``output`` (optional): the answer the trace's later requests quote (a chat turn includes the previous answer).
  The simulator generates exactly these tokens; a live server generates its own, so there the reuse of earlier
  answers is lower than the trace intends.
- ``priority`` (default 0, larger = more important), ``tag`` (free text, e.g. the workload part it came from).
"""
from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import msgspec


class TraceRequest(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    id: str
    prompt: list[int]
    max_tokens: int
    arrival: float = 0.0
    after: str | None = None
    delay: float = 0.0
    output: list[int] | None = None
    priority: int = 0
    tag: str | None = None

    def __post_init__(self) -> None:
        if not self.prompt:
            raise ValueError(f"trace request {self.id!r} has an empty prompt")
        if self.max_tokens < 1:
            raise ValueError(f"trace request {self.id!r}: max_tokens must be >= 1")
        if self.output is not None and len(self.output) != self.max_tokens:
            raise ValueError(f"trace request {self.id!r}: output has {len(self.output)} tokens, max_tokens is "
                             f"{self.max_tokens}")


def validate(trace: list[TraceRequest]) -> list[TraceRequest]:
    ids = set()
    for r in trace:
        if r.id in ids:
            raise ValueError(f"trace request id {r.id!r} appears twice")
        ids.add(r.id)
    for r in trace:
        if r.after is not None and r.after not in ids:
            raise ValueError(f"trace request {r.id!r} comes after {r.after!r}, which is not in the trace")
    return trace


def load(path: str | Path) -> list[TraceRequest]:
    decoder = msgspec.json.Decoder(TraceRequest)
    out = []
    with open(path, "rb") as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    out.append(decoder.decode(line))
                except (msgspec.ValidationError, msgspec.DecodeError, ValueError) as exc:
                    raise ValueError(f"{path}:{n}: {exc}") from None
    return validate(out)


def save(trace: Iterable[TraceRequest], path: str | Path) -> None:
    encoder = msgspec.json.Encoder()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        for r in trace:
            f.write(encoder.encode(r) + b"\n")


def max_token_id(trace: list[TraceRequest]) -> int:
    return max(max(r.prompt) for r in trace)
