"""`specstep generate` (as `python -m specstep.scheduler.cli`): the JSONL contract end to end in a subprocess, and
one-line errors with a non-zero exit for bad inputs. Subprocesses are few (each pays for a torch import, seconds
on a loaded machine): the remaining error cases call the same entry point, `specstep.scheduler.cli.main`,
in-process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from specstep.engine.sampling_params import SamplingParams
from specstep.engine.tokenizer import Tokenizer
from tests.helpers import make_core, run_to_completion

FIELDS = {"prompt_token_ids", "token_ids", "text", "finish_reason", "spec"}
SPEC_FIELDS = {"drafted_tokens", "accepted_tokens", "mean_accepted_length", "acceptance_per_position"}


def cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    return subprocess.run([sys.executable, "-m", "specstep.scheduler.cli", "generate", *map(str, args)], env=env,
                          cwd=cwd, capture_output=True, text=True, timeout=120)


def write_jsonl(path: Path, lines: list) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


INPUTS = [
    {"prompt": "def wrap(text, width):\n    return"},
    {"prompt_token_ids": [5, 6, 7, 300], "max_tokens": 5},
    {"prompt": "import os", "max_tokens": 3, "temperature": 1.0, "top_k": 50, "seed": 3},
]


@pytest.fixture(scope="module")
def plain_run(tiny_target, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cli")
    out = tmp / "out.jsonl"
    res = cli("--model", tiny_target, "--prompts", write_jsonl(tmp / "in.jsonl", INPUTS), "--max-tokens", 8,
              "--ignore-eos", "--page-size", 4, "--device", "cpu", "--output", out)
    assert res.returncode == 0, res.stderr
    return [json.loads(line) for line in out.read_text().splitlines()]


def test_jsonl_round_trip(tiny_target, plain_run):
    tok = Tokenizer.from_folder(tiny_target)
    assert len(plain_run) == len(INPUTS)
    for line in plain_run:
        assert FIELDS <= line.keys() and SPEC_FIELDS <= line["spec"].keys()
        assert line["finish_reason"] == "length"
        assert line["text"] == tok.decode(line["token_ids"])
        assert all(0 <= t < 320 for t in line["token_ids"])
    assert plain_run[0]["prompt_token_ids"] == tok.encode(INPUTS[0]["prompt"])
    assert plain_run[1]["prompt_token_ids"] == INPUTS[1]["prompt_token_ids"]
    assert [len(x["token_ids"]) for x in plain_run] == [8, 5, 3]  # --max-tokens and per-line overrides
    assert plain_run[0]["spec"]["drafted_tokens"] == 0

    # The same requests in-process give the same tokens (greedy, and sampled with the same seed).
    core = make_core(tiny_target, page_size=4)
    params = [SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True),
              SamplingParams(temperature=1.0, top_k=50, max_tokens=3, seed=3, ignore_eos=True)]
    reqs = run_to_completion(core, [x["prompt_token_ids"] for x in plain_run], params, seeds=[0, 0, 3])
    assert [r.output_token_ids for r in reqs] == [x["token_ids"] for x in plain_run]


def test_speculative_run_writes_stats_and_same_greedy_tokens(tiny_target, tiny_draft, tmp_path, plain_run):
    res = cli("--model", tiny_target, "--prompts", write_jsonl(tmp_path / "in.jsonl", INPUTS[:2]), "--max-tokens", 8,
              "--ignore-eos", "--page-size", 4, "--device", "cpu", "--spec", "draft_model", "--draft", tiny_draft,
              "--num-spec-tokens", 3, "--spec-policy", "fixed")
    assert res.returncode == 0, res.stderr
    lines = [json.loads(x) for x in res.stdout.splitlines()]  # no --output: JSONL on stdout
    assert [x["token_ids"] for x in lines] == [x["token_ids"] for x in plain_run[:2]]
    for x in lines:
        spec = x["spec"]
        assert spec["drafted_tokens"] > 0 and 0 <= spec["accepted_tokens"] <= spec["drafted_tokens"]
        assert spec["mean_accepted_length"] == pytest.approx(1 + spec["accepted_tokens"] / spec["spec_steps"],
                                                             abs=1e-4)
        assert 1 <= len(spec["acceptance_per_position"]) <= 3


def cli_in_process(capsys, *args) -> subprocess.CompletedProcess:
    from specstep.scheduler.cli import main

    code = main(["generate", *map(str, args)])
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, out, err)


def assert_one_line_error(res: subprocess.CompletedProcess, *needles: str) -> None:
    assert res.returncode != 0
    assert res.stdout == ""
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, f"expected a one-line error, got:\n{res.stderr}"
    assert "Traceback" not in res.stderr
    for needle in needles:
        assert needle in lines[0], f"{needle!r} not in {lines[0]!r}"


def test_missing_model_folder(tmp_path):
    res = cli("--model", tmp_path / "no-such-model", "--prompt", "hi")
    assert_one_line_error(res, "model ", "no-such-model", "does not exist")


def test_token_ids_outside_the_vocabulary(tiny_target, tmp_path):
    lines = [{"prompt_token_ids": [1, 2]}, {"prompt_token_ids": [3, 320, -1]}]
    res = cli("--model", tiny_target, "--prompts", write_jsonl(tmp_path / "in.jsonl", lines), "--device", "cpu")
    assert_one_line_error(res, "in.jsonl:2:", "outside the vocabulary", "320", "-1")


@pytest.mark.parametrize(("lines", "needles"), [
    (['{"prompt_token_ids": [1, 2]}', '{"prompt": "unterminated'], [":2:", "malformed JSON"]),
    ([{"prompt": "a", "prompt_token_ids": [1]}], [":1:", "exactly one of 'prompt' or 'prompt_token_ids'"]),
])
def test_malformed_input_lines(capsys, tiny_target, tmp_path, lines, needles):
    res = cli_in_process(capsys, "--model", tiny_target, "--prompts", write_jsonl(tmp_path / "in.jsonl", lines))
    assert_one_line_error(res, "in.jsonl", *needles)


@pytest.mark.parametrize(("lines", "needles"), [
    ([{"prompt_token_ids": [[1]]}], [":1:", "'prompt_token_ids' must be a non-empty list of integers"]),
    ([{"prompt": "x", "max_tokens": 0}], [":1:", "max_tokens must be >= 1"]),
    ([{"prompt": ""}], [":1:", "'prompt' must be a non-empty string"]),
    ([{"prompt_token_ids": []}], [":1:", "'prompt_token_ids' must be a non-empty list"]),
])
def test_bad_prompts(capsys, tiny_target, tmp_path, lines, needles):
    res = cli_in_process(capsys, "--model", tiny_target, "--prompts", write_jsonl(tmp_path / "in.jsonl", lines),
                         "--device", "cpu")
    assert_one_line_error(res, "in.jsonl", *needles)


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_flashinfer_without_it_is_a_one_line_error(capsys, tiny_target, tmp_path, command):
    from specstep.engine.attention import flashinfer_backend as fib
    from specstep.scheduler.cli import main

    if fib.AVAILABLE:
        pytest.skip("flashinfer is installed here")
    prompts = write_jsonl(tmp_path / "in.jsonl", [{"prompt_token_ids": [1, 2]}])
    args = ["--prompts", str(prompts)] if command == "generate" else []
    code = main([command, "--model", str(tiny_target), "--device", "cpu", "--attention", "flashinfer", *args])
    out, err = capsys.readouterr()
    assert_one_line_error(subprocess.CompletedProcess([], code, out, err), "flashinfer", "not installed")


def test_log_level_sets_which_engine_messages_reach_stderr(tiny_target):
    """A request that fills a KV cache of 5 usable pages logs a warning: shown at the default level, in generate's
    own format, and hidden under --log-level error (the run itself unchanged)."""
    common = ("--model", tiny_target, "--device", "cpu", "--max-tokens", 30, "--ignore-eos", "--num-pages", 6,
              "--page-size", 4)
    shown, hidden = cli(*common), cli(*common, "--log-level", "error")
    assert shown.returncode == hidden.returncode == 0, shown.stderr + hidden.stderr
    assert "specstep generate WARNING: request 0 filled the KV cache" in shown.stderr
    assert "filled the KV cache" not in hidden.stderr
    assert json.loads(shown.stdout)["token_ids"] == json.loads(hidden.stdout)["token_ids"]
    res = cli(*common, "--log-level", "loud")
    assert res.returncode == 2 and "--log-level" in res.stderr
