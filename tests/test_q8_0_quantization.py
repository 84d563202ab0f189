"""`--quantization q8_0`: a Hugging Face folder's linears and embedding quantised to GGUF Q8_0 blocks at load, as
`llama-quantize` would. The blocks are the `gguf` package's own quantisation of the checkpoint's weights; with fp32
activations greedy tokens are transformers' on those blocks' dequantised weights; with int8 activations
speculative output is plain output; resident weights are the blocks' bytes; every way it cannot run is a typed
error."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specstep.engine.cpu_kernels import CpuKernels
from specstep.engine.errors import ConfigError
from specstep.engine.kernels import binding
from specstep.engine.memory_probe import resident_bytes
from specstep.engine.model_loader import describe_cpu_kernels, load_model
from specstep.engine.models.gguf_embedding import GGUFEmbedding
from specstep.engine.models.gguf_kernel import unavailable
from specstep.engine.models.gguf_linear import GGUFLinear
from specstep.engine.sampling_params import SamplingParams
from tests.fixtures_gguf import write_gguf
from tests.helpers import make_checkpoint, make_core, run_to_completion
from tests.test_half_folders import SHAPE, half_folder

pytestmark = pytest.mark.skipif(bool(unavailable() or binding.unavailable()),
                                reason="the GGUF kernels do not build here")

PROMPT = [5, 17, 99, 3, 250, 41, 7, 8, 5, 17, 99, 3]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def q8_0_roundtrip(w: torch.Tensor) -> torch.Tensor:
    """What a Q8_0 block holds for fp32 weights `w`: the `gguf` package's quantise, then dequantise."""
    from gguf import GGMLQuantizationType, quants

    q = quants.quantize(w.float().numpy(), GGMLQuantizationType.Q8_0)
    return torch.from_numpy(np.ascontiguousarray(quants.dequantize(q, GGMLQuantizationType.Q8_0), np.float32))


@pytest.mark.parametrize("dtype,arch,tied", [("bfloat16", "llama", True), ("float32", "qwen2", False)])
def test_greedy_tokens_are_transformers_on_the_q8_0_weights(tmp_path, dtype, arch, tied):
    import transformers

    folder = (half_folder(tmp_path / "m", dtype, arch, tied) if dtype != "float32"
              else make_checkpoint(tmp_path / "m", seed=7, arch=arch, tokenizer=True, **SHAPE))
    core = make_core(folder, quantization="q8_0", activations="fp32")
    target = core.engine.target
    linears = [m for m in target.modules() if isinstance(m, GGUFLinear)]
    assert len(linears) == 4 * 2 + 1 and {m.fmt for m in linears} == {"Q8_0"}
    assert isinstance(target.embed_tokens, GGUFEmbedding) and target.native is not None
    assert "quantised to Q8_0 at load" in describe_cpu_kernels(target)
    (req,) = run_to_completion(core, [PROMPT], GREEDY)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        for p in hf.parameters():
            if p.dim() == 2:  # every linear's and the embedding's weights, as their blocks hold them
                p.copy_(q8_0_roundtrip(p))
    with torch.inference_mode():
        out = hf.generate(torch.tensor([PROMPT]), max_new_tokens=GREEDY.max_tokens, do_sample=False,
                          pad_token_id=0)
    assert req.output_token_ids == out[0, len(PROMPT):].tolist()


@pytest.mark.parametrize("spec", ["ngram", "draft_model"])
def test_int8_speculation_is_plain_decoding(tmp_path, spec):
    folder = half_folder(tmp_path / "m", "bfloat16")
    (plain,) = run_to_completion(make_core(folder, quantization="q8_0", activations="int8"), [PROMPT], GREEDY)
    extra = {"draft": str(folder)} if spec == "draft_model" else {}
    core = make_core(folder, quantization="q8_0", activations="int8", num_spec_tokens=4, spec=spec, **extra)
    acts = {m.activations for m in core.engine.target.modules() if isinstance(m, GGUFLinear)}
    assert acts <= {"int8", "int8-vnni", "int8-tiles"}
    (out,) = run_to_completion(core, [PROMPT], GREEDY)
    assert out.output_token_ids == plain.output_token_ids


def test_resident_weights_are_the_blocks(tmp_path):
    """Against an independent count: 34 bytes a 32 weights of every linear and of the embedding (a tied lm_head
    reads the embedding's blocks: counted once), plus the fp32 norms."""
    folder = half_folder(tmp_path / "m", "bfloat16", tied=True)
    net = load_model(folder, "cpu", "auto", CpuKernels(quantization="q8_0"))
    cfg = net.cfg
    d, inter, layers = cfg.hidden_size, cfg.intermediate_size, cfg.num_layers
    kv = cfg.num_kv_heads * cfg.head_dim
    per_layer = (d + 2 * kv) * d + d * d + 2 * inter * d + d * inter
    weights = layers * per_layer + cfg.vocab_size * d
    norms = sum(p.numel() for n, p in net.named_parameters() if "norm" in n)
    assert all(p.dtype == torch.float32 for p in net.parameters())
    assert resident_bytes(net) - resident_bytes(net.rotary) == weights // 32 * 34 + 4 * norms


def test_linears_with_widths_off_the_blocks_stay_fp32(tmp_path):
    folder = make_checkpoint(tmp_path / "m", seed=7, tokenizer=True, hidden_size=128, intermediate_size=200,
                             num_attention_heads=4, num_key_value_heads=2)
    net = load_model(folder, "cpu", "auto", CpuKernels(quantization="q8_0"))
    kept = [n for n, m in net.named_modules()
            if n.endswith(("_proj", "lm_head")) and not isinstance(m, GGUFLinear)]
    assert kept and all(n.endswith("down_proj") for n in kept)  # 200 inputs: not whole blocks
    assert "linears kept in fp32" in describe_cpu_kernels(net)
    with torch.inference_mode():
        assert torch.isfinite(net.compute_logits(net.forward_dense(torch.tensor([PROMPT])))).all()


def test_tokens_equal_the_same_folder_as_a_q8_0_gguf_file(tmp_path, monkeypatch):
    """Quantised at load or by a GGUF writer (the `gguf` package's quantiser, llama.cpp's rounding), the blocks are
    the same bytes: int8 activations give the same tokens, for the same cost."""
    monkeypatch.setenv("SPECSTEP_CACHE", str(tmp_path / "cache"))
    folder = make_checkpoint(tmp_path / "m", seed=7, tokenizer=True, tie_word_embeddings=True, **SHAPE)
    gguf = write_gguf(tmp_path / "m.gguf", folder, qtype="Q8_0")
    got = make_core(folder, quantization="q8_0", activations="int8")
    ref = make_core(gguf, activations="int8")
    pairs = [(a, b) for a, b in zip(got.engine.target.modules(), ref.engine.target.modules(), strict=True)
             if isinstance(a, (GGUFLinear, GGUFEmbedding))]
    assert len(pairs) == 4 * 2 + 2
    for a, b in pairs:
        assert type(a) is type(b) and a.fmt == b.fmt == "Q8_0" and torch.equal(a.blocks, b.blocks)
    prompts = [PROMPT, PROMPT[3:] + [1, 2, 3]]
    assert ([r.output_token_ids for r in run_to_completion(got, prompts, GREEDY)]
            == [r.output_token_ids for r in run_to_completion(ref, prompts, GREEDY)])


def test_where_it_cannot_run_is_a_typed_error(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECSTEP_CACHE", str(tmp_path / "cache"))
    folder = make_checkpoint(tmp_path / "m", seed=7, tokenizer=True, **SHAPE)
    with pytest.raises(ConfigError, match="float32 activations"):
        load_model(folder, "cpu", "bfloat16", CpuKernels(quantization="q8_0"))
    with pytest.raises(ConfigError, match="not on cuda"):
        load_model(folder, "cuda", "auto", CpuKernels(quantization="q8_0"))
    gguf = write_gguf(tmp_path / "m.gguf", folder, qtype="Q8_0")
    with pytest.raises(ConfigError, match="GGUF file's blocks already"):
        load_model(gguf, "cpu", "auto", CpuKernels(quantization="q8_0"))
