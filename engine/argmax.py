"""Each row's argmax in `engine/kernels/argmax.cpp` on CPU: the indices `torch.argmax(x, dim=-1)` returns (the first
maximum, or a row's first NaN), at the memory's pace where torch's CPU reduction tracks an index beside every element
(70 us for one 49152-wide row, 2.4 ms for a batch-8 verify step's 40 rows). Greedy sampling and greedy acceptance read
their tokens here; elsewhere (another device, dtype, no kernel) it is `torch.argmax`."""

from __future__ import annotations

import ctypes

import torch

from specstep.engine.kernels import library

# Rows x width from which both threads split the rows: below it, one thread (waking a sleeping one costs more
# than it saves: a batch-1 row is ~0.2 MB).
THREADED_ELEMENTS = 1 << 20


def _build() -> ctypes.CDLL | None:
    return library.load()[0]


def argmax(x: torch.Tensor) -> torch.Tensor:
    """`torch.argmax(x, dim=-1)`, the same indices."""
    if x.device.type != "cpu" or x.dtype != torch.float32 or x.dim() == 0 or x.shape[-1] == 0:
        return x.argmax(dim=-1)
    lib = _build()
    if lib is None:
        return x.argmax(dim=-1)
    n = x.shape[-1]
    rows = x.reshape(-1, n)  # a view where the leading dims collapse (a copy otherwise)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape[0], dtype=torch.long)
    threads = torch.get_num_threads() if rows.numel() >= THREADED_ELEMENTS else 1
    lib.argmax_rows(rows.data_ptr(), rows.shape[0], n, rows.stride(0), out.data_ptr(), threads)
    return out.view(x.shape[:-1])


def greedy_accept(logits: torch.Tensor, drafts: torch.Tensor, num_draft: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Greedy acceptance in one pass (`rejection_sampler`'s greedy rule): logits [B, k + 1, V], drafts [B, k],
    num_draft [B] -> (out [B, k + 1], accepted [B]), out[:, :a + 1] the accepted drafts and the corrected or bonus
    token, out[a] repeated past it (the rule leaves those undefined; this keeps them valid token ids). Each request's
    rows are read only up to its first rejection. None where the kernel does not apply: the caller's torch form."""
    if (logits.device.type != "cpu" or logits.dtype != torch.float32 or logits.dim() != 3 or logits.shape[-1] == 0
            or drafts.dtype != torch.long
            or drafts.shape != (logits.shape[0], logits.shape[1] - 1) or drafts.device.type != "cpu"
            or num_draft.shape != (logits.shape[0],) or num_draft.device.type != "cpu"):
        return None
    lib = _build()
    if lib is None:
        return None
    b, k1, n = logits.shape
    rows = logits.reshape(b * k1, n)  # row (b, j) at b * k1 + j: a view where the leading dims collapse
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    if drafts.stride(-1) != 1:
        drafts = drafts.contiguous()
    num_draft = num_draft.to(torch.long).contiguous()
    out = torch.empty(b, k1, dtype=torch.long, device="cpu")
    accepted = torch.empty(b, dtype=torch.long, device="cpu")
    threads = torch.get_num_threads() if rows.numel() >= THREADED_ELEMENTS and b > 1 else 1
    lib.greedy_accept(rows.data_ptr(), b, k1, n, rows.stride(0), drafts.data_ptr(), drafts.stride(0),
                      num_draft.data_ptr(), out.data_ptr(), accepted.data_ptr(), threads)
    return out, accepted
