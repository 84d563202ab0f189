"""Helpers for tensor-parallel tests: a paged forward shared by TP = 1 and TP = N, and the per-rank worker that
`torch.multiprocessing.spawn` runs (it must live in an importable module). Each worker joins a gloo group through
a `file://` store in a folder the test owns, loads its shard of each checkpoint and saves the gathered logits."""

from __future__ import annotations

from pathlib import Path

import torch

from specstep.engine.batch_builder import build_forward_batch
from specstep.engine.kv_cache import KVPool
from specstep.engine.model_loader import load_model, load_mtp_head
from specstep.engine.parallel import SINGLE, TPGroup, init_tp_group

PAGE = 4
PROMPTS = [[3, 17, 250, 9, 41, 5, 77], [8, 2, 319, 60, 11]]
DECODE = [[101], [202]]  # fixed next tokens: the step does not depend on what either run sampled


@torch.inference_mode()
def paged_forward(folder: Path, tp: TPGroup = SINGLE, cpu_linear: str = "matmul",
                  head: Path | None = None) -> dict[str, torch.Tensor]:
    """Prefill two prompts, then one decode step, through `ForwardBatch` and `KVPool` (per-rank KV heads);
    with `head`, the MTP head over the prefill's hidden states too. Returns float32 logits over the vocabulary."""
    model = load_model(folder, cpu_linear=cpu_linear, tp=tp)
    pool = KVPool(model.rank_cfg, model.cfg.num_layers, 8, PAGE, torch.float32, "cpu")
    tables = [[1, 2], [3, 4]]
    prefill = build_forward_batch(PROMPTS, [0, 0], tables, PAGE, "cpu")
    hidden = model(prefill, pool)
    out = {"prefill": model.compute_logits(hidden)}
    decode = build_forward_batch(DECODE, [len(p) for p in PROMPTS], tables, PAGE, "cpu")
    out["decode"] = model.compute_logits(model(decode, pool))
    if head is not None:
        mtp = load_mtp_head(head, model.cfg, cpu_linear=cpu_linear, tp=tp)
        head_pool = KVPool(mtp.rank_cfg, 1, 8, PAGE, torch.float32, "cpu")
        # The MTP shift: position i sees h[i] and the embedding of token i + 1.
        shifted = [p[1:] + d for p, d in zip(PROMPTS, DECODE)]
        fb = build_forward_batch(shifted, [0, 0], tables, PAGE, "cpu")
        out["mtp"] = model.compute_logits(mtp(fb, head_pool, model.embed_tokens(fb.input_ids), hidden))
    return out


def forward_worker(rank: int, world_size: int, store_file: str, jobs: list[tuple[str, str, str, str | None]],
                   out_dir: str) -> None:
    """`jobs`: (name, checkpoint folder, cpu_linear mode, MTP head folder or None) per checkpoint."""
    torch.set_num_threads(1)  # the ranks share the machine's cores
    tp = init_tp_group(world_size, rank, f"file://{store_file}", backend="gloo", join_timeout_s=120)
    try:
        for name, folder, mode, head in jobs:
            out = paged_forward(Path(folder), tp, mode, Path(head) if head else None)
            torch.save(out, Path(out_dir) / f"{name}-rank{rank}.pt")
    finally:
        tp.close()
