"""CUDA checks (skipped without a GPU; `scripts/gpu_check.sh` runs them): graph replay vs eager for every
step kind and bucket, padding on the dummy page, FlashInfer vs the torch backend (eager and under a graph),
and speculative greedy equality (through graph replays, and through the engine)."""

from __future__ import annotations

import os
from types import SimpleNamespace

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from specstep.engine.attention import flashinfer_backend as fib  # noqa: E402
from specstep.engine.attention.torch_backend import paged_attention  # noqa: E402
from specstep.engine.batch_builder import build_forward_batch, build_layout  # noqa: E402
from specstep.engine.config import ModelConfig  # noqa: E402
from specstep.engine.forward_batch import ForwardBatch  # noqa: E402
from specstep.engine.kv_cache import KVPool  # noqa: E402
from specstep.engine.model_loader import load_model  # noqa: E402
from specstep.engine.sampling_params import SamplingParams  # noqa: E402
from tests.fixtures_models import make_flashinfer_checkpoint, make_mtp_head  # noqa: E402
from tests.helpers import make_checkpoint, make_core, run_to_completion  # noqa: E402
from tests.test_cuda_graphs import (  # noqa: E402
    BUCKETS,
    KINDS,
    NUM_PAGES,
    PAGE,
    PROMPTS,
    build_setup,
    check_padding,
    check_replay_matches_eager,
    greedy_generate,
    make_runner,
    spec_runner,
)

pytestmark = pytest.mark.gpu
CUDA = "cuda"


# ---- graphs ---------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def cuda_setup(request, tmp_path_factory):
    return build_setup(make_checkpoint(tmp_path_factory.mktemp("gpu_target"), seed=3), CUDA, request.param)


@pytest.fixture(scope="module")
def cuda_runner(cuda_setup):
    r = make_runner(cuda_setup, CUDA)
    info = r.capture()
    assert info.backend == "cuda" and info.buckets == BUCKETS and info.graphs == len(BUCKETS) * len(KINDS)
    return r


def _tol(s) -> float:
    return 1e-4 if s.pool.k[0].dtype == torch.float32 else 2e-2


@pytest.mark.parametrize("kind,q", KINDS)
@pytest.mark.parametrize("batch", [1, 2, 3, 4])
def test_cuda_graph_replay_matches_eager(cuda_setup, cuda_runner, kind, q, batch):
    check_replay_matches_eager(cuda_setup, cuda_runner, kind, q, batch, _tol(cuda_setup))
    torch.cuda.synchronize()


@pytest.mark.parametrize("kind,q", [("decode", 1), ("verify", 3)])
def test_cuda_padding_lane_touches_only_the_dummy_page(cuda_setup, cuda_runner, kind, q):
    check_padding(cuda_setup, cuda_runner, kind, q, _tol(cuda_setup))


def test_cuda_speculative_greedy_equals_plain_with_graphs(tmp_path):
    target = load_model(make_checkpoint(tmp_path / "t", seed=3), CUDA, "float32")
    draft = load_model(make_checkpoint(tmp_path / "d", seed=1, hidden_size=32, intermediate_size=64,
                                       num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1),
                       CUDA, "float32")
    pool = KVPool(target.cfg, target.cfg.num_layers, NUM_PAGES, PAGE, torch.float32, CUDA)
    for d, dpool in ((draft, KVPool(draft.cfg, 1, NUM_PAGES, PAGE, torch.float32, CUDA)),
                     (target, KVPool(target.cfg, target.cfg.num_layers, NUM_PAGES, PAGE, torch.float32, CUDA))):
        eager = spec_runner(target, pool, d, dpool, 2, CUDA, enabled=False)
        graphs = spec_runner(target, pool, d, dpool, 2, CUDA)
        plain = greedy_generate(eager, target, pool, d, dpool, PROMPTS, 10, 0)
        assert greedy_generate(graphs, target, pool, d, dpool, PROMPTS, 10, 0) == plain
        assert greedy_generate(graphs, target, pool, d, dpool, PROMPTS, 10, 2) == plain


@pytest.mark.parametrize("spec", ["draft_model", "ngram"])
def test_cuda_engine_speculative_greedy_equality(tiny_target, tiny_draft, spec):
    """Through the engine (StepEngine picks up graphs once the GraphRunner is wired in)."""
    prompts = [[5, 17, 42, 7, 5, 17], [9, 3], [100, 200, 50, 25, 60, 1, 100, 200]]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    common = dict(device=CUDA, dtype="float32", max_batch_size=4)  # 3 graph buckets, not 8: start-up time
    plain = run_to_completion(make_core(tiny_target, **common), prompts, params)
    extra = {"draft": str(tiny_draft)} if spec == "draft_model" else {}
    fast = run_to_completion(make_core(tiny_target, spec=spec, num_spec_tokens=3, **common, **extra), prompts,
                             params)
    assert [r.output_token_ids for r in fast] == [r.output_token_ids for r in plain]


@pytest.mark.parametrize("spec", ["none", "mtp"])
@pytest.mark.parametrize("graphs", ["on", "off"])
def test_cuda_steady_state_decode_syncs_only_in_its_readback(tiny_target, tmp_path, monkeypatch, spec, graphs):
    """Steady-state decode steps under sync debug mode "error": every input is staged (pinned, non-blocking)
    and nothing synchronises except the one documented readback, `StepOutput.read`."""
    from specstep.engine.step_engine import StepOutput
    from specstep.scheduler.core.request import Request

    draft = str(make_mtp_head(tmp_path / "head", tiny_target)) if spec == "mtp" else None
    core = make_core(tiny_target, device=CUDA, dtype="float32", spec=spec, draft=draft, num_spec_tokens=3,
                     spec_policy="fixed", graphs=graphs, max_batch_size=4)
    params = SamplingParams(temperature=0.7, max_tokens=64, ignore_eos=True)
    for i, p in enumerate(PROMPTS):
        core.add_request(Request(str(i), list(p), params, seed=i))
    for _ in range(3):  # prefill, then two decode steps (warm caches, allocator, chained pipeline)
        core.step()
    read = StepOutput.read

    def documented_readback(out):
        torch.cuda.set_sync_debug_mode(0)
        try:
            return read(out)
        finally:
            torch.cuda.set_sync_debug_mode("error")
    monkeypatch.setattr(StepOutput, "read", documented_readback)
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(6):
            core.step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    core.stream.close()


# ---- bf16 speculation -----------------------------------------------------------------------------------------

def _common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _greedy_logits(model, ids: list[int]) -> torch.Tensor:
    """The target's next-token logits after `ids`, one eager prefill in the model's own dtype."""
    pages = -(-len(ids) // PAGE)
    pool = KVPool(model.cfg, model.cfg.num_layers, pages + 1, PAGE, model.embed_tokens.weight.dtype, CUDA)
    fb = build_forward_batch([ids], [0], [list(range(1, pages + 1))], PAGE, CUDA)
    with torch.inference_mode():
        return model.compute_logits(model(fb, pool)[-1:])[0]


@pytest.mark.parametrize("graphs", ["off", "on"])
def test_cuda_bf16_mtp_greedy_equals_plain(graphs):
    """MTP speculation in bfloat16 (torch attention, graphs on and off) emits plain bf16 greedy decoding's tokens.
    The embedded target with its trained head, so drafts are often accepted (partial and full acceptance, the
    bonus token). Verify runs k + 1 rows where plain decoding runs one, and bf16 GEMMs of other shapes may round
    differently: where the outputs part, both tokens must be near-tied maxima of the target's logits there (a
    wrong acceptance emits a token far from the argmax)."""
    from specstep.engine.model_source import EMBEDDED_TARGET

    prompts = [[5, 17, 42, 7, 5, 17], [9, 3], [100, 200, 50, 25, 60, 1, 100, 200], [3, 1, 4, 1, 5, 9, 2, 6] * 3]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    common = dict(device=CUDA, dtype="bfloat16", attention="torch", graphs=graphs, max_batch_size=4,
                  max_model_len=256)
    outs = {}
    for spec in ("none", "mtp"):
        core = make_core(EMBEDDED_TARGET, spec=spec, num_spec_tokens=3, spec_policy="fixed", **common)
        reqs = run_to_completion(core, prompts, params)
        outs[spec] = [r.output_token_ids for r in reqs]
        if spec == "mtp":
            assert sum(r.stats.accepted for r in reqs) > 0, "the trained head should get drafts accepted"
            assert graphs == "off" or core.engine.graphs.replays > 0
        core.stream.close()
    if outs["mtp"] == outs["none"]:
        return
    target = load_model(EMBEDDED_TARGET, CUDA, "bfloat16")
    for prompt, plain, fast in zip(prompts, outs["none"], outs["mtp"]):
        i = _common_prefix(plain, fast)
        if i == len(plain):
            continue
        logits = _greedy_logits(target, prompt + plain[:i])
        top, spread = logits.max().item(), (logits.max() - logits.min()).item()
        gaps = top - logits[plain[i]].item(), top - logits[fast[i]].item()
        assert max(gaps) <= 0.02 * spread, (f"token {i} of prompt {prompt}: plain {plain[i]}, speculative "
                                             f"{fast[i]}, below the max logit by {gaps} (spread {spread:.2f})")


# ---- FlashInfer vs torch -------------------------------------------------------------------------------------

needs_flashinfer = pytest.mark.skipif(
    not fib.AVAILABLE,
    reason="flashinfer is not importable (bring its wheels in .whl/ for scripts/gpu_check.sh, see docs/testing.md)")
FI_PAGE, FI_MAX_PAGES = 16, 8
FI_CFG = ModelConfig(architecture="llama", vocab_size=256, hidden_size=4096, intermediate_size=64, num_layers=1,
                     num_heads=32, num_kv_heads=8, head_dim=128)


def _fi_problem(q_lens, kv_lens, seed=0):
    """Random bf16 pool, shuffled pages, queries; the torch reference output."""
    g = torch.Generator(device=CUDA).manual_seed(seed)
    pool = KVPool(FI_CFG, 1, 64, FI_PAGE, torch.bfloat16, CUDA)
    pool.k[0].normal_(generator=g)
    pool.v[0].normal_(generator=g)
    perm = (torch.randperm(63, generator=torch.Generator().manual_seed(seed)) + 1).tolist()
    tables = [perm[FI_MAX_PAGES * i: FI_MAX_PAGES * i + -(-kv // FI_PAGE)] for i, kv in enumerate(kv_lens)]
    q = torch.randn(int(sum(q_lens)), FI_CFG.q_size, generator=g, device=CUDA, dtype=torch.bfloat16)
    layout = build_layout(q_lens, tables, FI_PAGE, CUDA, max_kv_len=FI_MAX_PAGES * FI_PAGE)
    start = torch.tensor(np.subtract(kv_lens, q_lens), device=CUDA)
    meta = ForwardBatch.derive(layout, start, torch.zeros(len(q), dtype=torch.long, device=CUDA)).attn
    scale = FI_CFG.head_dim**-0.5
    ref = paged_attention(q, pool.k[0], pool.v[0], meta, FI_CFG.num_heads, scale)
    pt = np.zeros((len(tables), FI_MAX_PAGES), np.int32)
    for i, t in enumerate(tables):
        pt[i, : len(t)] = t
    return pool, q, ref, pt, meta, scale


@needs_flashinfer
@pytest.mark.parametrize("slot,q_lens,kv_lens", [
    ("decode", [1, 1, 1], [1, 37, 120]),
    ("verify", [5, 5, 5], [5, 64, 121]),
    ("verify", [1, 5, 3], [1, 64, 121]),
    ("prefill", [7, 30, 1], [7, 45, 16]),
])
def test_flashinfer_matches_torch(slot, q_lens, kv_lens):
    pool, q, ref, pt, meta, scale = _fi_problem(q_lens, kv_lens)
    fi = fib.FlashInferAttention(FI_CFG, FI_PAGE, torch.bfloat16, torch.device(CUDA), FI_MAX_PAGES)
    fi.plan(slot, np.array(q_lens), np.array(kv_lens), pt)
    meta.slot = slot
    out = fi.forward(q, pool.k[0], pool.v[0], meta, FI_CFG.num_heads, scale)
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)


@needs_flashinfer
@pytest.mark.parametrize("slot,q", [("decode", 1), ("verify", 5)])
def test_flashinfer_under_cuda_graph_with_padding(slot, q):
    """Capture at 4 lanes with padding-only plans, then plan 3 live lanes with new lengths and replay."""
    dev = torch.device(CUDA)
    fi = fib.FlashInferAttention(FI_CFG, FI_PAGE, torch.bfloat16, dev, FI_MAX_PAGES)
    pool, _, _, _, _, scale = _fi_problem([q] * 3, [q] * 3)
    q_static = torch.zeros(4 * q, FI_CFG.q_size, dtype=torch.bfloat16, device=CUDA)
    fi.plan_padding(slot, 4, q)
    meta = SimpleNamespace(slot=slot)

    def step():
        return fi.forward(q_static, pool.k[0], pool.v[0], meta, FI_CFG.num_heads, scale)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for seed, kv_lens in enumerate(([q, 40, 100], [q + 20, 70, 128])):
        pool2, qs, ref, pt, _, _ = _fi_problem([q] * 3, kv_lens, seed=seed)
        pool.k[0].copy_(pool2.k[0])
        pool.v[0].copy_(pool2.v[0])
        fi.plan(slot, np.full(3, q), np.array(kv_lens), pt, lanes=4)
        q_static[: 3 * q].copy_(qs)
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out[: 3 * q].float(), ref.float(), rtol=2e-2, atol=2e-2)


@needs_flashinfer
@pytest.mark.parametrize("graphs", ["off", "on"])
@pytest.mark.parametrize("spec", ["none", "draft_model", "mtp"])
def test_flashinfer_engine_follows_torch_engine(tmp_path, spec, graphs):
    """The whole engine (prefill, chained verify/draft/refill plans, graph replays) with FlashInfer against the
    torch backend, both fp16. Different kernels round differently, so a random-init model's near-tied logits
    may eventually pick another token: most of each output must agree before the first difference (a wrong
    plan changes tokens at once). tests/test_flashinfer_engine.py checks exact equality on CPU over a fake.
    head_dim 64 (target, draft and head): FlashInfer's prebuilt kernels, no JIT compile inside the check."""
    target = make_flashinfer_checkpoint(tmp_path / "t", seed=3)
    draft = {"draft_model": str(make_flashinfer_checkpoint(tmp_path / "d", seed=1, num_hidden_layers=1)),
             "mtp": str(make_mtp_head(tmp_path / "head", target))}.get(spec)
    prompts = [[5, 9, 11, 3, 7], [4, 2], [8] * 11, [17, 4, 9, 21, 5, 6, 7], [3, 1, 4, 1, 5, 9, 2, 6] * 5]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    outs = {}
    for attention in ("torch", "flashinfer"):
        core = make_core(target, device=CUDA, dtype="float16", page_size=16, max_batch_size=4, max_model_len=256,
                         spec=spec, draft=draft, num_spec_tokens=3, spec_policy="fixed", graphs=graphs,
                         attention=attention)
        outs[attention] = [r.output_token_ids for r in run_to_completion(core, prompts, params)]
        core.stream.close()
    agree = [_common_prefix(a, b) for a, b in zip(outs["torch"], outs["flashinfer"])]
    assert sum(agree) >= 0.75 * 32 * len(prompts) and min(agree) >= 4, agree
