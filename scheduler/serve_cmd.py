"""`specstep serve`: the frontend in this process, the scheduler in a supervised child process.

Protocol: docs/protocol.md; the OpenAI-compatible HTTP API: docs/http.md. This process never imports torch; the
scheduler process does.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import logging
import sys
from pathlib import Path

from specstep.engine.engine_config import SERVE_MAX_STEP_LATENCY, EngineConfig
from specstep.engine.errors import CheckpointError, SpecstepError
from specstep.engine.model_source import serve_default_spec
from specstep.scheduler.engine_options import add_engine_arguments, engine_config_from_args
from specstep.scheduler.generate_cmd import resolve_model_arg

DEFAULT_ADDRESS = "tcp://127.0.0.1:5555"
MAX_STEP_LATENCY = SERVE_MAX_STEP_LATENCY  # chunked prefill's default here (`EngineConfig.max_step_latency`)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_engine_arguments(p, "serve")
    s = p.add_argument_group("server")
    s.add_argument("--address", default=DEFAULT_ADDRESS,
                   help="ROUTER address to bind (default: %(default)s, loopback only; port 0 = any free port, "
                        "printed in the 'listening on' and 'ready' lines and in HEALTH_REPLY)")
    s.add_argument("--max-prompt-len", type=int, default=None,
                   help="longest prompt accepted, in tokens (default: what the model and the KV cache allow)")
    s.add_argument("--max-tokens-limit", type=int, default=None,
                   help="largest max_tokens a request may ask for (default: the model's length less one, at most "
                        "what the whole KV cache holds)")
    s.add_argument("--trace", default=None, help="write a Chrome/Perfetto trace of the server here on exit "
                                                 "(default: none)")
    s.add_argument("--startup-timeout", type=float, default=300.0,
                   help="seconds for the scheduler process to load the model and report ready (default: "
                        "%(default)s)")
    s.add_argument("--max-restarts", type=int, default=5,
                   help="scheduler restarts allowed within --restart-window seconds before giving up (status "
                        "'failed'; default: %(default)s)")
    s.add_argument("--restart-window", type=float, default=300.0,
                   help="seconds over which --max-restarts is counted (default: %(default)s)")
    s.add_argument("--drain-timeout", type=float, default=60.0,
                   help="on SIGTERM, seconds to let in-flight requests finish (default: %(default)s)")
    s.add_argument("--max-inflight", type=int, default=4096,
                   help="unfinished requests in the server before new ones get OVERLOADED (default: %(default)s)")
    s.add_argument("--metrics-port", type=int, default=9400,
                   help="Prometheus /metrics on 127.0.0.1:PORT (0: any free port, -1: off; a taken port only warns; "
                        "default: %(default)s). Metrics: docs/metrics.md")
    s.add_argument("--http-port", type=int, default=8000,
                   help="OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, /v1/models, /health) on "
                        "--http-host:PORT (0: any free port, -1: off; the URL is printed in the 'listening' and "
                        "'ready' lines; default: %(default)s). docs/http.md")
    s.add_argument("--http-host", default="127.0.0.1",
                   help="address the HTTP API binds (default: %(default)s, loopback only)")
    s.add_argument("--log-level", default="INFO", help="default: %(default)s")


def default_spec(model: str) -> str:
    """A target is served with the proposer shipped as its default (an MTP head, else a draft model); a target
    with none, with n-gram prompt lookup (no model, and the adaptive policy turns it off where it loses)."""
    return serve_default_spec(Path(model))


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="specstep serve %(levelname)s: %(message)s")
    try:
        name, origin = resolve_model_arg(args)
        cfg, tokenizer = _check(args)
    except (SpecstepError, ValueError) as e:
        print(f"specstep serve: error: {e}", file=sys.stderr)
        return 2
    import uvloop

    from specstep.scheduler.server.frontend import Frontend, FrontendConfig
    from specstep.scheduler.server.http.chat_template import load_chat_template

    fcfg = FrontendConfig(address=args.address, engine=dataclasses.asdict(cfg), model_name=name, model_origin=origin,
                          max_tokens=args.max_tokens_limit, max_prompt_len=args.max_prompt_len,
                          trace=args.trace, startup_timeout_s=args.startup_timeout,
                          max_restarts=args.max_restarts, restart_window_s=args.restart_window,
                          drain_timeout_s=args.drain_timeout, max_inflight=args.max_inflight,
                          metrics_port=None if args.metrics_port < 0 else args.metrics_port,
                          http_host=args.http_host, http_port=None if args.http_port < 0 else args.http_port,
                          chat_template=load_chat_template(args.model) if args.http_port >= 0 else None)
    printer = lambda line: print(line, flush=True)
    return uvloop.run(Frontend(fcfg, tokenizer).serve(printer))


def _check(args: argparse.Namespace) -> tuple[EngineConfig, object]:
    """Fail fast, before any process starts, on what can be checked without loading a model."""
    from specstep.engine.tokenizer import Tokenizer

    if args.spec is None:
        args.spec = default_spec(args.model)
    cfg = engine_config_from_args(args)
    if cfg.draft_path is not None and not Path(cfg.draft_path).is_dir():
        raise SpecstepError(f"draft folder {cfg.draft_path!r} does not exist")
    for name in ("max_prompt_len", "max_tokens_limit", "max_inflight"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise SpecstepError(f"--{name.replace('_', '-')} must be >= 1")
    if args.http_port > 65535:
        raise SpecstepError(f"--http-port must be a port (0-65535), 0 for any free one or -1 for off, got "
                            f"{args.http_port}")
    if args.max_restarts < 0:
        raise SpecstepError("--max-restarts must be >= 0")
    if cfg.attention == "flashinfer":  # the scheduler would fail at start-up: say it now (without torch here)
        if importlib.util.find_spec("flashinfer") is None:
            raise SpecstepError("attention backend flashinfer: the flashinfer package is not installed "
                                "(pip install specstep[cuda], or bring its wheel)")
        if cfg.device == "cpu":
            raise SpecstepError("attention backend flashinfer needs a CUDA device, not cpu")
    try:
        tokenizer = Tokenizer.from_folder(cfg.model)
    except CheckpointError:
        tokenizer = None  # token-id prompts only
    return cfg, tokenizer
