"""The `specstep` console command. Each subcommand lives in its own module exposing
`add_arguments(parser)` and `run(args) -> int`; modules are imported only when their subcommand runs,
so `specstep --help` stays fast and torch is not imported by commands that do not need it."""

from __future__ import annotations

import argparse
import importlib
import os
import sys

# Torch's OpenMP threads spin by default; on a 2-core machine that collapses throughput whenever another
# thread is busy. Must be set before torch is imported anywhere in the process.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

SUBCOMMANDS = {
    "generate": ("specstep.scheduler.generate_cmd", "offline batched generation from prompts or JSONL"),
    "serve": ("specstep.scheduler.serve_cmd", "serve the ZeroMQ protocol and an OpenAI-compatible HTTP API "
                                                "(frontend + scheduler process)"),
    "loadgen": ("specstep.loadgen.cli", "load generator: throughput/latency sweeps against a server"),
    "trace": ("specstep.traces.cli", "analyse a trace file written with --trace"),
    "train-defaults": ("specstep.training.defaults", "train the embedded default tokenizer, target and draft"),
    "train-head": ("specstep.training.head", "train an MTP (EAGLE-style) head for a target"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="specstep", description="speculative-decoding LLM serving engine")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in SUBCOMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in SUBCOMMANDS:
        parser.print_help() if not argv or argv[0] in ("-h", "--help") else parser.error(
            f"unknown command {argv[0]!r}")
        return 0 if not argv or argv[0] in ("-h", "--help") else 2
    module_name, help_text = SUBCOMMANDS[argv[0]]
    module = importlib.import_module(module_name)
    cmd = argparse.ArgumentParser(prog=f"specstep {argv[0]}", description=help_text)
    module.add_arguments(cmd)
    args = cmd.parse_args(argv[1:])
    try:
        return int(module.run(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
