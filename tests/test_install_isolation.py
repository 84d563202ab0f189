"""The installed code is what runs, wherever `specstep serve` is started, and a `kill -9` leaves no socket
folders behind.

The server is started through the installed `specstep` console script from a directory holding decoy
`scheduler/`, `engine/` and `specstep/` packages that leave a marker file when imported: none may be imported,
by the server, by the scheduler process it starts (before the fix, that child ran `python -m
scheduler.server.scheduler_process`, and the current directory came first on its `sys.path`), or, at TP = 2, by the
tensor-parallel follower that the scheduler process starts in turn (in the same directory)."""

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
from specstep.scheduler.server.protocol import GenerateRequest
from specstep.scheduler.server.sockets import ipc_address, pid_alive, remove_stale_ipc

CONSOLE_SCRIPT = Path(sys.executable).parent / "specstep"
DECOYS = ["scheduler", "engine", "specstep", "specstep/scheduler", "specstep/engine"]


def plant_decoys(root: Path) -> None:
    for pkg in DECOYS:
        folder = root / pkg
        folder.mkdir(parents=True, exist_ok=True)
        marker = f"(__import__('pathlib').Path({str(root)!r}) / 'imported-{pkg.replace('/', '.')}').touch()\n"
        (folder / "__init__.py").write_text(marker)
        for mod in ("scheduler_process", "cli", "serve_cmd", "tp_follower"):
            (folder / f"{mod}.py").write_text(marker)


def imported(root: Path) -> list[str]:
    return sorted(p.name for p in root.glob("imported-*"))


def socket_folders(tmp: Path) -> list[Path]:
    return sorted(tmp.glob("specstep-*"))


def children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(c) for c in path.read_text().split()] if path.exists() else []


@pytest.mark.skipif(not CONSOLE_SCRIPT.exists(), reason="specstep is not installed in this environment")
@pytest.mark.parametrize("tp", [1, 2])
async def test_serve_from_a_decoy_directory_runs_the_installed_code_and_kill9_leaves_no_sockets(tiny_target,
                                                                                            tmp_path, tp):
    cwd, tmp = tmp_path / "checkout", tmp_path / "tmp"
    tmp.mkdir()
    plant_decoys(cwd)
    srv = ServerProcess(["--model", str(tiny_target), "--spec", "none", "--device", "cpu", "--kv-cache-tokens",
                         "1024", "--tensor-parallel-size", str(tp)],
                        cwd=cwd, env={"TMPDIR": str(tmp)}, launcher=[str(CONSOLE_SCRIPT)])
    try:
        srv.start()
    finally:  # a child that imported a decoy may fail start-up instead (the follower's decoy joins no group)
        assert imported(cwd) == []
    c = Client(srv.address)
    try:
        final = await c.complete(GenerateRequest("r", prompt_token_ids=[3, 1, 4, 1, 5], max_tokens=8,
                                                 temperature=0.0, ignore_eos=True), 60)
        assert len(final.token_ids) == 8
        engine = (await c.stats()).engine
        scheduler_pid, followers = engine.pid, children(engine.pid)
        assert engine.tensor_parallel_size == tp and len(followers) == tp - 1, followers
        assert socket_folders(tmp), "the scheduler's ipc sockets should live under TMPDIR while serving"
    finally:
        c.close()
    assert imported(cwd) == []
    os.kill(srv.pid, signal.SIGKILL)
    srv.wait(10)
    deadline = time.monotonic() + 20
    while pid_alive(scheduler_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not pid_alive(scheduler_pid), "the scheduler process outlived its killed frontend"
    while any(pid_alive(p) for p in followers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(pid_alive(p) for p in followers), "a tensor-parallel follower outlived its leader"
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
