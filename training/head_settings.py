"""The settings of one `specstep train-head` run: budget, optimiser, objective weights, feature pool."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class HeadSettings:
    minutes: float = 12.0  # wall-clock budget of precomputation + optimisation
    max_steps: int | None = None  # stop earlier (tests, smoke runs)
    seq_len: int = 256  # target window; the head sees seq_len - 1 positions of it
    batch_size: int = 4  # windows per optimiser step
    lr: float = 3e-3
    warmup_steps: int = 30
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    hidden_weight: float = 1.0  # smooth L1 to the target's next hidden state
    logit_weight: float = 0.1  # KL to the target's next-token distribution (top-k + tail bucket)
    topk: int = 32
    reuse: float = 2.0  # each precomputed window is drawn about this many times
    chunk_windows: int = 32  # windows precomputed at a time
    max_pool_tokens: int = 600_000  # cap on cached positions (fp16 hidden + top-k), oldest chunks replaced
    precompute_batch: int = 8
    evals: int = 6  # periodic validations (inference path) over the budget
    periodic_val_windows: int = 8
    log_every_s: float = 30.0
