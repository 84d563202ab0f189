"""Starting and stopping a tensor-parallel group: the leader (this process) spawns one follower process per
other rank (`scheduler.parallel.tp_follower`), each on its own device, and joins them in a torch.distributed group.

Followers log to the leader's stderr (the scheduler process's log under `serve`), each line tagged with its
rank; their stdout goes nowhere (the leader's is where `generate` writes its JSONL).

Lifetimes. Followers are children of the leader; each exits when the leader says stop, when any collective
fails (a rank died: gloo and NCCL raise on a closed peer), or when its parent is gone. A follower that dies takes
the leader's next step down with an error: the scheduler process exits, the frontend fails every in-flight
request with ENGINE_DIED, and the supervisor restarts the whole group (bounded, as for any scheduler death). A
follower that cannot start fails the leader's start-up at once with a `ParallelError` naming its exit status.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
import subprocess
import threading
import time
from dataclasses import dataclass, field

from specstep.engine.engine_config import EngineConfig
from specstep.engine.parallel.group import TPGroup, init_tp_group
from specstep.scheduler.launch import module_command

log = logging.getLogger("specstep.tp")

JOIN_TIMEOUT_S = 120.0  # followers import torch and start before they join; a model loads after
# An idle server's followers wait inside a broadcast for the next step: no deadline in practice. A dead rank is
# noticed by its closed connection (gloo and NCCL raise on it), not by this timeout.
COLLECTIVE_TIMEOUT_S = 30 * 24 * 3600.0


@dataclass(slots=True)
class TPGroupHandle:
    tp: TPGroup | None
    procs: list[subprocess.Popen] = field(default_factory=list)
    _watching: threading.Event = field(default_factory=threading.Event)
    _grace_s: float = 0.0

    def watch(self, grace_s: float = 0.0, interval_s: float = 0.5) -> None:
        """From now on a follower that exits ends this process (status 70), `grace_s` after it is seen gone
        unless the watch was stopped meanwhile (`stop`, `kill`): on NCCL a dead peer inside one machine is not
        reported, so the leader would wait in its next collective for good. The scheduler process's death is
        what the frontend and supervisor act on (ENGINE_DIED, a new group). Calling it again changes the grace
        period of the running watch."""
        self._grace_s = grace_s
        if self._watching.is_set():
            return
        self._watching.set()

        def loop() -> None:
            while self._watching.is_set():
                why = self.dead()
                if why is not None:
                    deadline = time.monotonic() + self._grace_s
                    while self._watching.is_set() and time.monotonic() < deadline:
                        time.sleep(interval_s)
                    if self._watching.is_set():
                        log.error("tensor-parallel follower %s: exiting so the group restarts", why)
                        os._exit(70)
                    return
                time.sleep(interval_s)
        threading.Thread(target=loop, name="tp-watchdog", daemon=True).start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Wait for the followers to leave (after the leader's stop message), killing any that do not."""
        self._watching.clear()
        for p in self.procs:
            try:
                p.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def kill(self) -> None:
        """After a failure: the followers may be inside a collective the leader will never join."""
        self._watching.clear()
        for p in self.procs:
            p.kill()
            p.wait()

    def dead(self) -> str | None:
        """Why a follower can no longer take part (its process exited), else None."""
        for rank, p in enumerate(self.procs, start=1):
            if p.poll() is not None:
                return f"exited (rank {rank}, status {p.returncode}; its output is on this process's stderr)"
        return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_tp_group(cfg: EngineConfig) -> TPGroupHandle:
    n = cfg.tensor_parallel_size
    init_method = f"tcp://127.0.0.1:{free_port()}"
    config = json.dumps(dataclasses.asdict(cfg))
    env = {**os.environ, "SPECSTEP_TP_PARENT": str(os.getpid())}
    handle = TPGroupHandle(None)
    for rank in range(1, n):
        cmd = module_command("specstep.scheduler.parallel.tp_follower", config, str(rank), str(n), init_method)
        handle.procs.append(subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, env=env))
    try:
        device = "cuda" if cfg.device in ("auto", "cuda") and _cuda() else "cpu"
        handle.tp = init_tp_group(n, 0, init_method, device=device, join_timeout_s=JOIN_TIMEOUT_S,
                                  timeout_s=COLLECTIVE_TIMEOUT_S, alive=handle.dead)
    except BaseException:
        handle.kill()
        raise
    return handle


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()
