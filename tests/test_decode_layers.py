"""The decoder layers in C++ (`engine.models.decode_layers`, `--cpu-layers auto`): they compute the torch layers'
results to rounding, one call a step of few positions and two a layer otherwise with the same bits, whatever
shares the step and whatever the thread count; bad slots are a typed error; where they do not apply the torch
layers run and the ready line says why."""

from __future__ import annotations

import pytest
import torch

from specstep.engine.batch_builder import build_forward_batch
from specstep.engine.cpu_kernels import CpuKernels
from specstep.engine.forward_batch import SplitAttention
from specstep.engine.gguf_checkpoint import converted_folder
from specstep.engine.kv_cache import KVPool
from specstep.engine.model_loader import describe_cpu_kernels, load_model
from specstep.engine.models import decode_layers
from specstep.engine.models.gguf_kernel import bf16_tiles_unavailable, tiles_unavailable, vnni_unavailable
from specstep.engine.native import cpu_flags
from specstep.engine.sampling_params import SamplingParams
from specstep.engine.thread_choice import ThreadChoice
from tests.fixtures_gguf import pin_int8_form, write_gguf
from tests.helpers import make_core, run_to_completion

pytestmark = pytest.mark.skipif(bool(decode_layers.unavailable()),
                                reason=f"C++ layers unavailable: {decode_layers.unavailable()}")

PAGE = 4
PROMPT = [5, 17, 99, 3, 41, 8, 230, 12, 77, 64, 1, 2, 3, 4, 150, 9, 30]
NEXT = [11, 250, 7, 7, 199]


@pytest.fixture(scope="module")
def gguf_model(tiny_target, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gguf")
    return converted_folder(write_gguf(tmp / "t.gguf", tiny_target, qtype="Q4_1"), cache=tmp)


def load(model, layers: str, activations: str = "fp32"):
    return load_model(model, "cpu", "float32", CpuKernels(layers=layers, activations=activations))


def steps(net, kv_dtype=torch.float32, pool_out=None):
    """Logits of: a 17-token prompt beside a 40-token one (per-layer calls: a decode-sized lane and a longer one
    attend in separate parts), NEXT decoded
    one token a step (one call a step), NEXT as one verify step (one call), and again beside another lane's
    decode row (lanes this ragged split their attention: per-layer calls). The KV pool in `kv_dtype`, appended
    to `pool_out` if given."""
    pool = KVPool(net.rank_cfg, len(net.layers), 64, PAGE, kv_dtype, "cpu")
    if pool_out is not None:
        pool_out.append(pool)
    pages, other = list(range(1, 21)), list(range(21, 60))
    n = len(PROMPT)

    def step(lanes):
        fb = build_forward_batch([t for t, _, _ in lanes], [s for _, s, _ in lanes], [p for _, _, p in lanes], PAGE,
                                 "cpu")
        with torch.inference_mode():
            return net.compute_logits(net(fb, pool))

    prompt = step([(PROMPT, 0, pages[: -(-n // PAGE)]), (list(range(100, 140)), 0, other)])
    single = torch.cat([step([([t], n + i, pages[: -(-(n + i + 1) // PAGE)])]) for i, t in enumerate(NEXT)])
    verify = step([(NEXT, n, pages)])
    beside = step([(NEXT, n, pages), ([9], 140, other)])
    return prompt, single, verify, beside


def long_prompts(net, kv_dtype=torch.float32):
    """Logits of fresh prompts of 40 and 23 tokens: one forward the attention kernel takes whole (one call: the
    kernel attends each lane as alone, so they share a part)."""
    pool = KVPool(net.rank_cfg, len(net.layers), 64, PAGE, kv_dtype, "cpu")
    fb = build_forward_batch([list(range(100, 140)), list(range(200, 223))], [0, 0],
                             [list(range(1, 11)), list(range(11, 17))], PAGE, "cpu", net.attention, "prefill")
    with torch.inference_mode():
        return net.compute_logits(net(fb, pool))


def test_native_layers_compute_the_torch_layers_logits(gguf_model):
    native, eager = load(gguf_model, "auto"), load(gguf_model, "torch")
    assert native.native is not None and eager.native is None
    assert "decoder layers in specstep's C++" in describe_cpu_kernels(native)
    assert "decoder layers in torch (--cpu-layers torch)" in describe_cpu_kernels(eager)
    for a, b in zip(steps(native), steps(eager), strict=True):
        assert (a - b).abs().max() < 1e-4 * b.abs().max()
        assert torch.equal(a.argmax(-1), b.argmax(-1))


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("acts", ["fp32", "int8"])  # int8: the host's kernel, and its prompt GEMM (AMX-BF16 here)
def test_one_call_a_step_and_per_layer_calls_give_the_same_bits(gguf_model, monkeypatch, acts, kv_dtype):
    net = load(gguf_model, "auto", acts)
    prompt, single, verify, beside = steps(net, kv_dtype)
    # batch-invariant: verify rows are the decode steps' bits, alone or beside another lane
    assert torch.equal(verify, single) and torch.equal(beside[: len(NEXT)], single)
    calls = []
    stack = decode_layers.NativeLayers.forward

    def spy(self, x, batch, kv, rope, attention):
        calls.append(attention.runs_kernel(x, kv.k[0], batch.attn, self.num_heads))
        return stack(self, x, batch, kv, rope, attention)

    monkeypatch.setattr(decode_layers.NativeLayers, "forward", spy)
    steps(net, kv_dtype)
    assert calls == [False] + [True] * len(NEXT) + [True, False]
    prompts = long_prompts(net, kv_dtype)
    assert calls[-1]  # the prompts' forward: one call, their rows flagged for the prompt GEMM
    monkeypatch.setattr(type(net.attention), "runs_kernel", lambda *a: False)  # every step per layer
    again = steps(net, kv_dtype)
    assert all(torch.equal(a, b) for a, b in zip(again, (prompt, single, verify, beside), strict=True))
    assert torch.equal(long_prompts(net, kv_dtype), prompts)


@pytest.mark.parametrize("acts", [
    "int8-lanes",
    pytest.param("int8-tiles", marks=pytest.mark.skipif(bool(tiles_unavailable()),
                                                        reason=f"AMX tiles: {tiles_unavailable()}")),
    pytest.param("int8-vnni", marks=pytest.mark.skipif(bool(vnni_unavailable()),
                                                       reason=f"AVX-512 VNNI: {vnni_unavailable()}"))])
def test_int8_activations_keep_verify_rows_bitwise_and_stay_near_the_fp32_logits(gguf_model, acts, monkeypatch):
    """`--activations int8` in the C++ layers (AVX2 lanes; AMX tiles; AVX-512 VNNI lanes over the tiles' copy): a
    verify step's rows are the decode steps' bits (alone and beside another lane), and the logits stay near the
    exact fp32 layers' (about 1% of the largest logit on this random model, as near as the torch layers over the
    same int8 kernel are: a rounding apart before a quantisation moves a value by a quantisation step; prompt
    rows take the fp32 prompt GEMM in the C++ layers with AVX2 lanes, the AMX-BF16 prompt GEMM with the tiles
    where the host has AMX-BF16, the int8 kernel itself otherwise)."""
    pinned = pin_int8_form(acts, monkeypatch)
    net, eager, exact = load(gguf_model, "auto", pinned), load(gguf_model, "torch", pinned), load(gguf_model, "auto")
    assert "int8 activations" in describe_cpu_kernels(net)
    assert ("in AMX tiles" in describe_cpu_kernels(net)) == (acts == "int8-tiles")
    assert ("times int8 activations in AVX-512 VNNI lanes" in describe_cpu_kernels(net)) == (acts == "int8-vnni")
    flagged = []
    spy = decode_layers.prompt_rows
    monkeypatch.setattr(decode_layers, "prompt_rows", lambda *a: flagged.append(spy(*a)) or flagged[-1])
    steps(net)  # the 40-token lane's rows: the prompt GEMM of the kind the activations take, or their own kernel
    kind = {"int8-lanes": decode_layers.PROMPT_GEMM, "int8-vnni": 0,
            "int8-tiles": 0 if bf16_tiles_unavailable() else decode_layers.PROMPT_GEMM_BF16_TILES}[acts]
    assert {int(v) for f in flagged if f is not None for v in f.unique()} == ({0, kind} if kind else set())
    monkeypatch.undo()
    prompt, single, verify, beside = steps(net)
    assert torch.equal(verify, single) and torch.equal(beside[: len(NEXT)], single)
    for a, b, c in zip(steps(net), steps(eager), steps(exact), strict=True):
        scale = c.abs().max()
        assert (a - b).abs().max() < 5e-2 * scale
        assert 1e-4 * scale < (a - c).abs().max() < 5e-2 * scale  # int8, not fp32: near it


@pytest.mark.parametrize("acts", [
    "fp32", pytest.param("int8-tiles", marks=pytest.mark.skipif(bool(bf16_tiles_unavailable()),
                                                                reason=f"AMX-BF16: {bf16_tiles_unavailable()}"))])
def test_prompt_rows_take_the_gemm_and_decode_rows_beside_them_keep_their_bits(gguf_model, acts, monkeypatch):
    """A step with a prompt lane (more than 17 positions: the prompt GEMM; with AMX tiles its AMX-BF16 form)
    beside a decode lane (its context longer than the prompt, so the step's attention splits, as a mixed step's
    does): the decode row's logits are bitwise its logits in a step of its own, and the prompt's are the torch
    layers' to rounding (fp32), or near them (the tiles: the torch layers take the int8 kernel, about 1% away)."""
    pinned = pin_int8_form(acts, monkeypatch)
    net, eager = load(gguf_model, "auto", pinned), load(gguf_model, "torch", pinned)
    kind = decode_layers.PROMPT_GEMM if acts == "fp32" else decode_layers.PROMPT_GEMM_BF16_TILES
    assert net.native.prompt_gemm == kind
    long_prompt, context = list(range(100, 140)), PROMPT * 3
    n = len(context)
    outs = {}
    for name, model in (("native", net), ("torch", eager)):
        pool = KVPool(model.rank_cfg, len(model.layers), 64, PAGE, torch.float32, "cpu")
        pages, other = list(range(1, 21)), list(range(21, 60))

        def step(lanes, model=model, pool=pool):
            fb = build_forward_batch([t for t, _, _ in lanes], [s for _, s, _ in lanes], [p for _, _, p in lanes],
                                     PAGE, "cpu")
            with torch.inference_mode():
                return model.compute_logits(model(fb, pool)), fb

        step([(context, 0, pages[: -(-n // PAGE)])])
        alone, _ = step([([11], n, pages[: -(-(n + 1) // PAGE)])])
        beside, fb = step([([11], n, pages[: -(-(n + 1) // PAGE)]), (long_prompt, 0, other)])
        outs[name] = (alone, beside)
        assert isinstance(fb.attn, SplitAttention)
        rows = decode_layers.prompt_rows(fb.attn, fb.num_tokens, kind)
        assert rows is not None and rows.tolist() == [0] + [kind] * len(long_prompt)
    alone, beside = outs["native"]
    assert torch.equal(beside[:1], alone)
    ref = outs["torch"][1]
    assert (beside - ref).abs().max() < (1e-4 if acts == "fp32" else 5e-2) * ref.abs().max()


def test_prompt_gemm_flags_a_call_cannot_run_are_a_typed_error(gguf_model, monkeypatch):
    """A call's prompt rows take one prompt GEMM: rows asking for both kinds are refused (-1), not run with one
    kind's bits for the other's rows; so is the AMX-BF16 kind where the host cannot run it."""
    net = load(gguf_model, "auto")
    real = decode_layers.prompt_rows

    def one_row_of_the_other_kind(meta, tokens, kind=decode_layers.PROMPT_GEMM):
        flags = real(meta, tokens, kind)
        if flags is not None:
            flags[int(flags.nonzero()[0, 0])] = decode_layers.PROMPT_GEMM_BF16_TILES
        return flags

    monkeypatch.setattr(decode_layers, "prompt_rows", one_row_of_the_other_kind)
    with pytest.raises(decode_layers.LayerKernelError, match="returned -1"):
        steps(net)


def test_a_bf16_cache_holds_torchs_rounding_of_the_fp32_caches_values(gguf_model):
    """`--kv-cache-dtype bfloat16` in the C++ layers: layer 0's keys and values (which no attention precedes) are
    bitwise torch's `.to(torch.bfloat16)` of what an fp32 cache holds, and the logits stay near the torch layers'
    over a bf16 cache and near the fp32 cache's (a bf16 rounding of K and V apart)."""
    net, eager = load(gguf_model, "auto"), load(gguf_model, "torch")
    wide, narrow, torch_narrow = [], [], []
    exact = steps(net, torch.float32, wide)
    got = steps(net, torch.bfloat16, narrow)
    ref = steps(eager, torch.bfloat16, torch_narrow)
    assert narrow[0].k[0].dtype == torch.bfloat16
    written = wide[0].k[0].abs().sum((1, 2)) > 0
    assert written.sum() > 40
    for cache in ("k", "v"):
        got_cache, fp32_cache = getattr(narrow[0], cache)[0], getattr(wide[0], cache)[0]
        assert torch.equal(got_cache[written], fp32_cache[written].to(torch.bfloat16))
    for a, b, c in zip(got, ref, exact, strict=True):
        scale = c.abs().max()
        assert (a - b).abs().max() < 1e-3 * scale
        assert 0 < (a - c).abs().max() < 2e-2 * scale


def test_the_caches_bf16_rounding_is_torchs():
    """`to_bf16` against torch's conversion: ties to even both ways, the largest finite values rounding to inf,
    infinities, signed zeros and subnormals bitwise; NaNs (any payload) NaNs (c10's 0x7FC0, where torch's vector
    path writes 0xFFFF)."""
    lib = decode_layers._build()[0]
    bits = torch.tensor([0x3F808000, 0x3F818000, 0x3F807FFF, 0x3F808001, 0x7F7FFFFF, 0x7F7F8000, 0xFF7FFFFF,
                         0x7F800000, 0xFF800000, 0x7FC00001, 0xFFFFFFFF, 0x7F800001, 0x80000000, 0x00000000,
                         0x00000001, 0x80008000, 0x00018000, 0x3EAAAAAB], dtype=torch.int64).to(torch.int32)
    x = torch.cat([bits.view(torch.float32), torch.randn(4096, generator=torch.Generator().manual_seed(0)) * 1e3])
    out = torch.empty(x.numel(), dtype=torch.int16)
    lib.bf16_round_rows(x.data_ptr(), out.data_ptr(), x.numel())
    ref = x.to(torch.bfloat16).view(torch.int16)
    nan = x.isnan()
    assert nan.sum() == 3 and torch.equal(out[~nan], ref[~nan])
    assert (out[nan] == 0x7FC0).all() and out.view(torch.bfloat16)[nan].isnan().all()


def test_results_do_not_depend_on_the_threads(gguf_model, monkeypatch):
    """Every call on one thread, then every call on two (each phase split between them, barriers between)."""
    net = load(gguf_model, "auto")
    before = torch.get_num_threads()
    monkeypatch.setattr(decode_layers, "THREADS", ThreadChoice(always_all=0))  # all of torch's threads, untimed
    try:
        torch.set_num_threads(1)
        one = steps(net)
        torch.set_num_threads(2)
        two = [steps(net) for _ in range(3)]
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(a, b) for run in two for a, b in zip(one, run, strict=True))


def test_a_slot_past_the_cache_is_a_typed_error(gguf_model):
    net = load(gguf_model, "auto")
    pool = KVPool(net.rank_cfg, len(net.layers), 8, PAGE, torch.float32, "cpu")
    fb = build_forward_batch([[5]], [0], [[1]], PAGE, "cpu")
    fb.slot_mapping.fill_(8 * PAGE)  # one past the pool's last slot
    with torch.inference_mode(), pytest.raises(decode_layers.LayerKernelError, match="returned -1"):
        net(fb, pool)


def test_an_fp32_model_keeps_the_torch_layers(tiny_target):
    net = load(tiny_target, "auto")
    assert net.native is None and "decoder layers" not in describe_cpu_kernels(net)


def test_engine_greedy_output_is_the_torch_layers(gguf_model):
    prompts = [[5, 17, 99, 3, 250, 41], [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17]]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = {layers: [r.output_token_ids for r in run_to_completion(
        make_core(gguf_model, spec="ngram", cpu_layers=layers), prompts, params)] for layers in ("auto", "torch")}
    assert outs["auto"] == outs["torch"]


def test_qwen2_biases_and_a_long_context(tmp_path):
    """Off the tuned path: Qwen2's q/k/v biases (filled with random values in both models: a checkpoint's are
    zero at init) and a 400-token context (many pages, keys past 8 vectors of scores): the C++ layers' logits are
    the torch layers' to rounding, and a verify step's rows are the decode steps' bits there too."""
    from tests.helpers import make_checkpoint

    src = make_checkpoint(tmp_path / "src", seed=7, arch="qwen2", tokenizer=True)
    model = converted_folder(write_gguf(tmp_path / "q.gguf", src, arch="qwen2", qtype="Q4_1"), cache=tmp_path)
    nets = {name: load(model, name) for name in ("auto", "torch")}
    assert nets["auto"].native is not None
    g = torch.Generator().manual_seed(0)
    biases = [torch.randn(layer.self_attn.qkv_proj.bias.shape, generator=g) * 0.5 for layer in nets["auto"].layers]
    context, n = [(7 * i) % 250 + 1 for i in range(400)], 400
    outs = {}
    for name, net in nets.items():
        with torch.no_grad():
            for layer, b in zip(net.layers, biases, strict=True):
                layer.self_attn.qkv_proj.bias.copy_(b)  # in place: the C++ layers read this memory
        pool = KVPool(net.rank_cfg, len(net.layers), 110, PAGE, torch.float32, "cpu")
        pages = list(range(1, 108))

        def step(tokens, start, net=net, pool=pool, pages=pages):
            fb = build_forward_batch([tokens], [start], [pages[: -(-(start + len(tokens)) // PAGE)]], PAGE, "cpu")
            with torch.inference_mode():
                return net.compute_logits(net(fb, pool))

        step(context, 0)
        single = torch.cat([step([t], n + i) for i, t in enumerate(NEXT)])
        outs[name] = (single, step(NEXT, n))
    single, verify = outs["auto"]
    assert torch.equal(verify, single)
    ref = outs["torch"][0]
    assert (single - ref).abs().max() < 1e-4 * ref.abs().max()


@pytest.mark.skipif(not cpu_flags() >= {"avx512f", "avx512dq", "avx512bw", "avx512vl"},
                    reason="no AVX-512: both calls would run the 8-lane form")
def test_the_mlp_gates_16_lane_form_gives_the_8_lane_forms_bits():
    """silu(g) * u in AVX-512 where the CPU has it (the attention kernel's exp in 16 lanes): every lane's
    operations are the 8-lane form's, so the layers' bits do not depend on which ran. Gates across the exp's range
    (past -87 it is 0), signed zeros, infinities and NaN, and a width that leaves an 8-wide tail."""
    lib = decode_layers._build()[0]
    rows, width = 7, 1544  # 96 16-lane vectors and one 8-lane tail a row
    gen = torch.Generator().manual_seed(0)
    gate = torch.randn(rows, width, generator=gen) * torch.tensor([0.1, 1.0, 8.0, 30.0, 100.0, 1e-3, 60.0])[:, None]
    gate[0, :8] = torch.tensor([0.0, -0.0, -87.5, -86.5, float("inf"), -float("inf"), float("nan"), 1e-40])
    gu = torch.cat([gate, torch.randn(rows, width, generator=gen)], dim=1).contiguous()
    out = {lanes: torch.empty(rows, width) for lanes in (8, 16)}
    for lanes, a in out.items():
        lib.silu_mul_rows(gu.data_ptr(), a.data_ptr(), rows, width, lanes)
    assert torch.equal(out[8].view(torch.int32), out[16].view(torch.int32))
    g, u = gu[:, :width].double(), gu[:, width:].double()
    finite = torch.isfinite(gate)
    finite[0, :8] = False  # the special values: bits compared above
    torch.testing.assert_close(out[16].double()[finite], (torch.nn.functional.silu(g) * u)[finite], rtol=1e-6,
                               atol=1e-30)
