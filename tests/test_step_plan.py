"""The scheduler's plans: a decision is counted once, when its step runs, on both stream paths; a chained plan
that cannot run as decided (n-gram drafting needs the previous step's tokens on the host, a stale draft must
catch up first) leaves nothing counted; plain n-gram steps chain on the overlap path."""

from __future__ import annotations

import numpy as np
import pytest

from specstep.engine.sampling_params import SamplingParams
from specstep.scheduler.core.page_allocator import PageAllocator
from specstep.scheduler.core.request import Request
from specstep.scheduler.core.scheduler import ModelFacts, Scheduler, SchedulerConfig
from specstep.scheduler.core.step_plan import StepKind
from specstep.scheduler.spec.policy import AdaptivePolicy, PolicyConfig
from tests.sim_engine import Scenario, simulate
from tests.test_policy_harness import adaptive, mtp_cost, ngram_cost


@pytest.mark.parametrize("overlap", [False, True], ids=["inline", "overlap"])
@pytest.mark.parametrize("proposer", ["mtp", "ngram"])
def test_every_counted_decision_ran(proposer, overlap):
    """Acceptance that falls and comes back: the policy explores, speculates, stops and probes. Whatever it
    decided for a chained step that was then dropped must not be in its counts."""
    cost = mtp_cost() if proposer == "mtp" else ngram_cost()
    scenario = Scenario(cost, alpha=lambda rid, t: 0.8 if t < 800 or t > 2000 else 0.05)
    sim = simulate(scenario, proposer, [(0, f"r{i}", None) for i in range(4)], 700, adaptive(proposer),
                   overlap=overlap)
    pol = sim.core.policy
    ran = len(sim.steps)  # decode steps the engine ran
    assert sum(pol.reasons.values()) == ran, dict(pol.reasons)
    assert pol.steps == ran
    drafted = sum(k > 0 for _, k, _ in sim.steps)
    assert pol.reasons["probe"] > 0 and pol.reasons["explore"] > 0 and 0 < drafted < ran  # every branch reached
    sim.core.check_integrity()


def test_plain_ngram_steps_chain_on_the_overlap_path():
    """Unpredictable text: n-gram speculation stays off, and its plain steps are built while the previous one
    runs (before chaining they drained every step, losing the overlap that is the point of the CUDA path)."""
    scenario = Scenario(ngram_cost(), alpha=lambda rid, t: 0.02)
    sim = simulate(scenario, "ngram", [(0, f"r{i}", None) for i in range(4)], 300, adaptive("ngram"), overlap=True)
    launched_chained = sim.core.chained_steps
    assert launched_chained > 0.8 * len(sim.steps), (launched_chained, len(sim.steps))


def test_a_plan_is_frozen_and_its_decision_counted_only_at_launch():
    policy = AdaptivePolicy(PolicyConfig(kind="fixed", k_max=3, keeps_draft_kv=False))
    facts = ModelFacts(vocab_size=100, has_proposer=True, has_draft_model=False, draft_shift=0, lookahead=0)
    sched = Scheduler(facts, PageAllocator(64, 4), SchedulerConfig(max_batch_size=4, num_spec_tokens=3), policy)
    for i in range(2):
        sched.add_request(Request(str(i), [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=10), seed=i))
    plan = sched.schedule()
    assert plan.kind is StepKind.PREFILL and [r.request_id for r, _ in plan.prompts] == ["0", "1"]
    with pytest.raises(AttributeError):
        plan.kind = StepKind.DECODE  # frozen
    sched.results.finish_prefill(plan, [5, 6])
    plan = sched.schedule()
    assert plan.kind is StepKind.DECODE and plan.decision.num_draft.tolist() == [3, 3]
    assert sched.last_decision is None  # decided, not launched
    sched.launched(plan, np.array([2, 3]))
    assert sched.last_decision.num_draft.tolist() == [2, 3] and sched.last_decision.k == 3  # as it ran
