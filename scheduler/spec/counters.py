"""Per-request speculation counters, kept by the engine and, from the per-step counts each output carries,
by the frontend (so a request cut short by a stop string still reports them). No torch here, and no serving
packages at import: the engine core (and the GPU tests, on an image without msgspec) import this module."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from specstep.scheduler.server.protocol import SpecStats


@dataclass(slots=True)
class SpecCounters:
    """Per-request speculation counters; positions are draft depths 0..k-1."""

    steps: int = 0  # decode steps that drafted at least one token
    drafted: int = 0
    accepted: int = 0
    drafted_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)
    last_k: int = 0  # drafts in the latest step
    acceptance_estimate: float = 0.0  # the policy's, as last reported
    steps_off: int = 0
    steps_probing: int = 0

    def policy(self, acceptance: float, steps_off: int, steps_probing: int) -> None:
        """The engine's running view of how the policy treated the request (cumulative, so the latest wins)."""
        self.acceptance_estimate, self.steps_off, self.steps_probing = acceptance, steps_off, steps_probing

    def record(self, num_draft: int, num_accepted: int) -> None:
        self.last_k = max(num_draft, 0)
        if num_draft <= 0:
            return
        self.steps += 1
        self.drafted += num_draft
        self.accepted += num_accepted
        grow = num_draft - len(self.drafted_per_position)
        if grow > 0:
            self.drafted_per_position.extend([0] * grow)
            self.accepted_per_position.extend([0] * grow)
        for j in range(num_draft):
            self.drafted_per_position[j] += 1
            self.accepted_per_position[j] += int(num_accepted > j)

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per speculative step, the bonus token counted: 1 + accepted / steps."""
        return 1.0 + self.accepted / self.steps if self.steps else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    def to_dict(self) -> dict:
        return {
            "drafted_tokens": self.drafted,
            "accepted_tokens": self.accepted,
            "spec_steps": self.steps,
            "acceptance_rate": round(self.acceptance_rate, 4),
            "mean_accepted_length": round(self.mean_accepted_length, 4),
            "acceptance_per_position": [round(a / d, 4) if d else 0.0 for a, d in
                                        zip(self.accepted_per_position, self.drafted_per_position)],
            "drafted_per_position": list(self.drafted_per_position),
            "accepted_per_position": list(self.accepted_per_position),
            "last_k": self.last_k,
            "acceptance_estimate": round(self.acceptance_estimate, 4),
            "steps_off": self.steps_off,
            "steps_probing": self.steps_probing,
        }

    def to_wire(self) -> SpecStats:
        from specstep.scheduler.server.protocol import SpecStats  # serving only (msgspec)

        fields = SpecStats.__struct_fields__
        return SpecStats(**{k: v for k, v in self.to_dict().items() if k in fields})
