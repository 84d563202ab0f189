"""Explicit constructors for tests: random-init checkpoints written with transformers, a tiny tokenizer,
and engines built from them. No global state: every test builds what it uses."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

from specstep.engine.engine_config import EngineConfig  # noqa: E402
from specstep.engine.sampling_params import SamplingParams  # noqa: E402
from specstep.scheduler.build import build_engine  # noqa: E402
from specstep.scheduler.core.engine_core import EngineCore  # noqa: E402
from specstep.scheduler.core.request import Request  # noqa: E402
from specstep.scheduler.spec.decision import Decision  # noqa: E402
from specstep.scheduler.spec.policy import AdaptivePolicy, PolicyConfig  # noqa: E402

TINY_VOCAB = 320


def write_tokenizer(folder: Path, vocab_size: int = TINY_VOCAB) -> None:
    """A byte-level BPE trained in well under a second on a few standard-library files."""
    import sysconfig

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    text = [(stdlib / name).read_text() for name in ("textwrap.py", "shlex.py", "bisect.py")]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(text, trainer)
    tok.save(str(folder / "tokenizer.json"))


def make_checkpoint(folder: Path, seed: int = 0, arch: str = "llama", tokenizer: bool = False,
                    **overrides) -> Path:
    """A random-init Hugging Face checkpoint (save_pretrained) of a small Llama/Qwen2/Mistral."""
    import transformers

    kw = dict(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, eos_token_id=0,
              bos_token_id=0, tie_word_embeddings=False)
    kw.update(overrides)
    cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
           "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
           "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM)}[arch]
    torch.manual_seed(seed)
    model = cls[1](cls[0](**kw)).eval()
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    if tokenizer:
        write_tokenizer(folder, kw["vocab_size"])
    return folder


def make_core(model: Path, **cfg) -> EngineCore:
    cfg.setdefault("kv_cache_tokens", 8192)
    cfg.setdefault("device", "cpu")
    # The tests through here were written for k = num_spec_tokens on every step; EngineConfig's (and the CLI's)
    # default is the adaptive policy. A test of the adaptive policy says so.
    cfg.setdefault("spec_policy", "fixed")
    core, _, _ = build_engine(EngineConfig(model=str(model), **cfg))
    return core


def run_to_completion(core: EngineCore, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
                      seeds: list[int] | None = None, check_every_step: bool = True) -> list[Request]:
    reqs = []
    for i, p in enumerate(prompts):
        sp = params[i] if isinstance(params, list) else params
        reqs.append(Request(str(i), list(p), sp, seed=(seeds[i] if seeds else 1000 + i)))
        core.add_request(reqs[-1])
    while core.has_unfinished():
        core.step()
        if check_every_step:
            core.check_integrity()
    core.check_integrity()
    assert core.allocator.num_free == core.allocator.num_usable, "pages leaked after all requests finished"
    return reqs


class ScriptedPolicy(AdaptivePolicy):
    """Drafts `k` on steps where pattern[i % len] is true; otherwise no drafts, refill as `off_refill`; the
    proposer consumes prompts at prefill unless `prefill` is false (then it catches up when it first drafts)."""

    def __init__(self, k: int, pattern: list[bool], off_refill: bool, prefill: bool = True) -> None:
        super().__init__(PolicyConfig(kind="adaptive", k_max=k))
        self.k, self.pattern, self.off_refill, self.i, self.prefill = k, pattern, off_refill, 0, prefill

    @property
    def proposer_current(self) -> bool:
        return self.prefill

    def choose(self, accs, overrides, room, behind=None, commit=True, limits=None):  # (limits: scripted anyway)
        on = self.pattern[self.i % len(self.pattern)]
        nd = np.minimum(np.full(len(accs), self.k if on else 0), np.asarray(room)).clip(0)
        d = Decision(nd, int(nd.max(initial=0)), bool(on or self.off_refill), 0.0, 0.0, "model")
        if commit:
            self.commit(d)
        return d

    def commit(self, decision):  # the pattern advances per step that runs, not per decision made
        self.i += 1
        super().commit(decision)
