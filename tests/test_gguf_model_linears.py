"""A GGUF checkpoint's linears swapped onto the Q4_1 / Q8_0 kernel (`engine/models/gguf_model_linears.py`): it loads
onto it (and off it with `--quantization none`), its greedy output is the fp32 model's, and every way the kernel
or an int8 form cannot run is a typed error naming the cause."""

from __future__ import annotations

import pytest
import torch

from specstep.engine.cpu_kernels import CpuKernels
from specstep.engine.errors import ConfigError
from specstep.engine.model_loader import describe_cpu_kernels, load_model
from specstep.engine.models import gguf_kernel
from specstep.engine.models.gguf_kernel import tiles_unavailable, unavailable, vnni_unavailable
from specstep.engine.models.gguf_linear import GGUFLinear
from specstep.engine.sampling_params import SamplingParams
from tests.fixtures_gguf import pin_int8_form, write_gguf
from tests.helpers import make_checkpoint, make_core, run_to_completion

pytestmark = pytest.mark.skipif(bool(unavailable()), reason=f"GGUF kernel unavailable: {unavailable()}")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECSTEP_CACHE", str(tmp_path / "cache"))


@pytest.mark.parametrize("fmt,tied", [("Q4_1", False), ("Q4_1", True), ("Q8_0", False)])
def test_a_gguf_checkpoint_loads_onto_the_kernel_and_computes_the_fp32_models_logits(tmp_path, cache, fmt, tied):
    src = make_checkpoint(tmp_path / "src", seed=5, tokenizer=True, tie_word_embeddings=tied)
    path = write_gguf(tmp_path / "m.gguf", src, qtype=fmt)
    quant = load_model(path, "cpu", "float32", CpuKernels(quantization="gguf"))
    fp32 = load_model(path, "cpu", "float32", CpuKernels(quantization="none"))
    linears = [m for m in quant.modules() if isinstance(m, GGUFLinear)]
    assert len(linears) == 2 * len(quant.layers) * 2 + 1  # qkv, o, gate_up, down a layer, and lm_head
    assert not any(isinstance(m, GGUFLinear) for m in fp32.modules())
    assert f"{fmt} linears" in describe_cpu_kernels(quant) and "batch-invariant" in describe_cpu_kernels(quant)
    isa = "AVX-512" if gguf_kernel.kernel_isa() == "avx512" else "AVX2"
    assert f"in specstep's {isa} kernel" in describe_cpu_kernels(quant)  # the form that runs here
    if tied:  # the lm_head and the embedding read the same blocks (one storage; no fp32 table stays)
        assert quant.lm_head.blocks.data_ptr() == quant.embed_tokens.blocks.data_ptr()
        assert torch.equal(quant.lm_head.weight, quant.embed_tokens.weight)
    ids = torch.tensor([[5, 17, 99, 3, 250, 41, 7, 8]])
    with torch.inference_mode():
        a = quant.compute_logits(quant.forward_dense(ids))
        b = fp32.compute_logits(fp32.forward_dense(ids))
    assert (a - b).abs().max() < 1e-4 * b.abs().max()


def test_greedy_output_on_the_kernel_is_the_fp32_models(tmp_path, cache):
    src = make_checkpoint(tmp_path / "src", seed=6, tokenizer=True)
    path = write_gguf(tmp_path / "m.gguf", src, qtype="Q4_1")
    prompts = [[5, 17, 99, 3, 250, 41], [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17]]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    outs = {}
    for q in ("gguf", "none"):
        reqs = run_to_completion(make_core(path, quantization=q, activations="fp32"), prompts, params)
        outs[q] = [r.output_token_ids for r in reqs]
    assert outs["gguf"] == outs["none"]


def test_quantization_gguf_where_the_kernel_cannot_run_is_a_config_error(tmp_path, cache, monkeypatch):
    src = make_checkpoint(tmp_path / "src", seed=5, tokenizer=True)
    path = write_gguf(tmp_path / "m.gguf", src, qtype="Q4_1")
    monkeypatch.setattr("specstep.engine.models.gguf_model_linears.unavailable", lambda: "this CPU lacks AVX2")
    with pytest.raises(ConfigError, match="lacks AVX2"):
        load_model(path, "cpu", "float32", CpuKernels(quantization="gguf"))
    auto = load_model(path, "cpu", "float32", CpuKernels(quantization="auto"))
    assert not any(isinstance(m, GGUFLinear) for m in auto.modules())
    assert "GGUF kernel unavailable: this CPU lacks AVX2" in describe_cpu_kernels(auto)


def test_int8_activations_need_the_gguf_kernel(tmp_path, cache, monkeypatch):
    """`--activations int8` is the GGUF kernel's: with `--quantization none`, on a checkpoint that is not GGUF or
    where the kernel cannot run it is a typed error, never a silent fp32 run; a Hugging Face draft beside a GGUF
    target keeps fp32 and says so."""
    from specstep.engine.engine_config import EngineConfig, InvalidOption

    src = make_checkpoint(tmp_path / "src", seed=5, tokenizer=True)
    path = write_gguf(tmp_path / "m.gguf", src, qtype="Q4_1")
    with pytest.raises(InvalidOption, match="--activations int8 runs in the GGUF kernel"):
        EngineConfig(model=str(path), activations="int8", quantization="none")
    with pytest.raises(ValueError, match="not with quantization none"):
        CpuKernels(quantization="none", activations="int8")
    with pytest.raises(ConfigError, match="not a GGUF checkpoint"):
        make_core(src, activations="int8")
    hf = load_model(src, "cpu", "float32", CpuKernels(activations="int8"))
    assert "fp32 activations (not a GGUF checkpoint)" in describe_cpu_kernels(hf)
    with monkeypatch.context() as pin:
        lanes = load_model(path, "cpu", "float32", CpuKernels(activations=pin_int8_form("int8-lanes", pin)))
    assert {m.kernel_fmt for m in lanes.modules() if isinstance(m, GGUFLinear)} == {"Q4_1/int8-packed"}
    with pytest.raises(ValueError, match="activations must be one of auto, fp32, int8, got 'int8-lanes'"):
        CpuKernels(activations="int8-lanes")  # an ISA is SPECSTEP_CPU_ISA's to pin, not the activations'
    with pytest.raises(InvalidOption, match="--activations must be one of auto, fp32, int8, got 'int8-tiles'"):
        EngineConfig(model=str(path), activations="int8-tiles")
    int8 = load_model(path, "cpu", "float32", CpuKernels(activations="int8"))  # the host's int8 kernel
    host = "tiles" if not tiles_unavailable() else "vnni" if not vnni_unavailable() else "packed"
    assert {m.kernel_fmt for m in int8.modules() if isinstance(m, GGUFLinear)} == {f"Q4_1/int8-{host}"}
    assert ("in AMX tiles" in describe_cpu_kernels(int8)) == (host == "tiles")
    assert ("times int8 activations in AVX-512 VNNI lanes" in describe_cpu_kernels(int8)) == (host == "vnni")
    monkeypatch.setattr("specstep.engine.models.int8_forms.tiles_unavailable", lambda: "this CPU lacks AMX_TILE")
    with monkeypatch.context() as pin, pytest.raises(ConfigError, match="SPECSTEP_CPU_ISA=amx: AMX tiles cannot "
                                                                        "run here: this CPU lacks"):
        load_model(path, "cpu", "float32", CpuKernels(activations=pin_int8_form("int8-tiles", pin)))
    monkeypatch.setattr("specstep.engine.models.int8_forms.vnni_unavailable", lambda: "")
    vnni = load_model(path, "cpu", "float32", CpuKernels(activations="int8"))  # (built, not run: the host may lack it)
    assert {m.kernel_fmt for m in vnni.modules() if isinstance(m, GGUFLinear)} == {"Q4_1/int8-vnni"}
    assert "in AVX-512 VNNI lanes" in describe_cpu_kernels(vnni)
    assert "(AMX tiles: this CPU lacks AMX_TILE)" in describe_cpu_kernels(vnni)
    monkeypatch.setattr("specstep.engine.models.int8_forms.vnni_unavailable", lambda: "this CPU lacks AVX512_VNNI")
    with monkeypatch.context() as pin, pytest.raises(ConfigError, match="SPECSTEP_CPU_ISA=avx512: AVX-512 VNNI "
                                                                        "lanes cannot run here: this CPU"):
        load_model(path, "cpu", "float32", CpuKernels(activations=pin_int8_form("int8-vnni", pin)))
    lanes = load_model(path, "cpu", "float32", CpuKernels(activations="int8"))
    assert {m.kernel_fmt for m in lanes.modules() if isinstance(m, GGUFLinear)} == {"Q4_1/int8-packed"}
    assert "(AMX tiles: this CPU lacks AMX_TILE; AVX-512 VNNI: this CPU lacks AVX512_VNNI)" in describe_cpu_kernels(
        lanes)
    monkeypatch.setattr("specstep.engine.models.gguf_model_linears.unavailable", lambda: "this CPU lacks AVX2")
    with pytest.raises(ConfigError, match="--activations int8: the GGUF kernel cannot run here: this CPU lacks"):
        load_model(path, "cpu", "float32", CpuKernels(activations="int8"))
