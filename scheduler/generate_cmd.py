"""`specstep generate`: offline batched generation. A stable contract: JSONL in, JSONL out.

Input lines: {"prompt": "..."} or {"prompt_token_ids": [...]}, optionally with per-line "max_tokens",
"temperature", "top_p", "top_k", "seed". Output lines: prompt_token_ids, token_ids, text, finish_reason, spec
(per-request speculation stats) and timings.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

from specstep.engine.engine_config import SPEC_KINDS, EngineConfig
from specstep.engine.errors import SpecstepError
from specstep.engine.model_source import default_target, resolve_model
from specstep.scheduler.spec_policy import OBJECTIVES

PER_LINE_FIELDS = {"max_tokens": int, "temperature": float, "top_p": float, "top_k": int, "seed": int}


def add_engine_arguments(p: argparse.ArgumentParser, max_step_latency: float | None = None) -> None:
    """Engine options shared by `generate` and `serve` (`max_step_latency`: the command's default; None: chunked
    prefill off unless asked for)."""
    p.add_argument("--model", default=None,
                   help="target model: a Hugging Face folder or a GGUF file (converted once into "
                        f"~/.cache/specstep). Default: {default_target().origin}")
    p.add_argument("--spec", choices=SPEC_KINDS, default="none", help="speculation proposer (default: %(default)s)")
    p.add_argument("--draft", default=None,
                   help="draft model or MTP head folder (default: the one shipped for the target, if any)")
    p.add_argument("--draft-vocab", type=int, default=None,
                   help="drafter vocabulary: the N most frequent tokens from its folder's draft_vocab.json "
                        "(default: all of that list when present; 0: the full vocabulary). Lossless either way")
    p.add_argument("--num-spec-tokens", type=int, default=4,
                   help="draft tokens per step (k; the maximum if adaptive; default: %(default)s)")
    p.add_argument("--spec-policy", choices=["fixed", "adaptive"], default="adaptive",
                   help="fixed k, or choose k per step/request from measured acceptance and step costs, with a "
                        "governor that turns speculation off where it loses more than --spec-delta "
                        "(default: %(default)s)")
    p.add_argument("--spec-objective", choices=OBJECTIVES, default="throughput",
                   help="what the adaptive policy optimises: tokens per second, or tokens per second with no "
                        "speculative step longer than --spec-itl-budget times a plain step (p99 inter-token latency; "
                        "default: %(default)s)")
    p.add_argument("--spec-itl-budget", type=float, default=1.1,
                   help="latency objective: the longest speculative step, as a multiple of a plain step (default: "
                        "%(default)s)")
    p.add_argument("--spec-delta", type=float, default=0.02,
                   help="adaptive: the governor switches speculation off when confident it runs below (1 - delta) "
                        "of plain decoding's throughput (default: %(default)s)")
    p.add_argument("--spec-epsilon", type=float, default=None,
                   help="adaptive: the largest fraction of steps spent probing while speculation is off "
                        "(default 0.02; 0.005 with the latency objective)")
    p.add_argument("--overlap", choices=["auto", "on", "off"], default="auto",
                   help="prepare step N+1 on the host while step N runs (auto: on for CUDA; off on CPU, where the "
                        "worker-thread stream shares the GIL and measured slower, see README; default: %(default)s)")
    p.add_argument("--no-overlap", dest="overlap", action="store_const", const="off", help="same as --overlap off")
    p.add_argument("--graphs", choices=["auto", "on", "off"], default="auto",
                   help="captured step graphs (auto: on CUDA; on: the contract-checking CPU stand-in; default: "
                        "%(default)s)")
    p.add_argument("--attention", choices=["auto", "torch", "flashinfer"], default="auto",
                   help="paged-attention backend (auto: torch; flashinfer: CUDA with the flashinfer package; default: "
                        "%(default)s)")
    p.add_argument("--cpu-linear", choices=["auto", "matmul", "onednn"], default="auto",
                   help="CPU linear kernels (auto: prepacked oneDNN at every row count with --batch-invariant on, "
                        "else MKL or oneDNN per weight shape and row count, timed at load; matmul / onednn: one "
                        "kernel everywhere, matmul only with --batch-invariant off; default: %(default)s)")
    p.add_argument("--batch-invariant", choices=["on", "off"], default="on",
                   help="CPU: every row of a step computes the bits it would alone (oneDNN linears at every row "
                        "count, row-invariant attention), so speculative greedy output is plain greedy output "
                        "bitwise; off: the fastest kernel per row count (on an AVX2 host a plain decode step "
                        "measured 1.09-1.26x with it on: oneDNN's one-row linear is slower than MKL's and the "
                        "invariant attention runs more ops; default: %(default)s)")
    p.add_argument("--page-size", type=int, default=16, help="tokens per KV page (default: %(default)s)")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, metavar="N",
                   help="split the target (and its MTP head) over N ranks, one process and one device each "
                        "(torch.distributed: NCCL on GPUs, gloo on CPU); a draft model runs on rank 0 only "
                        "(default: %(default)s)")
    p.add_argument("--gpu-memory-utilization", type=float, default=None, metavar="F",
                   help="share of memory the engine may use, KV cache included: the KV cache gets F x the GPU's "
                        "memory minus what is in use (weights, other processes), a warm-up's peak at the largest "
                        "batch and a CUDA-graph reserve; on CPU F x the RAM available at start-up minus the "
                        "weights and an activation estimate (default: 0.9 on CUDA, as vLLM; on CPU 0.5 with the KV "
                        "cache capped at 4 GiB). The ready line reports the result")
    p.add_argument("--kv-cache-tokens", type=int, default=None,
                   help="KV capacity in tokens, overriding the memory plan (default: planned, see "
                        "--gpu-memory-utilization)")
    p.add_argument("--num-pages", type=int, default=None,
                   help="KV pages (overrides --kv-cache-tokens and the plan; default: planned)")
    p.add_argument("--max-batch-size", type=int, default=64,
                   help="most requests decoding at once (default: %(default)s)")
    chunking = (f"calibrated, --max-step-latency {max_step_latency:g}" if max_step_latency is not None else
                "off, a prompt is prefilled whole in a step of its own while running requests wait")
    p.add_argument("--max-num-batched-tokens", type=int, default=None, metavar="N",
                   help="chunked prefill with a fixed budget of N tokens a step: running requests decode one token "
                        "each and prompts are prefilled in chunks beside them; 0: off (default: "
                        f"{chunking})")
    p.add_argument("--no-chunked-prefill", dest="max_num_batched_tokens", action="store_const", const=0,
                   help="same as --max-num-batched-tokens 0: whole-prompt prefill steps (default: "
                        f"{'chunked' if max_step_latency is not None else 'off already'})")
    latency = f"{max_step_latency:g}" if max_step_latency is not None else "unset: chunked prefill off"
    p.add_argument("--max-step-latency", type=float, default=max_step_latency, metavar="X",
                   help="chunked prefill with a budget calibrated at start-up (a few seconds on CPU) and kept true "
                        "from the engine's own step times: a step mixing prompt chunks with decoding costs at most X "
                        "of the running batch's plain decode steps, so running streams keep about X times their "
                        "usual inter-token gap while a long prompt is prefilled; larger X: faster prefill, longer "
                        f"gaps. --max-num-batched-tokens overrides it (default: {latency}). The ready line reports "
                        "the budget")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="longest sequence, prompt + output tokens (default: the model's own limit)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="weights and activations (default: %(default)s: float32 on CPU, its linears reading bf16 "
                        "weights where this CPU's oneDNN runs them measured faster (AVX512_BF16, AMX; numerics "
                        "change, the ready line says; float32: exact); on CUDA the checkpoint's 16-bit dtype, "
                        "bfloat16 for a float32 checkpoint)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N (default: %(default)s: cuda if "
                                                    "available)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads on CPU (default: 1 with overlap, 2 without)")


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


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(model=args.model, spec=args.spec, draft=args.draft, num_spec_tokens=args.num_spec_tokens,
                        draft_vocab=args.draft_vocab,
                        page_size=args.page_size, kv_cache_tokens=args.kv_cache_tokens, num_pages=args.num_pages,
                        gpu_memory_utilization=args.gpu_memory_utilization,
                        tensor_parallel_size=args.tensor_parallel_size,
                        max_batch_size=args.max_batch_size, max_num_batched_tokens=args.max_num_batched_tokens,
                        max_step_latency=args.max_step_latency,
                        max_model_len=args.max_model_len, dtype=args.dtype,
                        device=args.device, threads=args.threads, spec_policy=args.spec_policy,
                        spec_objective=args.spec_objective, spec_itl_budget=args.spec_itl_budget,
                        spec_delta=args.spec_delta, spec_epsilon=args.spec_epsilon,
                        overlap=resolve_overlap(args.overlap, args.device), graphs=args.graphs,
                        attention=args.attention, cpu_linear=args.cpu_linear,
                        batch_invariant=args.batch_invariant == "on")


def resolve_overlap(choice: str, device: str) -> bool:
    if choice != "auto":
        return choice == "on"
    if device == "auto":
        import torch

        return torch.cuda.is_available()
    return device.startswith("cuda")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_engine_arguments(p)
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
    try:
        return _run(args)
    except (SpecstepError, ValueError) as e:
        print(f"specstep generate: error: {e}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    from specstep.engine.sampling_params import SamplingParams
    from specstep.scheduler.build import build_engine
    from specstep.scheduler.request import Request

    items = read_inputs(args)
    resolve_model_arg(args)
    recorder, tracer = make_tracer(args.trace)
    core, tokenizer, info = build_engine(engine_config_from_args(args), tracer)
    reqs = []
    for i, item in enumerate(items):
        where = item.get("_where", "--prompt")
        if "prompt" in item:
            if not isinstance(item["prompt"], str) or not item["prompt"]:
                raise SpecstepError(f"{where}: 'prompt' must be a non-empty string")
            if tokenizer is None:
                raise SpecstepError(f"{args.model}: no tokenizer.json; give prompt_token_ids instead")
            ids = tokenizer.encode(item["prompt"])
        else:
            ids = item["prompt_token_ids"]
            if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and not isinstance(t, bool)
                                                               for t in ids):
                raise SpecstepError(f"{where}: 'prompt_token_ids' must be a non-empty list of integers")
            bad = [t for t in ids if not 0 <= t < info.vocab_size]
            if bad:
                raise SpecstepError(f"{where}: token ids outside the vocabulary [0, {info.vocab_size}): {bad[:5]}")
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

    out = open(args.output, "w") if args.output else sys.stdout
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
    total = sum(r.num_output_tokens for r in reqs)
    print(f"{len(reqs)} requests, {total} tokens in {elapsed:.2f}s ({total / elapsed:.1f} tok/s), spec={info.spec}",
          file=sys.stderr)
    return 0


def ready_text(info) -> str:
    """`spec X, N KV pages; kv cache ... (how it was sized)[; graphs ...]; chunked prefill ...`: the start-up
    facts a user checks first."""
    # Imported here: `serve` imports this module in its frontend process, which never imports torch.
    from specstep.cuda_graphs.runner import describe_capture

    text = f"spec {info.spec}, {info.num_pages} KV pages"
    text = f"{text}; {info.memory.describe()}" if info.memory is not None else text
    graphs = describe_capture(info.graphs)
    text = f"{text}; {graphs}" if graphs else text
    return f"{text}; {info.prefill}" if info.prefill else text


def make_tracer(path: str | None):
    """NVTX ranges always (free without a profiler); a recorder too when a trace file is asked for."""
    from specstep.traces.tracer import Tracer, TraceRecorder

    recorder = TraceRecorder() if path else None
    return recorder, Tracer(recorder)
