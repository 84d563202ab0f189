"""A start converts only what no GGUF kernel reads: the partial conversion holds config, tokenizer and the tensors
outside the block types (norms, biases); the blocks come from the file. The fp32 checkpoint is written only where
something reads fp32 weights (`--quantization none`, a weight the kernels do not take), and the fingerprint that
finds a target's shipped heads is the fp32 checkpoint's."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from specstep.engine import model_loader
from specstep.engine.cpu_kernels import CpuKernels
from specstep.engine.fingerprint import fingerprint
from specstep.engine.gguf_checkpoint import BLOCK_TYPES, converted_folder, fp32_folder, is_partial
from specstep.engine.kernels import binding
from specstep.engine.model_loader import load_model
from specstep.engine.model_source import resolve_model
from specstep.engine.models.gguf_kernel import FORMATS
from specstep.engine.models.gguf_linear import GGUFLinear
from tests.fixtures_gguf import write_gguf
from tests.helpers import make_checkpoint

pytestmark = pytest.mark.skipif(bool(binding.unavailable()), reason="the kernel layer does not build here")

SHAPE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)
PROMPT = torch.tensor([[5, 17, 99, 3, 250, 41, 7, 8]])


@pytest.fixture
def gguf_file(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECSTEP_CACHE", str(tmp_path / "cache"))
    src = make_checkpoint(tmp_path / "src", seed=11, arch="qwen2", tokenizer=True, **SHAPE)
    return write_gguf(tmp_path / "m.gguf", src, arch="qwen2", qtype="Q4_K_M")


def _names(folder) -> set[str]:
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        return set(f.keys())


def _logits(net) -> torch.Tensor:
    with torch.inference_mode():
        return net.compute_logits(net.forward_dense(PROMPT))


def test_block_types_are_the_kernels_formats():
    assert BLOCK_TYPES == set(FORMATS) | set(binding.formats())


def test_a_start_reads_the_blocks_and_never_writes_the_fp32_checkpoint(gguf_file):
    folder = resolve_model(gguf_file)
    full = folder.parent / folder.name.removesuffix("-partial")
    assert is_partial(folder) and folder != full
    names = _names(folder)
    assert names and all(n.endswith(("norm.weight", ".bias")) for n in names)  # q/k/v biases, norms
    net = load_model(gguf_file, "cpu", "float32", CpuKernels())
    assert sum(isinstance(m, GGUFLinear) for m in net.modules()) == 4 * 2 + 1
    assert not full.exists()
    assert converted_folder(gguf_file) == full  # (written now, for the reference)
    assert torch.equal(_logits(net), _logits(load_model(full, "cpu", "float32", CpuKernels())))


def test_fp32_weights_come_from_the_fp32_checkpoint(gguf_file, monkeypatch):
    folder = resolve_model(gguf_file)
    full = folder.parent / folder.name.removesuffix("-partial")
    net = load_model(gguf_file, "cpu", "float32", CpuKernels(quantization="none"))
    assert full.is_dir() and not any(isinstance(m, GGUFLinear) for m in net.modules())
    assert fp32_folder(folder) == full and len(_names(full)) > len(_names(folder))
    # a weight the blocks do not supply on this host: read from the fp32 checkpoint, not missing
    monkeypatch.setattr(model_loader, "block_params", lambda model, path: frozenset())
    again = load_model(gguf_file, "cpu", "float32", CpuKernels())
    assert torch.equal(_logits(again), _logits(load_model(full, "cpu", "float32", CpuKernels())))


def test_the_fingerprint_is_the_fp32_checkpoints(tmp_path, monkeypatch):
    """llama files store q and k rows permuted: the partial conversion digests them un-permuted, as written."""
    monkeypatch.setenv("SPECSTEP_CACHE", str(tmp_path / "cache"))
    src = make_checkpoint(tmp_path / "src", seed=3, tokenizer=True, **SHAPE)
    path = write_gguf(tmp_path / "l.gguf", src, qtype="Q4_K")
    partial = resolve_model(path)
    assert is_partial(partial) and fingerprint(partial) == fingerprint(converted_folder(path))
