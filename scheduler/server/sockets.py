"""The one socket helper: every ZMQ socket in the project is made, addressed and sent on through here."""

from __future__ import annotations

import asyncio
import os
import tempfile
from pathlib import Path

import zmq

# Internal PUSH/PULL pipes never drop or block on a high-water mark (0 = unbounded): the peer is our own
# process and drains as fast as it can. The public ROUTER gets a large but finite mark, so one client that
# stops reading cannot grow the server's memory without bound (see send_now).
INTERNAL_HWM = 0
ROUTER_HWM = 100_000


def make_socket(ctx: zmq.Context, kind: int, *, bind: str | None = None, connect: str | None = None,
                hwm: int = INTERNAL_HWM, router_mandatory: bool = False) -> zmq.Socket:
    """A socket bound to `bind` or connected to `connect`. A bound tcp address may end in ':0' or ':*'
    for a free port; read the result with `bound_address`."""
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.RCVHWM, hwm)
    if router_mandatory:
        # Sending to a client that has gone away raises EHOSTUNREACH instead of dropping silently: that is how
        # the frontend learns a client disappeared and aborts its requests.
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    try:
        if bind is not None:
            sock.bind(_wildcard_port(bind))
        if connect is not None:
            sock.connect(connect)
    except zmq.ZMQError:
        sock.close(linger=0)
        raise
    return sock


def _wildcard_port(address: str) -> str:
    if address.startswith("tcp://") and address.endswith(":0"):
        return address[:-2] + ":*"
    return address


def bound_address(sock: zmq.Socket) -> str:
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


IPC_PREFIX = "specstep-"


def ipc_address(name: str) -> str:
    """A fresh ipc:// path in a private (0700) temp dir named after this process, `specstep-PID-XXXX`, so a
    later start can tell a dead process's folder from a live one's (short: ipc paths are limited to ~100 bytes)."""
    folder = Path(tempfile.mkdtemp(prefix=f"{IPC_PREFIX}{os.getpid()}-"))
    return f"ipc://{folder / name}"


def remove_stale_ipc(tmp: str | None = None) -> list[Path]:
    """Remove the ipc folders of specstep processes that no longer exist (a `kill -9` leaves them behind).
    Only folders named `specstep-PID-*` whose PID is gone and that hold nothing but sockets are touched."""
    removed = []
    for folder in Path(tmp or tempfile.gettempdir()).glob(f"{IPC_PREFIX}*-*"):
        pid = folder.name[len(IPC_PREFIX):].split("-", 1)[0]
        if not pid.isdigit() or pid_alive(int(pid)) or not folder.is_dir() or folder.is_symlink():
            continue
        try:
            entries = list(folder.iterdir())
            if any(not e.is_socket() for e in entries):
                continue
            for e in entries:
                e.unlink()
            folder.rmdir()
            removed.append(folder)
        except OSError:  # another user's, or raced with another start: leave it
            continue
    return removed


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def remove_ipc(address: str) -> None:
    if address.startswith("ipc://"):
        path = Path(address[len("ipc://"):])
        for p in (path, path.parent):
            try:
                os.rmdir(p) if p.is_dir() else p.unlink()
            except OSError:
                pass


def send_now(sock: zmq.Socket, frames: list[bytes]) -> bool:
    """Send without blocking. False when the peer is gone (ROUTER_MANDATORY: EHOSTUNREACH) or its queue is full
    (EAGAIN); the caller treats both as 'this client cannot be served'. Works on asyncio and plain sockets."""
    try:
        result = sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
    except zmq.ZMQError as e:
        if e.errno in (zmq.EHOSTUNREACH, zmq.EAGAIN):
            return False
        raise
    if isinstance(result, asyncio.Future):
        # An asyncio socket with no queued sends resolves a NOBLOCK send at once (we never queue sends on it).
        err = result.exception() if result.done() else None
        if isinstance(err, zmq.ZMQError) and err.errno in (zmq.EHOSTUNREACH, zmq.EAGAIN):
            return False
        if err is not None:
            raise err
    return True
