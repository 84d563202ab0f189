"""`--kv-cache-dtype`: the KV pools' dtype. auto is the model's; bfloat16 on CPU halves a page's bytes (the memory
plan holds twice the tokens), the ready line says so, every pool (target and proposer) takes it, and greedy output
is plain decoding's under it (tests/test_batch_invariance.py checks the logits bitwise). On CUDA only the model's
own dtype is accepted."""

from __future__ import annotations

import pytest
import torch

from specstep.engine.engine_config import EngineConfig
from specstep.engine.errors import ConfigError
from specstep.engine.sampling_params import SamplingParams
from specstep.scheduler.build import build_engine, cache_dtype
from tests.helpers import make_core, run_to_completion


def test_auto_is_the_models_dtype_and_cuda_keeps_it():
    cfg = EngineConfig(model="m")
    assert cache_dtype(cfg, torch.float32, torch.device("cpu")) == torch.float32
    assert cache_dtype(cfg, torch.float16, torch.device("cuda")) == torch.float16
    bf16 = EngineConfig(model="m", kv_cache_dtype="bfloat16")
    assert cache_dtype(bf16, torch.float32, torch.device("cpu")) == torch.bfloat16
    assert cache_dtype(bf16, torch.bfloat16, torch.device("cuda")) == torch.bfloat16  # the model's own: accepted
    with pytest.raises(ConfigError, match="--kv-cache-dtype bfloat16: on cuda the KV cache holds the model's dtype "
                                          r"\(float16\)"):
        cache_dtype(bf16, torch.float16, torch.device("cuda"))
    with pytest.raises(ValueError, match="--kv-cache-dtype must be one of auto, float32, bfloat16"):
        EngineConfig(model="m", kv_cache_dtype="fp8")


@pytest.mark.parametrize("spec", ["ngram", "draft_model"])
def test_a_bf16_cache_holds_twice_the_tokens_and_speculation_is_plain_decoding(spec, tiny_target):
    common = dict(model=str(tiny_target), device="cpu", spec=spec, num_spec_tokens=3, spec_policy="fixed",
                  kv_cache_tokens=512)
    if spec == "draft_model":
        common["draft"] = str(tiny_target)
    engines = {dtype: build_engine(EngineConfig(**common, kv_cache_dtype=dtype)) for dtype in ("auto", "bfloat16")}
    (wide, _, wide_info), (narrow, _, narrow_info) = engines["auto"], engines["bfloat16"]
    pools = [narrow.engine.pool] + ([narrow.engine.proposer.pool] if spec == "draft_model" else [])
    assert {p.k[0].dtype for p in pools} == {torch.bfloat16}
    assert wide.engine.pool.k[0].dtype == torch.float32
    assert narrow_info.memory.bytes_per_page * 2 == wide_info.memory.bytes_per_page
    assert "tokens in bfloat16 (" in narrow_info.memory.describe()
    assert "bfloat16" not in wide_info.memory.describe()
    prompts = [[7, 8, 9, 10] * 3, [3, 5, 11, 3, 5, 11, 3]]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    plain_core, _, _ = build_engine(EngineConfig(**{**common, "spec": "none"}, kv_cache_dtype="bfloat16"))
    plain = run_to_completion(plain_core, prompts, params)
    spec_out = run_to_completion(narrow, prompts, params)
    assert [r.output_token_ids for r in spec_out] == [r.output_token_ids for r in plain]


def test_chunked_prefill_over_a_bf16_cache_keeps_speculation_plain(tiny_target):
    """Mixed steps (prompt chunks beside decode rows: the chunks' attention in torch's SDPA over the bf16 pages,
    cast to fp32; the decode rows' in the kernel) under `--kv-cache-dtype bfloat16`: n-gram speculation gives plain
    decoding's tokens, and the pages all come back."""
    import tests.test_chunked_prefill as chunked

    def core(spec):
        return make_core(tiny_target, spec=spec, page_size=4, max_batch_size=4, max_num_batched_tokens=7,
                         kv_cache_dtype="bfloat16")

    plain = chunked.run_staggered(core("none"), chunked.prompts(), chunked.GREEDY)
    spec_core = core("ngram")
    log = chunked.StepLog(spec_core)
    spec = chunked.run_staggered(spec_core, chunked.prompts(), chunked.GREEDY)
    assert spec_core.engine.pool.k[0].dtype == torch.bfloat16
    assert log.mixed > 0 and log.partial_chunks > 0
    assert sum(r.stats.drafted for r in spec) > 0
    assert [r.output_token_ids for r in spec] == [r.output_token_ids for r in plain]
