"""KV capacity planned from memory (`engine.memory_plan`, `engine.memory_probe`): the arithmetic with injected
figures, the override order, the clamps and the typed error; the CPU path end to end on the embedded target;
the CUDA measuring code run on CPU over a stand-in for torch.cuda; the plan in the ready lines."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from specstep.engine import memory_probe as probe
from specstep.engine.engine_config import EngineConfig
from specstep.engine.errors import ConfigError
from specstep.engine.memory_plan import GiB, MemoryFigures, MiB, plan_kv_cache
from specstep.engine.model_loader import load_model
from specstep.engine.models.cpu_linear import pack
from specstep.engine.sampling_params import SamplingParams
from specstep.scheduler import build as build_mod
from specstep.scheduler.build import build_engine
from tests.helpers import run_to_completion

BPP = 1 * MiB  # bytes per page, target and proposer together
PAGE = 16
SEQ = 1000  # positions one sequence may write -> 63 pages
SEQ_PAGES = 63


def figures(capacity=100 * GiB, utilization=0.9, in_use=2 * GiB, weights=1 * GiB, activations=3 * GiB,
            graphs=1 * GiB, kv_cap=None, device="cuda") -> MemoryFigures:
    return MemoryFigures(device, capacity, utilization, in_use, weights, activations, graphs, kv_cap)


def plan(f=None, max_batch=10_000, **kw):
    return plan_kv_cache(BPP, PAGE, SEQ, max_batch, f if f is not None else figures(), **kw)


def test_budget_arithmetic():
    p = plan()
    expected = (int(0.9 * 100 * GiB) - 2 * GiB - 3 * GiB - 1 * GiB) // BPP
    assert (p.num_pages, p.source, p.limit) == (expected, "planned", "")
    assert p.kv_tokens == (expected - 1) * PAGE and p.kv_bytes == expected * BPP


def test_overrides_win_in_order_num_pages_then_kv_cache_tokens():
    f = figures()
    assert plan(f, num_pages=7, kv_cache_tokens=4096).num_pages == 7
    by_tokens = plan(f, kv_cache_tokens=4096)
    assert (by_tokens.num_pages, by_tokens.source) == (4096 // PAGE + 1, "--kv-cache-tokens")
    # Explicit sizes are taken as given: smaller than one sequence is allowed (tests of preemption ask for it).
    assert plan(f, num_pages=3).num_pages == 3
    assert plan_kv_cache(BPP, PAGE, SEQ, 4, None, kv_cache_tokens=32).figures is None  # nothing measured


def test_at_most_what_a_full_batch_of_longest_sequences_holds():
    p = plan(figures(capacity=1000 * GiB), max_batch=4)
    assert p.num_pages == 4 * SEQ_PAGES + 1
    assert "--max-batch-size" in p.limit


def test_cpu_default_cap_never_below_one_sequence():
    capped = plan(figures(kv_cap=100 * MiB, device="cpu"))
    assert capped.num_pages == 100 and "CPU default" in capped.limit
    tiny_cap = plan(figures(kv_cap=10 * MiB, device="cpu"))
    assert tiny_cap.num_pages == SEQ_PAGES + 1  # the cap is a default: one longest sequence still fits


def test_too_little_memory_is_a_typed_error_naming_the_shortfall_and_the_flags():
    # Budget 10 GiB x 0.5 = 5 GiB, minus 4.98 GiB: 20 MiB left, but one sequence needs 64 pages = 64 MiB.
    f = figures(capacity=10 * GiB, utilization=0.5, in_use=4 * GiB, activations=int(0.98 * GiB), graphs=0)
    with pytest.raises(ConfigError) as e:
        plan(f)
    msg = str(e.value)
    assert "missing" in msg and "--gpu-memory-utilization" in msg and "--kv-cache-tokens" in msg
    assert "64 MiB" in msg  # what one sequence needs
    assert plan(figures(capacity=10 * GiB, utilization=0.5, in_use=4 * GiB, activations=int(0.9 * GiB),
                        graphs=0)).num_pages >= SEQ_PAGES + 1


def test_describe_names_every_term():
    text = plan(figures()).describe()
    assert text.startswith("kv cache ") and "90% of 100.0 GiB GPU memory" in text
    for piece in ("1.0 GiB weights", "3.0 GiB activations", "1.0 GiB graphs", "1.0 GiB other"):
        assert piece in text, piece
    assert plan(kv_cache_tokens=4096).describe() == "kv cache 4,096 tokens (257 MiB, --kv-cache-tokens)"


@pytest.mark.parametrize("value", [0.0, -0.1, 1.5])
def test_utilization_is_validated(value):
    with pytest.raises(ConfigError, match="--gpu-memory-utilization"):
        EngineConfig(gpu_memory_utilization=value)
    EngineConfig(gpu_memory_utilization=1.0)


def test_resident_bytes_counts_shared_storage_once_and_packed_copies():
    emb = nn.Embedding(100, 8)
    head = nn.Linear(8, 100, bias=False)
    head.weight = emb.weight  # tied: one tensor
    head._view = emb.weight.detach()[:50]  # another tensor over the same storage
    m = nn.ModuleDict({"emb": emb, "head": head})
    assert probe.resident_bytes(m) == 100 * 8 * 4
    head._packed = pack(torch.randn(100, 8))  # an oneDNN-packed copy is extra resident memory
    assert probe.resident_bytes(m) == 2 * 100 * 8 * 4


def test_largest_steps_shapes():
    decode, prefill = probe.largest_steps(8, 3, 512, 517, 16, 4096, None)
    assert decode.q_lens == (4,) * 8 and decode.width == 528 and decode.logit_rows == 32
    assert prefill.q_lens == (511,) * 8 and prefill.logit_rows == 8  # 4096 tokens admit 8 longest prompts
    _, mixed = probe.largest_steps(8, 3, 512, 517, 16, 4096, 64)
    assert sum(mixed.q_lens) == 64 and mixed.q_lens[:7] == (1,) * 7  # decode rows beside one chunk
    assert all(s + q <= mixed.width for s, q in zip(mixed.starts, mixed.q_lens))


def test_cpu_plan_sizes_the_engines_pools(monkeypatch):
    """The embedded target on CPU: with 1 GiB 'available', half of it minus the measured weights and the
    activation estimate becomes the KV cache, and every pool, the allocator and the ready info agree."""
    monkeypatch.setattr(build_mod, "host_ram_available", lambda: 1 * GiB)
    core, _, info = build_engine(EngineConfig(spec="draft_model", device="cpu", num_spec_tokens=2))
    plan_ = info.memory
    f = plan_.figures
    assert (f.device, f.capacity, f.utilization, f.kv_cap) == ("cpu", 1 * GiB, 0.5, 4 * GiB)
    eng = core.engine
    pools = [eng.pool, eng.proposer.pool]
    assert plan_.bytes_per_page == sum(p.page_bytes for p in pools)
    assert plan_.num_pages == (f.budget - f.weights - f.activations) // plan_.bytes_per_page  # memory-bound
    assert plan_.limit == ""
    for p in pools:
        assert p.num_pages == plan_.num_pages
        assert sum(t.numel() * t.element_size() for t in p.k + p.v) == plan_.num_pages * p.page_bytes
    assert core.allocator.num_pages == info.num_pages == plan_.num_pages
    # Measured while the pools held the dummy page only: everything reachable now, less the pages added since.
    grown = (plan_.num_pages - 1) * eng.proposer.pool.page_bytes
    assert f.weights == probe.resident_bytes(eng.target, eng.proposer) - grown
    # The sized pools serve: a request runs to completion over them.
    (req,) = run_to_completion(core, [[1, 2, 3, 4]], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    assert len(req.output_token_ids) == 6


class FakeCuda:
    """torch.cuda's memory API over scripted numbers; the warm-up itself runs on CPU tensors."""

    def __init__(self, peaks: list[int], free: int, total: int) -> None:
        self.peaks, self.free, self.total = list(peaks), free, total
        self.calls: list[str] = []
        self._peak = 0

    def synchronize(self, device=None) -> None:
        pass

    def reset_peak_memory_stats(self, device=None) -> None:
        self.calls.append("reset")
        self._peak = self.peaks.pop(0)

    def memory_allocated(self, device=None) -> int:
        return 5 * GiB

    def max_memory_allocated(self, device=None) -> int:
        return 5 * GiB + self._peak

    def empty_cache(self) -> None:
        self.calls.append("empty_cache")

    def mem_get_info(self, device=None) -> tuple[int, int]:
        self.calls.append("mem_get_info")
        return self.free, self.total


def test_cuda_measuring_over_a_fake_torch_cuda(tiny_target):
    target = load_model(tiny_target, "cpu", "float32", "matmul")
    decode, prefill = probe.largest_steps(4, 2, 128, 131, 16, 256, None)
    cuda = FakeCuda(peaks=[300 * MiB, 500 * MiB], free=60 * GiB, total=80 * GiB)
    f = probe.measure_cuda(target, (decode, prefill), (target,), 16, torch.device("cpu"), None, carry=10 * MiB,
                           graph_count=12, overhead_per_graph=4 * MiB, cuda=cuda)
    assert cuda.calls == ["reset", "reset", "empty_cache", "mem_get_info"]  # the cache is emptied before reading
    assert (f.device, f.capacity, f.utilization, f.in_use) == ("cuda", 80 * GiB, 0.9, 20 * GiB)
    assert f.activations == 500 * MiB + 10 * MiB  # the larger warm-up peak (the prefill here)
    assert f.graphs == 300 * MiB + 10 * MiB + 12 * 4 * MiB  # the decode step's peak and each graph's overhead
    assert f.kv_cap is None
    off = probe.measure_cuda(target, (decode, prefill), (target,), 16, torch.device("cpu"), 0.5,
                             cuda=FakeCuda([1, 2], 1, 2))
    assert (off.graphs, off.utilization) == (0, 0.5)


def test_cuda_warm_up_out_of_memory_is_a_typed_error(tiny_target, monkeypatch):
    target = load_model(tiny_target, "cpu", "float32", "matmul")

    def oom(*args):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(probe, "warm_up", oom)
    shapes = probe.largest_steps(4, 2, 128, 131, 16, 256, None)
    with pytest.raises(ConfigError, match="--max-batch-size"):
        probe.measure_cuda(target, shapes, (target,), 16, torch.device("cpu"), None, cuda=FakeCuda([0, 0], 1, 2))


def test_ready_lines_carry_the_plan(tiny_target, tmp_path, capsys):
    from specstep.scheduler.cli import main
    from specstep.scheduler.server.scheduler_process import ready_message

    prompts = tmp_path / "in.jsonl"
    prompts.write_text('{"prompt_token_ids": [1, 2, 3]}\n')
    assert main(["generate", "--model", str(tiny_target), "--prompts", str(prompts), "--max-tokens", "2",
                 "--device", "cpu", "--gpu-memory-utilization", "0.05"]) == 0
    err = capsys.readouterr().err
    line = next(x for x in err.splitlines() if x.startswith("specstep generate: ready ("))
    assert "kv cache " in line and "5% of " in line and "available RAM minus" in line

    core, _, info = build_engine(EngineConfig(model=str(tiny_target), device="cpu", max_batch_size=4))
    ready = ready_message(core, info, None)
    assert ready.kv_cache == info.memory.describe() and ready.kv_cache.startswith("kv cache ")
    assert ready.num_pages == info.memory.num_pages
