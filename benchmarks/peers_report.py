"""What `bench_peers` prints from its results: a console table, a markdown table and the ratios
between engines.

Results hold, per engine, one entry per "mode/set/bN": median seconds over the sweeps (seconds_all: every sweep),
tokens, and the first sweep's output token ids.
"""

from __future__ import annotations

from pathlib import Path

from benchmarks.common import console, table

ENGINES = {"specstep": "specstep", "vllm": "vLLM", "transformers": "transformers"}


def engines(results: dict) -> dict[str, str]:
    """Engine key -> label, in the order they ran; specstep with other activations than fp32 (specstep-int8,
    specstep-auto) by them; llama.cpp (llamacpp, llamacpp-1t, ...) with its thread count."""
    out = {}
    for key, v in results.items():
        if not isinstance(v, dict):
            continue
        if key.startswith("specstep-"):
            out[key] = f"specstep, {key.removeprefix('specstep-')} activations"
        else:
            threads = v.get("threads")
            out[key] = ENGINES.get(key) or f"llama.cpp, {threads} thread{'s' if threads != 1 else ''}"
    return out


def runs(results: dict, engine: str) -> dict:
    return {k: v for k, v in results.get(engine, {}).items() if isinstance(v, dict)}


def tps(results: dict, engine: str, key: str) -> float | None:
    v = runs(results, engine).get(key)
    return v["tokens"] / v["seconds"] if v and v["seconds"] > 0 else None


def spread(v: dict) -> tuple[float, float]:
    """Slowest and fastest sweep, tokens/s."""
    return v["tokens"] / max(v["seconds_all"]), v["tokens"] / min(v["seconds_all"])


def same(outputs: list, ref: dict | None) -> tuple[int, int]:
    """Prompts whose tokens equal the reference run's, of those compared."""
    if ref is None:
        return 0, 0
    return sum(a == b for a, b in zip(outputs, ref["outputs"])), len(outputs)


def report(results: dict) -> None:
    rows = []
    for engine, label in engines(results).items():
        for key, v in runs(results, engine).items():
            mode, name, batch = key.split("/")
            own = tps(results, engine, f"plain/{name}/{batch}")
            peers = [tps(results, e, f"plain/{name}/{batch}") for e in ("vllm", "llamacpp")]
            t = v["tokens"] / v["seconds"]
            lo, hi = spread(v)
            ref = runs(results, "specstep").get(f"plain/{name}/{batch}")
            own_ref = runs(results, engine).get(f"plain/{name}/{batch}") if mode != "plain" else None
            eq, eq_own = same(v["outputs"], ref), same(v["outputs"], own_ref)
            rows.append([label, mode, name, batch, t, f"{lo:.1f}-{hi:.1f}", f"{t / own:.2f}" if own else "",
                         *(f"{t / p:.2f}" if p else "" for p in peers), "{}/{}".format(*eq),
                         "{}/{}".format(*eq_own) if own_ref else ""])
    table(f"greedy, {results['new_tokens']} new tokens, {Path(results['model']).name} ({results['machine']}), "
          f"median of {results['repeats']}",
          ["engine", "mode", "prompts", "batch", "tok/s", "range", "x own plain", "x vLLM plain",
           "x llama.cpp plain", "= specstep plain", "= own plain"], rows)
    ratios(results)


def markdown(results: dict) -> str:
    """A markdown table: tokens/s per engine and mode [range over sweeps] (ratio to the engine's own plain)."""
    cols = [f"{name} b{b}" for name in results["sets"] for b in results["batches"]]
    lines = ["| engine | mode | " + " | ".join(cols) + " | tokens = specstep plain | tokens = own plain |",
             "| --- | --- | " + " | ".join("---" for _ in cols) + " | --- | --- |"]
    for engine, label in engines(results).items():
        done = runs(results, engine)
        for mode in dict.fromkeys(k.split("/")[0] for k in done):
            cells, eq, eq_own = [], [0, 0], [0, 0]
            for col in cols:
                name, b = col.split()
                v, plain = done.get(f"{mode}/{name}/{b}"), done.get(f"plain/{name}/{b}")
                if v is None:
                    cells.append("-")
                    continue
                t = v["tokens"] / v["seconds"]
                lo, hi = spread(v)
                cells.append(f"{t:.1f}" + (f" [{lo:.1f}-{hi:.1f}]" if len(v["seconds_all"]) > 1 else "")
                             + ("" if mode == "plain" or not plain else
                                f" ({t / (plain['tokens'] / plain['seconds']):.2f}x)"))
                for acc, n in ((eq, same(v["outputs"], runs(results, "specstep").get(f"plain/{name}/{b}"))),
                               (eq_own, same(v["outputs"], plain if mode != "plain" else None))):
                    acc[0], acc[1] = acc[0] + n[0], acc[1] + n[1]
            own = "-" if mode == "plain" else f"{eq_own[0]}/{eq_own[1]}"
            lines.append(f"| {label} | {mode} | " + " | ".join(cells) + f" | {eq[0]}/{eq[1]} | {own} |")
    return "\n".join(lines)


def best(results: dict, engine: str, suffix: str, speculative: bool = True) -> tuple[float | None, str]:
    """The fastest mode of an engine on one set and batch: (tokens/s, mode); speculative modes only by default."""
    cands = [(tps(results, engine, k), k.split("/")[0]) for k in runs(results, engine)
             if k.endswith(suffix) and not (speculative and k.startswith("plain/"))]
    return max(cands, default=(None, ""))


def ratios(results: dict) -> None:
    """specstep against vLLM (plain and best speculative), against its own plain decoding, and against llama.cpp."""
    lines = []
    for name in results["sets"]:
        for batch in ("b1", "b8"):
            suffix = f"/{name}/{batch}"
            sp, vp = tps(results, "specstep", f"plain{suffix}"), tps(results, "vllm", f"plain{suffix}")
            best_s, best_v = best(results, "specstep", suffix), best(results, "vllm", suffix)
            if sp and vp:
                lines.append(f"{name} {batch}: specstep plain / vLLM plain = {sp / vp:.2f}")
            if best_s[0] and best_v[0]:
                lines.append(f"{name} {batch}: best specstep ({best_s[1]}) / best vLLM speculative = "
                             f"{best_s[0] / best_v[0]:.2f}")
            if name == "code" and batch == "b1" and sp and best_s[0]:
                lines.append(f"code b1: best specstep ({best_s[1]}) / specstep plain = {best_s[0] / sp:.2f}")
            ours = [e for e in engines(results) if e.startswith("specstep")]
            for engine in ours[1:]:  # other activations: against their own plain and specstep's fp32
                own, best_o = tps(results, engine, f"plain{suffix}"), best(results, engine, suffix)
                if own and sp:
                    lines.append(f"{name} {batch}: {engine} plain / specstep plain = {own / sp:.2f}")
                if own and best_o[0]:
                    lines.append(f"{name} {batch}: best {engine} ({best_o[1]}) / {engine} plain = "
                                 f"{best_o[0] / own:.2f}")
            for engine, label in engines(results).items():
                if not engine.startswith("llamacpp"):
                    continue
                lp = tps(results, engine, f"plain{suffix}")
                best_l = best(results, engine, suffix, speculative=False)
                for ours_engine in ours:
                    op = tps(results, ours_engine, f"plain{suffix}")
                    if op and lp:
                        lines.append(f"{name} {batch}: {ours_engine} plain / {label} plain = {op / lp:.2f}")
                    top_s = best(results, ours_engine, suffix, speculative=False)
                    if top_s[0] and best_l[0]:
                        lines.append(f"{name} {batch}: fastest {ours_engine} ({top_s[1]}) / fastest {label} "
                                     f"({best_l[1]}) = {top_s[0] / best_l[0]:.2f}")
    for line in lines:
        console.print(line)
