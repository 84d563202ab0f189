"""The static-buffer contract on the CPU stand-in: step functions that would break under a real CUDA graph are
caught at capture or replay, and well-behaved ones (state written in place, prepare hooks) pass."""

from __future__ import annotations

import pytest
import torch

from specstep.cuda_graphs import BufferSpec, GraphConfig, GraphContractError, GraphKey, GraphRunner, StepKind

SPECS = lambda q: {"x": BufferSpec(rows=q, trailing=(4,), dtype=torch.float32)}  # noqa: E731


def capture_one(fn, replays: int = 2) -> GraphRunner:
    r = GraphRunner("cpu", GraphConfig(buckets=(2,), max_batch=2, deep_check_replays=None, warmup_runs=0))
    r.register(StepKind("s", fn, SPECS, (1,)))
    r.capture()
    for i in range(replays):
        r.run("s", 1, {"x": torch.full((2, 4), float(i))}, 2)
    return r


def test_well_behaved_step_passes_and_reads_static_outputs():
    state = torch.zeros(2, 4)

    def fn(inp, key):
        state.add_(inp["x"])  # state written in place: fine under a graph
        return {"y": inp["x"] * 2 + 1, "state": state}

    r = capture_one(fn)
    out = r.run("s", 1, {"x": torch.ones(2, 4)}, 2)
    assert torch.equal(out["y"], torch.full((2, 4), 3.0)) and out["state"].data_ptr() == state.data_ptr()


BREAKERS = {
    "rebinds an input": (lambda inp, key: inp.__setitem__("x", inp["x"] + 1) or {"y": inp["x"]},
                         "rebound input 'x'"),
    "reallocates an input": (lambda inp, key: {"y": inp["x"].set_(inp["x"].clone()) * 1},
                             "static input 'x' changed by the step"),
    "resizes an input": (lambda inp, key: {"y": inp["x"].resize_(1, 4) * 1}, "static input 'x' changed"),
    "syncs with the host": (lambda inp, key: {"y": inp["x"] * inp["x"].sum().item()}, "synchronises"),
    "masks with a bool tensor": (lambda inp, key: {"y": inp["x"][inp["x"] > 0]}, "synchronises"),
    "bakes host data in": (lambda inp, key: {"y": inp["x"] + torch.tensor([1.0, 2.0, 3.0, 4.0])},
                           "built from host data"),
}


@pytest.mark.parametrize("name", list(BREAKERS))
def test_contract_breakers_fail_at_capture(name):
    fn, message = BREAKERS[name]
    with pytest.raises(GraphContractError, match=message):
        capture_one(fn)


def test_escaping_allocation_is_caught():
    class Proposer:
        last = None

        def step(self, inp, key):
            y = inp["x"] * 2
            self.last = y + 1  # state rebound to a fresh tensor: stale under replay
            return {"y": y}

    with pytest.raises(GraphContractError, match="alive after it returned"):
        capture_one(Proposer().step)


def test_host_state_steering_the_work_is_caught():
    calls = []

    def shape_changes(inp, key):
        calls.append(1)
        return {"y": inp["x"][: 1 + len(calls) % 2]}  # a view: the output shape follows host state

    with pytest.raises(GraphContractError, match="output 'y' is"):
        capture_one(shape_changes)

    bufs = [torch.zeros(2, 4), torch.zeros(2, 4)]

    def picks_buffer(inp, key):
        calls.append(1)
        out = bufs[len(calls) % 2]
        out.copy_(inp["x"])
        return {"y": out}

    with pytest.raises(GraphContractError, match="storage differs"):
        capture_one(picks_buffer)

    def scalar_changes(inp, key):
        calls.append(1)
        return {"y": inp["x"] * float(len(calls))}

    with pytest.raises(GraphContractError, match="device work changed"):
        capture_one(scalar_changes)


def test_static_buffers_rebound_outside_the_step_are_caught():
    r = capture_one(lambda inp, key: {"y": inp["x"] + 1}, replays=0)
    graph = r._graphs[GraphKey("s", 2, 1)]
    graph.inputs["x"].set_(torch.zeros(2, 4))  # someone re-pointed the static buffer
    with pytest.raises(GraphContractError, match="before the step ran"):
        r.run("s", 1, {"x": torch.ones(2, 4)}, 2)


def test_prepare_hook_runs_before_each_capture():
    seen = []
    r = GraphRunner("cpu", GraphConfig(buckets=(1, 2), max_batch=2, warmup_runs=0))
    r.register(StepKind("s", lambda inp, key: {"y": inp["x"] + 1}, SPECS, (1,), prepare=seen.append))
    r.capture()
    assert seen == [GraphKey("s", 1, 1), GraphKey("s", 2, 1), GraphKey("s", 1, 1)]  # estimate, then 2, 1
