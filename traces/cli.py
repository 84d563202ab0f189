"""`specstep trace`: analyse a trace file written with `--trace`.

    specstep trace report FILE [--json]   hidden CPU preparation, device idle gaps, host syncs, per-kind times
    specstep trace check FILE             exit 1 unless the ranges on every track nest properly
"""

from __future__ import annotations

import argparse
import json
import sys

from specstep.traces.report import analyze, load_trace, nesting_errors


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=["report", "check"], help="report: figures; check: nesting only")
    p.add_argument("file", help="Chrome / Perfetto trace-event JSON written by --trace")
    p.add_argument("--json", action="store_true", help="print the report as JSON")


def run(args: argparse.Namespace) -> int:
    try:
        spans = load_trace(args.file)
    except (OSError, ValueError, KeyError) as e:
        print(f"specstep trace: cannot read {args.file!r}: {e}", file=sys.stderr)
        return 2
    errors = nesting_errors(spans)
    if args.action == "check":
        for e in errors:
            print(e)
        print(f"{len(spans)} ranges, {len(errors)} nesting errors")
        return 1 if errors else 0
    report = analyze(spans)
    if args.json:
        print(json.dumps({**report.to_dict(), "nesting_errors": errors}, indent=2))
    else:
        print(report.format())
        if errors:
            print(f"\nwarning: {len(errors)} ranges do not nest (run `specstep trace check`)", file=sys.stderr)
    return 0
