"""This host's peak rates of the vector instructions a verify step's extra rows cost at the fewest (`fma_rate.cpp`),
and the arithmetic floor they put under a verify step's cost against a decode step's (`bench_steps`' column)."""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from specstep.engine.models.cpu_linear import CpuLinear
from specstep.engine.models.gguf_kernel import amx_lane_rows_now
from specstep.engine.models.gguf_linear import GGUFLinear
from specstep.engine.native import cpu_flags, load_kernel

FMA_SEEDS = tuple(1.0 + 0.01 * i for i in range(10))  # ten distinct chains (`fma_rate.cpp`)
VNNI_SEEDS = tuple(1000 * i - 4321 for i in range(10))
VNNI_BYTES = (0x0F03_7F01, 0x7F_81_02_FF)  # x's 4 unsigned bytes, y's 4 signed ones, in every lane


def _rate_lib() -> ctypes.CDLL | None:
    lib, _ = load_kernel(Path(__file__).with_name("fma_rate.cpp"))
    if lib is None:
        return None
    f32p, i32p = ctypes.POINTER(ctypes.c_float), ctypes.POINTER(ctypes.c_int)
    for fn in (lib.fma_rate, lib.fma_rate512):
        fn.argtypes = [ctypes.c_long, ctypes.c_int, f32p, f32p]
        fn.restype = ctypes.c_double
    lib.vnni_rate.argtypes = [ctypes.c_long, ctypes.c_int, i32p, ctypes.c_int, ctypes.c_int, i32p]
    lib.vnni_rate.restype = ctypes.c_double
    return lib


def fma_rate(threads: int, repeats: int = 5, iters: int = 20_000_000, lanes: int = 8
             ) -> tuple[float, list[float]] | None:
    """This host's peak fp32 FMA instructions a second over `threads` threads, 8-lane or (where the CPU has AVX-512)
    16-lane ones (`fma_rate.cpp`), the best of `repeats` (a peak: the other runs lost time to the host), and the
    first thread's ten chains' final values (each its own computation); None where the C++ kernels (or 16 lanes)
    cannot run."""
    lib = _rate_lib()
    if lib is None or (lanes == 16 and "avx512f" not in cpu_flags()):
        return None
    fn = lib.fma_rate512 if lanes == 16 else lib.fma_rate
    seeds, out = (ctypes.c_float * 10)(*FMA_SEEDS), (ctypes.c_float * (10 * threads))()
    rate = max(fn(iters, threads, seeds, out) for _ in range(repeats))
    return rate, list(out)[:10]


def vnni_rate(threads: int, repeats: int = 5, iters: int = 20_000_000) -> tuple[float, list[int]] | None:
    """This host's peak 512-bit vpdpbusd instructions a second (64 int8 multiply-adds each) over `threads` threads,
    the best of `repeats`, and the first thread's ten chains' final lane-0 values; None without AVX-512 VNNI."""
    lib = _rate_lib()
    if lib is None or not {"avx512f", "avx512_vnni"} <= cpu_flags():
        return None
    seeds, out = (ctypes.c_int * 10)(*VNNI_SEEDS), (ctypes.c_int * (10 * threads))()
    rate = max(lib.vnni_rate(iters, threads, seeds, *VNNI_BYTES, out) for _ in range(repeats))
    return rate, list(out)[:10]


def peak_rates(threads: int) -> dict[str, float]:
    """The instruction rates `arithmetic_floor` takes, those this host has: "fma8", "fma16", "vnni" (a second)."""
    got = {"fma8": fma_rate(threads), "fma16": fma_rate(threads, lanes=16), "vnni": vnni_rate(threads)}
    return {name: r[0] for name, r in got.items() if r is not None}


def arithmetic_floor(rows: int, extra_rows: int, model: torch.nn.Module, activations: str,
                     rates: dict[str, float]) -> tuple[float, str] | None:
    """The least time `extra_rows` more rows can add to a step's linears (`rows` in all: a verify step's), and the
    instructions it counts (a `peak_rates` name): the multiply-adds at the fewest vector instructions they take
    (fp32: one FMA per 8, or per 16 where the CPU has AVX-512; int8 in AVX-512 VNNI lanes: one vpdpbusd per 64) at
    this host's peak rate of those, with every load, conversion, scale, attention and sampling free. None where no
    such bound holds: int8 rows that run in AMX tiles (a tile multiply takes up to 16 rows at once: the extra rows'
    cost is their readout, not multiply-adds) and int8 in AVX2 lanes (three instructions per 32, whose rate this
    does not measure)."""
    macs = extra_rows * multiply_adds(model)
    if activations == "fp32":
        if any(m.plan.dtype != "float32" for m in model.modules() if isinstance(m, CpuLinear)):
            return None  # bf16 linears (`--dtype auto` chose them): bf16 dot products, which this does not count
        # the fewer seconds of the widths the host has (a lower bound whichever the kernel runs)
        bounds = [(macs / lanes / rates[f"fma{lanes}"], f"fma{lanes}") for lanes in (8, 16) if f"fma{lanes}" in rates]
        return min(bounds) if bounds else None
    kinds = {m.activations for m in model.modules() if isinstance(m, GGUFLinear)}
    if "vnni" not in rates or not kinds or not kinds <= {"int8-tiles", "int8-vnni"}:
        return None
    if "int8-tiles" in kinds:  # the rows must all run in the lanes: at most the crossovers' rows a call
        fmts = {m.fmt for m in model.modules() if isinstance(m, GGUFLinear)}
        if rows > min(amx_lane_rows_now(f) for f in fmts):
            return None
    return macs / 64 / rates["vnni"], "vnni"


def multiply_adds(model: torch.nn.Module) -> int:
    """Multiply-adds a row of a step spends in the target's linears (lm_head included): what a verify step's
    extra rows add to a decode step's arithmetic."""
    return sum(m.in_features * m.out_features for m in model.modules()
               if isinstance(m, (GGUFLinear, CpuLinear, torch.nn.Linear)))
