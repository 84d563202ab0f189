"""GGUF checkpoints in every format of the kernel layer (engine/kernels), end to end: the linears read the file's
blocks and the decoder layers run in C++; with fp32 activations greedy tokens are transformers' on the dequantised
checkpoint, with int8 activations (the default on blocks) speculative output is plain output. Models of real
layouts at toy sizes: widths of 256 (a K-quant block), Qwen2 biases, tied embeddings, Q4_K_M's format mix."""

from __future__ import annotations

import pytest
import torch

from specstep.engine.errors import ConfigError
from specstep.engine.gguf_checkpoint import converted_folder
from specstep.engine.kernels import binding
from specstep.engine.model_loader import describe_cpu_kernels
from specstep.engine.models.gguf_linear import GGUFLinear
from specstep.engine.sampling_params import SamplingParams
from tests.fixtures_gguf import write_gguf
from tests.helpers import make_checkpoint, make_core, run_to_completion
from tests.test_batch_invariance import record_target_logits

pytestmark = pytest.mark.skipif(bool(binding.unavailable()), reason="the kernel layer does not build here")

SHAPE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)
# (format, architecture, tied embeddings)
MODELS = [("Q4_0", "llama", False), ("Q5_0", "llama", False), ("Q5_1", "llama", False), ("Q2_K", "qwen2", True),
          ("Q3_K", "llama", False), ("Q4_K", "llama", False),
          ("Q5_K", "llama", False), ("Q6_K", "llama", False), ("Q4_K_M", "qwen2", True), ("F16", "qwen2", False),
          ("BF16", "llama", True)]
PROMPT = [5, 17, 99, 3, 250, 41, 7, 8]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("src")
    return {(arch, tied): make_checkpoint(root / f"{arch}-{tied}", seed=11, arch=arch, tokenizer=True,
                                          tie_word_embeddings=tied, **SHAPE)
            for arch, tied in {(a, t) for _, a, t in MODELS}}


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECSTEP_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _gguf(tmp_path, sources, fmt: str, arch: str, tied: bool):
    return write_gguf(tmp_path / f"{fmt}.gguf", sources[(arch, tied)], arch=arch, qtype=fmt)


def _linears(core) -> list[GGUFLinear]:
    return [m for m in core.engine.target.modules() if isinstance(m, GGUFLinear)]


@pytest.mark.parametrize("fmt,arch,tied", MODELS)
def test_fp32_greedy_tokens_are_transformers_on_the_dequantised_checkpoint(tmp_path, cache, sources, fmt, arch,
                                                                          tied):
    import transformers

    path = _gguf(tmp_path, sources, fmt, arch, tied)
    core = make_core(path, activations="fp32")
    linears = _linears(core)
    assert len(linears) == 4 * 2 + 1 and all(m.kernel is not None and m.activations == "fp32" for m in linears)
    assert core.engine.target.native is not None  # the decoder layers ran in C++
    (req,) = run_to_completion(core, [PROMPT], GREEDY)
    hf = transformers.AutoModelForCausalLM.from_pretrained(converted_folder(path), torch_dtype=torch.float32)
    with torch.inference_mode():
        out = hf.generate(torch.tensor([PROMPT]), max_new_tokens=GREEDY.max_tokens, do_sample=False,
                          pad_token_id=0)
    assert req.output_token_ids == out[0, len(PROMPT):].tolist()


@pytest.mark.parametrize("fmt,arch,tied", [m for m in MODELS if m[0] != "F16"])
def test_default_activations_verify_rows_are_plain_decode_rows_bitwise(tmp_path, cache, sources, fmt, arch, tied):
    """The default arithmetic (int8 on blocks; bf16 dot products on BF16 tensors where the CPU has them): the model
    as its own draft (every draft accepted), so each verify row's inputs are plain decoding's and its logits must
    be plain decoding's bit for bit; the tokens too."""
    path = _gguf(tmp_path, sources, fmt, arch, tied)
    plain_core = make_core(path)
    expected = "int8" if fmt != "BF16" else "bf16" if binding.runs_here("BF16", "bf16") else "fp32"
    assert {m.activations for m in _linears(plain_core)} == {expected}
    note = describe_cpu_kernels(plain_core.engine.target)
    assert ("bf16 activations in AVX-512 BF16 dot products" in note) == (expected == "bf16")
    plain_logits = record_target_logits(plain_core)
    (plain,) = run_to_completion(plain_core, [PROMPT], GREEDY)
    core = make_core(path, num_spec_tokens=4, spec="draft_model", draft=str(path))
    spec_logits = record_target_logits(core)
    (spec,) = run_to_completion(core, [PROMPT], GREEDY)
    assert spec.output_token_ids == plain.output_token_ids
    tokens, compared = PROMPT + plain.output_token_ids, 0
    for p, rows in spec_logits.items():
        for start, ids, row in rows:
            if len(ids) > 1 and ids == tokens[start:p + 1] and p in plain_logits:
                assert torch.equal(row, plain_logits[p][0][2]), p
                compared += 1
    assert compared >= GREEDY.max_tokens // 2  # rows of real verify steps


def test_cpu_isa_environment_pins_the_kernels(tmp_path, cache, sources, monkeypatch):
    """SPECSTEP_CPU_ISA pins the ISA the kernels run in (the same bits on each: the kernels' own tests); a name
    no kernel has is a clear error."""
    from specstep.engine.cpu_kernels import CpuKernels
    from specstep.engine.model_loader import describe_cpu_kernels, load_model

    path = _gguf(tmp_path, sources, "Q4_K_M", "qwen2", True)
    monkeypatch.setenv(binding.ISA_ENV, "avx2")
    model = load_model(path, "cpu", "float32", CpuKernels(activations="auto"))
    assert {m.kernel.isa for m in model.modules() if isinstance(m, GGUFLinear)} == {"avx2"}
    assert "in specstep's AVX2 kernels, int8 activations" in describe_cpu_kernels(model)
    monkeypatch.setenv(binding.ISA_ENV, "neon")
    for activations in ("auto", "fp32"):  # one parser for every arithmetic: a typed error, never a traceback
        with pytest.raises(ConfigError, match="SPECSTEP_CPU_ISA='neon'"):
            load_model(path, "cpu", "float32", CpuKernels(activations=activations))


@pytest.mark.parametrize("fmt,arch,tied", [("Q4_K_M", "qwen2", True), ("Q6_K", "llama", False)])
def test_block_weights_are_never_read_as_fp32(tmp_path, cache, sources, monkeypatch, fmt, arch, tied):
    """The converted checkpoint's fp32 tensors are read only where no block module takes the weight (norms,
    biases): the linears' and the embedding's weights go from the file's blocks straight into their modules, so
    a load's peak stays near the file's size. Under `--quantization none` every tensor is read, as before."""
    from specstep.engine import loader
    from specstep.engine.cpu_kernels import CpuKernels
    from specstep.engine.model_loader import load_model

    path = _gguf(tmp_path, sources, fmt, arch, tied)
    read: list[str] = []
    real = loader._read_share
    monkeypatch.setattr(loader, "_read_share", lambda f, name, *a: read.append(name) or real(f, name, *a))
    model = load_model(path, "cpu", "float32", CpuKernels())
    assert len(_linears_of(model)) == 4 * 2 + 1 and not any(t.is_meta for t in model.state_dict().values())
    assert read and all(name.endswith(("norm.weight", ".bias")) for name in read), read
    read.clear()
    load_model(path, "cpu", "float32", CpuKernels(quantization="none"))
    assert "model.embed_tokens.weight" in read and sum(name.endswith("proj.weight") for name in read) == 7 * 2


def _linears_of(model) -> list[GGUFLinear]:
    return [m for m in model.modules() if isinstance(m, GGUFLinear)]


@pytest.mark.parametrize("fmt,arch,tied", [("Q4_K_M", "qwen2", True), ("Q2_K", "qwen2", True),
                                           ("Q3_K", "llama", False), ("Q4_0", "llama", False),
                                           ("Q5_1", "llama", False), ("BF16", "llama", True)])
def test_prompt_rows_take_the_kernels_own_gemm_beside_decode_rows(tmp_path, cache, sources, fmt, arch, tied):
    """The default arithmetic in the C++ layers (int8 on blocks; bf16 dot products on BF16 tensors): a prompt lane
    (more than 17 positions) beside a decode lane. The prompt's rows take the kernel's own prompt GEMM
    (`int8_gemm.inc`, `bf16_dot.cpp`, where the host has them): not the decode kernel's bits (the same step with the
    prompt GEMM off), but its results to rounding (int8: about 1% of the largest logit, as a summation order's
    difference moves some of the next layers' quantised values a step); the decode row keeps its bits from a step of
    its own."""
    from specstep.engine.batch_builder import build_forward_batch
    from specstep.engine.cpu_kernels import CpuKernels
    from specstep.engine.kv_cache import KVPool
    from specstep.engine.model_loader import load_model
    from specstep.engine.models import decode_layers

    if decode_layers.unavailable():
        pytest.skip(f"C++ layers unavailable: {decode_layers.unavailable()}")
    path = _gguf(tmp_path, sources, fmt, arch, tied)
    net = load_model(path, "cpu", "float32", CpuKernels(activations="auto"))
    if not any(k.gemm for m in _linears_of(net) for k, _, _ in m.parts):
        pytest.skip("no prompt GEMM of the kernels' own on this host (AVX-512 VNNI, AVX-512 BF16)")
    assert net.native.prompt_gemm == decode_layers.PROMPT_GEMM
    assert decode_layers.OWN_GEMMS["bf16" if fmt == "BF16" else "int8"] in describe_cpu_kernels(net)
    page, context, prompt = 4, PROMPT * 3, list(range(100, 140))
    n, outs = len(context), {}
    for kind in (decode_layers.PROMPT_GEMM, 0):
        net.native.prompt_gemm = kind
        pool = KVPool(net.rank_cfg, len(net.layers), 64, page, torch.float32, "cpu")
        pages, other = list(range(1, 21)), list(range(21, 60))

        def step(lanes, pool=pool):
            fb = build_forward_batch([t for t, _, _ in lanes], [s for _, s, _ in lanes], [p for _, _, p in lanes],
                                     page, "cpu")
            with torch.inference_mode():
                return net.compute_logits(net(fb, pool))

        step([(context, 0, pages[: -(-n // page)])])
        alone = step([([11], n, pages[: -(-(n + 1) // page)])])
        beside = step([([11], n, pages[: -(-(n + 1) // page)]), (prompt, 0, other)])
        outs[kind] = (alone, beside)
    alone, beside = outs[decode_layers.PROMPT_GEMM]
    assert torch.equal(beside[:1], alone)
    ref = outs[0][1][1:]
    assert not torch.equal(beside[1:], ref)
    assert (beside[1:] - ref).abs().max() < 0.03 * ref.abs().max()
