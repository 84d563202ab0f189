"""The speculation policy's configuration: candidate k, objective, priors, decay rates and the governor's floor."""

from __future__ import annotations

from dataclasses import dataclass

from specstep.scheduler.spec.governor import GovernorConfig

OBJECTIVES = ("throughput", "latency")


@dataclass(frozen=True, slots=True)
class PolicyConfig:
    kind: str = "adaptive"  # adaptive | fixed
    k_max: int = 4
    candidates: tuple[int, ...] | None = None  # k values allowed (e.g. those with captured graphs)
    objective: str = "throughput"  # throughput | latency
    itl_budget: float = 1.1  # latency objective: a speculative step may take at most this times a plain one
    prior_alpha: float = 0.6
    alpha_decay: float = 0.85  # EMA weight of the past, per drafting step
    cost_decay: float = 0.9  # EMA weight of the past, per measured step
    cost_shape: str = "lanes"  # lanes | rows (see costs.StepCosts)
    margin: float = 0.05  # hysteresis on the batch's k
    probe_every: int = 4  # first probe of a request that stopped speculating; doubles after each failed probe
    # Longest probe interval; n-gram (rows) backs off less: its acceptance comes in bursts (a copied span)
    # that sparse probes miss, and a probe costs it a few verify rows, not a draft loop over every lane.
    probe_max: int | None = None  # None: 16 for rows, 64 for lanes
    keeps_draft_kv: bool = True  # model proposers refill a KV cache; n-gram has none
    can_drop_refill: bool = True  # the proposer catches up after steps without refill (every model proposer)
    explore_samples: int = 2  # measurements of each k (across buckets) before the cost model is trusted
    plain_samples: int = 3  # measurements of plain decoding per bucket first: one noisy sample misled it
    min_gain: float = 0.3  # expected extra tokens per step below which a request is not worth a draft
    remeasure_every: int = 32  # per bucket: one step in this many re-measures the stalest other candidate
    governor: GovernorConfig = GovernorConfig()

    def __post_init__(self) -> None:
        if self.kind not in ("adaptive", "fixed"):
            raise ValueError(f"spec policy must be adaptive or fixed, got {self.kind!r}")
        if self.objective not in OBJECTIVES:
            raise ValueError(f"--spec-objective must be one of {', '.join(OBJECTIVES)}, got {self.objective!r}")
        if self.itl_budget < 1.0:
            raise ValueError(f"--spec-itl-budget must be >= 1.0 (a multiple of a plain step), got {self.itl_budget}")
        if self.cost_shape not in ("lanes", "rows"):
            raise ValueError(f"cost shape must be lanes or rows, got {self.cost_shape!r}")
        self.governor.validate()

    @property
    def drops_refill(self) -> bool:
        """Whether a step may skip the proposer's refill (`ThroughputModel.refill`: only when nobody drafts); the
        fixed policy always refills a model proposer. Graph capture follows this (`engine.step_graphs`)."""
        return self.kind != "fixed" and self.keeps_draft_kv and self.can_drop_refill

    @property
    def ks(self) -> tuple[int, ...]:
        if self.candidates is not None:
            return tuple(sorted({0, *(k for k in self.candidates if k <= self.k_max)}))
        return tuple(range(self.k_max + 1))
