"""The engine's flags, generated from `EngineConfig`'s field metadata (`engine.engine_config.Option`): one
default, one validation and one help text per option, written once on its field.

    field                       flag                      CLI value -> field
    num_spec_tokens: int = 4    --num-spec-tokens N       int(N)
    batch_invariant: bool       --batch-invariant on|off  "on" -> True
    overlap: bool (from_cli)    --overlap auto|on|off     resolved by the device (`resolve_overlap`)
    graph_standin (cli=False)   (none)                    the field's default: library-only

Values are checked once, by `EngineConfig.__post_init__`; argparse only lists the choices (`--help` and its own
usage error).
"""

from __future__ import annotations

import argparse
from dataclasses import fields
from typing import Any

from specstep.engine.engine_config import EngineConfig, command_default, flag_of, option_of

COMMANDS = ("generate", "serve")
LIBRARY_DEFAULT = "EngineConfig's"  # in --help, before the library's default where a command's differs


def on_off(text: str) -> bool:
    if text not in ("on", "off"):
        raise argparse.ArgumentTypeError(f"expected on or off, got {text!r}")
    return text == "on"


def _shown(value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    return "none" if value is None else str(value)


def cli_fields() -> list:
    """The `EngineConfig` fields that are flags (not the library-only ones), in field order."""
    return [f for f in fields(EngineConfig) if option_of(f).cli]


def help_text(f, command: str) -> str:
    opt = option_of(f)
    if callable(opt.shown):
        shown = opt.shown(command)
    else:
        shown = opt.shown if opt.shown is not None else _shown(command_default(f.name, command))
    if command_default(f.name, command) != f.default:  # one default per option, or both stated
        shown = f"{shown}; {LIBRARY_DEFAULT}: {opt.library_shown or _shown(f.default)}"
    text = opt.help.format(default=shown) if "{default}" in opt.help else f"{opt.help} (default: {shown})"
    return text.replace("%", "%%")  # argparse formats help with %


def add_engine_arguments(p: argparse.ArgumentParser, command: str) -> None:
    """Every `EngineConfig` field as a flag of `specstep COMMAND`, in field order."""
    if command not in COMMANDS:
        raise ValueError(f"command must be one of {', '.join(COMMANDS)}, got {command!r}")
    for f in cli_fields():
        opt = option_of(f)
        kind = str(f.type).split("|")[0].strip()
        kw: dict[str, Any] = {"dest": f.name, "default": command_default(f.name, command),
                              "help": help_text(f, command)}
        if opt.cli_choices is not None:
            kw["choices"] = opt.cli_choices
        elif kind == "bool":
            kw.update(type=on_off, choices=(True, False), metavar="{on,off}")
        else:
            kw["type"] = {"int": int, "float": float}.get(kind, str)
            if opt.choices is not None:
                kw["choices"] = opt.choices
        if opt.metavar is not None:
            kw["metavar"] = opt.metavar
        p.add_argument(*((opt.short,) if opt.short else ()), flag_of(f.name), **kw)
        for alias in opt.aliases:
            p.add_argument(alias.flag, dest=f.name, action="store_const", const=alias.const,
                           help=alias.help(command) if callable(alias.help) else alias.help)


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The config from parsed flags: each field's CLI value, turned into the field's where the option says how."""
    values = {}
    for f in cli_fields():
        value, opt = getattr(args, f.name), option_of(f)
        values[f.name] = opt.from_cli(value, args) if opt.from_cli is not None else value
    return EngineConfig(**values)
