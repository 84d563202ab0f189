"""Starts the scheduler process, owns the frontend's end of its two sockets, and restarts it when it dies.

Each start is an *incarnation* with fresh ipc sockets, so nothing sent to or from a dead process can leak into
its successor. A start succeeds when the child's Ready message arrives within the start-up timeout. When a
running incarnation exits unexpectedly, the handler is told at once (the frontend fails that incarnation's
requests with ENGINE_DIED), and a new one is started, at most `max_restarts` times per `restart_window_s`;
after that the supervisor is `failed` and `wait_ready` raises UNAVAILABLE. Requests that arrive while an
incarnation starts simply wait for it in `wait_ready`.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import msgspec
import zmq
import zmq.asyncio

from specstep.scheduler.launch import module_command
from specstep.scheduler.server.protocol import (
    EngineOutputs,
    EngineReject,
    EngineShutdown,
    EngineStats,
    EngineStatsQuery,
    ErrorCode,
    ProtocolError,
    Ready,
    SchedulerProcessConfig,
    Wire,
    decode_from_engine,
    encode_engine,
)
from specstep.scheduler.server.restart_budget import RestartBudget
from specstep.scheduler.server.sockets import ipc_address, make_socket, remove_ipc, remove_stale_ipc

log = logging.getLogger("specstep.supervisor")


class EngineHandler(Protocol):
    def on_outputs(self, msg: EngineOutputs) -> None: ...
    def on_reject(self, msg: EngineReject) -> None: ...
    def on_engine_died(self, incarnation: int) -> None: ...


@dataclass(eq=False)
class Incarnation:
    number: int
    push: zmq.asyncio.Socket
    pull: zmq.asyncio.Socket
    addresses: tuple[str, str]
    proc: asyncio.subprocess.Process | None = None
    ready: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    outbox: asyncio.Queue = field(default_factory=asyncio.Queue)
    tasks: list[asyncio.Task] = field(default_factory=list)


class SchedulerSupervisor:
    def __init__(self, ctx: zmq.asyncio.Context, make_config: Callable[[str, str], SchedulerProcessConfig],
                 handler: EngineHandler, startup_timeout_s: float = 300.0, max_restarts: int = 5,
                 restart_window_s: float = 300.0, command: list[str] | None = None) -> None:
        self.ctx = ctx
        # How to start a scheduler process; its config (JSON) is appended as the last argument.
        self.command = command or module_command("specstep.scheduler.server.scheduler_process")
        self.make_config = make_config
        self.handler = handler
        self.startup_timeout_s = startup_timeout_s
        self._budget = RestartBudget(max_restarts, restart_window_s)
        self.state = "starting"  # starting | ready | restarting | failed | stopping | stopped
        self.ready: Ready | None = None
        self.restarts = 0
        self._current: Incarnation | None = None
        self._numbers = itertools.count(1)
        self._state_changed = asyncio.Event()
        self._stats: dict[int, asyncio.Future] = {}
        self._tags = itertools.count(1)
        self._restart_task: asyncio.Task | None = None
        self._start_task: asyncio.Future | None = None

    # ---- the frontend's side ---------------------------------------------------------------------------------
    async def wait_ready(self) -> Ready:
        while self.state != "ready":
            if self.state in ("stopping", "stopped"):
                raise ProtocolError(ErrorCode.SHUTTING_DOWN, "the server is shutting down")
            if self.state == "failed":
                raise ProtocolError(ErrorCode.UNAVAILABLE, f"no scheduler process ({self.state})")
            self._state_changed.clear()
            await self._state_changed.wait()
        assert self.ready is not None
        return self.ready

    @property
    def incarnation(self) -> int:
        return self._current.number if self._current is not None and self.state == "ready" else 0

    def send(self, msg: Wire) -> int:
        """Queue `msg` for the current scheduler; returns its incarnation number (0 if none is ready: dropped)."""
        inc = self._current
        if inc is None or self.state not in ("ready", "stopping"):
            return 0
        inc.outbox.put_nowait(encode_engine(msg))
        return inc.number

    async def stats(self, timeout_s: float = 5.0) -> EngineStats | None:
        if self.state != "ready":
            return None
        tag = next(self._tags)
        fut = asyncio.get_running_loop().create_future()
        self._stats[tag] = fut
        self.send(EngineStatsQuery(tag))
        try:
            return await asyncio.wait_for(fut, timeout_s)
        except asyncio.TimeoutError:
            return None
        finally:
            self._stats.pop(tag, None)

    def _set_state(self, state: str) -> None:
        self.state = state
        self._state_changed.set()

    # ---- start / restart / stop ------------------------------------------------------------------------------
    async def start(self) -> bool:
        """The first start; False if the scheduler did not come up (state `failed`) or `stop()` was called
        meanwhile (state `stopped`: the start is cancelled and its process reaped)."""
        for folder in remove_stale_ipc():
            log.info("removed %s, left by a process that is gone", folder)
        self._start_task = asyncio.ensure_future(self._launch())
        try:
            if await self._start_task:
                return True
        except asyncio.CancelledError:
            if self.state not in ("stopping", "stopped"):
                raise  # our caller was cancelled, not the start
            return False
        if self.state not in ("stopping", "stopped"):
            self._set_state("failed")
        return False

    async def _launch(self) -> bool:
        number = next(self._numbers)
        in_addr, out_addr = ipc_address("in"), ipc_address("out")
        push = make_socket(self.ctx, zmq.PUSH, bind=in_addr)
        try:
            pull = make_socket(self.ctx, zmq.PULL, bind=out_addr)
        except BaseException:
            push.close(linger=0)
            remove_ipc(in_addr)
            raise
        inc = Incarnation(number, push, pull, (in_addr, out_addr))
        try:
            cfg = self.make_config(in_addr, out_addr)
            env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE")
            inc.proc = await asyncio.create_subprocess_exec(*self.command, msgspec.json.encode(cfg).decode(),
                                                            env=env)
        except BaseException:  # could not spawn, or cancelled meanwhile: leave no socket behind
            await self._reap(inc)
            raise
        inc.tasks.append(asyncio.create_task(self._read(inc)))
        exited = asyncio.ensure_future(inc.proc.wait())
        try:
            done, _ = await asyncio.wait({inc.ready, exited}, timeout=self.startup_timeout_s,
                                         return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:  # stopped while starting: leave no process behind
            exited.cancel()
            await self._reap(inc)
            raise
        if inc.ready not in done:
            why = (f"exited with code {inc.proc.returncode}" if exited in done
                   else f"not ready within {self.startup_timeout_s:g}s")
            log.error("scheduler process %d (pid %d) %s during start-up", number, inc.proc.pid, why)
            exited.cancel()
            await self._reap(inc)
            return False
        self.ready = inc.ready.result()
        self._current = inc
        inc.tasks.append(asyncio.create_task(self._send(inc)))
        inc.tasks.append(asyncio.create_task(self._watch(inc, exited)))
        if self.state in ("stopping", "stopped"):  # stop() is under way: it shuts this incarnation down
            return True
        self._set_state("ready")
        log.info("scheduler process %d ready (pid %d)", number, inc.proc.pid)
        return True

    async def _watch(self, inc: Incarnation, exited: asyncio.Future) -> None:
        code = await exited
        if self.state in ("stopping", "stopped"):
            return
        log.error("scheduler process %d (pid %d) exited with code %s", inc.number, inc.proc.pid, code)
        self._current = None
        self._set_state("restarting")
        for fut in self._stats.values():
            if not fut.done():
                fut.set_result(None)
        self.handler.on_engine_died(inc.number)
        self._restart_task = asyncio.create_task(self._restart(inc))

    async def _restart(self, dead: Incarnation) -> None:
        await self._reap(dead)
        while True:
            if not self._budget.take(time.monotonic()):
                log.error("scheduler restarted %d times within %gs: giving up", self._budget.max_restarts,
                          self._budget.window_s)
                self._set_state("failed")
                return
            self.restarts += 1
            try:
                if await self._launch():
                    return
            except (OSError, zmq.ZMQError):  # could not spawn or bind: a failed start, not a stuck supervisor
                log.exception("starting scheduler process failed")
            if self.state in ("stopping", "stopped"):
                return
            await asyncio.sleep(self._budget.backoff_s)

    async def stop(self, drain: bool = True, timeout_s: float = 30.0) -> None:
        """Ask the scheduler to exit (after finishing its requests if `drain`), then make sure it has. A start
        or restart still in progress is cancelled (its process is reaped)."""
        inc = self._current
        self._set_state("stopping")
        for task in (self._start_task, self._restart_task):
            if task is not None and not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        inc = self._current  # a start or restart may have completed just before the cancel
        if inc is not None and inc.proc is not None and inc.proc.returncode is None:
            inc.outbox.put_nowait(encode_engine(EngineShutdown(drain=drain)))
            try:
                await asyncio.wait_for(inc.proc.wait(), timeout_s)
            except asyncio.TimeoutError:
                log.warning("scheduler did not exit within %gs; killing it", timeout_s)
        if inc is not None:
            await self._reap(inc)
        self._set_state("stopped")

    async def _reap(self, inc: Incarnation) -> None:
        """Kill the process if still alive, stop its tasks, close and remove its sockets."""
        if inc.proc is not None and inc.proc.returncode is None:
            inc.proc.kill()
            await inc.proc.wait()
        me = asyncio.current_task()
        for task in inc.tasks:
            if task is not me:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        inc.push.close(linger=0)
        inc.pull.close(linger=0)
        for addr in inc.addresses:
            remove_ipc(addr)

    # ---- socket tasks (one per socket and incarnation) ---------------------------------------------------------
    async def _send(self, inc: Incarnation) -> None:
        while True:
            frames = await inc.outbox.get()
            await inc.push.send_multipart(frames, copy=False)  # waits while the child's PULL is not yet attached

    async def _read(self, inc: Incarnation) -> None:
        while True:
            frames = await inc.pull.recv_multipart()
            try:
                msg = decode_from_engine(frames)
            except ProtocolError as e:
                log.error("dropped a malformed message from the scheduler: %s", e.message)
                continue
            if isinstance(msg, EngineOutputs):
                self.handler.on_outputs(msg)
            elif isinstance(msg, EngineReject):
                self.handler.on_reject(msg)
            elif isinstance(msg, EngineStats):
                fut = self._stats.get(msg.tag)
                if fut is not None and not fut.done():
                    fut.set_result(msg)
            elif isinstance(msg, Ready) and not inc.ready.done():
                inc.ready.set_result(msg)
