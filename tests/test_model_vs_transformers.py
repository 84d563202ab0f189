"""Our Llama-family model on the paged KV cache against transformers' own implementation of the same checkpoint.

Ragged batches (several prompts of different lengths in one forward), incremental feeding (prefill part of each
prompt, then chunks: the decode and multi-token verify shapes), page sizes 1 and 16 with shuffled, non-contiguous
page tables. Checkpoints use a larger init than usual so attention is far from uniform and position or layout bugs
move the logits well beyond float32 noise. Plus the loader's errors and formats (shards, dtypes, legacy keys).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from specstep.engine.batch_builder import build_forward_batch
from specstep.engine.errors import CheckpointError
from specstep.engine.kv_cache import KVPool
from specstep.engine.model_loader import load_model
from tests.fixtures_models import hf_model, scattered_page_tables
from tests.helpers import make_checkpoint

INIT = dict(initializer_range=0.1)
SHAPES = {
    "gqa": ("llama", {}),
    "mha": ("llama", dict(num_key_value_heads=4)),
    "mqa": ("llama", dict(num_key_value_heads=1)),
    "llama_attention_bias": ("llama", dict(attention_bias=True, mlp_bias=True)),
    "qwen2_bias": ("qwen2", {}),
    "tied": ("llama", dict(tie_word_embeddings=True)),
    "rope_linear": ("llama", dict(rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0})),
    "rope_llama3": ("llama", dict(rope_parameters={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64, "rope_theta": 500000.0})),
    "head_dim_24": ("llama", dict(hidden_size=96, num_attention_heads=4, num_key_value_heads=2)),
    "head_dim_40": ("llama", dict(head_dim=40)),
    "mistral": ("mistral", dict(sliding_window=None)),
}
PROMPT_LENS = [1, 7, 16, 17, 40]
def shape_params(names):
    return list(names)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """One random-init checkpoint per shape, built lazily and shared by this module's tests."""
    cache: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in cache:
            arch, overrides = SHAPES[name]
            cache[name] = make_checkpoint(tmp_path_factory.mktemp(name), seed=len(cache), arch=arch,
                                          **{**INIT, **overrides})
        return cache[name]

    return get


def prompts_for(vocab: int, lens=PROMPT_LENS, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lens]


@torch.inference_mode()
def reference_logits(hf, prompts: list[list[int]]) -> list[torch.Tensor]:
    return [hf(torch.tensor([p])).logits[0].float() for p in prompts]


def assert_logits_close(ours: torch.Tensor, ref: torch.Tensor, what: str = "") -> None:
    scale = ref.abs().max().item()
    assert scale > 0.5, "degenerate reference logits: the comparison would prove little"
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=2e-5 * scale, msg=lambda m: f"{what}: {m}")


def make_pool(model, page_size: int, num_pages: int = 256) -> KVPool:
    return KVPool(model.cfg, model.cfg.num_layers, num_pages, page_size, model.embed_tokens.weight.dtype, "cpu")


@torch.inference_mode()
def run_ragged(model, pool, ids: list[list[int]], start: list[int], tables: list[list[int]]) -> list[torch.Tensor]:
    fb = build_forward_batch(ids, start, tables, pool.page_size, "cpu")
    logits = model.compute_logits(model(fb, pool))
    return list(logits.split([len(t) for t in ids]))


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("shape", shape_params(SHAPES))
def test_ragged_prefill_matches_transformers(checkpoints, shape, page_size):
    folder = checkpoints(shape)
    model, hf = load_model(folder), hf_model(folder)
    prompts = prompts_for(model.cfg.vocab_size)
    ref = reference_logits(hf, prompts)
    pool = make_pool(model, page_size, num_pages=128 if page_size == 1 else 16)
    tables = scattered_page_tables(PROMPT_LENS, page_size, pool.num_pages, seed=page_size)
    for i, (ours, r) in enumerate(zip(run_ragged(model, pool, prompts, [0] * len(prompts), tables), ref)):
        assert_logits_close(ours, r, f"{shape} prompt {i} (len {len(prompts[i])})")


# Each request's prompt is fed as: a prefill of `first` tokens, then chunks cycling through `chunks`
# (1 = decode, >1 = a verify-shaped multi-token query); all requests advance together in ragged batches.
SCHEDULES = {"decode": (3, [1]), "verify": (1, [4, 2, 6]), "mixed": (5, [1, 3, 1, 8])}


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("shape", ["gqa", "qwen2_bias", "tied", "rope_llama3", "head_dim_24", "head_dim_40"])
def test_incremental_chunks_match_full_sequence(checkpoints, shape, page_size):
    folder = checkpoints(shape)
    model, hf = load_model(folder), hf_model(folder)
    lens = [2, 9, 16, 23, 33]
    prompts = prompts_for(model.cfg.vocab_size, lens, seed=1)
    ref = reference_logits(hf, prompts)
    for name, (first, chunks) in SCHEDULES.items():
        pool = make_pool(model, page_size, num_pages=128 if page_size == 1 else 16)
        tables = scattered_page_tables(lens, page_size, pool.num_pages, seed=3)
        got: list[list[torch.Tensor]] = [[] for _ in prompts]
        done = [0] * len(prompts)
        step = 0
        while any(d < n for d, n in zip(done, lens)):
            # request i takes a different chunk size than its neighbours in the same step (ragged verify)
            want = [min(first, n) if d == 0 else chunks[(step + i) % len(chunks)] for i, (d, n) in
                    enumerate(zip(done, lens))]
            active = [i for i in range(len(prompts)) if done[i] < lens[i]]
            ids = [prompts[i][done[i]:done[i] + want[i]] for i in active]
            outs = run_ragged(model, pool, ids, [done[i] for i in active], [tables[i] for i in active])
            for i, ids_i, out in zip(active, ids, outs):
                got[i].append(out)
                done[i] += len(ids_i)
            step += 1
        assert step > 3
        for i in range(len(prompts)):
            assert_logits_close(torch.cat(got[i]), ref[i], f"{shape}/{name} prompt {i}")


def test_decode_ignores_stale_kv_past_the_sequence(checkpoints):
    """Slots past a request's length (rolled-back drafts, a previous owner's data) must not leak into attention."""
    model = load_model(checkpoints("gqa"))
    prompt = prompts_for(model.cfg.vocab_size, [20])[0]
    pool = make_pool(model, 4, num_pages=16)
    table = [[9, 3, 12, 5, 7, 1]]
    clean = run_ragged(model, pool, [prompt[:10]], [0], table)[0]
    for layer in range(model.cfg.num_layers):  # garbage everywhere after position 10
        slots = torch.tensor([table[0][p // 4] * 4 + p % 4 for p in range(10, 24)])
        pool.k[layer][slots] = 1e3
        pool.v[layer][slots] = -1e3
    again = run_ragged(model, pool, [prompt[9:10]], [9], table)[0]
    assert_logits_close(again[0], clean[-1], "decode after garbage beyond the sequence")


# ---- loader: formats ---------------------------------------------------------------------------------------


def test_sharded_checkpoint_loads(tmp_path):
    import transformers

    folder = make_checkpoint(tmp_path / "src", seed=3, **INIT)
    hf = hf_model(folder)
    sharded = tmp_path / "sharded"
    hf.save_pretrained(sharded, max_shard_size="60KB")
    shards = sorted(p.name for p in sharded.glob("*.safetensors"))
    assert (sharded / "model.safetensors.index.json").is_file() and len(shards) > 2, shards
    model = load_model(sharded)
    prompts = prompts_for(model.cfg.vocab_size, [5, 12])
    pool = make_pool(model, 16)
    ours = run_ragged(model, pool, prompts, [0, 0], [[1], [2]])
    for o, r in zip(ours, reference_logits(hf, prompts)):
        assert_logits_close(o, r, "sharded")
    (sharded / shards[1]).unlink()
    with pytest.raises(CheckpointError, match=f"missing: {shards[1]}"):
        load_model(sharded)
    assert transformers is not None


def test_tied_checkpoint_that_still_stores_lm_head_loads(tmp_path, checkpoints):
    folder = tmp_path / "tied"
    shutil.copytree(checkpoints("tied"), folder)
    t = load_file(str(folder / "model.safetensors"))
    assert "lm_head.weight" not in t
    t["lm_head.weight"] = t["model.embed_tokens.weight"].clone()
    save_file(t, str(folder / "model.safetensors"), metadata={"format": "pt"})
    model = load_model(folder)
    assert model.lm_head.weight is model.embed_tokens.weight


def test_legacy_config_keys_give_the_same_model(tmp_path, checkpoints):
    """transformers 4.x wrote `rope_theta` and `rope_scaling` (with `type`) at top level, and `torch_dtype`."""
    src = checkpoints("rope_llama3")
    folder = tmp_path / "legacy"
    shutil.copytree(src, folder)
    raw = json.loads((folder / "config.json").read_text())
    rp = raw.pop("rope_parameters")
    raw["rope_theta"] = rp.pop("rope_theta")
    raw["rope_scaling"] = {"type": rp.pop("rope_type"), **rp}
    raw["torch_dtype"] = raw.pop("dtype")
    (folder / "config.json").write_text(json.dumps(raw))
    a, b = load_model(src), load_model(folder)
    assert a.cfg == b.cfg
    prompts = prompts_for(a.cfg.vocab_size, [40])
    ours = run_ragged(b, make_pool(b, 16), prompts, [0], [[4, 2, 8]])[0]
    assert_logits_close(ours, reference_logits(hf_model(src), prompts)[0], "legacy keys")


@pytest.mark.parametrize("saved", ["float32", "bfloat16", "float16"])
def test_dtypes_load(tmp_path, checkpoints, saved):
    """Checkpoints saved in each dtype load in each dtype; half precision stays close to the fp32 reference."""
    src = checkpoints("gqa")
    hf32 = hf_model(src)
    folder = tmp_path / saved
    hf_model(src, getattr(torch, saved)).save_pretrained(folder)
    assert load_file(str(folder / "model.safetensors"))["lm_head.weight"].dtype == getattr(torch, saved)
    prompts = prompts_for(320, [6, 19])
    ref = torch.cat(reference_logits(hf32, prompts))
    assert load_model(folder).embed_tokens.weight.dtype == torch.float32  # auto on CPU: float32
    for dtype in ("float32", "bfloat16", "float16"):
        model = load_model(folder, dtype=dtype)
        assert all(p.dtype == getattr(torch, dtype) for p in model.parameters())
        ours = torch.cat(run_ragged(model, make_pool(model, 16), prompts, [0, 0], [[3, 1], [2, 4]]))
        assert ours.dtype == torch.float32 and torch.isfinite(ours).all()
        lossy = saved != "float32" or dtype != "float32"
        if not lossy:
            assert_logits_close(ours, ref, "fp32")
            continue
        err = (ours - ref).abs().max().item() / ref.abs().max().item()
        agree = (ours.argmax(-1) == ref.argmax(-1)).float().mean().item()
        assert err < 0.05 and agree >= 0.8, f"saved {saved}, loaded {dtype}: rel err {err:.3f}, argmax {agree:.2f}"


def test_unsupported_dtype_is_an_error(checkpoints):
    with pytest.raises(CheckpointError, match="unsupported dtype 'float8'"):
        load_model(checkpoints("gqa"), dtype="float8")


# ---- loader: errors name the problem -----------------------------------------------------------------------


@pytest.fixture
def ckpt_copy(tmp_path, checkpoints):
    folder = tmp_path / "copy"
    shutil.copytree(checkpoints("gqa"), folder)
    return folder


def edit_config(folder: Path, **changes) -> None:
    raw = json.loads((folder / "config.json").read_text())
    raw.update(changes)
    (folder / "config.json").write_text(json.dumps(raw))


def edit_tensors(folder: Path, fn) -> None:
    t = load_file(str(folder / "model.safetensors"))
    fn(t)
    save_file(t, str(folder / "model.safetensors"), metadata={"format": "pt"})


def test_missing_folder(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_model(tmp_path / "nope")


def test_missing_config(ckpt_copy):
    (ckpt_copy / "config.json").unlink()
    with pytest.raises(CheckpointError, match="no config.json"):
        load_model(ckpt_copy)


def test_missing_weights(ckpt_copy):
    (ckpt_copy / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"no \*\.safetensors"):
        load_model(ckpt_copy)


@pytest.mark.parametrize(("changes", "match"), [
    (dict(architectures=["GPT2LMHeadModel"], model_type="gpt2"), "unsupported architecture.*GPT2LMHeadModel"),
    (dict(rope_parameters={"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e4}), "unsupported rope_scaling.*yarn"),
    (dict(architectures=["MistralForCausalLM"], sliding_window=8), "sliding-window"),
    (dict(hidden_size=None), "hidden_size"),
])
def test_config_errors(ckpt_copy, changes, match):
    if changes.get("hidden_size", 1) is None:
        raw = json.loads((ckpt_copy / "config.json").read_text())
        del raw["hidden_size"]
        (ckpt_copy / "config.json").write_text(json.dumps(raw))
    else:
        edit_config(ckpt_copy, **changes)
    with pytest.raises(CheckpointError, match=match):
        load_model(ckpt_copy)


@pytest.mark.parametrize(("edit", "match"), [
    (lambda t: t.pop("model.layers.1.mlp.down_proj.weight"), r"missing tensor 'layers\.1\.mlp\.down_proj\.weight'"),
    (lambda t: t.pop("model.layers.0.self_attn.k_proj.weight"), r"missing tensor.*layers\.0\.self_attn\.k_proj"),
    (lambda t: t.pop("lm_head.weight"), r"missing tensor 'lm_head\.weight'"),
    (lambda t: t.update({"model.norm.weight": torch.ones(65)}), r"'norm\.weight' has shape \(65,\).*\(64,\)"),
    (lambda t: t.update({"model.layers.0.self_attn.v_proj.weight": torch.zeros(16, 64)}),
     r"qkv_proj.*has shape \(112, 64\).*\(128, 64\)"),
    (lambda t: t.update({"model.layers.0.extra.weight": torch.zeros(3)}),
     r"unexpected tensor 'model\.layers\.0\.extra"),
    (lambda t: t.update({"model.layers.2.input_layernorm.weight": torch.ones(64)}),
     r"unexpected tensor 'model\.layers\.2\.input_layernorm"),
    (lambda t: t.update({f"model.layers.0.self_attn.{x}_proj.bias": torch.zeros(n) for x, n in
                         (("q", 64), ("k", 32), ("v", 32))}), r"unexpected tensor.*qkv_proj\.bias.*biases"),
    (lambda t: t.update({"model.layers.0.self_attn.q_proj.bias": torch.zeros(64)}), r"self_attn\.[kv]_proj\.bias"),
])
def test_tensor_errors_name_the_tensor(ckpt_copy, edit, match):
    edit_tensors(ckpt_copy, edit)
    with pytest.raises(CheckpointError, match=match):
        load_model(ckpt_copy)


def test_mtp_head_folder_is_not_a_language_model(tmp_path, checkpoints):
    from tests.fixtures_models import make_mtp_head

    head = make_mtp_head(tmp_path / "head", checkpoints("gqa"))
    with pytest.raises(CheckpointError, match="is an MTP head"):
        load_model(head)


def test_page_tables_really_are_fragmented():
    tables = scattered_page_tables(PROMPT_LENS, 1, 128, seed=1)
    flat = [p for t in tables for p in t]
    assert len(set(flat)) == len(flat) and 0 not in flat
    assert np.mean([b == a + 1 for t in tables for a, b in zip(t, t[1:])]) < 0.1
