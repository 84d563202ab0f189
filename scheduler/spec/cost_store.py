"""Step costs carried across runs: a fresh process starts from the costs this host measured last time.

A run of a few hundred tokens spent a large share of itself re-learning what a speculative step costs (every k
measured twice before the model was trusted; at batch 6 on an AVX-512 CPU a k = 4 step costs 4.5 plain steps). The
costs depend on the model, the proposer, the host and the kernel plan, so they are kept per such key, as the CPU
linear plans and the kernel builds are, in the user cache:

    $SPECSTEP_CACHE (default ~/.cache/specstep) / step_costs / <key digest>.json

What is stored is each measured cost as a ratio to a plain step of its batch bucket (and n-gram's cost per draft
row, likewise), not seconds: the machine's load moves every step together, and the ratios carry over. At start
they are the policy's prior (`StepCosts.load_prior`): the plain step is measured live first (it is free), the
other costs come from the prior until live samples replace them, and exploration does not re-measure what the
prior already has. The file is rewritten as the run goes. A file that cannot be read, is of another version or
key, or holds a value that makes no sense is ignored with a warning: the run starts cold, as before. Deleting the
folder clears it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import platform
from pathlib import Path

from specstep.engine.model_source import cache_root
from specstep.scheduler.spec.costs import StepCosts

log = logging.getLogger("specstep.spec")

VERSION = 1
FOLDER = "step_costs"


def store_folder() -> Path:
    """Where every key's file lives: `$SPECSTEP_STEP_COSTS` where set, else the user cache's `step_costs`
    folder. The variable reaches child processes (a server's scheduler), which a patched function would not."""
    return Path(os.environ.get("SPECSTEP_STEP_COSTS") or cache_root() / FOLDER)


def host_id() -> str:
    """The CPU (model name and feature flags), its core count, the torch version: what a cost depends on."""
    import torch

    info = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            info.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    name = info.get("model name") or platform.processor() or platform.machine()
    flags = hashlib.sha256(info.get("flags", "").encode()).hexdigest()[:12]
    return f"{name}|flags {flags}|cpus {os.cpu_count()}|torch {torch.__version__}"


class StepCostStore:
    """One key's stored costs (`key`: what they were measured under, every value a string) in `folder`."""

    def __init__(self, folder: Path, key: dict[str, str]) -> None:
        self.key = dict(sorted(key.items()))
        digest = hashlib.sha256(json.dumps(self.key).encode()).hexdigest()[:16]
        self.path = folder / f"{digest}.json"

    def load(self, costs: StepCosts) -> bool:
        """Seed `costs` with the stored prior; False (and a warning where a file was there) when there is none."""
        if not self.path.is_file():
            return False
        try:
            data = json.loads(self.path.read_text())
            if not isinstance(data, dict) or data.get("version") != VERSION:
                raise ValueError(f"version {data.get('version') if isinstance(data, dict) else None!r}, "
                                 f"expected {VERSION}")
            if data.get("key") != self.key:
                raise ValueError("it was measured under another key")
            entries = _entries(data.get("ratios"))
            rows = _entries(data.get("row_ratios"))
        except (OSError, ValueError, TypeError, KeyError) as e:
            log.warning("ignoring the stored step costs in %s (%s): measuring afresh", self.path, e)
            return False
        costs.load_prior(entries, rows)
        return True

    def save(self, costs: StepCosts) -> None:
        """Write the live ratios over the stored ones (atomic; a read-only cache only means a cold start)."""
        ratios, rows = costs.prior_state()
        data = {"version": VERSION, "key": self.key,
                "ratios": {f"{b}/{k}/{int(r)}": [v, n] for (b, k, r), (v, n) in sorted(ratios.items())},
                "row_ratios": {f"{b}/{k}/{int(r)}": [v, n] for (b, k, r), (v, n) in sorted(rows.items())}}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(data, indent=1))
            tmp.replace(self.path)  # concurrent starts never read half a file
        except OSError as e:
            log.debug("could not store step costs in %s: %s", self.path, e)


def _entries(table) -> dict[tuple[int, int, bool], tuple[float, int]]:
    """"bucket/k/refill" -> [ratio, samples], checked: a ratio must be a positive finite number."""
    if not isinstance(table, dict):
        raise ValueError("no table of ratios")
    out = {}
    for name, value in table.items():
        b, k, r = (int(x) for x in name.split("/"))
        ratio, count = value
        if not (isinstance(ratio, (int, float)) and math.isfinite(ratio) and ratio > 0 and b >= 1 and k >= 0
                and r in (0, 1) and isinstance(count, int) and count >= 1):
            raise ValueError(f"entry {name!r}: {value!r} makes no sense")
        out[b, k, bool(r)] = (float(ratio), count)
    return out
