"""What the speculation policy tracks per request and what it hands the engine core per step (no torch)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from specstep.scheduler.spec.plain_hold import HoldTicket


@dataclass(slots=True)
class RequestAcceptance:
    """EMA of per-position acceptance: alpha = accepted / (accepted + rejections), both decayed per step; and
    how the request speculated, for its final message."""

    accepted: float = 0.0
    trials: float = 0.0
    idle_steps: int = 0  # consecutive steps without drafting
    probe_interval: int = 0  # idle steps before the next probe (0: not set yet)
    steps_off: int = 0  # decode steps in which it drafted nothing
    steps_probing: int = 0  # steps in which it drafted only to re-measure its acceptance
    last_k: int = 0  # drafts in its latest step
    sampled: bool = False  # its sampling kind (not greedy): the policy keeps an acceptance prior per kind

    def update(self, num_draft: int, num_accepted: int, decay: float, probe: bool = False) -> None:
        self.last_k = num_draft
        if num_draft <= 0:
            self.idle_steps += 1
            self.steps_off += 1
            return
        if probe:
            self.steps_probing += 1
        self.idle_steps = 0
        self.accepted = decay * self.accepted + num_accepted
        self.trials = decay * self.trials + num_accepted + (1 if num_accepted < num_draft else 0)

    def back_off(self, paid: bool) -> None:
        """After a probe: probe twice as often if it paid, half as often if not."""
        self.probe_interval = self.probe_interval // 2 if paid else self.probe_interval * 2

    def alpha(self, prior: float, prior_weight: float = 1.0) -> float:
        return (self.accepted + prior * prior_weight) / (self.trials + prior_weight)


@dataclass(frozen=True, slots=True)
class Effects:
    """What committing a decision applies to the policy, once, when its step runs (`AdaptivePolicy.commit`):
    choosing has no side effects, so a decision that is dropped (a chained step re-planned) costs nothing."""

    bucket: int | None = None  # batch bucket whose step counter advances (None: the fixed policy)
    governor_counted: bool = False  # the governor counts an off step
    governor_probe: bool = False  # ... and spends its probe on this one
    explore_key: int | None = None  # k > 0: a try of k; -bucket: a try of plain in it
    current_k: int | None = None  # the batch's k, for the next decision's hysteresis
    probe_clock_reset: bool | None = None  # the policy's probe clock: reset (True), advanced (False), kept (None)
    next_remeasure: tuple[int, int] | None = None  # (bucket, its step counter at the next re-measurement)
    # (request, idle_steps, probe_interval) to set: probe intervals clamped, lanes a subset probe covers backed off
    acceptance: tuple[tuple[RequestAcceptance, int, int], ...] = ()


@dataclass(slots=True)
class PendingEffects:
    """The effects of the decision being made, gathered while choosing and frozen into `Decision.effects`."""

    bucket: int | None = None
    governor_counted: bool = False
    governor_probe: bool = False
    explore_key: int | None = None
    current_k: int | None = None
    probe_clock_reset: bool | None = None
    next_remeasure: tuple[int, int] | None = None
    acceptance: dict[int, tuple[RequestAcceptance, int | None, int]] = field(default_factory=dict)

    def freeze(self) -> Effects:
        return Effects(self.bucket, self.governor_counted, self.governor_probe, self.explore_key, self.current_k,
                       self.probe_clock_reset, self.next_remeasure,
                       tuple(self.acceptance[i] for i in sorted(self.acceptance)))


@dataclass(frozen=True, slots=True)
class Decision:
    """One step's speculation, made once by the policy and not changed after (the engine core derives a new
    one with `dataclasses.replace` where pages force speculation off, and records what really ran beside it)."""

    num_draft: np.ndarray  # [B] per request
    k: int  # the batch's k (widest lane)
    refill: bool  # keep the draft's KV current this step
    expected_tokens: float
    expected_cost: float
    reason: str = "model"  # model | explore | remeasure | probe | off | fixed | none
    auto: np.ndarray | None = None  # [B] requests the policy decides for (not fixed-k overrides)
    probing: np.ndarray | None = None  # [B] requests drafting only to re-measure their acceptance
    # [B] lanes whose stale draft catches up before the step (None: every stale lane, when it refills). A probe
    # from plain decoding catches up only the lanes it drafts with: at batch 64 a draft-model catch-up of every
    # lane cost more than the probes' whole budget.
    catch_up: np.ndarray | None = None
    break_even: float | None = None  # accepted drafts a probing lane needs to pay its share of the step's overhead
    effects: Effects | None = None  # what `AdaptivePolicy.commit` applies when the step runs
    # [B] drafts the proposer said each lane would make, when it knew before the decision (n-gram); their
    # outcomes are counted per limit (`AdaptivePolicy.by_limit`)
    limits: np.ndarray | None = None
    hold: HoldTicket | None = None  # a plain choice's: it is reused while its inputs stay the same (plain_hold.py)

    @property
    def explored(self) -> bool:
        return self.reason == "explore"

    @property
    def measures(self) -> bool:
        """The step is taken to time a candidate (exploration, a re-measurement): its cost must be measured on its
        own, not inside a fused mixed step."""
        return self.reason in ("explore", "remeasure")

    def auto_drafts(self, num_draft: np.ndarray) -> bool:
        """Did the policy's choice (or a probe) have auto requests draft, given what the step really drafted?
        Exploration and re-measurement steps run k values on purpose: the governor does not judge them."""
        if self.reason not in ("model", "probe"):
            return False
        auto = self.auto if self.auto is not None else np.ones(len(num_draft), dtype=bool)
        return bool((np.asarray(num_draft)[auto] > 0).any())

    def to_log(self) -> dict:
        return {"k": self.k, "refill": self.refill, "speculating": int((self.num_draft > 0).sum()),
                "expected_tokens": round(self.expected_tokens, 3),
                "expected_cost_ms": round(self.expected_cost * 1e3, 3), "reason": self.reason}
