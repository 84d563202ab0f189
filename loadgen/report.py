"""Write a sweep's results: JSON (everything, with each point's `per_address` breakdown), CSV (one row per
setting and load point: the totals), PNG plots, tables."""

from __future__ import annotations

import csv
import json
from pathlib import Path

CSV_COLUMNS = [
    "setting", "mode", "load", "num_requests", "num_ok", "duration_s", "output_tokens", "output_tokens_per_s",
    "speedup_vs_baseline", "scaling_vs_lowest_load", "requests_per_s", "ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms",
    "itl_p50_ms", "itl_p90_ms", "itl_p99_ms", "latency_p50_ms", "latency_p90_ms", "latency_p99_ms",
    "server_queue_p50_ms", "acceptance_rate", "mean_accepted_length", "mean_tokens_per_message",
    "num_preemptions", "errors",
    # the long-prompt workload (loadgen/long_prompt.py)
    "stream_itl_quiet_p50_ms", "stream_itl_prefill_p99_ms", "stream_itl_prefill_max_ms",
    "stream_itl_prefill_p99_over_p50", "long_ttft_p50_ms", "long_ttft_max_ms",
]


def add_ratios(settings: dict[str, dict]) -> None:
    """Throughput relative to the first setting at the same load (e.g. speculation on vs off), and relative to
    the same setting's lowest load (e.g. concurrency 16 vs 1)."""
    names = list(settings)
    base = {(p["mode"], p["load"]): p["output_tokens_per_s"] for p in settings[names[0]]["points"]} if names else {}
    for s in settings.values():
        points = s["points"]
        lowest = min(points, key=lambda p: p["load"])["output_tokens_per_s"] if points else 0
        for p in points:
            b = base.get((p["mode"], p["load"]))
            p["speedup_vs_baseline"] = round(p["output_tokens_per_s"] / b, 4) if b else None
            p["scaling_vs_lowest_load"] = round(p["output_tokens_per_s"] / lowest, 4) if lowest else None


def write(out_dir: Path, config: dict, settings: dict[str, dict], plots: bool = True) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    add_ratios(settings)
    written = [out_dir / "results.json", out_dir / "results.csv"]
    written[0].write_text(json.dumps({"config": config, "settings": settings}, indent=2))
    with open(written[1], "w", newline="") as f:
        w = csv.DictWriter(f, CSV_COLUMNS, extrasaction="ignore")
        w.writeheader()
        for name, s in settings.items():
            for p in s["points"]:
                w.writerow({**p, "setting": name, "errors": json.dumps(p["errors"])})
    if plots:
        written += plot(out_dir, settings)
    return written


def plot(out_dir: Path, settings: dict[str, dict]) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, s in settings.items():
        pts = sorted(s["points"], key=lambda p: p["load"])
        xs = [p["itl_p99_ms"] for p in pts]
        ys = [p["output_tokens_per_s"] for p in pts]
        if any(x is None for x in xs):
            continue
        ax.plot(xs, ys, marker="o", label=name)
        for p, x, y in zip(pts, xs, ys):
            ax.annotate(p["label"], (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax.set_xlabel("p99 inter-token latency (ms)")
    ax.set_ylabel("output tokens / s")
    ax.set_title("Throughput vs p99 inter-token latency")
    paths.append(_save(plt, fig, ax, out_dir / "throughput_vs_p99_itl.png"))

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, s in settings.items():
        pts = sorted(s["points"], key=lambda p: p["load"])
        ax.plot([p["load"] for p in pts], [p["output_tokens_per_s"] for p in pts], marker="o", label=name)
    mode = next((p["mode"] for s in settings.values() for p in s["points"]), "closed")
    ax.set_xlabel("concurrency" if mode == "closed" else "arrival rate (requests / s)")
    ax.set_ylabel("output tokens / s")
    ax.set_xscale("log", base=2)
    paths.append(_save(plt, fig, ax, out_dir / "throughput_vs_load.png"))
    return paths


def _save(plt, fig, ax, path: Path) -> Path:
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def table(settings: dict[str, dict]):
    from rich.table import Table

    t = Table(title="specstep loadgen")
    for col in ("setting", "load", "ok", "tok/s", "x base", "TTFT p50", "ITL p50", "ITL p99", "latency p99",
                "accept", "tok/step"):
        t.add_column(col, justify="left" if col == "setting" else "right")

    def ms(v) -> str:
        return "-" if v is None else f"{v:.1f}"

    for name, s in settings.items():
        for p in s["points"]:
            t.add_row(name, p["label"], f"{p['num_ok']}/{p['num_requests']}", f"{p['output_tokens_per_s']:.1f}",
                      "-" if p.get("speedup_vs_baseline") is None else f"{p['speedup_vs_baseline']:.2f}",
                      ms(p["ttft_p50_ms"]), ms(p["itl_p50_ms"]), ms(p["itl_p99_ms"]), ms(p["latency_p99_ms"]),
                      "-" if p["acceptance_rate"] is None else f"{p['acceptance_rate']:.2f}",
                      "-" if p["mean_accepted_length"] is None else f"{p['mean_accepted_length']:.2f}")
    return t


def long_prompt_table(settings: dict[str, dict]):
    """The long-prompt workload: the streams' gaps while a long prompt is prefilled, and its TTFT."""
    from rich.table import Table

    t = Table(title="streams while a long prompt is prefilled")
    for col in ("setting", "streams", "ITL p50 quiet", "ITL p99 in prefill", "max in prefill", "p99 / p50 quiet",
                "long TTFT p50", "long TTFT max"):
        t.add_column(col, justify="left" if col == "setting" else "right")
    ms = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
    for name, s in settings.items():
        for p in s["points"]:
            if "stream_itl_prefill_p99_ms" in p:
                t.add_row(name, str(p["streams"]), ms(p["stream_itl_quiet_p50_ms"]), ms(p["stream_itl_prefill_p99_ms"]),
                          ms(p["stream_itl_prefill_max_ms"]), ms(p["stream_itl_prefill_p99_over_p50"]),
                          ms(p["long_ttft_p50_ms"]), ms(p["long_ttft_max_ms"]))
    return t


def address_table(settings: dict[str, dict]):
    """Each load point's share per replica (several `--address`)."""
    from rich.table import Table

    from specstep.loadgen.router import error_name

    t = Table(title="per address")
    for col in ("setting", "load", "address", "ok", "tokens", "errors", "TTFT p50", "latency p50", "latency p99"):
        t.add_column(col, justify="left" if col in ("setting", "address", "errors") else "right")
    ms = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
    for name, s in settings.items():
        for p in s["points"]:
            for address, a in p.get("per_address", {}).items():
                errors = ", ".join(f"{n} {error_name(code)}" for code, n in a["errors"].items()) or "-"
                down = s.get("replicas", {}).get(address, {}).get("down")
                t.add_row(name, p["label"], address + (" (down at the end)" if down else ""),
                          f"{a['num_ok']}/{a['num_requests']}", str(a["output_tokens"]), errors,
                          ms(a["ttft_p50_ms"]), ms(a["latency_p50_ms"]), ms(a["latency_p99_ms"]))
    return t

