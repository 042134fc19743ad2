"""ZeroMQ transport and the actor shell.

Every actor has one PULL inbox bound at its own ``ipc://`` address in a private runtime dir and one PUSH outbox
per peer it talks to -- except the runner ranks, whose inbox subscribes to the scheduler's plans: the scheduler
publishes each step's plan once (``Publisher``) and every rank, on this machine (``ipc://``) or on another node
(``tcp://``), gets it. Messages are msgspec msgpack, decoded straight into the inbox's union of Structs. Plans
carry a sequence number (``PlanSequence``): a rank drops a plan it has already had and ends on a gap rather than
run on without a step's KV writes. Across machines the plans' socket speaks CurveZMQ with the nodes' shared key
(actors/node_auth.py).
``run_actor`` is each child process's whole life: sockets, the core (slow: e.g. loading a model), a Ready (or
Failed) report to the launcher, the actor's loop until SIGTERM.
"""
from __future__ import annotations

import asyncio
import ctypes
import gc
import logging
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec
import zmq
import zmq.asyncio

from radixserve.actors.node_auth import NodeKeys, PeerGuard
from radixserve.wire.codec import decoder, encoder
from radixserve.wire.messages import Failed, Ready

log = logging.getLogger(__name__)

ActorName = str  # "api" | "tokenizer" | "scheduler" | "runner" | "launcher"
PLAN_HWM = 1024  # plans queued per subscriber: the scheduler waits for each step, so a real rank lags by one or two
PLAN_MAX_BYTES = 256 * 2**20  # a larger frame on the plans' link is a broken or hostile peer: libzmq drops it
SUBSCRIPTION_MAX_BYTES = 4096  # what a subscriber may send the publisher: its subscription (and Curve handshake)


@dataclass(frozen=True)
class Endpoints:
    """Every socket address, derived from the runtime dir and, across machines, node 0's ``--dist-init-addr``
    HOST:PORT (no address literals anywhere else): torch.distributed's store at PORT, the plans at PORT+1, the
    nodes' link at PORT+2."""

    runtime_dir: str
    node0: str | None = None  # HOST:PORT when the ranks span machines
    keys: NodeKeys | None = None  # the nodes' Curve keys when the ranks span machines (every plan subscriber's too)

    def address(self, name: ActorName) -> str:
        return f"ipc://{self.runtime_dir}/{name}.sock"

    def _tcp(self, offset: int) -> str:
        host, _, port = self.node0.rpartition(":")
        return f"tcp://{host}:{int(port) + offset}"  # node 0 listens there only, not on every interface

    def plans_bound(self, name: str = "plans") -> list[str]:
        """Where a scheduler publishes plans (``name``: its replica's): its runtime dir, and node 0's PORT+1 when
        ranks are elsewhere."""
        return [self.address(name)] + ([self._tcp(1)] if self.node0 else [])

    def plans_source(self, node_rank: int, name: str = "plans") -> str:
        """Where a rank on ``node_rank`` subscribes to the plans."""
        return self.address(name) if node_rank == 0 else self._tcp(1)

    def node_link(self) -> str:
        return self._tcp(2)


class Channel:
    """An actor's sockets: its inbox and a PUSH per peer."""

    def __init__(self, endpoints: Endpoints, name: ActorName, inbox_type: Any, peers: tuple[ActorName, ...],
                 ctx: zmq.asyncio.Context | None = None, subscribe: str | None = None) -> None:
        """``subscribe``: the inbox is a subscription to the publisher at that address (a runner rank's)."""
        self.ctx = ctx or zmq.asyncio.Context()
        if subscribe is None:
            self.inbox = self.ctx.socket(zmq.PULL)
            self.inbox.bind(endpoints.address(name))
        else:
            self.inbox = self.ctx.socket(zmq.SUB)
            self.inbox.setsockopt(zmq.RCVHWM, PLAN_HWM)  # a plan dropped past it is caught by its sequence number
            self.inbox.setsockopt(zmq.MAXMSGSIZE, PLAN_MAX_BYTES)
            self.inbox.setsockopt(zmq.SUBSCRIBE, b"")
            if endpoints.keys is not None:
                endpoints.keys.connect(self.inbox)
            self.inbox.connect(subscribe)
        self.inbox.setsockopt(zmq.LINGER, 0)
        self.outboxes: dict[ActorName, zmq.asyncio.Socket] = {}
        for peer in peers:
            sock = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 1000)  # a last message (Failed) still leaves when we exit
            sock.connect(endpoints.address(peer))
            self.outboxes[peer] = sock
        self._encoder = encoder()
        self._decoder = decoder(inbox_type)
        self.plans = PlanSequence() if subscribe is not None else None

    async def recv(self) -> Any:
        if self.plans is None:
            return self._decoder.decode(await self.inbox.recv(copy=False))
        while True:  # plans: [sequence number, plan]
            frames = await self.inbox.recv_multipart(copy=False)
            if self.plans.accept(frames):
                return self._decoder.decode(frames[1])

    async def recv_ready(self) -> list[Any]:
        """Everything already waiting in the inbox, without blocking."""
        out = []
        while await self.inbox.poll(0):
            out.append(await self.recv())
        return out

    async def send(self, peer: ActorName, msg: msgspec.Struct) -> None:
        await self.outboxes[peer].send(self._encoder.encode(msg), copy=False)

    async def try_send(self, peer: ActorName, msg: msgspec.Struct) -> bool:
        """Send unless ``peer``'s queue is full (its high-water mark): False then, and nothing was sent."""
        try:
            await self.outboxes[peer].send(self._encoder.encode(msg), copy=False, flags=zmq.NOBLOCK)
        except zmq.Again:
            return False
        return True

    def close(self) -> None:
        for sock in (self.inbox, *self.outboxes.values()):
            sock.close()
        self.ctx.term()


class PlanLost(RuntimeError):
    """A plan never reached this rank: its KV cache no longer matches the scheduler's."""


class PlanSequence:
    """A rank's check of the plans' sequence numbers (1, 2, ...: ``Publisher`` numbers them): the next one is run,
    one already seen (a replay) is dropped and counted, a gap raises PlanLost -- the rank ends, and with it the
    server, rather than run later steps without one step's KV writes. A malformed message raises PlanLost too."""

    def __init__(self) -> None:
        self.expected = 1
        self.replayed = 0

    def accept(self, frames: list) -> bool:
        """True: run this plan (``frames``: [8-byte big-endian sequence number, plan])."""
        if len(frames) != 2 or len(frames[0]) != 8:
            raise PlanLost(f"a plan message of {len(frames)} frame(s) is not [sequence number, plan]")
        seq = int.from_bytes(frames[0].bytes, "big")
        if seq == self.expected:
            self.expected += 1
            return True
        if seq < self.expected:
            self.replayed += 1
            log.warning("dropped plan %d: already run (%d replayed plans dropped)", seq, self.replayed)
            return False
        raise PlanLost(f"plan {seq} arrived after plan {self.expected - 1}: {seq - self.expected} plan(s) never "
                       "reached this rank, so its KV cache no longer matches the scheduler's; ending")


class Publisher:
    """One message to every subscriber (the scheduler's plans to all runner ranks: one send per step, however
    many ranks), numbered for PlanSequence. ``wait_for(n)`` before the first send: a subscription made before it
    is never missed. ``keys``: the socket speaks CurveZMQ, and only holders of the nodes' key subscribe."""

    def __init__(self, addresses: list[str], keys: NodeKeys | None = None) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.XPUB)
        self.sock.setsockopt(zmq.XPUB_VERBOSE, 1)  # every subscriber's subscription, not only the first
        self.sock.setsockopt(zmq.SNDHWM, PLAN_HWM)
        self.sock.setsockopt(zmq.MAXMSGSIZE, SUBSCRIPTION_MAX_BYTES)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.guard = PeerGuard(self.ctx, keys, "the plans' port") if keys is not None else None
        if keys is not None:
            keys.serve(self.sock)
            self.guard.watch(self.sock)
        for address in addresses:
            self.sock.bind(address)
        self.subscribers = 0
        self.sent = 0
        self._encoder = encoder()

    def wait_for(self, n: int, timeout_s: float) -> None:
        """Until ``n`` subscribers have joined; RuntimeError after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while self.subscribers < n:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError(f"only {self.subscribers} of {n} runner ranks subscribed to the plans in "
                                   f"{timeout_s:.0f}s")
            if self.sock.poll(min(left, 0.1) * 1000):
                self.subscribers += self.sock.recv()[:1] == b"\x01"
            if self.guard is not None:
                self.guard.drain()

    def send(self, msg: msgspec.Struct) -> None:
        self.sent += 1
        self.sock.send_multipart([self.sent.to_bytes(8, "big"), self._encoder.encode(msg)], copy=False)
        if self.guard is not None:
            self.guard.drain()

    def close(self) -> None:
        if self.guard is not None:
            self.guard.close()
        self.sock.close()
        self.ctx.term()


class Actor(Protocol):
    async def run(self) -> None: ...


@dataclass(frozen=True)
class ActorSpec:
    """What a child process needs; pickled to it by multiprocessing (spawn)."""

    endpoints: Endpoints
    server_args: Any  # ServerArgs, resolved
    model_dir: str  # a HF-format folder
    scheduler_config: Any  # SchedulerConfig
    log_level: str = "info"
    model_source: str | None = None  # the file or folder the user gave (a GGUF file's own quantized weights)
    tokenizer_dir: str | None = None  # the tokenizer's HF folder (--tokenizer-path); None: model_dir
    dist_addr: str | None = None  # HOST:PORT where the tensor-parallel ranks meet (torch.distributed's store)
    replica: int | None = None  # with --dp > 1: the data-parallel replica this actor belongs to

    def named(self, base: ActorName) -> ActorName:
        return replica_name(base, self.replica)


def replica_name(base: ActorName, replica: int | None) -> ActorName:
    """A data-parallel replica's own actor (or socket) name, ``scheduler.1``; the plain name without --dp."""
    return base if replica is None else f"{base}.{replica}"


def die_with_parent() -> None:
    """Linux: get SIGTERM if the launcher dies, even by SIGKILL -- no orphaned actors."""
    if sys.platform.startswith("linux"):
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def run_actor(name: ActorName, spec: ActorSpec, inbox_type: Any, peers: tuple[ActorName, ...],
              build: Callable[[ActorSpec, Channel], tuple[Actor, dict[str, Any]]],
              subscribe: str | None = None) -> None:
    """A child process's entry: never returns normally; exits 0 on SIGTERM, 1 on failure. ``subscribe``: the
    inbox subscribes to that publisher instead of being bound at the actor's own address."""
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group; the launcher stops us in order
    logging.basicConfig(level=spec.log_level.upper(), format=f"%(asctime)s [{name}] %(name)s: %(message)s")
    import uvloop

    sys.exit(uvloop.run(_actor_main(name, spec, inbox_type, peers, build, subscribe)))


async def _actor_main(name, spec, inbox_type, peers, build, subscribe) -> int:
    channel = Channel(spec.endpoints, name, inbox_type, (*peers, "launcher"), subscribe=subscribe)
    try:
        actor, info = build(spec, channel)
    except Exception as exc:
        log.error("failed to start: %s", traceback.format_exc())
        await channel.send("launcher", Failed(name, f"{type(exc).__name__}: {exc}"))
        channel.close()
        return 1
    # what start-up made (the model, its tokenizer, the imports: with the bundled model ~380,000 objects) lives as
    # long as the actor: out of the collector's sight, a full collection no longer stops a step to walk it (in one
    # process with the bundled model: 85-130 ms each, two in a pass of 32 requests)
    gc.collect()
    gc.freeze()
    await channel.send("launcher", Ready(name, os.getpid(), info))
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    work = asyncio.create_task(actor.run())
    stopper = asyncio.create_task(stop.wait())
    await asyncio.wait([work, stopper], return_when=asyncio.FIRST_COMPLETED)
    code = 0
    if work.done() and work.exception() is not None:
        exc = work.exception()
        log.error("crashed: %s", "".join(traceback.format_exception(exc)))
        code = 1
    work.cancel()
    stopper.cancel()
    channel.close()
    gc.unfreeze()  # back in sight, so that exiting collects them (nanobind otherwise reports triton's as leaked)
    return code
