"""GGUF checkpoints: converted once into a Hugging Face folder, loaded with the same weights and tokenizer as the
source checkpoint, cached, and refused with typed errors that name what is unsupported."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from specstep.engine.errors import CheckpointError
from specstep.engine.gguf_checkpoint import converted_folder
from specstep.engine.model_loader import load_model
from specstep.engine.model_source import resolve_model
from specstep.engine.sampling_params import SamplingParams
from specstep.engine.tokenizer import Tokenizer
from tests.fixtures_gguf import write_gguf
from tests.fixtures_models import hf_model
from tests.helpers import make_checkpoint, make_core, run_to_completion

PROMPTS = [[5, 17, 99, 3, 250, 41], [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17]]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECSTEP_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.mark.parametrize("arch,tied", [("llama", False), ("llama", True), ("qwen2", False)])
def test_f32_gguf_converts_to_the_source_weights(tmp_path, cache, arch, tied):
    """Names, llama.cpp's q/k row permutation (undone), biases and tied embeddings come back exactly."""
    src = make_checkpoint(tmp_path / "src", seed=3, arch=arch, tokenizer=True, tie_word_embeddings=tied)
    gguf_path = write_gguf(tmp_path / "m.gguf", src, arch=arch)
    folder = resolve_model(gguf_path)
    assert folder.parent == cache / "gguf"
    ref, got = hf_model(src), hf_model(folder)
    ref_sd, got_sd = ref.state_dict(), got.state_dict()
    assert set(ref_sd) == set(got_sd)
    for name, t in ref_sd.items():
        assert torch.equal(t, got_sd[name]), name
    ids = torch.tensor([PROMPTS[0]])
    assert torch.equal(ref(ids).logits, got(ids).logits)


def test_quantised_gguf_is_dequantised_by_the_gguf_package(tmp_path, cache):
    """Q8_0 weights load as the gguf package dequantises them; the engine's greedy output on them equals
    transformers' on the converted folder."""
    import gguf

    src = make_checkpoint(tmp_path / "src", seed=4, tokenizer=True)
    gguf_path = write_gguf(tmp_path / "q8.gguf", src, qtype="Q8_0")
    reader = gguf.GGUFReader(str(gguf_path))
    t = next(t for t in reader.tensors if t.name == "blk.0.ffn_up.weight")
    expect = gguf.quants.dequantize(t.data, t.tensor_type).reshape(tuple(int(d) for d in reversed(t.shape)))
    model = load_model(gguf_path, "cpu", "float32")
    inter = model.cfg.intermediate_size
    assert torch.equal(model.layers[0].mlp.gate_up_proj.weight[inter:], torch.from_numpy(np.array(expect)))
    core = make_core(gguf_path)
    reqs = run_to_completion(core, PROMPTS, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    hf = hf_model(converted_folder(gguf_path))  # the fp32 checkpoint
    for r, p in zip(reqs, PROMPTS):
        out = hf.generate(torch.tensor([p]), max_new_tokens=12, min_new_tokens=12, do_sample=False)
        assert r.output_token_ids == out[0, len(p):].tolist()


def test_tokenizer_from_gguf_metadata_matches_the_source(tmp_path, cache):
    src = make_checkpoint(tmp_path / "src", seed=5, tokenizer=True)
    gguf_path = write_gguf(tmp_path / "m.gguf", src)
    ours, ref = Tokenizer.from_folder(gguf_path), Tokenizer.from_folder(src)
    text = "def f(x):\n    return x + 12345  # café <|endoftext|> tail"
    assert ours.encode(text) == ref.encode(text)
    assert ours.decode(ours.encode(text), skip_special_tokens=False) == text
    assert ours.eos_token_ids == (0,)


def test_conversion_is_cached_and_a_folder_holding_a_gguf_works(tmp_path, cache):
    src = make_checkpoint(tmp_path / "src", seed=6, tokenizer=True)
    (tmp_path / "dir").mkdir()
    gguf_path = write_gguf(tmp_path / "dir" / "m.gguf", src)
    first = converted_folder(gguf_path, full=False)
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert resolve_model(tmp_path / "dir") == first  # a folder with one GGUF and no config.json
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp  # not converted again
    assert not [p for p in (cache / "gguf").iterdir() if p.name.startswith(".converting")]


def test_not_a_gguf_file(tmp_path, cache):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"PK\x03\x04 definitely a zip")
    with pytest.raises(CheckpointError, match="not a GGUF file"):
        resolve_model(bad)
    with pytest.raises(CheckpointError, match="does not exist"):
        resolve_model(tmp_path / "missing.gguf")


def test_unsupported_architecture_is_named(tmp_path, cache):
    src = make_checkpoint(tmp_path / "src", seed=7, tokenizer=True)
    gguf_path = write_gguf(tmp_path / "phi.gguf", src, architecture_name="phi3")
    with pytest.raises(CheckpointError, match="unsupported GGUF architecture 'phi3'"):
        resolve_model(gguf_path)


def test_unsupported_quantisation_is_named(tmp_path, cache):
    src = make_checkpoint(tmp_path / "src", seed=8, tokenizer=True)
    gguf_path = write_gguf(tmp_path / "q81.gguf", src, extra_tensor=("blk.0.attn_q_extra.weight", "Q8_1"))
    with pytest.raises(CheckpointError, match="Q8_1"):
        resolve_model(gguf_path)
    assert not list((cache / "gguf").glob("q81-*"))  # nothing half-converted is left to be found later


def test_unsupported_pre_tokenizer_is_named(tmp_path, cache):
    src = make_checkpoint(tmp_path / "src", seed=9, tokenizer=True)
    gguf_path = write_gguf(tmp_path / "m.gguf", src, pre="chameleon")
    with pytest.raises(CheckpointError, match="pre-tokenizer 'chameleon'"):
        resolve_model(gguf_path)


def test_quantised_blocks_come_from_a_cached_tensor_index(tmp_path, cache, monkeypatch):
    """The GGUF kernel's blocks are the reader's bytes (q/k rows un-permuted as conversion does); after the first
    read, the tensors' offsets come from the index cached beside the converted folders and no reader parses the
    file's metadata again; an index that does not parse, has another shape or another version is rebuilt, a
    rewritten file gets its own, and one rewritten with its old size and mtime is read again."""
    import gguf

    from specstep.engine import gguf_checkpoint as gc

    src = make_checkpoint(tmp_path / "src", seed=4, tokenizer=True)
    gguf_path = write_gguf(tmp_path / "q8.gguf", src, qtype="Q8_0")
    st = gguf_path.stat()
    reader = gguf.GGUFReader(str(gguf_path))
    heads = json.loads((src / "config.json").read_text())["num_attention_heads"]
    expect = {t.name: np.array(t.data).reshape(int(t.shape[1]), -1) for t in reader.tensors
              if t.tensor_type.name == "Q8_0"}
    first = gc.quantized_blocks(gguf_path, ("Q8_0",))
    assert len(first) == len(expect) > 0
    up = first["model.layers.0.mlp.up_proj.weight"][1]
    assert torch.equal(up, torch.from_numpy(expect["blk.0.ffn_up.weight"]))
    q = first["model.layers.0.self_attn.q_proj.weight"][1]
    assert torch.equal(q, gc._unpermute(torch.from_numpy(expect["blk.0.attn_q.weight"]), heads))
    (index,) = (cache / "gguf").glob("*.tensors.json")

    def no_reader(path):
        raise AssertionError("the metadata was parsed again")
    with monkeypatch.context() as m:
        m.setattr(gc, "_reader", no_reader)
        again = gc.quantized_blocks(gguf_path, ("Q8_0",))
    assert all(torch.equal(again[n][1], first[n][1]) for n in first)
    for bad in ("{not json", "{}", "[]", "null", json.dumps({**json.loads(index.read_text()), "version": -1})):
        index.write_text(bad)
        assert torch.equal(gc.quantized_blocks(gguf_path, ("Q8_0",))["model.layers.0.mlp.up_proj.weight"][1], up)
        assert json.loads(index.read_text())["tensors"], bad
    write_gguf(gguf_path, make_checkpoint(tmp_path / "src2", seed=5, tokenizer=True), qtype="Q8_0")
    assert not torch.equal(gc.quantized_blocks(gguf_path, ("Q8_0",))["model.layers.0.mlp.up_proj.weight"][1], up)
    assert len(list((cache / "gguf").glob("*.tensors.json"))) == 2
    # the first file back under the same name, size and mtime (as cp -p would): its own bytes, not the index's
    first_file = write_gguf(tmp_path / "again.gguf", src, qtype="Q8_0")
    assert first_file.stat().st_size == st.st_size
    os.replace(first_file, gguf_path)
    os.utime(gguf_path, ns=(st.st_atime_ns, st.st_mtime_ns))
    reads = []
    with monkeypatch.context() as m:
        m.setattr(gc, "_reader", lambda path: reads.append(path) or gguf.GGUFReader(str(path)))
        assert torch.equal(gc.quantized_blocks(gguf_path, ("Q8_0",))["model.layers.0.mlp.up_proj.weight"][1], up)
    assert reads == [gguf_path], "an index of the file it replaced was trusted"
