"""Summary statistics of one load point, as measured by the client (docs/protocol.md defines the fields)."""

from __future__ import annotations

from collections import Counter

import numpy as np

from specstep.loadgen.client import Result
from specstep.loadgen.runner import RunResult

PERCENTILES = (50, 90, 99)


def percentiles(values: list[float], prefix: str) -> dict[str, float | None]:
    if not values:
        return {f"{prefix}_p{p}_ms": None for p in PERCENTILES} | {f"{prefix}_mean_ms": None}
    arr = np.asarray(values) * 1000.0
    out = {f"{prefix}_p{p}_ms": round(float(np.percentile(arr, p)), 3) for p in PERCENTILES}
    out[f"{prefix}_mean_ms"] = round(float(arr.mean()), 3)
    return out


def summarize(run: RunResult, addresses: list[str] | None = None) -> dict:
    """TTFT, inter-token latency (gaps between token-carrying messages; tokens accepted together in one
    speculative step arrive together), request latency, throughput and speculation acceptance; and, under
    `per_address`, each server's share (every one of `addresses`, if given, even one that got nothing)."""
    ok = [r for r in run.results if r.ok]
    errors = Counter(str(r.error.code) for r in run.results if r.error is not None)
    out_tokens = sum(r.num_output_tokens for r in ok)
    drafted = sum(r.final.spec.drafted_tokens for r in ok)
    accepted = sum(r.final.spec.accepted_tokens for r in ok)
    steps = sum(r.final.spec.spec_steps for r in ok)
    duration = max(run.duration_s, 1e-9)
    summary = {
        "mode": run.point.mode,
        "load": run.point.load,
        "label": run.point.label,
        "num_requests": len(run.results),
        "num_ok": len(ok),
        "errors": dict(errors),
        "duration_s": round(run.duration_s, 4),
        "output_tokens": out_tokens,
        "output_tokens_per_s": round(out_tokens / duration, 3),
        "requests_per_s": round(len(ok) / duration, 4),
        "mean_tokens_per_message": round(out_tokens / max(1, sum(len(r.chunk_times) for r in ok)), 4),
        "acceptance_rate": round(accepted / drafted, 4) if drafted else None,
        "mean_accepted_length": round(1 + accepted / steps, 4) if steps else None,
        "num_preemptions": sum(r.final.num_preemptions for r in ok),
    }
    summary |= percentiles([r.ttft for r in ok if r.ttft is not None], "ttft")
    summary |= percentiles([g for r in ok for g in r.itls], "itl")
    summary |= percentiles([r.end - r.start for r in ok], "latency")
    # Servers that report no timings (OpenAI-compatible peers: total_s 0) have no server-side queue time.
    summary |= percentiles([r.final.timings.queue_s for r in ok if r.final.timings.total_s > 0], "server_queue")
    summary["per_address"] = per_address(run.results, addresses or [])
    return summary


def per_address(results: list[Result], addresses: list[str]) -> dict[str, dict]:
    """Requests, output tokens, errors (by code, as in `summarize`), TTFT and latency per server. Results no
    server took (the router had none live) are under "unrouted"."""
    groups: dict[str, list[Result]] = {a: [] for a in addresses}
    for r in results:
        groups.setdefault(r.address or "unrouted", []).append(r)
    out = {}
    for address, rs in groups.items():
        ok = [r for r in rs if r.ok]
        out[address] = {
            "num_requests": len(rs),
            "num_ok": len(ok),
            "output_tokens": sum(r.num_output_tokens for r in ok),
            "errors": dict(Counter(str(r.error.code) for r in rs if r.error is not None)),
        }
        out[address] |= percentiles([r.ttft for r in ok if r.ttft is not None], "ttft")
        out[address] |= percentiles([r.end - r.start for r in ok], "latency")
    return out
