"""A request's state inside the scheduler process.

Length vocabulary (one word per length, used everywhere):
    len(token_ids)  = prompt + output tokens so far
    num_computed    = tokens whose target KV is written; while running, num_computed == len(token_ids) - 1
                      (the last sampled token is fed by the next step)
    len(page_table) * page_size >= every position a step may write (num_computed + k + 1 + look-ahead)
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from specstep.engine.sampling_params import SamplingParams
from specstep.scheduler.spec.counters import SpecCounters
from specstep.scheduler.spec.decision import RequestAcceptance


class Status(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    FINISHED = 2
    PREFILLING = 3  # admitted, its prompt prefilled in chunks (pages and a slot held), not decoding yet


class FinishReason(str, enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


@dataclass(eq=False, slots=True)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    num_spec_tokens: int | None = None  # per-request override: None = engine policy, 0 = off, k = fixed
    arrival_time: float = field(default_factory=time.monotonic)
    token_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    page_table: list[int] = field(default_factory=list)
    slot: int = -1
    status: Status = Status.WAITING
    finish_reason: FinishReason | None = None
    stats: SpecCounters = field(default_factory=SpecCounters)
    num_preemptions: int = 0
    first_token_time: float | None = None
    acceptance: RequestAcceptance = field(default_factory=RequestAcceptance)
    draft_len: int = 0  # tokens the draft model has consumed (behind len(token_ids) while its refill is dropped)
    prefill_with_proposer: bool = True  # chunked prefill: the proposer consumes its chunks (fixed at admission)

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)
        self.acceptance.sampled = not self.params.greedy  # the policy's acceptance prior is per kind

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def finished(self) -> bool:
        return self.status == Status.FINISHED
