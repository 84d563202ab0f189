"""Step-time microbenchmarks on Llama-shaped random-weight models (run by scripts/gpu_check.sh).

    python scripts/gpu_bench.py --out results.json [--shapes 1B,8B] [--buckets 1,4,16] [--time-budget 240]
    python scripts/gpu_bench.py --device cpu --shapes tiny --dtype float32 --buckets 1,2 --iters 3   (smoke test)

Per shape: a bf16 target built directly from a ModelConfig (random init, no checkpoint) and a one-layer MTP
head. Measured per step kind and batch bucket, with graphs on and off:
    decode  target, 1 token per request          verify  target, k + 1 = 5 tokens per request
    draft   MTP head, k = 4 greedy steps (1 graph)  refill  MTP head over 5 tokens per request
and, when flashinfer imports, decode/verify again with FlashInfer attention ("fi_decode", "fi_verify"): after
the torch figures are written, captured in a GraphRunner of their own (its own memory pool), so a FlashInfer
failure is recorded in the output (`results[shape]["flashinfer"]`, `errors`) and loses nothing else.
Also: device copy bandwidth, the decode memory-bandwidth floor (weight bytes / copy bandwidth), and three bounds
checked (graph >= 2x eager for decode at batch 1 on 1B; decode <= 1.3x floor on 8B at batch 1; verify(5) <= 1.15x
decode at batch 1). Writes JSON to --out and prints a short table last.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

SHAPES = {  # Llama 3.2 1B and Llama 3.1 8B shapes; "tiny" for CPU smoke tests
    "1B": dict(hidden_size=2048, intermediate_size=8192, num_layers=16, num_heads=32, num_kv_heads=8,
               head_dim=64, vocab_size=128256, tie_word_embeddings=True),
    "8B": dict(hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32, num_kv_heads=8,
               head_dim=128, vocab_size=128256),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                 vocab_size=320),
}
PAGE, K = 16, 4


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="gpu_bench.json", help="JSON results file")
    p.add_argument("--shapes", default="1B,8B")
    p.add_argument("--buckets", default="1,4,16")
    p.add_argument("--ctx", type=int, default=448, help="context tokens per request before the step")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--time-budget", type=float, default=240.0, help="seconds; later measurements are skipped")
    p.add_argument("--no-flashinfer", action="store_true")
    return p.parse_args(argv)


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        import torch

        self.torch, self.args = torch, args
        self.device = torch.device(args.device)
        self.dtype = getattr(torch, args.dtype)
        self.cuda = self.device.type == "cuda"
        self.t0 = time.perf_counter()
        self.rows: list[dict] = []
        self.skipped: list[str] = []

    def over_budget(self, what: str) -> bool:
        if time.perf_counter() - self.t0 > self.args.time_budget:
            self.skipped.append(what)
            return True
        return False

    def time_ms(self, fn, iters: int, warmup: int = 3) -> float:
        torch = self.torch
        for _ in range(warmup):
            fn()
        if not self.cuda:
            t = time.perf_counter()
            for _ in range(iters):
                fn()
            return (time.perf_counter() - t) * 1e3 / iters
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / iters

    def copy_bandwidth(self) -> float:
        """Bytes per second moved by a device-to-device copy (read + write counted)."""
        n = (1 << 30) if self.cuda else (64 << 20)
        src = self.torch.empty(n, dtype=self.torch.uint8, device=self.device)
        dst = self.torch.empty_like(src)
        ms = self.time_ms(lambda: dst.copy_(src), 10)
        return 2 * n / (ms * 1e-3)

    def build(self, cfg):
        """A model on the device with random weights: built on meta, materialised, then initialised."""
        torch = self.torch
        from specstep.engine.models.llama import LlamaForCausalLM
        from specstep.engine.models.mtp_head import MTPHead

        cls = MTPHead if cfg.architecture == "mtp" else LlamaForCausalLM
        default = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device("meta"):
                model = cls(cfg)
        finally:
            torch.set_default_dtype(default)
        model = model.to_empty(device=self.device).eval()
        if getattr(cfg, "tie_word_embeddings", False) and hasattr(model, "lm_head"):
            model.lm_head.weight = model.embed_tokens.weight  # to_empty does not keep the tie
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(1.0) if p.dim() == 1 else p.normal_(0.0, 0.02)  # 1-D parameters are RMSNorm weights
        model.rotary.build_tables(self.device)
        return model


def weight_bytes(model) -> int:
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


def decode_read_bytes(model) -> int:
    """Weight bytes a decode step must read: all of them, less an untied embedding (one row is read)."""
    emb = model.embed_tokens.weight
    tied = emb.data_ptr() == model.lm_head.weight.data_ptr()
    return weight_bytes(model) - (0 if tied else emb.numel() * emb.element_size())


class FlashInferRoute:
    """fi_<kind> step kinds: the target's decode/verify steps with FlashInfer installed as the target's
    attention backend while the step's Python runs (eagerly, or once under capture); the plain kinds keep
    the torch backend. Plans are made once per (kind, batch) outside the timed loop: lengths are fixed here."""

    def __init__(self, bench: Bench, cfg, target, max_pages) -> None:
        from specstep.engine.attention import flashinfer_backend as fib

        self.fi = fib.FlashInferAttention(cfg, PAGE, bench.dtype, bench.device, max_pages)
        self.target = target
        self.calls = 0

    def kind(self, name: str, pool, inputs, q: int):
        from specstep.cuda_graphs import StepKind
        from tests.graph_reference_steps import target_step

        step = target_step(self.target, pool, slot=name)

        def fn(inp, key):
            reference, self.target.attention = self.target.attention, self.fi
            self.calls += 1
            try:
                return step(inp, key)
            finally:
                self.target.attention = reference

        return StepKind(f"fi_{name}", fn, inputs, (q,), prepare=lambda key: self.fi.plan_padding(name, key.batch, q))


def bench_shape(bench: Bench, name: str, buckets: list[int], fi_enabled: bool, result: dict, save) -> None:
    """Measure `name` into `result` (the caller's, already in the saved results): the torch backend's kinds,
    `save()`, then FlashInfer's in a runner of their own."""
    import dataclasses

    torch = bench.torch
    from specstep.cuda_graphs import StepKind
    from specstep.engine.config import ModelConfig
    from specstep.engine.kv_cache import KVPool
    from tests.graph_reference_steps import mtp_draft_step, mtp_inputs, mtp_refill_step, target_inputs, target_step

    args = bench.args
    cfg = ModelConfig(architecture="llama", max_position_embeddings=2048, rope_theta=500000.0, **SHAPES[name])
    t = time.perf_counter()
    target = bench.build(cfg)
    head_cfg = dataclasses.replace(cfg, architecture="mtp", num_layers=1)
    head = bench.build(head_cfg)
    max_pages = -(-(args.ctx + K + 1) // PAGE)
    pages = max(buckets) * max_pages + 1
    pool = KVPool(cfg, cfg.num_layers, pages, PAGE, bench.dtype, bench.device)
    head_pool = KVPool(head_cfg, 1, pages, PAGE, bench.dtype, bench.device)
    result.update({"config": dataclasses.asdict(cfg), "weight_bytes": weight_bytes(target),
                   "decode_read_bytes": decode_read_bytes(target), "head_weight_bytes": weight_bytes(head),
                   "build_s": time.perf_counter() - t, "flashinfer": "off"})

    kinds = [StepKind("decode", target_step(target, pool), target_inputs(max_pages), (1,)),
             StepKind("verify", target_step(target, pool), target_inputs(max_pages), (K + 1,)),
             StepKind("draft", mtp_draft_step(head, target, head_pool, K),
                      mtp_inputs(max_pages, cfg.hidden_size, bench.dtype), (1,)),
             StepKind("refill", mtp_refill_step(head, target, head_pool),
                      mtp_inputs(max_pages, cfg.hidden_size, bench.dtype), (K + 1,))]
    result["capture"], result["steps"] = _measure(bench, name, kinds, buckets, max_pages, cfg)
    save()  # the torch figures are on disk before FlashInfer runs
    if fi_enabled and not bench.over_budget(f"{name} flashinfer"):
        _measure_flashinfer(bench, name, cfg, target, pool, buckets, max_pages, result)
    del target, head, pool, head_pool
    if bench.cuda:
        torch.cuda.empty_cache()


def _measure_flashinfer(bench: Bench, name, cfg, target, pool, buckets, max_pages, result) -> None:
    """fi_decode / fi_verify in a GraphRunner of their own: a failure (not installed, a kernel that would need
    compiling, a capture error) is recorded, and the torch figures already measured stay."""
    from specstep.engine.errors import ConfigError
    from tests.graph_reference_steps import target_inputs

    try:
        route = FlashInferRoute(bench, cfg, target, max_pages)
    except ConfigError as e:  # not installed, or no CUDA device
        result["flashinfer"] = f"skipped: {e}"
        return
    kinds = [route.kind("decode", pool, target_inputs(max_pages), 1),
             route.kind("verify", pool, target_inputs(max_pages), K + 1)]
    try:
        result["flashinfer_capture"], rows = _measure(bench, name, kinds, buckets, max_pages, cfg, route)
    except Exception as e:  # noqa: BLE001 (recorded: the check's first run on real hardware reads it here)
        result["flashinfer"] = f"failed: {type(e).__name__}: {e}"
        return
    finally:
        result["flashinfer_calls"] = route.calls
    result["flashinfer"] = "on"
    result["steps"] = result["steps"] + rows


def _measure(bench: Bench, name, kinds, buckets, max_pages, cfg, route=None) -> tuple[dict, list[dict]]:
    """Capture `kinds` in a GraphRunner of their own (its own memory pool on CUDA), then time each kind and
    bucket replayed and eager. Rows join `bench.rows` only once all are measured."""
    import numpy as np

    torch, args = bench.torch, bench.args
    from specstep.cuda_graphs import GraphConfig, GraphRunner

    on = GraphRunner(bench.device, GraphConfig(buckets=tuple(buckets), max_batch=max(buckets)))
    off = GraphRunner(bench.device, GraphConfig(enabled=False, max_batch=max(buckets)))
    for k in kinds:
        on.register(k)
        off.register(k)
    info = on.capture()

    rows = []
    for kind in kinds:
        q = kind.q_values[0]
        for b in buckets:
            if bench.over_budget(f"{name} {kind.name} b={b}"):
                continue
            pt = torch.arange(1, 1 + b * max_pages, device=bench.device).view(b, max_pages)
            inp = {"start": torch.full((b,), args.ctx, device=bench.device), "page_table": pt,
                   "input_ids": torch.randint(0, cfg.vocab_size, (b * q,), device=bench.device)}
            if kind.name in ("draft", "refill"):
                inp["hidden"] = torch.randn(b * q, cfg.hidden_size, device=bench.device, dtype=bench.dtype)
            if kind.name.startswith("fi_"):  # lengths are fixed here: plan once, outside the timed loop
                route.fi.plan(kind.name[3:], np.full(b, q), np.full(b, args.ctx + q), pt.cpu().numpy(), lanes=b)
            for graphs, runner in (("on", on), ("off", off)):
                ms = bench.time_ms(lambda r=runner, n=kind.name, q=q, i=inp, b=b: r.run(n, q, i, b), args.iters)
                rows.append({"shape": name, "kind": kind.name, "batch": b, "q": q, "graphs": graphs, "ms": ms})
    bench.rows.extend(rows)
    return info.to_dict(), rows


def step_ms(rows, shape, kind, batch, graphs="on"):
    return next((r["ms"] for r in rows if (r["shape"], r["kind"], r["batch"], r["graphs"]) ==
                 (shape, kind, batch, graphs)), None)


def summarise(rows, results, bandwidth) -> dict:
    out = {}
    best = lambda shape, kind: min((v for v in (step_ms(rows, shape, kind, 1), step_ms(rows, shape, "fi_" + kind, 1))
                                    if v is not None), default=None)
    for shape, res in results.items():
        if "decode_read_bytes" not in res:  # failed while building
            continue
        floor_ms = res["decode_read_bytes"] / bandwidth * 1e3
        res["floor_ms"] = floor_ms
        dec, ver = best(shape, "decode"), best(shape, "verify")
        eager, graph = step_ms(rows, shape, "decode", 1, "off"), step_ms(rows, shape, "decode", 1, "on")
        out[shape] = {"floor_ms": floor_ms, "decode_ms": dec, "decode_over_floor": dec / floor_ms if dec else None,
                      "verify5_over_decode": ver / dec if dec and ver else None,
                      "graph_speedup_decode_b1": eager / graph if eager and graph else None}
    checks = {"graph >= 2x eager (decode, b=1, 1B)": ("1B", "graph_speedup_decode_b1", lambda v: v >= 2.0),
              "decode <= 1.3x floor (b=1, 8B)": ("8B", "decode_over_floor", lambda v: v <= 1.3),
              "verify(5) <= 1.15x decode (b=1, 8B)": ("8B", "verify5_over_decode", lambda v: v <= 1.15)}
    out["checks"] = {label: (None if out.get(s, {}).get(f) is None else bool(ok(out[s][f])))
                     for label, (s, f, ok) in checks.items()}
    return out


def table(rows, summary) -> str:
    lines = [f"{'shape':<6}{'kind':<11}{'batch':>6}{'q':>3}{'graphs ms':>11}{'eager ms':>10}{'speedup':>9}"]
    keys = sorted({(r["shape"], r["kind"], r["batch"], r["q"]) for r in rows}, key=lambda x: (x[0], x[1], x[2]))
    for shape, kind, b, q in keys:
        on, off = step_ms(rows, shape, kind, b, "on"), step_ms(rows, shape, kind, b, "off")
        sp = f"{off / on:.2f}x" if on and off else "-"
        lines.append(f"{shape:<6}{kind:<11}{b:>6}{q:>3}{on or float('nan'):>11.3f}{off or float('nan'):>10.3f}"
                     f"{sp:>9}")
    for shape, s in summary.items():
        if shape != "checks":
            lines.append(f"{shape}: floor {s['floor_ms']:.3f} ms, decode/floor {_f(s['decode_over_floor'])}, "
                         f"verify5/decode {_f(s['verify5_over_decode'])}, graph speedup b=1 "
                         f"{_f(s['graph_speedup_decode_b1'])}")
    for label, ok in summary["checks"].items():
        lines.append(f"  [{'PASS' if ok else 'FAIL' if ok is False else 'n/a '}] {label}")
    return "\n".join(lines)


def _f(v) -> str:
    return "n/a" if v is None else f"{v:.2f}"


def main(argv=None) -> int:
    args = parse_args(argv)
    bench = Bench(args)
    torch = bench.torch
    if bench.cuda and not torch.cuda.is_available():
        print("gpu_bench: no CUDA device", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    env = {"torch": torch.__version__, "device": torch.cuda.get_device_name() if bench.cuda else "cpu",
           "dtype": args.dtype, "ctx": args.ctx, "k": K, "page_size": PAGE}
    try:
        import flashinfer

        env["flashinfer"] = getattr(flashinfer, "__version__", "unknown")
    except ImportError:
        env["flashinfer"] = None
    bandwidth = bench.copy_bandwidth()
    env["copy_bandwidth_GBps"] = bandwidth / 1e9
    buckets = [int(b) for b in args.buckets.split(",")]
    results, errors = {}, {}

    def save() -> dict:
        summary = summarise(bench.rows, results, bandwidth)
        out = {"env": env, "results": results, "summary": summary, "errors": errors, "skipped": bench.skipped,
               "seconds": time.perf_counter() - bench.t0}
        Path(args.out).write_text(json.dumps(out, indent=2))
        return summary

    with torch.inference_mode():
        for shape in args.shapes.split(","):
            if bench.over_budget(shape):
                continue
            results[shape] = {}
            try:
                bench_shape(bench, shape, buckets, not args.no_flashinfer, results[shape], save)
            except Exception as e:  # noqa: BLE001 (record it, keep measuring the other shapes)
                errors[shape] = f"{type(e).__name__}: {e}"
                print(f"gpu_bench: {shape} failed: {errors[shape]}", file=sys.stderr)
            if results[shape].get("flashinfer", "").startswith("failed"):
                errors[f"{shape} flashinfer"] = results[shape]["flashinfer"]
                print(f"gpu_bench: {shape} FlashInfer {results[shape]['flashinfer']}", file=sys.stderr)
            save()  # after every shape: a timeout keeps what was measured
    summary = save()
    print(f"copy bandwidth {bandwidth / 1e9:.0f} GB/s; results in {args.out}; "
          f"{len(bench.skipped)} measurements skipped (time budget)")
    print(table(bench.rows, summary))
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
