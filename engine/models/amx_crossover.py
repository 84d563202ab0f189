"""Up to how many rows a call of the AMX formats takes the AVX-512 VNNI lanes rather than the tiles: measured at
load on the model's own linears, cached per machine.

Both forms compute the same bits (`gguf_amx.cpp`: the same integer block sums, the same readout), so the choice is
speed alone. A tile pass pays fixed costs a block (its operands' tile loads, the sums' store and readout through
memory) and almost nothing a row; the lanes pay 8 `vpdpbusd` a block and row and nothing fixed. Where they cross
differs between hosts of one kind: on one AMX host the tiles' time over the lanes' at 1 / 2 / 4 / 5 / 8 rows of
SmolLM2's Q4_1 stack was 1.17 / 1.16 / 1.09 / 1.06 / 0.95, on another 1.15 / 1.13 / 1.15 / 1.22 / 1.12 with the
tiles ahead only from 16 rows (`benchmarks/bench_gguf_kernel.py --activations int8-tiles,int8-vnni`, one thread).
A fixed crossover of 4 rows cost the second host's batch-1 verify step (5 rows) 9%.

So the loader times one pass over the model's linears of each format in both forms at 1-8 rows (one thread: the
kernel's own rate, without thread wake-ups; the forms alternating, medians of `ROUNDS`) and gives the lanes every
row count up to the first the tiles win (`choose_lane_rows`). About half a second for SmolLM2, once per machine.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

import torch
from torch import nn

from specstep.engine.models.cpu_linear_plans import PLANS
from specstep.engine.models.gguf_kernel import (
    AMX_LANE_DEFAULTS,
    amx_lane_rows,
    build_id,
    gguf_linear,
    set_amx_lane_defaults,
)

PROBE_ROWS = tuple(range(1, 9))  # the row counts the lanes can take (`AMX_LANES_MOST`)
ROUNDS = 5  # timed passes of each form and row count, alternating


def choose_lane_rows(tiles_ms: Sequence[float], lanes_ms: Sequence[float]) -> int:
    """The largest row count (of PROBE_ROWS, in order) up to which the lanes were never slower than the tiles; 0 where
    the tiles win at one row. A threshold, not a per-row choice: a step's cost grows with its rows in both forms, so
    a row count the lanes win past one they lost is the host's noise."""
    rows = 0
    for r, tiles, lanes in zip(PROBE_ROWS, tiles_ms, lanes_ms):
        if lanes > tiles:
            break
        rows = r
    return rows


def measure_lane_rows(linears: Sequence[nn.Module], rounds: int = ROUNDS) -> tuple[list[float], list[float]]:
    """ms of one pass over `linears` (`GGUFLinear`s of one AMX format) at each of PROBE_ROWS, in the tiles and in the
    lanes."""
    g = torch.Generator().manual_seed(0)  # (the global generator's state must not depend on the cache)
    xs = {(r, k): torch.randn(r, k, generator=g) for r in PROBE_ROWS for k in sorted({m.in_features for m in linears})}

    def one_pass(rows: int, lanes: bool) -> float:
        amx_lane_rows(8 if lanes else 0)
        t0 = time.perf_counter()
        for m in linears:
            gguf_linear(xs[rows, m.in_features], m.packed, m.out_features, m.kernel_fmt, m.bias, threads=1)
        return time.perf_counter() - t0

    times: dict[tuple[int, bool], list[float]] = {(r, f): [] for r in PROBE_ROWS for f in (False, True)}
    was = amx_lane_rows(-1)  # an override in force (a test's, an A/B's) is restored after
    try:
        with torch.inference_mode():
            one_pass(1, True), one_pass(1, False)  # first touches
            for _ in range(rounds):
                for key in times:
                    times[key].append(one_pass(*key))
    finally:
        amx_lane_rows(was)
    return ([statistics.median(times[r, False]) * 1e3 for r in PROBE_ROWS],
            [statistics.median(times[r, True]) * 1e3 for r in PROBE_ROWS])


# bytes of the packed weights each format's kernel defaults were measured over: a process's largest model of a format
# sets them (a draft loaded after its target measures its own, and leaves the target's)
_MEASURED_BYTES: dict[str, int] = {}


def lane_rows_for(model: nn.Module) -> dict[str, int]:
    """Measure (or read from the per-machine cache) each AMX format's crossover over `model`'s linears of it, and
    set them as the kernel's defaults unless a larger model of that format set them. Returns {GGML type: rows}
    in force after (a larger model's, where one set them)."""
    from specstep.engine.models.gguf_linear import GGUFLinear

    by_fmt: dict[str, list[nn.Module]] = {}
    for m in model.modules():
        if isinstance(m, GGUFLinear) and m.kernel_fmt.endswith("/int8-tiles"):
            by_fmt.setdefault(m.fmt, []).append(m)
    build = build_id()  # a new kernel measures again
    chosen = {}
    for fmt, linears in sorted(by_fmt.items()):
        shapes = sorted({(m.out_features, m.in_features) for m in linears})
        key = f"amx_lanes:{fmt}:{len(linears)}x{shapes}:{build}:rows{','.join(map(str, PROBE_ROWS))}"
        timed = PLANS.get(key, lambda linears=linears: list(measure_lane_rows(linears)))
        chosen[fmt] = choose_lane_rows(*timed)
    nbytes = {fmt: sum(m.packed.numel() for m in linears) for fmt, linears in by_fmt.items()}
    set_amx_lane_defaults({fmt: rows for fmt, rows in chosen.items() if nbytes[fmt] >= _MEASURED_BYTES.get(fmt, 0)})
    for fmt, n in nbytes.items():
        _MEASURED_BYTES[fmt] = max(n, _MEASURED_BYTES.get(fmt, 0))
    return {fmt: AMX_LANE_DEFAULTS.get(fmt, rows) for fmt, rows in chosen.items()}
