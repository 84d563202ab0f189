"""Start and stop a `specstep serve` process (for sweeps across server settings, and for tests)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from specstep.scheduler.launch import module_command

_LISTENING = re.compile(r"serve: listening on (\S+)")
_HTTP_LISTENING = re.compile(r"HTTP listening on (\S+)")


class ServerProcess:
    """`specstep serve ARGS --address tcp://127.0.0.1:0`; `start()` returns the bound address once ready. The HTTP
    API is off unless `http` (then on a free port: `http_url`), so servers started side by side never collide."""

    def __init__(self, args: list[str], host: str = "127.0.0.1", log_path: str | Path | None = None,
                 cwd: str | Path | None = None, env: dict[str, str] | None = None,
                 launcher: list[str] | None = None, http: bool = False) -> None:
        self.args = list(args)
        self.http = http
        self.http_url: str | None = None
        self.cwd = cwd  # where it runs: nothing there can shadow the installed code (see scheduler/launch.py)
        self.extra_env = dict(env or {})
        # What runs `specstep` (an installed console script, say); by default this interpreter, cwd-proof.
        self.launcher = list(launcher) if launcher else module_command("specstep.scheduler.cli")
        self.host = host
        # A log of our own (no `log_path`) is removed when the server stops cleanly, kept when it did not.
        self._own_log = log_path is None
        self.log_path = Path(log_path) if log_path else Path(tempfile.mkstemp(prefix="specstep-serve-",
                                                                              suffix=".log")[1])
        self.proc: subprocess.Popen | None = None
        self.address: str | None = None

    def start(self, timeout_s: float = 300.0) -> str:
        if self.proc is not None and self.proc.poll() is None and self.address is not None:
            return self.address  # already running (e.g. started by `with`): never start a second server
        env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", PYTHONUNBUFFERED="1", **self.extra_env)
        http = [] if "--http-port" in self.args else ["--http-port", "0" if self.http else "-1"]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [*self.launcher, "serve", "--address", f"tcp://{self.host}:0", *http, *self.args],
                stdout=log, stderr=subprocess.STDOUT, env=env, cwd=self.cwd)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            text = self.log()
            if self.address is None and (m := _LISTENING.search(text)):
                self.address = m.group(1)
            if self.http_url is None and (m := _HTTP_LISTENING.search(text)):
                self.http_url = m.group(1)
            if self.address is not None and "specstep serve: ready" in text:
                return self.address
            if self.proc.poll() is not None:
                raise RuntimeError(f"specstep serve exited with code {self.proc.returncode}:\n{self.log()[-4000:]}")
            time.sleep(0.05)
        self.stop()
        raise TimeoutError(f"specstep serve not ready within {timeout_s:g}s:\n{self.log()[-4000:]}")

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def signal(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)

    def wait(self, timeout_s: float) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout_s)

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """SIGTERM (drain), then SIGKILL after `timeout_s`. Returns the exit code."""
        if self.proc is None:
            return None
        self.signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        if code == 0 and self._own_log:
            self.log_path.unlink(missing_ok=True)
        return code

    def __enter__(self) -> ServerProcess:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
