"""Every option of `specstep serve` and `specstep generate` says its default in --help, and the ones a client of
the server needs most show the actual value."""

from __future__ import annotations

import argparse

import pytest

from specstep.scheduler import cli


def parser(command: str) -> argparse.ArgumentParser:
    module = __import__(cli.SUBCOMMANDS[command][0], fromlist=["add_arguments"])
    p = argparse.ArgumentParser(prog=f"specstep {command}")
    module.add_arguments(p)
    return p


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_every_option_states_its_default(command):
    p = parser(command)
    for action in p._actions:
        if action.option_strings in (["-h", "--help"], ["--no-overlap"]):  # --no-overlap: --overlap off
            continue
        assert "default" in (action.help or "").lower(), f"{action.option_strings}: {action.help!r}"


@pytest.mark.parametrize("command, shown", [
    ("serve", ["--drain-timeout DRAIN_TIMEOUT", "(default: 60.0)", "default: 5)", "(default: 300.0)", "4096",
               "(default: planned, see --gpu-memory-utilization)", "(default: 0.9 on CUDA", "(default: 64)",
               "tcp://127.0.0.1:5555", "default: 9400"]),
    ("generate", ["(default: planned, see --gpu-memory-utilization)", "(default: 64)", "(default: 16)",
                  "(default: none)"]),
])
def test_help_shows_the_values(command, shown, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main([command, "--help"])
    assert e.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    for piece in shown:
        assert piece in text, piece
