"""The installed code is what runs, wherever `specstep serve` is started, and a `kill -9` leaves no socket
folders behind.

The server is started through the installed `specstep` console script from a directory holding decoy
`scheduler/`, `engine/` and `specstep/` packages that leave a marker file when imported: none may be imported,
by the server or by the scheduler process it starts (before the fix, that child ran `python -m
scheduler.scheduler_process`, and the current directory came first on its `sys.path`)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from specstep.loadgen.client import Client
from specstep.loadgen.server import ServerProcess
from specstep.scheduler.protocol import GenerateRequest
from specstep.scheduler.sockets import ipc_address, pid_alive, remove_stale_ipc

CONSOLE_SCRIPT = Path(sys.executable).parent / "specstep"
DECOYS = ["scheduler", "engine", "specstep", "specstep/scheduler", "specstep/engine"]


def plant_decoys(root: Path) -> None:
    for pkg in DECOYS:
        folder = root / pkg
        folder.mkdir(parents=True, exist_ok=True)
        marker = f"(__import__('pathlib').Path({str(root)!r}) / 'imported-{pkg.replace('/', '.')}').touch()\n"
        (folder / "__init__.py").write_text(marker)
        for mod in ("scheduler_process", "cli", "serve_cmd"):
            (folder / f"{mod}.py").write_text(marker)


def socket_folders(tmp: Path) -> list[Path]:
    return sorted(tmp.glob("specstep-*"))


@pytest.mark.skipif(not CONSOLE_SCRIPT.exists(), reason="specstep is not installed in this environment")
async def test_serve_from_a_decoy_directory_runs_the_installed_code_and_kill9_leaves_no_sockets(tiny_target,
                                                                                            tmp_path):
    cwd, tmp = tmp_path / "checkout", tmp_path / "tmp"
    tmp.mkdir()
    plant_decoys(cwd)
    srv = ServerProcess(["--model", str(tiny_target), "--spec", "none", "--device", "cpu", "--kv-cache-tokens",
                         "1024"], cwd=cwd, env={"TMPDIR": str(tmp)}, launcher=[str(CONSOLE_SCRIPT)])
    srv.start()
    c = Client(srv.address)
    try:
        final = await c.complete(GenerateRequest("r", prompt_token_ids=[3, 1, 4, 1, 5], max_tokens=8,
                                                 temperature=0.0, ignore_eos=True), 60)
        assert len(final.token_ids) == 8
        scheduler_pid = (await c.stats()).engine.pid
        assert socket_folders(tmp), "the scheduler's ipc sockets should live under TMPDIR while serving"
    finally:
        c.close()
    assert sorted(p.name for p in cwd.glob("imported-*")) == []
    os.kill(srv.pid, signal.SIGKILL)
    srv.wait(10)
    deadline = time.monotonic() + 20
    while pid_alive(scheduler_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not pid_alive(scheduler_pid), "the scheduler process outlived its killed frontend"
    assert socket_folders(tmp) == []


def unix_socket(path: Path) -> None:
    """A socket file as a killed process leaves it (bound, never unlinked)."""
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(path))
    s.close()


def test_a_later_start_removes_folders_of_dead_processes_only(tmp_path, monkeypatch):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    dead_pid = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                                  text=True, check=True).stdout)
    live = Path(ipc_address("in")[len("ipc://"):])  # this process's: alive
    unix_socket(live)
    stale = tmp_path / f"specstep-{dead_pid}-abcd"
    stale.mkdir()
    unix_socket(stale / "in")
    unix_socket(stale / "out")
    kept = tmp_path / f"specstep-{dead_pid}-efgh"  # holds more than sockets: not ours to judge
    kept.mkdir()
    (kept / "notes.txt").write_text("x")
    assert remove_stale_ipc() == [stale]
    assert not stale.exists() and live.exists() and kept.exists()
