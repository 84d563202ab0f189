"""Shared pieces of the benchmarks: prompts, running the engine on a workload, tables.

Benchmarks print ratios measured side by side in one run (the machine is shared and noisy; absolute figures
move, ratios much less). They are scripts, never timed tests. Run as a script, a benchmark's tables are also
appended to a dated file under benchmarks/results/ (`$SPECSTEP_RESULTS_DIR` moves it; empty: off) that names the
date, the host's CPU and flags and the command.
"""

from __future__ import annotations

import os
import shlex
import sys

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import random  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from specstep.engine.engine_config import DEFAULT_TARGET, EngineConfig  # noqa: E402
from specstep.engine.sampling_params import SamplingParams  # noqa: E402
from specstep.scheduler.build import build_engine  # noqa: E402
from specstep.scheduler.core.request import Request  # noqa: E402

console = Console()


def code_prompts(n: int, length: int, seed: int = 0, model: Path = DEFAULT_TARGET) -> list[list[int]]:
    """Prompts cut from held-out standard-library files (never seen in training)."""
    from tokenizers import Tokenizer

    from specstep.training.data import heldout_prompts

    return heldout_prompts(Tokenizer.from_file(str(Path(model) / "tokenizer.json")), n, length, seed)


def random_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """Unpredictable prompts: uniformly random token ids (no structure for any proposer to exploit)."""
    rng = random.Random(seed)
    return [[rng.randrange(1, vocab) for _ in range(length)] for _ in range(n)]


@dataclass
class RunResult:
    tokens: int
    seconds: float
    drafted: int
    accepted: int
    spec_steps: int
    outputs: list[list[int]]

    @property
    def tok_per_s(self) -> float:
        return self.tokens / self.seconds

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        return 1 + self.accepted / self.spec_steps if self.spec_steps else 1.0


def run_engine(cfg: EngineConfig, prompts: list[list[int]], params: SamplingParams, batch: int,
               warmup: bool = True) -> RunResult:
    """Generate for every prompt, `batch` requests at a time (closed loop: a new one starts as one finishes)."""
    core, _, _ = build_engine(cfg)
    if warmup:
        drive(core, prompts[:1], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), 1, seed0=10**6)
    start = time.perf_counter()
    reqs = drive(core, prompts, params, batch)
    seconds = time.perf_counter() - start
    core.stream.close()
    return RunResult(tokens=sum(r.num_output_tokens for r in reqs), seconds=seconds,
                     drafted=sum(r.stats.drafted for r in reqs), accepted=sum(r.stats.accepted for r in reqs),
                     spec_steps=sum(r.stats.steps for r in reqs), outputs=[r.output_token_ids for r in reqs])


def drive(core, prompts, params, batch, seed0=0) -> list[Request]:
    pending = [Request(str(seed0 + i), list(p), params, seed=seed0 + i) for i, p in enumerate(prompts)]
    live = []
    done = []
    while pending or live:
        while pending and len(live) < batch:
            live.append(pending.pop(0))
            core.add_request(live[-1])
        core.step()
        done += [r for r in live if r.finished]
        live = [r for r in live if not r.finished]
    return sorted(done, key=lambda r: int(r.request_id))  # submission order, whatever order they finished in


def table(title: str, columns: list[str], rows: list[list]) -> None:
    t = Table(title=title)
    for c in columns:
        t.add_column(c, justify="right")
    for r in rows:
        t.add_row(*[f"{x:.2f}" if isinstance(x, float) else str(x) for x in r])
    console.print(t)
    record(title, columns, rows)


RESULTS_DIR = Path(__file__).resolve().parent / "results"
ISA_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "avx512_fp16",
             "amx_tile", "amx_int8", "amx_bf16")


def cpu() -> tuple[str, list[str]]:
    """The CPU's model name and which of the ISA flags the kernels choose by it has (Linux; empty elsewhere)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown CPU", []
    field = lambda key: next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith(key)), "")
    flags = set(field("flags").split())
    return field("model name") or "unknown CPU", [f for f in ISA_FLAGS if f in flags]


def results_file(script: str, name: str, flags: list[str], day: str) -> Path:
    """benchmarks/results/DATE-SCRIPT-HOST.md, HOST from the vendor and the widest ISA (amx, avx512, avx2)."""
    vendor = next((v for v in ("amd", "intel") if v in name.lower()), "cpu")
    isa = next((tag for flag, tag in (("amx_int8", "amx"), ("avx512f", "avx512"), ("avx2", "avx2")) if flag in flags),
               "base")
    root = Path(os.environ.get("SPECSTEP_RESULTS_DIR", RESULTS_DIR))
    return root / f"{day}-{script}-{vendor}-{isa}.md"


RECORDED_ENV = ("SPECSTEP_CPU_ISA",)  # environment variables a record's command line shows where set


def record(title: str, columns: list[str], rows: list[list]) -> Path | None:
    """Append one table as markdown to the results file when a benchmark runs as a script (`python -m
    benchmarks.bench_x` or its path): never from tests or other callers, which would write into the tree."""
    script = Path(sys.argv[0])
    if os.environ.get("SPECSTEP_RESULTS_DIR") == "" or script.parent.name != "benchmarks" \
            or not script.stem.startswith("bench_"):
        return None
    name, flags = cpu()
    now = time.gmtime()
    path = results_file(script.stem, name, flags, time.strftime("%Y-%m-%d", now))
    path.parent.mkdir(parents=True, exist_ok=True)
    cell = lambda x: f"{x:.2f}" if isinstance(x, float) else str(x)
    lines = [] if path.exists() else [f"# {script.stem} on {name}", "", f"- Host: {name}, {os.cpu_count()} cores, "
                                      f"flags {' '.join(flags) or 'none of ' + ' '.join(ISA_FLAGS)}",
                                      f"- torch {torch.__version__}, {torch.get_num_threads()} threads", ""]
    load = " / ".join(f"{x:.2f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "unknown"
    # (settings from the environment that choose the kernels: a figure pinned to AVX2 must say so)
    env = [f"{k}={os.environ[k]}" for k in RECORDED_ENV if os.environ.get(k)]
    command = shlex.join([*env, "python", "-m", f"benchmarks.{script.stem}", *sys.argv[1:]])
    lines += [f"## {title}", "", f"- Date: {time.strftime('%Y-%m-%d %H:%M UTC', now)}, load average {load}",
              f"- Command: `{command}`", "",
              "| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns),
              *("| " + " | ".join(cell(x) for x in r) + " |" for r in rows), ""]
    with path.open("a") as f:
        f.write("\n".join(lines) + "\n")
    return path


def machine() -> str:
    return f"{os.cpu_count()} cores, torch {torch.__version__}, threads {torch.get_num_threads()}"
