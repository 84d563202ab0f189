"""What the scheduler decided for one step, frozen: which requests, how many tokens each, the speculation
decision with its reason, what must catch up first. The engine core launches plans and hands their results
back (`Scheduler.finish_*`); nothing in a plan changes after it is made, and a decision in it is counted by
the policy only when its step launches (`Scheduler.launched`), so a plan that is dropped (a chained step that
cannot run as decided) leaves no trace. The counterpart of vLLM v1's `SchedulerOutput`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np

from specstep.scheduler.core.request import Request
from specstep.scheduler.core.stopping import RequestOutput
from specstep.scheduler.spec.decision import Decision


class StepKind(str, enum.Enum):
    NONE = "none"  # nothing to run (idle, or requests finished while scheduling: `StepPlan.finished`)
    PREFILL = "prefill"  # whole prompts
    MIXED = "mixed"  # chunked prefill: the running batch's decode step (speculative or plain), then prompt chunks
    DECODE = "decode"  # the running batch: plain or speculative


@dataclass(frozen=True, slots=True)
class StepPlan:
    kind: StepKind
    decode: tuple[Request, ...] = ()  # requests decoding in this step (decode and mixed steps), in row order
    prompts: tuple[tuple[Request, int], ...] = ()  # (request, prompt tokens this step) after the decode rows
    with_proposer: tuple[bool, ...] = ()  # per prompt: the proposer consumes it (off: it catches up later)
    decision: Decision | None = None  # a decode (or mixed) step's speculation; None: no decode rows
    catch_up: tuple[Request, ...] = ()  # stale drafts to bring current before the step drafts
    # A chained decode step (built while the previous one runs): each row's row in that step, and whether its
    # draft is current after it. None: built from the host state.
    chain_src: np.ndarray | None = None
    chain_refilled: np.ndarray | None = None
    decode_s: float | None = None  # mixed: the batch's decode step as decided, what the pacer holds the step to
    finished: tuple[RequestOutput, ...] = ()  # requests that ended while scheduling (one filled the KV cache)

    @property
    def chained(self) -> bool:
        return self.chain_src is not None
