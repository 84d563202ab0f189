"""The AMX formats' lanes / tiles crossover: the rule that picks it from timings, the kernel defaults it sets (in
both libraries that compile the kernel, surviving a test's `amx_lane_rows(-1)`), and the loader measuring it on
a GGUF model's own linears where the host has AMX."""

from __future__ import annotations

import json

import pytest

from specstep.engine.cpu_kernels import CpuKernels
from specstep.engine.model_loader import describe_cpu_kernels, load_model
from specstep.engine.models import amx_crossover, decode_layers, gguf_kernel
from specstep.engine.models.amx_crossover import PROBE_ROWS, choose_lane_rows
from specstep.engine.models.cpu_linear_plans import PLANS
from specstep.engine.models.gguf_linear import GGUFLinear
from tests.fixtures_gguf import pin_int8_form, write_gguf
from tests.helpers import make_checkpoint

needs_kernel = pytest.mark.skipif(bool(gguf_kernel.unavailable()), reason=f"kernel: {gguf_kernel.unavailable()}")


def test_the_lanes_take_every_row_count_up_to_the_first_the_tiles_win():
    tiles = [10.0] * len(PROBE_ROWS)
    assert choose_lane_rows(tiles, [9.0] * len(PROBE_ROWS)) == PROBE_ROWS[-1]  # lanes faster everywhere
    assert choose_lane_rows(tiles, [11.0] * len(PROBE_ROWS)) == 0  # the tiles win at one row
    crossing = [8.0, 8.5, 9.0, 9.5, 10.5, 11.0, 12.0, 13.0]  # the tiles ahead from 5 rows
    assert choose_lane_rows(tiles, crossing) == 4
    noisy = [9.0, 9.0, 10.5, 9.0, 9.0, 9.0, 9.0, 9.0]  # a win after a loss is the host's noise: a threshold
    assert choose_lane_rows(tiles, noisy) == 2
    assert choose_lane_rows(tiles, [10.0] * len(PROBE_ROWS)) == PROBE_ROWS[-1]  # a tie: the same bits, either


@pytest.fixture
def restore_defaults():
    saved = dict(gguf_kernel.AMX_LANE_DEFAULTS)
    yield
    gguf_kernel.AMX_LANE_DEFAULTS.clear()
    gguf_kernel.AMX_LANE_DEFAULTS.update(saved)
    if gguf_kernel._build()[0] is not None:
        gguf_kernel.apply_amx_lane_defaults(gguf_kernel._build()[0])


@needs_kernel
def test_measured_defaults_hold_for_the_layers_and_outlive_an_override(restore_defaults):
    if decode_layers._build()[0] is not gguf_kernel._build()[0]:  # (one library: the C++ layers read these too)
        pytest.fail("the C++ layers load a library of their own")
    gguf_kernel.set_amx_lane_defaults({"Q4_1": 6, "Q8_0": 2})
    assert (gguf_kernel.amx_lane_rows_now("Q4_1"), gguf_kernel.amx_lane_rows_now("Q8_0")) == (6, 2)
    was = gguf_kernel.amx_lane_rows(3)  # a test's or an A/B's override: both formats
    try:
        assert (gguf_kernel.amx_lane_rows_now("Q4_1"), gguf_kernel.amx_lane_rows_now("Q8_0")) == (3, 3)
    finally:
        gguf_kernel.amx_lane_rows(was)
    assert (gguf_kernel.amx_lane_rows_now("Q4_1"), gguf_kernel.amx_lane_rows_now("Q8_0")) == (6, 2)
    gguf_kernel.set_amx_lane_defaults({"Q4_1": -1})
    assert gguf_kernel.amx_lane_rows_now("Q4_1") == 4  # the built-in default


@pytest.mark.skipif(bool(gguf_kernel.tiles_unavailable()), reason=f"AMX tiles: {gguf_kernel.tiles_unavailable()}")
def test_loading_on_the_tiles_measures_the_crossover_on_the_models_linears(tmp_path, monkeypatch, restore_defaults):
    monkeypatch.setenv("SPECSTEP_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(PLANS, "_mem", {})
    monkeypatch.setattr(amx_crossover, "_MEASURED_BYTES", {})
    src = make_checkpoint(tmp_path / "src", seed=5, tokenizer=True)
    path = write_gguf(tmp_path / "m.gguf", src, qtype="Q8_0")
    timed = []
    measure = amx_crossover.measure_lane_rows

    def spy(linears, rounds=amx_crossover.ROUNDS):
        timed.append(sorted((m.out_features, m.in_features) for m in linears))
        tiles, lanes = measure(linears, rounds=1)
        return tiles, [t * (0.5 if r <= 3 else 2.0) for r, t in zip(PROBE_ROWS, tiles)]  # lanes ahead up to 3 rows

    monkeypatch.setattr(amx_crossover, "measure_lane_rows", spy)
    model = load_model(path, "cpu", "float32", CpuKernels(activations=pin_int8_form("int8-tiles", monkeypatch)))
    linears = [m for m in model.modules() if isinstance(m, GGUFLinear)]
    assert timed == [sorted((m.out_features, m.in_features) for m in linears)]  # the model's own, all of them
    assert gguf_kernel.amx_lane_rows_now("Q8_0") == 3
    assert "calls of few rows (Q8_0 up to 3, measured faster here at load)" in describe_cpu_kernels(model)
    stored = json.loads(PLANS.path().read_text())
    assert [k for k in stored if k.startswith("amx_lanes:Q8_0:")]  # cached per machine
    # a second load reads the cache, and a smaller model of the format (a draft) leaves the larger one's defaults
    small = make_checkpoint(tmp_path / "small", seed=6, tokenizer=True, hidden_size=32, intermediate_size=64,
                            num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
    load_model(path, "cpu", "float32", CpuKernels(activations=pin_int8_form("int8-tiles", monkeypatch)))
    assert len(timed) == 1
    monkeypatch.setattr(amx_crossover, "measure_lane_rows",
                        lambda linears, rounds=1: ([1.0] * len(PROBE_ROWS), [2.0] * len(PROBE_ROWS)))
    draft = load_model(write_gguf(tmp_path / "d.gguf", small, qtype="Q8_0"), "cpu", "float32",
                       CpuKernels(activations=pin_int8_form("int8-tiles", monkeypatch)))
    assert "Q8_0 up to 3" in describe_cpu_kernels(draft)  # what runs: the target's, which it measured over more
    assert gguf_kernel.amx_lane_rows_now("Q8_0") == 3
    was = gguf_kernel.amx_lane_rows(2)  # an override in force (an A/B's) outlives a measurement
    try:
        measure(linears, rounds=1)
        assert gguf_kernel.amx_lane_rows_now("Q8_0") == gguf_kernel.amx_lane_rows_now("Q4_1") == 2
    finally:
        gguf_kernel.amx_lane_rows(was)
