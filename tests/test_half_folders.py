"""Hugging Face folders saved in bf16 / fp16 on CPU: the linears read the file's 16-bit weights through the kernel
layer's BF16 / F16 rows (no fp32 copy). With fp32 activations greedy tokens are transformers' in fp32 on the same
weights (exact widening); by default a bf16 folder takes bf16 dot products where the CPU has them. Speculative
output is plain output, and the weights stay about 2 bytes a parameter; fp32 folders and `--quantization none` keep
the fp32 torch linears."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from specstep.engine.cpu_kernels import CpuKernels
from specstep.engine.kernels import binding
from specstep.engine.memory_probe import resident_bytes
from specstep.engine.model_loader import describe_cpu_kernels, load_model
from specstep.engine.models.gguf_embedding import GGUFEmbedding
from specstep.engine.models.gguf_linear import GGUFLinear
from specstep.engine.sampling_params import SamplingParams
from tests.helpers import make_checkpoint, make_core, run_to_completion

pytestmark = pytest.mark.skipif(bool(binding.unavailable()), reason="the kernel layer does not build here")

SHAPE = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2)
PROMPT = [5, 17, 99, 3, 250, 41, 7, 8, 5, 17, 99, 3]
LONG_PROMPT = [(37 * i + 11) % 250 + 3 for i in range(60)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def half_folder(folder, dtype: str, arch: str = "llama", tied: bool = False):
    """A random checkpoint saved by transformers in `dtype` (config.json's dtype and the safetensors' both)."""
    import transformers

    src = make_checkpoint(folder, seed=7, arch=arch, tokenizer=True, tie_word_embeddings=tied, **SHAPE)
    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=DTYPES[dtype])
    torch.manual_seed(8)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):  # (initialised to zeros: a dropped bias would not show)
                p.normal_(0.0, 1.0)
    model.save_pretrained(folder)
    return folder


def file_bytes(folder) -> int:
    total = 0
    for path in folder.glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                total += f.get_tensor(name).nbytes
    return total


@pytest.mark.parametrize("dtype,arch,tied", [("bfloat16", "llama", False), ("bfloat16", "qwen2", True),
                                             ("float16", "llama", True)])
def test_greedy_tokens_are_transformers_fp32_on_the_16_bit_weights(tmp_path, dtype, arch, tied):
    import transformers

    folder = half_folder(tmp_path / "m", dtype, arch, tied)
    config = json.loads((folder / "config.json").read_text())
    assert (config.get("dtype") or config.get("torch_dtype")) == dtype
    core = make_core(folder, activations="fp32")
    target = core.engine.target
    fmt = {"bfloat16": "BF16", "float16": "F16"}[dtype]
    linears = [m for m in target.modules() if isinstance(m, GGUFLinear)]
    assert len(linears) == 4 * 2 + 1 and {m.kernel_fmt.split("/")[0] for m in linears} == {fmt}
    assert {m.activations for m in linears} == {"fp32"} and isinstance(target.embed_tokens, GGUFEmbedding)
    assert target.native is not None  # the decoder layers ran in C++
    short = {"bfloat16": "bf16", "float16": "fp16"}[dtype]
    assert f"{short} weights as the checkpoint holds them" in describe_cpu_kernels(target)
    assert "fp32 activations (exact)" in describe_cpu_kernels(target)
    # (the long prompt's rows take the C++ layers' prompt GEMM over the weights' dequantised panels)
    reqs = run_to_completion(core, [PROMPT, LONG_PROMPT], GREEDY)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)  # exact widening
    for req, prompt in zip(reqs, [PROMPT, LONG_PROMPT], strict=True):
        with torch.inference_mode():
            out = hf.generate(torch.tensor([prompt]), max_new_tokens=GREEDY.max_tokens, do_sample=False,
                              pad_token_id=0)
        assert req.output_token_ids == out[0, len(prompt):].tolist()


@pytest.mark.parametrize("activations", ["fp32", "auto"])
def test_ngram_speculation_is_plain_decoding(tmp_path, activations):
    folder = half_folder(tmp_path / "m", "bfloat16")
    plain = run_to_completion(make_core(folder, activations=activations), [PROMPT, LONG_PROMPT], GREEDY)
    core = make_core(folder, num_spec_tokens=4, spec="ngram", activations=activations)
    linears = [m for m in core.engine.target.modules() if isinstance(m, GGUFLinear)]
    dot = activations == "auto" and binding.runs_here("BF16", "bf16")
    assert {m.activations for m in linears} == {"bf16" if dot else "fp32"}
    assert ("bf16 activations in AVX-512 BF16 dot products" in describe_cpu_kernels(core.engine.target)) == dot
    spec = run_to_completion(core, [PROMPT, LONG_PROMPT], GREEDY)
    assert [r.output_token_ids for r in spec] == [r.output_token_ids for r in plain]


def test_weights_stay_2_bytes_a_parameter(tmp_path):
    """Resident weights against an independent count: the safetensors' own bytes (2 a weight) plus the norms
    widened to fp32; the fp32 load of the same folder holds twice the bytes."""
    folder = half_folder(tmp_path / "m", "bfloat16", tied=True)
    net = load_model(folder, "cpu", "auto", CpuKernels())
    blocks = resident_bytes(*(m for m in net.modules() if isinstance(m, (GGUFLinear, GGUFEmbedding))))
    norms = sum(p.numel() for n, p in net.named_parameters() if "norm" in n)
    assert all(p.dtype == torch.float32 for p in net.parameters())
    assert blocks == file_bytes(folder) - 2 * norms  # every weight once, tied lm_head included, no copy
    rotary = resident_bytes(net.rotary)
    assert resident_bytes(net) - rotary <= 1.01 * (file_bytes(folder) + 2 * norms)
    fp32 = load_model(folder, "cpu", "auto", CpuKernels(quantization="none"))
    assert not any(isinstance(m, GGUFLinear) for m in fp32.modules())
    assert resident_bytes(fp32) - resident_bytes(fp32.rotary) > 1.9 * (resident_bytes(net) - rotary)


def test_fp32_folders_and_quantization_none_keep_fp32_weights(tmp_path):
    src = make_checkpoint(tmp_path / "fp32", seed=7, tokenizer=True, **SHAPE)
    net = load_model(src, "cpu", "auto", CpuKernels())
    assert not any(isinstance(m, GGUFLinear) for m in net.modules())
    assert "as the checkpoint holds them" not in describe_cpu_kernels(net)
    half = half_folder(tmp_path / "bf16", "bfloat16")
    exact = load_model(half, "cpu", "float32", CpuKernels(quantization="none"))
    assert not any(isinstance(m, GGUFLinear) for m in exact.modules())
    assert {p.dtype for p in exact.parameters()} == {torch.float32}
