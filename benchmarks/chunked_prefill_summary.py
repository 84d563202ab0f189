"""The summary table of `benchmarks/bench_chunked_prefill.sh`: per load point, chunked prefill (`default`) against
whole-prompt prefill (`whole`) from each point's loadgen results.csv, and the long-prompt workload's stall.

    python benchmarks/chunked_prefill_summary.py OUT
"""

from __future__ import annotations

import csv
import sys
from pathlib import Path


def rows(path: Path) -> dict[str, dict[str, str]]:
    with path.open() as f:
        return {r["setting"]: r for r in csv.DictReader(f)}


def num(r: dict[str, str], key: str) -> float:
    return float(r[key]) if r.get(key) else float("nan")


def main(out: Path) -> None:
    print("| load | setting | tok/s | default / whole | TTFT p50 ms | ITL p50 ms | ITL p99 ms |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    points = sorted(out.glob("code-c*/results.csv"), key=lambda p: int(p.parent.name.removeprefix("code-c")))
    for path in points:
        by = rows(path)
        whole = num(by["whole"], "output_tokens_per_s")
        for name in ("default", "whole"):
            r = by[name]
            tps = num(r, "output_tokens_per_s")
            ratio = f"{tps / whole:.2f}" if name == "default" else ""
            print(f"| c={path.parent.name.removeprefix('code-c')} | {name} | {tps:.1f} | {ratio} | "
                  f"{num(r, 'ttft_p50_ms'):.0f} | {num(r, 'itl_p50_ms'):.0f} | {num(r, 'itl_p99_ms'):.0f} |")
    long = out / "long-prompt" / "results.csv"
    if long.exists():
        print()
        print("| long-prompt (4 streams, one 3,000-token prompt) | quiet ITL p50 ms | ITL p99 during its prefill ms "
              "| stall (p99 / quiet p50) | long prompt TTFT ms |")
        print("| --- | --- | --- | --- | --- |")
        for name, r in rows(long).items():
            print(f"| {name} | {num(r, 'stream_itl_quiet_p50_ms'):.0f} | {num(r, 'stream_itl_prefill_p99_ms'):.0f} | "
                  f"{num(r, 'stream_itl_prefill_p99_over_p50'):.1f}x | {num(r, 'long_ttft_p50_ms'):.0f} |")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
