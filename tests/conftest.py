from __future__ import annotations

import pytest
import torch

from tests.helpers import make_checkpoint


@pytest.fixture(autouse=True)
def step_costs_apart(tmp_path_factory, monkeypatch):
    """Every test starts without stored step costs and keeps what it measures to itself (an engine otherwise
    reads and writes the user cache's, and one run's costs would be the next one's prior). An environment
    variable, so that the servers and CLI runs the tests start see the same folder."""
    monkeypatch.setenv("SPECSTEP_STEP_COSTS", str(tmp_path_factory.mktemp("step_costs")))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory):
    """A 2-layer GQA Llama with a tokenizer (random weights)."""
    return make_checkpoint(tmp_path_factory.mktemp("target"), seed=0, tokenizer=True)


@pytest.fixture(scope="session")
def tiny_draft(tmp_path_factory):
    """A 1-layer Llama sharing the target's vocabulary (random weights: acceptance near zero)."""
    return make_checkpoint(tmp_path_factory.mktemp("draft"), seed=1, hidden_size=32, intermediate_size=64,
                           num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
