"""What the scheduler calls on a step engine: the local `engine.step_engine.StepEngine` and the tensor-parallel
leader (`engine.parallel.tp_engine.LeaderEngine`, which announces each device call to the followers first) both
implement it, member by member; nothing is probed with `getattr` or forwarded by `__getattr__`.

Callers: `scheduler.core.engine_core.EngineCore` (and its chunked-prefill and stopping parts), and the prefill
budget's start-up timing (`scheduler.core.prefill_budget.measure_step_costs`). Start-up (`scheduler.build`) builds the
local engine itself and may use more of it (graphs, memory planning) before the core exists.

Threading: `plan_decode` runs on the scheduler thread (host work only); `prefill`, `catch_up`, `run_decode` and
`run_mixed` are device jobs, submitted to the device stream in the order the scheduler built them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    import numpy as np
    import torch

    from specstep.engine.parallel.group import TPGroup
    from specstep.engine.proposers.base import Proposer
    from specstep.engine.step_context import Chain, DecodePlan, SeqState
    from specstep.engine.step_engine import StepOutput


@runtime_checkable
class StepEngineProtocol(Protocol):
    #: the tensor-parallel group this engine steps with (`parallel.group.SINGLE` on one device)
    tp: TPGroup
    #: the proposer (None: no speculation); its `kv_lookahead` and `shift` shape the pages a step reserves
    proposer: Proposer | None
    #: the target's vocabulary size (prompt and sampling-parameter validation)
    vocab_size: int

    @property
    def has_draft_model(self) -> bool:
        """The proposer keeps a network with its own KV state (refill, catch-up); False for n-gram and none."""
        ...

    def can_chain(self, num_draft: np.ndarray) -> bool:
        """Whether a step drafting `num_draft[i]` tokens for request i can be built blind, chained on the
        previous step's device outputs (`plan_decode(..., chain=...)`): no proposer, a model proposer, or a host
        proposer (n-gram) on a plain step (every `num_draft` 0)."""
        ...

    def prefill(self, seqs: list[SeqState], with_proposer: bool | list[bool] = True,
                q_lens: list[int] | np.ndarray | None = None) -> torch.Tensor:
        """One target forward over ragged prompt chunks; the token sampled after each run [B] (device)."""
        ...

    def catch_up(self, seqs: list[SeqState], draft_lens: list[int]) -> None:
        """Bring a stale draft up to date with the tokens it skipped (only with `has_draft_model`)."""
        ...

    def plan_decode(self, seqs: list[SeqState], num_draft: np.ndarray, chain: Chain | None = None,
                    refill: bool = True) -> DecodePlan:
        """Host-side preparation of a decode step drafting `num_draft[i]` tokens for request i (may draft fewer:
        the plan's `num_draft` is what runs)."""
        ...

    def run_decode(self, plan: DecodePlan) -> StepOutput:
        """The device part of a planned decode step; no host sync (read the result with `StepOutput.read`)."""
        ...

    def fuses_mixed(self, plan: DecodePlan) -> bool:
        """Whether a mixed step with this planned decode step runs as one forward (`run_mixed`); else it runs
        `run_decode`, then `prefill` over its prompt chunks."""
        ...

    def run_mixed(self, plan: DecodePlan, seqs: list[SeqState], with_proposer: list[bool],
                  q_lens: list[int]) -> tuple[StepOutput, torch.Tensor]:
        """A mixed step in one target forward: the planned decode step's rows, then prompt chunks of `q_lens`
        tokens; its output, and the token sampled after each chunk [len(seqs)] (device). No host sync."""
        ...

    def close(self, failed: bool = False) -> None:
        """Release what the engine holds beyond its tensors (a tensor-parallel group's followers); `failed`:
        after an error, when other ranks may be stuck in a step this one left. Nothing on one device."""
        ...
