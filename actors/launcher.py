"""Launcher and supervisor: resolve the model and config once, spawn the actors, wait until each reports ready,
watch them, and take everything down (children first, then the runtime dir) on a signal or a death.

Node 0 runs the tokenizer, the scheduler and its share of the runner ranks (the api is the launching process
itself); another node of a multi-node server (``--node-rank`` k > 0) runs only its ranks, and its launcher and
node 0's watch each other over a NodeLink (actors/nodes.py). ``core=False``: the ranks only (an Engine with
``tp`` > 1 is their scheduler).
"""
from __future__ import annotations

import dataclasses
import importlib
import logging
import multiprocessing as mp
import shutil
import socket
import tempfile
import time
from pathlib import Path

import zmq

from radixserve.actors.node_auth import node_keys
from radixserve.actors.nodes import NodeLink
from radixserve.actors.runner_actor import rank_name
from radixserve.actors.transport import ActorSpec, Endpoints, replica_name
from radixserve.prepare import Prepared
from radixserve.wire.codec import decoder as inbox_decoder
from radixserve.wire.messages import Failed, LauncherInbox, Ready

log = logging.getLogger(__name__)

# actor name -> module whose main(spec) runs it (imported only in that child: the scheduler never loads torch)
ACTOR_MODULES = {
    "tokenizer": "radixserve.actors.tokenizer_actor",
    "scheduler": "radixserve.actors.scheduler.actor",
    "runner": "radixserve.actors.runner_actor",
    "shadow": "radixserve.lab.shadow_actor",
}
OPTIONAL_ACTORS = {"shadow"}  # actors the server can serve without (their death is logged, not fatal)
READY_TIMEOUT_S = 600.0
NODE_SILENCE_S = 10.0  # a node not heard from for this long (or --dist-timeout, if shorter) is taken for dead


class LaunchError(RuntimeError):
    pass


def _child(kind: str, spec: ActorSpec, rank: int | None) -> None:
    module = importlib.import_module(ACTOR_MODULES[kind])
    module.main(spec) if rank is None else module.main(spec, rank)


def dist_key_path(args) -> Path:
    """Where the nodes' shared key is (--dist-auth-key-file, else in radixserve's cache folder)."""
    from radixserve.trusted_cache import cache_root

    return Path(args.dist_auth_key_file) if args.dist_auth_key_file else cache_root() / "dist-auth.key"


def free_local_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Launcher:
    def __init__(self, prepared: Prepared, core: bool = True) -> None:
        self.prepared = prepared
        args = prepared.args
        self.runtime_dir = tempfile.mkdtemp(prefix="radixserve-")
        keys = node_keys(dist_key_path(args), create=args.node_rank == 0) if args.nnodes > 1 else None
        self.endpoints = Endpoints(self.runtime_dir, args.dist_init_addr if args.nnodes > 1 else None, keys)
        # name -> (kind, tensor-parallel rank, data-parallel replica) of every actor this launcher starts
        self.children: dict[str, tuple[str, int | None, int | None]] = {}
        core = core and args.node_rank == 0
        if core:
            self.children["tokenizer"] = ("tokenizer", None, None)
        if core and args.shadow_policies:
            self.children["shadow"] = ("shadow", None, None)
        replicas = [None] if args.dp == 1 else list(range(args.dp))
        for replica in replicas:
            if core:
                self.children[replica_name("scheduler", replica)] = ("scheduler", None, replica)
            for r in args.ranks_here:
                self.children[replica_name(rank_name(r), replica)] = ("runner", r, replica)
        self.ranks = {name: r for name, (kind, r, _) in self.children.items() if kind == "runner"}
        # a replica's ranks meet at node 0's --dist-init-addr, or, all on this machine, at a free local port
        # (--dp replicas are all on this machine: each its own local port, whatever --dist-init-addr says)
        self.dist_addrs = {replica: (args.dist_init_addr if args.dp == 1 else None)
                           or (f"127.0.0.1:{free_local_port()}" if args.tp > 1 else None) for replica in replicas}
        self.link = (NodeLink(self.endpoints.node_link(), args.node_rank, args.nnodes,
                              min(args.dist_timeout, NODE_SILENCE_S), keys, args.dist_timeout)
                     if keys is not None else None)
        self.processes: dict[str, mp.process.BaseProcess] = {}
        self.lost: set[str] = set()  # optional actors that have died
        self.info: dict[str, dict] = {}

    def start(self) -> None:
        """Spawn every actor and wait for all to be ready (and, across nodes, every node's); LaunchError names
        the one that was not."""
        p = self.prepared
        spec = ActorSpec(self.endpoints, p.args, str(p.files.path), p.scheduler_config, p.args.log_level,
                         str(p.files.source), str(p.tokenizer_dir))
        ctx = zmq.Context()
        inbox = ctx.socket(zmq.PULL)
        inbox.setsockopt(zmq.LINGER, 0)
        inbox.bind(self.endpoints.address("launcher"))
        decoder = inbox_decoder(LauncherInbox)
        spawn = mp.get_context("spawn")
        try:
            for name, (kind, rank, replica) in self.children.items():
                own = dataclasses.replace(spec, replica=replica, dist_addr=self.dist_addrs.get(replica))
                proc = spawn.Process(target=_child, args=(kind, own, rank), name=f"radixserve-{name}")
                proc.start()
                self.processes[name] = proc
            waiting = set(self.processes)
            deadline = time.monotonic() + READY_TIMEOUT_S
            told = False  # another node: node 0 has been told that this node's ranks are ready
            while waiting or (self.link is not None and self.link.node == 0 and not self.link.all_ready()):
                if inbox.poll(200):
                    msg = decoder.decode(inbox.recv())
                    if isinstance(msg, Failed):
                        raise LaunchError(f"the {msg.name} actor failed to start: {msg.message}")
                    assert isinstance(msg, Ready)
                    self.info[msg.name] = {"pid": msg.pid, **msg.info}
                    waiting.discard(msg.name)
                    log.info("%s ready (pid %d)", msg.name, msg.pid)
                for name in waiting:
                    code = self.processes[name].exitcode
                    if code is not None:
                        raise LaunchError(f"the {name} actor exited with code {code} before it was ready "
                                          "(its log is above)")
                if self.link is not None:
                    if self.link.poll():
                        raise LaunchError(f"the server could not start: {self.link.down}")
                    if not waiting and self.link.node != 0 and not told:
                        self.link.say_ready(self.info, self.settings())
                        told = True
                    differ = self.link.disagreement(self.settings()) if self.link.node == 0 else None
                    if differ:
                        raise LaunchError(differ)
                if time.monotonic() > deadline:
                    missing = list(waiting) or [f"node {n}" for n in range(1, p.args.nnodes)
                                                if n not in self.link.ready]
                    raise LaunchError(f"timed out after {READY_TIMEOUT_S:.0f}s waiting for: {', '.join(missing)}")
        except BaseException as exc:
            self.shutdown(f"{type(exc).__name__}: {exc}")
            raise
        finally:
            inbox.close()
            ctx.term()

    def settings(self) -> dict:
        """What every node of a multi-node server must have been started with alike."""
        a, m = self.prepared.args, self.prepared.model
        return {"tp": a.tp, "nnodes": a.nnodes, "dtype": a.dtype, "dist_backend": a.dist_backend,
                "model_type": m.model_type, "layers": m.num_layers, "hidden_size": m.hidden_size,
                "heads": m.num_heads, "kv_heads": m.num_kv_heads, "vocab_size": m.vocab_size,
                "intermediate_size": m.intermediate_size}

    def dead(self) -> list[tuple[str, int]]:
        """(name, exit code) of every actor that is no longer running and that serving needs: the shadow only
        watches, so its death is logged (once) and the server goes on without it."""
        out = []
        for name, proc in self.processes.items():
            if proc.exitcode is None:
                continue
            if name in OPTIONAL_ACTORS:
                if name not in self.lost:
                    self.lost.add(name)
                    log.error("the %s actor exited with code %d; serving goes on without it", name, proc.exitcode)
                continue
            out.append((name, proc.exitcode))
        return out

    def failure(self) -> str | None:
        """Why the server must end (an actor here died, another node ended or fell silent), or None."""
        dead = self.dead()
        if dead:
            return "; ".join(f"the {name} actor exited with code {code}" for name, code in dead)
        return self.link.poll() if self.link is not None else None

    def ranks_by_node(self) -> dict[int, list[dict]]:
        """Every runner rank's Ready info (rank, pid, ...), by node."""
        actors = dict(self.info)
        for infos in (self.link.ready.values() if self.link is not None else ()):
            actors.update(infos)
        nodes: dict[int, list[dict]] = {}
        for info in sorted((a for a in actors.values() if "rank" in a), key=lambda a: (a["replica"], a["rank"])):
            nodes.setdefault(info["node"], []).append(info)
        return nodes

    def pids(self) -> dict[str, int]:
        return {n: p.pid for n, p in self.processes.items()}

    def shutdown(self, reason: str = "stopped", timeout: float = 5.0) -> None:
        """SIGTERM every actor, SIGKILL what is still alive after ``timeout``, remove the runtime dir; the other
        nodes are told (``reason``) and end too."""
        if self.link is not None:
            self.link.say_down(reason)
        for proc in self.processes.values():
            if proc.exitcode is None:
                proc.terminate()
        deadline = time.monotonic() + timeout
        for proc in self.processes.values():
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.exitcode is None:
                proc.kill()
                proc.join(1.0)
        if self.link is not None:
            self.link.close()
            self.link = None
        shutil.rmtree(self.runtime_dir, ignore_errors=True)
