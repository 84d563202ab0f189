"""N-gram plain steps cost what plain decoding costs: no prompt lookup at k = 0."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from specstep.engine.proposers import ngram
from specstep.engine.proposers.ngram import NgramProposer


def test_no_lookup_at_k_0(monkeypatch):
    calls = []
    real = ngram.ngram_lookup

    def counting(*args, **kw):
        calls.append(1)
        return real(*args, **kw)
    monkeypatch.setattr(ngram, "ngram_lookup", counting)
    prop = NgramProposer(torch.device("cpu"))
    seqs = [SimpleNamespace(token_ids=[1, 2, 3, 1, 2], num_computed=4, page_table=[1], slot=0)]
    assert prop.propose_host(seqs, 0) == [[]]
    assert not calls, "a plain step paid the n-gram lookup"
    assert prop.propose_host(seqs, 2) == [[3, 1]] and calls
    assert len(prop.propose_host(seqs * 3, 0)) == 3
