"""`specstep generate`: offline batched generation. A stable contract: JSONL in, JSONL out.

Input lines: {"prompt": "..."} or {"prompt_token_ids": [...]}, optionally with per-line "max_tokens",
"temperature", "top_p", "top_k", "seed". Output lines: prompt_token_ids, token_ids, text, finish_reason, spec
(per-request speculation stats) and timings.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import sys
import time
from pathlib import Path

from specstep.engine.errors import SpecstepError
from specstep.engine.model_source import default_target, resolve_model
from specstep.scheduler.engine_options import add_engine_arguments, engine_config_from_args

__all__ = ["add_arguments", "engine_config_from_args", "ready_text", "resolve_model_arg", "run"]

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
PER_LINE_FIELDS = {"max_tokens": int, "temperature": float, "top_p": float, "top_k": int, "seed": int}


def resolve_model_arg(args: argparse.Namespace) -> tuple[str, str]:
    """Fill in the default target and convert a GGUF once, here; returns the model's (name, origin).

    After this `args.model` is a Hugging Face-format folder, so the processes started later only load it."""
    origin = args.model
    if args.model is None:
        choice = default_target(announce=True)
        args.model, origin = choice.reference, choice.origin
    name = Path(args.model).stem if Path(args.model).suffix == ".gguf" else Path(args.model).name
    args.model = str(resolve_model(args.model))
    return name, origin


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_engine_arguments(p, "generate")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", help="a single prompt text (default, without --prompts: 'def fibonacci(n):\\n')")
    src.add_argument("--prompts", help="JSONL file: one {\"prompt\": ...} or {\"prompt_token_ids\": [...]} per line "
                                      "(default: none, a single --prompt)")
    p.add_argument("--max-tokens", type=int, default=64, help="output tokens per prompt (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default: %(default)s, greedy)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (default: %(default)s = off)")
    p.add_argument("--top-k", type=int, default=0, help="top-k sampling (default: %(default)s = off)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (default: a random one per prompt)")
    p.add_argument("--ignore-eos", action="store_true", help="generate past end-of-sequence (default: stop there)")
    p.add_argument("--output", help="write JSONL here (default: stdout)")
    p.add_argument("--trace", help="write a Chrome/Perfetto trace of the run here (default: none)")
    # WARNING, not serve's INFO: stderr carries the ready line and the summary, and start-up's INFO lines (capture,
    # kernel timings) would bury them.
    p.add_argument("--log-level", type=str.upper, default="WARNING", choices=LOG_LEVELS,
                   help="the engine's log messages on stderr from this level up (default: %(default)s)")


def read_inputs(args: argparse.Namespace) -> list[dict]:
    if args.prompts is None:
        text = args.prompt if args.prompt is not None else "def fibonacci(n):\n"
        return [{"prompt": text}]
    path = Path(args.prompts)
    if not path.is_file():
        raise SpecstepError(f"prompts file {args.prompts!r} does not exist")
    items = []
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as e:
            raise SpecstepError(f"{path}:{lineno}: malformed JSON ({e.msg})") from None
        if not isinstance(item, dict) or ("prompt" in item) == ("prompt_token_ids" in item):
            raise SpecstepError(f"{path}:{lineno}: each line needs exactly one of 'prompt' or 'prompt_token_ids'")
        for name, kind in PER_LINE_FIELDS.items():
            if name in item and (not isinstance(item[name], (int, float)) or isinstance(item[name], bool)):
                raise SpecstepError(f"{path}:{lineno}: {name!r} must be a number")
            if name in item:
                item[name] = kind(item[name])
        item["_where"] = f"{path}:{lineno}"
        items.append(item)
    if not items:
        raise SpecstepError(f"{path}: no prompts")
    return items


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level, format="specstep generate %(levelname)s: %(message)s")
    try:
        return _run(args)
    except (SpecstepError, ValueError) as e:
        print(f"specstep generate: error: {e}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    from specstep.scheduler.build import build_engine

    items = read_inputs(args)
    resolve_model_arg(args)
    recorder, tracer = make_tracer(args.trace)
    core, tokenizer, info = build_engine(engine_config_from_args(args), tracer)
    reqs = _add_requests(core, items, args, tokenizer, info.vocab_size)

    # After every input is checked (an input error stays a one-line message), before the first step.
    print(f"specstep generate: ready ({ready_text(info)})", file=sys.stderr, flush=True)
    start = time.perf_counter()
    while core.has_unfinished():
        core.step()
    elapsed = time.perf_counter() - start
    core.check_integrity()
    core.close()
    if recorder is not None:
        recorder.save(args.trace)

    _write_outputs(reqs, tokenizer, args.output)
    total = sum(r.num_output_tokens for r in reqs)
    print(f"{len(reqs)} requests, {total} tokens in {elapsed:.2f}s ({total / elapsed:.1f} tok/s), spec={info.spec}",
          file=sys.stderr)
    return 0


def _add_requests(core, items: list[dict], args: argparse.Namespace, tokenizer, vocab_size: int) -> list:
    """One request per input, added to the engine core; per-line fields override the command line's."""
    from specstep.engine.sampling_params import SamplingParams
    from specstep.scheduler.core.request import Request

    reqs = []
    for i, item in enumerate(items):
        where = item.get("_where", "--prompt")
        ids = _prompt_ids(item, where, tokenizer, vocab_size, args.model)
        seed = item.get("seed", args.seed)
        params = SamplingParams(temperature=item.get("temperature", args.temperature),
                                top_p=item.get("top_p", args.top_p), top_k=item.get("top_k", args.top_k),
                                max_tokens=item.get("max_tokens", args.max_tokens), seed=seed,
                                ignore_eos=args.ignore_eos)
        try:
            req = Request(str(i), ids, params, seed=seed if seed is not None else random.getrandbits(63))
            core.add_request(req)
        except SpecstepError as e:
            raise SpecstepError(f"{where}: {e}") from None
        reqs.append(req)
    return reqs


def _prompt_ids(item: dict, where: str, tokenizer, vocab_size: int, model: str) -> list[int]:
    if "prompt" in item:
        if not isinstance(item["prompt"], str) or not item["prompt"]:
            raise SpecstepError(f"{where}: 'prompt' must be a non-empty string")
        if tokenizer is None:
            raise SpecstepError(f"{model}: no tokenizer.json; give prompt_token_ids instead")
        return tokenizer.encode(item["prompt"])
    ids = item["prompt_token_ids"]
    if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise SpecstepError(f"{where}: 'prompt_token_ids' must be a non-empty list of integers")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise SpecstepError(f"{where}: token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")
    return ids


def _write_outputs(reqs: list, tokenizer, output: str | None) -> None:
    """One JSONL line per request, in input order, to `output` (default: stdout)."""
    out = open(output, "w") if output else sys.stdout
    try:
        for req in reqs:
            line = {
                "prompt_token_ids": req.prompt_token_ids,
                "token_ids": req.output_token_ids,
                "text": tokenizer.decode(req.output_token_ids) if tokenizer else None,
                "finish_reason": req.finish_reason.value if req.finish_reason else None,
                "spec": req.stats.to_dict(),
            }
            out.write(json.dumps(line) + "\n")
    finally:
        if out is not sys.stdout:
            out.close()


def ready_text(info) -> str:
    """`spec X, N KV pages; kv cache ... (how it was sized)[; graphs ...]; chunked prefill ...[; CPU kernels]`:
    the start-up facts a user checks first."""
    # Imported here: `serve` imports this module in its frontend process, which never imports torch.
    from specstep.cuda_graphs.runner import describe_capture

    text = f"spec {info.spec}, {info.num_pages} KV pages"
    text = f"{text}; {info.memory.describe()}" if info.memory is not None else text
    graphs = describe_capture(info.graphs)
    text = f"{text}; {graphs}" if graphs else text
    text = f"{text}; {info.prefill}" if info.prefill else text
    return f"{text}; {info.kernels}" if info.kernels else text


def make_tracer(path: str | None):
    """NVTX ranges always (free without a profiler); a recorder too when a trace file is asked for."""
    from specstep.traces.tracer import Tracer, TraceRecorder

    recorder = TraceRecorder() if path else None
    return recorder, Tracer(recorder)
