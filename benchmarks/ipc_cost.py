"""Per-hop IPC cost of the actor transport: msgspec encode + ZMQ PUSH/PULL over ipc:// + decode, for the real
messages of a step. A child process echoes every message back (decoding and re-encoding it); one hop is half
the measured round trip.

    python benchmarks/ipc_cost.py [--iters 2000]
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import tempfile
import time

import msgspec
import numpy as np
import zmq

from radixserve.wire.codec import array, decoder, encoder
from radixserve.wire.messages import AbortReq, Delta, TextBatch, TokenBatch
from radixserve.wire.plans import ForwardPlan, ForwardResult, SamplingBatch

Any = ForwardPlan | ForwardResult | TokenBatch | TextBatch | AbortReq


def samples(batch: int, context: int) -> dict[str, msgspec.Struct]:
    col = lambda v, dt=np.int32: array(np.full(batch, v), dt)  # noqa: E731
    return {
        "AbortReq (tiny)": AbortReq("chatcmpl-0123456789abcdef-0"),
        f"ForwardPlan decode, batch {batch}, {context}-token rows": ForwardPlan(
            step=1, mode="decode", input_ids=col(5), prefix_lens=col(context - 1), extend_lens=col(1),
            rows=array(np.arange(batch)), row_writes=col(context - 1), new_slots=array(np.arange(batch)),
            sample=col(1, np.uint8),
            sampling=SamplingBatch(temperature=col(0, np.float32), top_p=col(1, np.float32), top_k=col(49152),
                                   min_p=col(0, np.float32), seeds=[None] * batch, output_index=col(3),
                                   top_logprobs=[None] * batch, all_greedy=True)),
        f"ForwardResult, batch {batch}": ForwardResult(1, [7] * batch),
        f"TokenBatch, batch {batch}": TokenBatch([f"chatcmpl-{i:032x}-0" for i in range(batch)], col(7), col(100),
                                                 col(50), {}),
        f"TextBatch, batch {batch}": TextBatch([Delta(f"chatcmpl-{i:032x}-0", " word", [7], 100, 3, 50)
                                                for i in range(batch)]),
    }


def echo(addr_in: str, addr_out: str) -> None:
    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    pull.bind(addr_in)
    push.connect(addr_out)
    dec, enc = decoder(Any), encoder()
    while True:
        msg = dec.decode(pull.recv(copy=False))
        if isinstance(msg, AbortReq) and msg.rid == "stop":
            return
        push.send(enc.encode(msg), copy=False)


class Echo:
    """A child process that echoes messages back; ``hop(msg)`` is half the median round trip, in seconds."""

    def __enter__(self) -> Echo:
        d = tempfile.mkdtemp()
        a_in, a_out = f"ipc://{d}/echo-in", f"ipc://{d}/echo-out"
        self.child = mp.get_context("spawn").Process(target=echo, args=(a_in, a_out))
        self.child.start()
        self.ctx = zmq.Context()
        self.push, self.pull = self.ctx.socket(zmq.PUSH), self.ctx.socket(zmq.PULL)
        self.pull.bind(a_out)
        self.push.connect(a_in)
        self.enc, self.dec = encoder(), decoder(Any)
        return self

    def hop(self, msg: msgspec.Struct, iters: int = 500) -> float:
        times = []
        for _ in range(iters):
            t = time.perf_counter()
            self.push.send(self.enc.encode(msg), copy=False)
            self.dec.decode(self.pull.recv(copy=False))
            times.append(time.perf_counter() - t)
        return statistics.median(times) / 2

    def __exit__(self, *exc: object) -> None:
        self.push.send(self.enc.encode(AbortReq("stop")))
        self.child.join(5)
        self.push.close(0)
        self.pull.close(0)
        self.ctx.term()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=2048)
    args = ap.parse_args()
    enc = encoder()
    print(f"{'message':52} {'bytes':>9} {'one hop (us)':>13}")
    with Echo() as e:
        for name, msg in samples(args.batch, args.context).items():
            print(f"{name:52} {len(enc.encode(msg)):>9} {e.hop(msg, args.iters) * 1e6:>13.1f}")


if __name__ == "__main__":
    main()
