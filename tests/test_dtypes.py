"""`--dtype auto`: float32 on CPU; on CUDA the checkpoint's half dtype, bfloat16 for a float32 checkpoint (as
vLLM does). Resolved without a GPU: only the device's type matters."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from specstep.engine.config import ModelConfig
from specstep.engine.errors import CheckpointError
from specstep.engine.loader import resolve_dtype


@pytest.mark.parametrize(("stored", "cuda", "cpu"), [("float32", torch.bfloat16, torch.float32),
                                                      ("float16", torch.float16, torch.float32),
                                                      ("bfloat16", torch.bfloat16, torch.float32)])
def test_auto_dtype_per_device(tiny_target, stored, cuda, cpu):
    cfg = dataclasses.replace(ModelConfig.from_folder(tiny_target), torch_dtype=stored)
    assert resolve_dtype("auto", cfg, torch.device("cuda")) == cuda
    assert resolve_dtype("auto", cfg, torch.device("cpu")) == cpu
    assert resolve_dtype("float32", cfg, torch.device("cuda")) == torch.float32  # explicit: as given


def test_unknown_dtype_is_a_checkpoint_error(tiny_target):
    with pytest.raises(CheckpointError, match="unsupported dtype"):
        resolve_dtype("float8", ModelConfig.from_folder(tiny_target), torch.device("cpu"))
