"""The memory plan's weight figure by real bytes: against an independent count (every parameter and buffer once,
plus the oneDNN-packed copy of each fp32 linear, the lm_head's included), and for GGUF checkpoints against the
file's own tensor bytes (blocks stay blocks: no fp32 copy of a linear or of the embedding stays resident)."""

from __future__ import annotations

import gguf
import pytest

from specstep.engine import memory_probe as probe
from specstep.engine.engine_config import EngineConfig
from specstep.engine.kernels import binding
from specstep.engine.models.cpu_linear import CpuLinear
from specstep.scheduler import build as build_mod
from specstep.scheduler.build import build_engine
from tests.fixtures_gguf import write_gguf
from tests.helpers import make_checkpoint

SHAPE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECSTEP_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(build_mod, "host_ram_available", lambda: 1 << 30)  # the plan sizes the pools from it


def _parameters_and_buffers(model) -> int:
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in (*model.parameters(), *model.buffers())}
    return sum(storages.values())


def _weights(path, **cfg) -> tuple[int, object]:
    core, _, info = build_engine(EngineConfig(model=str(path), device="cpu", max_model_len=256, **cfg))
    return info.memory.figures.weights, core.engine.target


@pytest.mark.parametrize("tied", [False, True])
def test_weight_figure_is_parameters_plus_packed_copies(tmp_path, cache, tied):
    src = make_checkpoint(tmp_path / "src", seed=3, tokenizer=True, tie_word_embeddings=tied)
    figure, target = _weights(src)
    linears = [m for m in target.modules() if isinstance(m, CpuLinear)]
    assert target.lm_head in linears
    packed = sum(m.out_features * m.in_features * 4 for m in linears if any(m.plan.onednn))
    assert packed > 0 and figure == _parameters_and_buffers(target) + packed


@pytest.mark.skipif(bool(binding.unavailable()), reason="the kernel layer does not build here")
@pytest.mark.parametrize("fmt,arch,tied", [("Q4_K_M", "qwen2", True), ("Q5_0", "llama", False),
                                           ("Q6_K", "llama", True)])
def test_gguf_resident_weights_are_the_files_tensor_bytes(tmp_path, cache, fmt, arch, tied):
    src = make_checkpoint(tmp_path / "src", seed=4, arch=arch, tokenizer=True, tie_word_embeddings=tied, **SHAPE)
    path = write_gguf(tmp_path / "m.gguf", src, arch=arch, qtype=fmt)
    file_bytes = sum(int(t.n_bytes) for t in gguf.GGUFReader(str(path)).tensors)
    figure, target = _weights(path)
    assert figure == probe.resident_bytes(target) == _parameters_and_buffers(target)
    weights = figure - _parameters_and_buffers(target.rotary)  # less the rotary tables (computed, not read)
    assert file_bytes <= weights <= 1.2 * file_bytes, (weights, file_bytes)
