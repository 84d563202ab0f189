"""Holding a plain choice: while the policy keeps choosing plain decoding for the same batch (its throughput model,
or the governor while off), it re-derives that choice every few steps instead of every step.

Deriving a decision reads every request's acceptance, prices each candidate k and checks each request's probe:
about half a millisecond of Python a step on a 2-core AMD EPYC host, where the default model's plain step takes
4.5 ms. Paid on every step while speculation is off, it made an adaptive engine that drafted nothing 10-16% slower
than a plain one. Yet while nothing drafts, almost nothing the choice reads changes: no acceptance or verify cost
is measured, and the batch, its room and the proposer's limits are what they were. So a plain choice is reused
while those stay the same, for at most `steps` committed steps, and never past the step at which a probe comes due
by its clock (a request's, or the governor's while off). What goes stale meanwhile is slow: the live plain cost
(an EMA), the ageing of an idle request's evidence (which halves every 16-64 steps) and the governor's probe debt
(paid off by a fraction of each step); a probe waiting on either comes at most `steps - 1` steps late.

Anything measured drops the hold (`AdaptivePolicy.observe_*`), as does a decision of another kind being committed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from specstep.scheduler.spec.decision import Decision, RequestAcceptance

HOLD_STEPS = 8  # committed steps a plain choice is reused for, at most


@dataclass(frozen=True, slots=True)
class HoldTicket:
    """What a plain decision is held under once its step runs (`Decision.hold`): choosing stays free of side
    effects, and only a committed decision is held."""

    key: tuple
    span: int  # committed steps it may be reused for
    accs: tuple[RequestAcceptance, ...]  # the batch's requests' (the choice holds for these very ones)


@dataclass(frozen=True, slots=True)
class HeldChoice:
    ticket: HoldTicket
    decision: Decision
    step: int  # the policy's committed steps when its step ran


class PlainHold:
    def __init__(self) -> None:
        self.steps = HOLD_STEPS
        self.held: HeldChoice | None = None

    @staticmethod
    def key(overrides: list[int | None], room: np.ndarray, limits: np.ndarray | None, k_max: int,
            governor_on: bool) -> tuple | None:
        """What a plain choice depends on that changes from step to step, beside the batch's requests; None where
        no choice is held (a fixed-k request drafts whatever the policy decides)."""
        if any(o is not None for o in overrides):
            return None
        # (room counts down to max_tokens: only its part up to k_max is read)
        return (governor_on, np.asarray(room, dtype=np.int64).clip(0, k_max).tobytes(),
                None if limits is None else np.asarray(limits, dtype=np.int64).tobytes())

    def reuse(self, accs: list[RequestAcceptance], key: tuple | None, step: int) -> Decision | None:
        """The held choice, if it was made for these very requests (by identity) and key, within its span."""
        h = self.held
        if key is None or h is None or h.ticket.key != key or step - h.step >= h.ticket.span:
            return None
        held = h.ticket.accs
        if len(held) != len(accs) or any(a is not b for a, b in zip(accs, held)):
            return None
        return h.decision

    def ticket(self, key: tuple | None, decision: Decision, accs: list[RequestAcceptance],
               probe_in: int) -> HoldTicket | None:
        """The ticket a freshly derived decision carries if it is plain: the model's choice (governor on), or the
        governor's while off. `probe_in`: committed steps before a probe comes due, a request's (on) or the
        governor's (off); <= 0: one is due and waits (for its evidence to age, or for the governor's debt)."""
        fx = decision.effects
        plain = decision.reason in ("model", "off") and not decision.num_draft.any()
        # Held, its effects are applied again at every step it is reused for: only those that mean "one more
        # plain step" may repeat (not a spent governor probe, an exploration or re-measurement's counter, nor
        # lanes a probe backed off, whose idle steps it resets).
        repeatable = fx is None or (not fx.governor_probe and fx.explore_key is None and fx.next_remeasure is None
                                    and all(idle is None for _, idle, _ in fx.acceptance))
        if key is None or not plain or not repeatable:
            return None
        return HoldTicket(key, self.steps if probe_in <= 0 else min(self.steps, probe_in), tuple(accs))

    def committed(self, decision: Decision, step: int) -> None:
        """A decision's step runs: hold it if it carries a ticket (a reused one keeps its first step's count)."""
        t = decision.hold
        if t is None:
            self.held = None
        elif self.held is None or self.held.ticket is not t:
            self.held = HeldChoice(t, decision, step)

    def drop(self) -> None:
        self.held = None
