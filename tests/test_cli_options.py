"""The engine's flags come from `EngineConfig`'s field metadata: a flag per field, the field's default (or the
per-command default its metadata states), its value reaching the field, and one validation for the library and
the CLI."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from specstep.engine.engine_config import (
    SERVE_MAX_STEP_LATENCY,
    SPEC_OBJECTIVES,
    EngineConfig,
    InvalidOption,
    command_default,
    flag_of,
    option_of,
)
from specstep.engine.errors import ConfigError
from specstep.scheduler import cli
from specstep.scheduler.engine_options import LIBRARY_DEFAULT, cli_fields, engine_config_from_args, help_text
from specstep.scheduler.spec.policy import OBJECTIVES

COMMANDS = ("generate", "serve")
ALL_FIELDS = dataclasses.fields(EngineConfig)
FIELDS = cli_fields()  # the flags
LIBRARY_ONLY = {"graph_standin"}  # fields tests construct, with no flag
# The only places where a command's default is not the config's, each stated on its field: the CLI fills in the
# pretrained target and serve's proposer itself, resolves overlap by device, and serve chunks prompts.
STATED = {("model", "generate"): None, ("model", "serve"): None, ("spec", "serve"): None,
          ("overlap", "generate"): "auto", ("overlap", "serve"): "auto",
          ("max_step_latency", "serve"): SERVE_MAX_STEP_LATENCY}
# A value other than the default for every field, as typed and as the config holds it.
GIVEN = {"model": ("m", "m"), "spec": ("ngram", "ngram"), "draft": ("d", "d"), "num_spec_tokens": ("5", 5),
         "ngram_match_ratio": ("0.5", 0.5),
         "draft_vocab": ("0", 0), "page_size": ("8", 8), "kv_cache_tokens": ("1024", 1024), "num_pages": ("9", 9),
         "gpu_memory_utilization": ("0.5", 0.5), "tensor_parallel_size": ("2", 2), "max_batch_size": ("7", 7),
         "max_prefill_tokens": ("512", 512), "max_num_batched_tokens": ("64", 64), "max_step_latency": ("2.5", 2.5),
         "max_model_len": ("256", 256), "dtype": ("bfloat16", "bfloat16"), "device": ("cuda:1", "cuda:1"),
         "threads": ("3", 3), "spec_policy": ("fixed", "fixed"), "spec_objective": ("latency", "latency"),
         "spec_itl_budget": ("1.5", 1.5), "spec_delta": ("0.05", 0.05), "spec_epsilon": ("0.1", 0.1),
         "overlap": ("on", True), "graphs": ("on", "on"), "attention": ("torch", "torch"),
         "cpu_linear": ("matmul", "matmul"), "batch_invariant": ("off", False), "quantization": ("gguf", "gguf"),
         "cpu_layers": ("torch", "torch"), "activations": ("int8", "int8"),
         "kv_cache_dtype": ("bfloat16", "bfloat16")}
# A value every field with a rule rejects.
INVALID = {"spec": "eagle", "num_spec_tokens": 17, "ngram_match_ratio": -1.0, "draft_vocab": -1, "page_size": 0,
           "kv_cache_tokens": 0,
           "num_pages": 1, "gpu_memory_utilization": 1.5, "tensor_parallel_size": 0, "max_batch_size": 0,
           "max_prefill_tokens": 0, "max_num_batched_tokens": -1, "max_step_latency": 1.0, "max_model_len": 0,
           "dtype": "int8", "device": "tpu", "threads": 0, "spec_policy": "greedy", "spec_objective": "cost",
           "spec_itl_budget": 0.5, "spec_delta": 1.0, "spec_epsilon": 0.0, "graphs": "compiled", "attention": "sdpa",
           "cpu_linear": "mkl", "overlap": "auto", "batch_invariant": "on", "graph_standin": "on", "quantization": "q4",
           "cpu_layers": "compiled", "activations": "bf16", "kv_cache_dtype": "fp8"}


def parser(command: str) -> argparse.ArgumentParser:
    module = __import__(cli.SUBCOMMANDS[command][0], fromlist=["add_arguments"])
    p = argparse.ArgumentParser(prog=f"specstep {command}")
    module.add_arguments(p)
    return p


@pytest.mark.parametrize("command", COMMANDS)
def test_every_field_is_a_flag_with_help(command):
    actions = {a.dest: a for a in parser(command)._actions if flag_of(a.dest) in a.option_strings}
    for f in FIELDS:
        assert f.name in actions, f"{f.name}: no {flag_of(f.name)}"
        assert option_of(f).help and "default" in actions[f.name].help.lower(), f.name


@pytest.mark.parametrize("command", COMMANDS)
def test_a_parsed_default_is_the_fields_or_the_stated_one(command):
    """No default written twice: what `specstep COMMAND` parses for an option it was not given is the field's
    default, or the per-command default stated in the field's metadata (and only where `STATED` expects one)."""
    args = parser(command).parse_args([])
    for f in FIELDS:
        stated = option_of(f).defaults
        assert (command in stated) == ((f.name, command) in STATED), f"{f.name}: unexpected per-command default"
        expected = STATED.get((f.name, command), f.default)
        assert command_default(f.name, command) == expected
        assert getattr(args, f.name) == expected, f"{command} {flag_of(f.name)}: parsed {getattr(args, f.name)!r}"


@pytest.mark.parametrize("command", COMMANDS)
def test_an_empty_command_line_is_the_config_default(command, tiny_target):
    """The config built from the command line differs from `EngineConfig()` only where `STATED` says."""
    args = parser(command).parse_args(["--model", str(tiny_target), "--device", "cpu", "--spec", "none"])
    expected = {"model": str(tiny_target), "device": "cpu", "overlap": False}  # auto on CPU: inline
    if command == "serve":
        expected["max_step_latency"] = SERVE_MAX_STEP_LATENCY
    assert engine_config_from_args(args) == EngineConfig(**expected)
    assert EngineConfig().spec_policy == args.spec_policy == "adaptive"  # one default, the users'


@pytest.mark.parametrize("command", COMMANDS)
def test_every_flag_reaches_its_field(command):
    assert set(GIVEN) == {f.name for f in FIELDS}
    argv = [piece for name, (text, _) in GIVEN.items() for piece in (flag_of(name), text)]
    cfg = engine_config_from_args(parser(command).parse_args(argv))
    for name, (_, value) in GIVEN.items():
        assert getattr(cfg, name) == value != command_default(name, command), name


@pytest.mark.parametrize("command", COMMANDS)
def test_aliases_and_short_flags(command):
    p = parser(command)
    given = ["--model", "m", "--spec", "none"]
    args = p.parse_args([*given, "--no-overlap", "--no-chunked-prefill", "-tp", "2", "--device", "cuda"])
    cfg = engine_config_from_args(args)
    assert (cfg.overlap, cfg.max_num_batched_tokens, cfg.tensor_parallel_size) == (False, 0, 2)
    assert engine_config_from_args(p.parse_args([*given, "--device", "cuda"])).overlap  # auto: on with CUDA


def test_one_validation_for_the_library_and_the_cli():
    ruled = {f.name for f in ALL_FIELDS if option_of(f).choices or option_of(f).check or f.type == "bool"}
    assert ruled == set(INVALID)
    for name, bad in INVALID.items():
        with pytest.raises(InvalidOption, match=flag_of(name)):
            EngineConfig(**{name: bad})
    assert issubclass(InvalidOption, ValueError) and issubclass(InvalidOption, ConfigError)
    for f in ALL_FIELDS:  # every default passes its own rule, and None is valid only where the type allows it
        EngineConfig(**{f.name: f.default})
    with pytest.raises(InvalidOption, match="--spec must be given"):
        EngineConfig(spec=None)


def test_an_invalid_value_is_a_one_line_cli_error(capsys, tiny_target):
    assert cli.main(["generate", "--model", str(tiny_target), "--device", "cpu", "--spec-delta", "1.5"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "specstep generate: error: --spec-delta must be in [0, 1), got 1.5"


def test_choices_match_the_policy():
    assert SPEC_OBJECTIVES == OBJECTIVES


@pytest.mark.parametrize("command", COMMANDS)
def test_a_command_default_other_than_the_librarys_is_stated_in_its_help(command):
    """One default per option for `EngineConfig` and `specstep COMMAND`, or both stated in the flag's help: each
    flag's parsed default against the field's, and the help of every flag whose two differ names the field's."""
    actions = {a.dest: a for a in parser(command)._actions if flag_of(a.dest) in a.option_strings}
    args = parser(command).parse_args([])
    differ = set()
    for f in FIELDS:
        text = help_text(f, command)
        assert actions[f.name].help == text
        if getattr(args, f.name) == f.default:
            assert LIBRARY_DEFAULT not in text, f"{flag_of(f.name)}: states a library default equal to its own"
            continue
        differ.add(f.name)
        library = option_of(f).library_shown or {True: "on", False: "off", None: "none"}.get(f.default, f.default)
        assert f"{LIBRARY_DEFAULT}: {library}" in text, f"{command} {flag_of(f.name)}: {text!r}"
    assert differ == {name for name, c in STATED if c == command}


@pytest.mark.parametrize("command", COMMANDS)
def test_library_only_fields_have_no_flag(command, capsys):
    """The CPU graph stand-in is a test fixture (`EngineConfig(graph_standin=True)`), not a user's choice: no flag,
    nothing in --help, and the CLI leaves it off; `--graphs` is CUDA graphs only (`compiled` is gone)."""
    assert LIBRARY_ONLY == {f.name for f in ALL_FIELDS if not option_of(f).cli}
    p = parser(command)
    text = p.format_help()
    assert "graph-standin" not in text and "stand-in" not in text and "compiled" not in text
    for argv in (["--graph-standin", "on"], ["--graphs", "compiled"]):
        with pytest.raises(SystemExit):
            p.parse_args(argv)
    capsys.readouterr()
    cfg = engine_config_from_args(p.parse_args(["--model", "m", "--spec", "none", "--device", "cpu"]))
    assert cfg.graph_standin is False and cfg.graphs == "auto"


def test_graphs_on_without_cuda_is_a_one_line_cli_error(capsys, tiny_target):
    assert cli.main(["generate", "--model", str(tiny_target), "--device", "cpu", "--graphs", "on"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "specstep generate: error: --graphs on needs a CUDA device; on cpu the steps run eagerly"

