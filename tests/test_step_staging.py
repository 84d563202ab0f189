"""Per-step host -> device copies go through the staging path only, and a decode step reads back once.

On CUDA a `torch.tensor(list, device=cuda)` or a `from_numpy(a).to(cuda)` is a pageable copy the host waits
for; the engine sends a step's inputs through `engine.staging.Staging` (pinned, double-buffered, one copy per
dtype) instead. The CPU cannot tell a pageable copy from a pinned one, so this checks the structure: while
decode steps run, nothing builds a tensor from host data outside `Staging.upload`, each step stages once, and
the host reads each step's results back in one transfer.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from specstep.engine import batch_builder
from specstep.engine.sampling_params import SamplingParams
from specstep.engine.staging import Staging
from specstep.scheduler.core.request import Request
from tests.fixtures_models import make_mtp_head
from tests.helpers import make_core

_HOST_TO_DEVICE = ("tensor", "as_tensor", "from_numpy")


class CopyRecorder:
    """Records tensor constructions from host data outside `Staging.upload` (any thread) and host readbacks."""

    def __init__(self, monkeypatch) -> None:
        self.local = threading.local()
        self.outside: list[str] = []
        self.uploads = 0
        self.readbacks = 0
        self.on = False
        for name in _HOST_TO_DEVICE:
            monkeypatch.setattr(torch, name, self._guard(getattr(torch, name), f"torch.{name}"))
        monkeypatch.setattr(batch_builder, "to_device", self._guard(batch_builder.to_device, "to_device"))
        upload = Staging.upload

        def staged(staging, arrays):
            self.local.depth = getattr(self.local, "depth", 0) + 1
            self.uploads += self.on
            try:
                return upload(staging, arrays)
            finally:
                self.local.depth -= 1
        monkeypatch.setattr(Staging, "upload", staged)
        for name in ("tolist", "item", "cpu", "numpy"):
            monkeypatch.setattr(torch.Tensor, name, self._readback(getattr(torch.Tensor, name)))

    def _guard(self, fn, name):
        def guarded(*a, **kw):
            if self.on and not getattr(self.local, "depth", 0):
                self.outside.append(name)
            return fn(*a, **kw)
        return guarded

    def _readback(self, fn):
        def counted(t, *a, **kw):
            if self.on and not getattr(self.local, "depth", 0):
                self.readbacks += 1
            return fn(t, *a, **kw)
        return counted


@pytest.mark.parametrize("spec", ["none", "ngram", "mtp", "draft_model"])
@pytest.mark.parametrize("overlap", [False, True])
def test_decode_steps_stage_their_inputs_once_and_read_back_once(tiny_target, tiny_draft, tmp_path, monkeypatch,
                                                                spec, overlap):
    draft = {"draft_model": str(tiny_draft), "mtp": str(make_mtp_head(tmp_path / "head", tiny_target))}.get(spec)
    core = make_core(tiny_target, spec=spec, draft=draft, num_spec_tokens=3, spec_policy="fixed", overlap=overlap,
                     max_batch_size=4)
    params = SamplingParams(temperature=0.7, max_tokens=40, ignore_eos=True)
    for i, p in enumerate([[5, 9, 11, 3, 7] * 3, [4, 2] * 4, [8] * 11]):
        core.add_request(Request(str(i), p, params, seed=i))
    core.step()  # the prefill (three prompts, one step)
    rec = CopyRecorder(monkeypatch)
    rec.on = True
    steps = 0
    for _ in range(6):
        core.step()
        steps += 1
    rec.on = False
    assert rec.outside == [], rec.outside
    # One staged upload a step; chained steps may run one step ahead, so allow one more in flight.
    assert steps <= rec.uploads <= steps + 1, (rec.uploads, steps)
    assert rec.readbacks <= steps, (rec.readbacks, steps)
    core.stream.close()


def test_staging_alternates_sets_and_does_not_alias_host_arrays():
    staging = Staging("cpu")
    a = np.arange(6, dtype=np.int64).reshape(2, 3)
    t, f, b = staging.upload([a, np.array([0.5, 2.0], dtype=np.float32), np.array([True, False])])
    assert t.tolist() == a.tolist() and t.dtype == torch.int64 and f.dtype == torch.float32 and b.dtype == torch.bool
    a[0, 0] = 99
    t[1, 1] = -1
    assert t[0, 0] == 0 and a[1, 1] == 4  # neither side aliases the other (a chained step patches device starts)
    big = np.arange(10_000, dtype=np.int64)
    (u,) = staging.upload([big])  # the next set, grown
    later = [staging.upload([np.full(6, i, np.int64)])[0] for i in range(4)]  # round the sets, past the first
    # Earlier results stay intact when their set's host buffer is rewritten (device copies are their own).
    assert u.tolist() == big.tolist() and t.tolist() == [[0, 1, 2], [3, -1, 5]]
    assert [x.tolist() for x in later] == [[i] * 6 for i in range(4)]
    with pytest.raises(TypeError):
        staging.upload([np.ones(2, np.int32)])
