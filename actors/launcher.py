"""Launcher and supervisor: resolve the model and config once, spawn the actors, wait until each reports ready,
watch them, and take everything down (children first, then the runtime dir) on a signal or a death."""
from __future__ import annotations

import importlib
import logging
import multiprocessing as mp
import shutil
import tempfile
import time

import zmq

from radixserve.actors.messages import Failed, LauncherInbox, Ready, decoder as inbox_decoder
from radixserve.actors.transport import ActorSpec, Endpoints
from radixserve.prepare import Prepared

log = logging.getLogger(__name__)

# actor name -> module whose main(spec) runs it (imported only in that child: the scheduler never loads torch)
ACTOR_MODULES = {
    "tokenizer": "radixserve.actors.tokenizer_actor",
    "scheduler": "radixserve.actors.scheduler.actor",
    "runner": "radixserve.actors.runner_actor",
}
READY_TIMEOUT_S = 600.0


class LaunchError(RuntimeError):
    pass


def _child(name: str, spec: ActorSpec) -> None:
    importlib.import_module(ACTOR_MODULES[name]).main(spec)


class Launcher:
    def __init__(self, prepared: Prepared) -> None:
        self.prepared = prepared
        self.runtime_dir = tempfile.mkdtemp(prefix="radixserve-")
        self.endpoints = Endpoints(self.runtime_dir)
        self.processes: dict[str, mp.process.BaseProcess] = {}
        self.info: dict[str, dict] = {}

    def start(self) -> None:
        """Spawn every actor and wait for all to be ready; LaunchError names the one that was not."""
        p = self.prepared
        spec = ActorSpec(self.endpoints, p.args, str(p.files.path), p.scheduler_config, p.args.log_level,
                         str(p.files.source))
        ctx = zmq.Context()
        inbox = ctx.socket(zmq.PULL)
        inbox.setsockopt(zmq.LINGER, 0)
        inbox.bind(self.endpoints.address("launcher"))
        decoder = inbox_decoder(LauncherInbox)
        spawn = mp.get_context("spawn")
        try:
            for name in ACTOR_MODULES:
                proc = spawn.Process(target=_child, args=(name, spec), name=f"radixserve-{name}")
                proc.start()
                self.processes[name] = proc
            waiting = set(self.processes)
            deadline = time.monotonic() + READY_TIMEOUT_S
            while waiting:
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
                if time.monotonic() > deadline:
                    raise LaunchError(f"timed out after {READY_TIMEOUT_S:.0f}s waiting for: {', '.join(waiting)}")
        except BaseException:
            self.shutdown()
            raise
        finally:
            inbox.close()
            ctx.term()

    def dead(self) -> list[tuple[str, int]]:
        """(name, exit code) of every actor that is no longer running."""
        return [(n, p.exitcode) for n, p in self.processes.items() if p.exitcode is not None]

    def pids(self) -> dict[str, int]:
        return {n: p.pid for n, p in self.processes.items()}

    def shutdown(self, timeout: float = 5.0) -> None:
        """SIGTERM every actor, SIGKILL what is still alive after ``timeout``, remove the runtime dir."""
        for proc in self.processes.values():
            if proc.exitcode is None:
                proc.terminate()
        deadline = time.monotonic() + timeout
        for proc in self.processes.values():
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.exitcode is None:
                proc.kill()
                proc.join(1.0)
        shutil.rmtree(self.runtime_dir, ignore_errors=True)
