"""Check that saved default folders load in `transformers` and give the same logits as our engine.

Usage: `python -m specstep.training.verify [OUT]` (OUT defaults to engine/defaults). Exits non-zero on a mismatch.
This guards the checkpoint format: the defaults double as the reference for side-by-side transformers runs.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from specstep.engine.model_loader import load_model  # noqa: E402
from specstep.training.defaults import default_out  # noqa: E402

TOLERANCE = 1e-4


def max_logit_difference(folder: Path, length: int = 48) -> float:
    import transformers

    ours = load_model(folder)
    theirs = transformers.LlamaForCausalLM.from_pretrained(str(folder), torch_dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, ours.cfg.vocab_size, (2, length), generator=generator)
    with torch.no_grad():
        a = ours.compute_logits(ours.forward_dense(ids))
        b = theirs(input_ids=ids).logits.float()
    return float((a - b).abs().max())


def main(argv: list[str]) -> int:
    out = Path(argv[0]) if argv else default_out()
    torch.set_num_threads(1)
    worst = 0.0
    for name in ("target", "draft"):
        diff = max_logit_difference(out / name)
        worst = max(worst, diff)
        print(f"{out / name}: max |logit difference| engine vs transformers = {diff:.2e}")
    ok = worst <= TOLERANCE
    print("OK" if ok else f"MISMATCH (> {TOLERANCE})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
