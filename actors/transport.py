"""ZeroMQ transport and the actor shell.

Every actor has one PULL inbox bound at its own ``ipc://`` address in a private runtime dir and one PUSH outbox
per peer it talks to. Messages are msgspec msgpack, decoded straight into the inbox's union of Structs.
``run_actor`` is each child process's whole life: sockets, the core (slow: e.g. loading a model), a Ready (or
Failed) report to the launcher, the actor's loop until SIGTERM.
"""
from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import signal
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec
import zmq
import zmq.asyncio

from radixserve.actors.messages import Failed, Ready, decoder, encoder

log = logging.getLogger(__name__)

ActorName = str  # "api" | "tokenizer" | "scheduler" | "runner" | "launcher"


@dataclass(frozen=True)
class Endpoints:
    """Every socket address, derived from the runtime dir (no address literals anywhere else)."""

    runtime_dir: str

    def address(self, name: ActorName) -> str:
        return f"ipc://{self.runtime_dir}/{name}.sock"


class Channel:
    """An actor's sockets: its inbox and a PUSH per peer."""

    def __init__(self, endpoints: Endpoints, name: ActorName, inbox_type: Any, peers: tuple[ActorName, ...],
                 ctx: zmq.asyncio.Context | None = None) -> None:
        self.ctx = ctx or zmq.asyncio.Context()
        self.inbox = self.ctx.socket(zmq.PULL)
        self.inbox.setsockopt(zmq.LINGER, 0)
        self.inbox.bind(endpoints.address(name))
        self.outboxes: dict[ActorName, zmq.asyncio.Socket] = {}
        for peer in peers:
            sock = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 1000)  # a last message (Failed) still leaves when we exit
            sock.connect(endpoints.address(peer))
            self.outboxes[peer] = sock
        self._encoder = encoder()
        self._decoder = decoder(inbox_type)

    async def recv(self) -> Any:
        return self._decoder.decode(await self.inbox.recv(copy=False))

    async def recv_ready(self) -> list[Any]:
        """Everything already waiting in the inbox, without blocking."""
        out = []
        while await self.inbox.poll(0):
            out.append(self._decoder.decode(await self.inbox.recv(copy=False)))
        return out

    async def send(self, peer: ActorName, msg: msgspec.Struct) -> None:
        await self.outboxes[peer].send(self._encoder.encode(msg), copy=False)

    def close(self) -> None:
        for sock in (self.inbox, *self.outboxes.values()):
            sock.close()
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


def die_with_parent() -> None:
    """Linux: get SIGTERM if the launcher dies, even by SIGKILL -- no orphaned actors."""
    if sys.platform.startswith("linux"):
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def run_actor(name: ActorName, spec: ActorSpec, inbox_type: Any, peers: tuple[ActorName, ...],
              build: Callable[[ActorSpec, Channel], tuple[Actor, dict[str, Any]]]) -> None:
    """A child process's entry: never returns normally; exits 0 on SIGTERM, 1 on failure."""
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group; the launcher stops us in order
    logging.basicConfig(level=spec.log_level.upper(), format=f"%(asctime)s [{name}] %(name)s: %(message)s")
    import uvloop

    sys.exit(uvloop.run(_actor_main(name, spec, inbox_type, peers, build)))


async def _actor_main(name, spec, inbox_type, peers, build) -> int:
    channel = Channel(spec.endpoints, name, inbox_type, (*peers, "launcher"))
    try:
        actor, info = build(spec, channel)
    except Exception as exc:
        log.error("failed to start: %s", traceback.format_exc())
        await channel.send("launcher", Failed(name, f"{type(exc).__name__}: {exc}"))
        channel.close()
        return 1
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
    return code
