"""Every dtype with every proposer: in bfloat16 and float16, greedy speculation (n-gram, draft model, MTP, MTP with a
reduced draft vocabulary) emits plain greedy decoding's tokens in the same dtype, and nothing in a step promotes
the model's dtype: the proposer's carried state, the KV pools and every forward's hidden states stay in it, and
(on the inline stream, where the ops run on this thread) no op mixes a half-precision tensor with a wider one.

The matrix: every (dtype, proposer) runs twice, graphs off / overlap off with a scripted policy (the proposer skips
the prompt, drafts k = 3 on some steps, drops the refill on the others and catches up when drafting resumes: the
MTP head's ring of target hidden states) and graphs on / overlap on with the fixed policy (k = 3 every step); the
two mixed corners run for MTP, whose carried hidden state feeds its next forward. Tiny models over a 16-token
vocabulary, 14 tokens for 4 prompts, two at a time (graph capture is most of the cost): every run accepts and
rejects drafts.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from specstep.engine.model_source import EMBEDDED_TARGET
from specstep.engine.proposers.draft_vocab import write_draft_vocab
from specstep.engine.sampling_params import SamplingParams
from tests.fixtures_models import make_mtp_head, make_perturbed_copy
from tests.helpers import ScriptedPolicy, make_checkpoint, make_core, run_to_completion

VOCAB, K = 16, 3
PARAMS = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)
HALF = (torch.bfloat16, torch.float16)
PROPOSERS = ["ngram", "draft_model", "mtp", "mtp_vocab"]
# (graphs, overlap, scripted policy): the two corners every proposer runs, then the mixed ones for MTP. The scripted
# policy runs inline only: with overlap the loop also asks it for chained steps it then discards (a drafting step
# cannot be chained onto one that dropped the refill), which shifts its pattern so that it never drafts again.
CORNERS = [("off", False, True), ("on", True, False)]
MIXED = [("on", False, True), ("off", True, False)]
CASES = ([pytest.param(p, *c, id=f"{p}-graphs_{c[0]}-overlap_{c[1]}") for p in PROPOSERS for c in CORNERS]
         + [pytest.param("mtp", *c, id=f"mtp-graphs_{c[0]}-overlap_{c[1]}") for c in MIXED])


def make_echo_mtp_head(folder: Path, target: Path, seed: int = 0) -> Path:
    """An MTP head that drafts "the last token again": `fc` passes the target's hidden state h[i] through (the token
    embedding dropped), the norms are plain and the layer adds little (small random weights), so the head's output
    points where h[i] does and the target's lm_head reads t[i + 1] off it. Against a target that often repeats a
    token its drafts are both accepted and rejected, where a random head's are almost never right."""
    make_mtp_head(folder, target, seed=seed, std=0.02)
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    d = tensors["model.fc.weight"].shape[0]
    tensors["model.fc.weight"] = torch.cat([torch.eye(d), torch.zeros(d, d)], dim=1)
    for name in ("model.hidden_norm.weight", "model.embed_norm.weight", "model.norm.weight"):
        tensors[name] = torch.ones(d)
    save_file(tensors, str(path), metadata={"format": "pt"})
    return folder


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """name -> (--spec, --draft); the target under "target". Drafters that are right often enough to accept and
    reject: a perturbed copy of the target, an MTP head that echoes the last token, the same head on half the
    vocabulary."""
    tmp = tmp_path_factory.mktemp("dtypes")
    target = make_checkpoint(tmp / "target", seed=7, vocab_size=VOCAB)
    draft = make_perturbed_copy(tmp / "draft", target, rel_noise=0.2)
    head = make_echo_mtp_head(tmp / "head", target, seed=1)
    reduced = shutil.copytree(head, tmp / "head_vocab")
    write_draft_vocab(reduced, torch.arange(VOCAB).float(), VOCAB // 2)  # tokens 15 down to 8
    return {"target": target, "ngram": ("ngram", None), "draft_model": ("draft_model", draft),
            "mtp": ("mtp", head), "mtp_vocab": ("mtp", reduced)}


def prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(VOCAB) for _ in range(n)] for n in (1, 6, 13)] + [[3, 7, 1, 5] * 3]


def engine(target, dtype: torch.dtype, **cfg):
    return make_core(target, dtype=str(dtype).removeprefix("torch."), page_size=4, max_batch_size=2,
                     max_model_len=64, **cfg)


@pytest.fixture(scope="module")
def plain(models):
    """Plain greedy tokens per dtype."""
    return {dtype: [r.output_token_ids for r in run_to_completion(engine(models["target"], dtype), prompts(), PARAMS)]
            for dtype in HALF}


class Promotions(TorchDispatchMode):
    """Records every op that mixes a half-precision tensor with a floating tensor of another dtype (the op
    computes in the wider one: a promotion). Casts (`.float()`, `.to()`) have one input and are not counted;
    float32 against float64 is the sampler's own arithmetic, in every model dtype alike."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        dtypes = {a.dtype for a in tree_leaves((args, kwargs or {}))
                  if isinstance(a, torch.Tensor) and a.is_floating_point() and a.dim() > 0}
        if len(dtypes) > 1 and dtypes & set(HALF):
            self.seen.add(f"{func}: {sorted(map(str, dtypes))}")
        return func(*args, **(kwargs or {}))


def hidden_dtypes(core) -> set[torch.dtype]:
    """Every forward's output dtype (target, and the proposer's network), from hooks: they also see forwards on
    the overlap stream's worker thread and inside graph captures and replays."""
    seen: set[torch.dtype] = set()
    proposer = core.engine.proposer
    for net in [core.engine.target] + ([proposer.network] if core.engine.has_draft_model else []):
        net.register_forward_hook(lambda mod, args, out: seen.add(out.dtype))
    return seen


@pytest.mark.parametrize("dtype", HALF, ids=["bf16", "fp16"])
@pytest.mark.parametrize(("proposer", "graphs", "overlap", "scripted"), CASES)
def test_speculation_in_half_precision_equals_plain_without_promotion(models, plain, dtype, proposer, graphs,
                                                                       overlap, scripted):
    spec, draft = models[proposer]
    core = engine(models["target"], dtype, spec=spec, draft=None if draft is None else str(draft),
                  num_spec_tokens=K, spec_policy="fixed", graph_standin=graphs == "on", overlap=overlap)
    if scripted:  # prompt skipped, refill dropped on off steps, catch-up when drafting resumes
        core.policy = ScriptedPolicy(K, [True, False, False, True, False], off_refill=False, prefill=False)
    hidden = hidden_dtypes(core)
    promotions = Promotions()
    if overlap:
        reqs = run_to_completion(core, prompts(), PARAMS)
    else:
        with promotions:  # inline stream: every op of every step runs on this thread
            reqs = run_to_completion(core, prompts(), PARAMS)
    core.stream.close()

    assert [r.output_token_ids for r in reqs] == plain[dtype]
    drafted, accepted = sum(r.stats.drafted for r in reqs), sum(r.stats.accepted for r in reqs)
    assert 0 < accepted < drafted, "steps should both accept and reject drafts"
    assert graphs == "off" or core.engine.graphs.replays > 0
    assert promotions.seen == set()
    assert hidden == {dtype}
    carried = core.engine.proposer.carried_state()
    if proposer != "ngram":
        assert {"carried_logits", "carried_hidden"} <= carried.keys() and ("history" in carried) == (spec == "mtp")
    for name, t in carried.items():
        # Logits stay float32 by design (compute_logits' dtype: sampling works in float32); all else is the model's.
        assert t.dtype == (torch.float32 if name == "carried_logits" else dtype), name
    pools = [core.engine.pool] + ([core.engine.proposer.pool] if core.engine.has_draft_model else [])
    assert {t.dtype for p in pools for t in p.k + p.v} == {dtype}


def test_cli_generates_with_mtp_in_bfloat16(tmp_path):
    """The reported failure: `specstep generate --dtype bfloat16 --spec mtp --num-spec-tokens 3` on the embedded
    target (its shipped head). The fixed policy drafts k = 3 from the first step (the adaptive one starts lower,
    and the failure needs k >= 2: the head's own hidden state fed back)."""
    inputs = tmp_path / "in.jsonl"
    inputs.write_text(json.dumps({"prompt": "def wrap(text, width):\n    return"}) + "\n")
    res = subprocess.run([sys.executable, "-m", "specstep.scheduler.cli", "generate", "--model", str(EMBEDDED_TARGET),
                          "--prompts", str(inputs), "--dtype", "bfloat16", "--spec", "mtp", "--num-spec-tokens", "3",
                          "--spec-policy", "fixed", "--max-tokens", "12", "--ignore-eos", "--device", "cpu",
                          "--kv-cache-tokens", "2048"],
                         capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"})
    assert res.returncode == 0, res.stderr[-2000:]
    (line,) = [json.loads(x) for x in res.stdout.splitlines()]
    assert len(line["token_ids"]) == 12 and line["finish_reason"] == "length"
    assert line["spec"]["drafted_per_position"][2] > 0  # the third draft (two head forwards deep) was proposed
    assert line["spec"]["accepted_tokens"] > 0  # the trained head's drafts were verified and kept
