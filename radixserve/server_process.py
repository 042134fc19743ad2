"""Run ``radixserve serve`` in a subprocess on a free port and wait until it is healthy (tests, benchmarks,
scripts)::

    server = ServerProcess("--max-total-tokens", "8192")
    ...  # server.url
    server.stop()
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request


class ServerProcess:
    """`radixserve serve` in a subprocess on a free port; its output goes to an unnamed temporary file (``output()``,
    kept after ``stop()``, removed with the object)."""

    def __init__(self, *args: str, env: dict | None = None, timeout: float = 180.0, command: str = "serve") -> None:
        """``command``: the radixserve subcommand (``router`` too: it has a /health as well)."""
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.TemporaryFile("w+")  # unnamed: gone with this object, read through output()
        self.proc = subprocess.Popen([sys.executable, "-m", "radixserve", command, "--port", str(self.port), *args],
                                     stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.output()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=1) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"server did not become healthy:\n{self.output()}")

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def stop(self) -> int:
        """SIGTERM (SIGKILL after 30 s); returns the exit code."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode
