"""A follower rank of a tensor-parallel group (started by `scheduler.parallel.tp_group`): join, build this rank's step
engine on its shard, replay the leader's steps until it says stop.

    python -m specstep.scheduler.parallel.tp_follower CONFIG_JSON RANK WORLD_SIZE INIT_METHOD
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time


def _exit_with_parent() -> None:
    """A follower never outlives its leader: if the parent process is gone, exit (collectives would fail too,
    but an idle follower waiting to join might not notice)."""
    parent = int(os.environ.get("SPECSTEP_TP_PARENT", "0"))

    def watch() -> None:
        while True:
            time.sleep(1.0)
            if parent and os.getppid() != parent:
                os._exit(3)
    if parent:
        threading.Thread(target=watch, daemon=True, name="parent-watch").start()


def main(argv: list[str]) -> int:
    config, rank, world_size, init_method = json.loads(argv[0]), int(argv[1]), int(argv[2]), argv[3]
    logging.basicConfig(level=logging.INFO, format=f"rank {rank} %(levelname)s %(name)s: %(message)s")
    _exit_with_parent()
    from specstep.engine.engine_config import EngineConfig
    from specstep.engine.parallel.group import init_tp_group
    from specstep.engine.parallel.tp_engine import follow
    from specstep.scheduler.build import build_step_engine, resolve_device
    from specstep.scheduler.parallel.tp_group import COLLECTIVE_TIMEOUT_S, JOIN_TIMEOUT_S

    cfg = EngineConfig(**config)
    device = resolve_device(cfg.device, rank)
    tp = init_tp_group(world_size, rank, init_method, device=device, join_timeout_s=JOIN_TIMEOUT_S,
                       timeout_s=COLLECTIVE_TIMEOUT_S)
    parts = build_step_engine(cfg, tp=tp)
    follow(parts.step_engine, tp)
    tp.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
