"""Tensor parallelism at the model layer, on CPU with gloo.

A group of ranks, each holding its shard, must compute what one process with the whole model computes: the same
paged prefill and decode logits (and MTP head logits) on every rank, for GQA, MHA, KV heads replicated over ranks,
tied embeddings, Qwen2 and Llama biases and a vocabulary that does not split evenly. Each rank must read only its
slices of the checkpoint, and a group that cannot form must fail with `ParallelError` in bounded time.
"""

from __future__ import annotations

import socket
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from specstep.engine.config import ModelConfig
from specstep.engine.errors import ParallelError
from specstep.engine.model_loader import load_model, load_mtp_head
from specstep.engine.parallel import SINGLE, ParallelConfig, TPGroup, init_tp_group
from specstep.engine.parallel.shard import rank_slice
from tests.fixtures_models import make_mtp_head
from tests.helpers import make_checkpoint
from tests.tp_workers import forward_worker, paged_forward

# name -> (architecture, config overrides, CPU linear kernel: both kernels must work on shards)
SHAPES = {
    "gqa": ("llama", {}, "matmul"),
    "mha": ("llama", dict(num_key_value_heads=4), "matmul"),
    "mqa_kv_replicated": ("llama", dict(num_key_value_heads=1), "matmul"),
    "tied": ("llama", dict(tie_word_embeddings=True), "onednn"),
    "qwen2_bias": ("qwen2", {}, "onednn"),
    "llama_bias": ("llama", dict(attention_bias=True, mlp_bias=True), "matmul"),
    "odd_vocab_tied": ("llama", dict(vocab_size=321, tie_word_embeddings=True), "matmul"),
}
WITH_HEAD = {"gqa", "qwen2_bias"}


def randomize_biases(folder: Path, seed: int) -> None:
    """transformers initialises biases to zero, which would hide a bias sliced or added the wrong number of times."""
    gen = torch.Generator().manual_seed(seed)
    tensors = load_file(str(folder / "model.safetensors"))
    biases = [k for k in tensors if k.endswith(".bias")]
    assert biases
    for k in biases:
        tensors[k] = 0.5 * torch.randn(tensors[k].shape, generator=gen)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, tuple[Path, str, Path | None]]:
    """Every shape's checkpoint (a larger init so logits are far from ties), with an MTP head for some."""
    out = {}
    for i, (name, (arch, overrides, mode)) in enumerate(SHAPES.items()):
        folder = make_checkpoint(tmp_path_factory.mktemp(name), seed=i, arch=arch, initializer_range=0.1,
                                 **overrides)
        if name.endswith("_bias"):
            randomize_biases(folder, seed=i)
        head = make_mtp_head(tmp_path_factory.mktemp(f"{name}_head"), folder, seed=i) if name in WITH_HEAD else None
        out[name] = (folder, mode, head)
    return out


def run_group(world_size: int, checkpoints, names, tmp: Path) -> dict[str, list[dict[str, torch.Tensor]]]:
    """Spawn `world_size` ranks once for all `names`; returns each shape's outputs per rank."""
    jobs = [(n, str(checkpoints[n][0]), checkpoints[n][1], str(checkpoints[n][2]) if checkpoints[n][2] else None)
            for n in names]
    mp.spawn(forward_worker, args=(world_size, str(tmp / "store"), jobs, str(tmp)), nprocs=world_size, join=True)
    return {n: [torch.load(tmp / f"{n}-rank{r}.pt") for r in range(world_size)] for n in names}


@pytest.fixture(scope="module")
def tp2(checkpoints, tmp_path_factory):
    return run_group(2, checkpoints, list(SHAPES), tmp_path_factory.mktemp("tp2"))


def assert_matches_single_rank(per_rank, ref: dict[str, torch.Tensor], what: str) -> None:
    assert set(per_rank[0]) == set(ref)
    for key, want in ref.items():
        scale = want.abs().max().item()
        assert scale > 0.5, "degenerate reference logits: the comparison would prove little"
        for rank, out in enumerate(per_rank):
            got = out[key]
            assert got.shape == want.shape, f"{what}/{key} rank {rank}"
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * scale,
                                       msg=lambda m, k=key, r=rank: f"{what}/{k} rank {r}: {m}")
            assert torch.equal(got.argmax(-1), want.argmax(-1)), f"{what}/{key} rank {rank}: argmax differs"
            # The gathered logits are the same bits everywhere: any rank may sample.
            assert torch.equal(got, per_rank[0][key]), f"{what}/{key}: rank {rank} differs from rank 0"


@pytest.mark.parametrize("shape", list(SHAPES))
def test_tp2_logits_match_tp1(checkpoints, tp2, shape):
    folder, mode, head = checkpoints[shape]
    assert_matches_single_rank(tp2[shape], paged_forward(folder, SINGLE, mode, head), shape)


def test_tp4_replicates_each_kv_head_on_two_ranks(checkpoints):
    """4 ranks over 4 heads and 2 KV heads: rank r holds q head r and KV head r // 2 (its q head's group), and the
    o_proj columns of head r. (The forward of a replicated KV head is checked at TP = 2 on `mqa_kv_replicated`.)"""
    folder, _, _ = checkpoints["gqa"]
    full = load_model(folder, cpu_linear="matmul")
    d, q = full.cfg.head_dim, full.cfg.q_size
    kv = full.cfg.kv_size
    for rank in range(4):
        model = load_model(folder, cpu_linear="matmul", tp=TPGroup(ParallelConfig(4, rank)))
        assert (model.rank_cfg.num_heads, model.rank_cfg.num_kv_heads) == (1, 1)
        for layer, ref in zip(model.layers, full.layers):
            w = ref.self_attn.qkv_proj.weight
            g = rank // 2
            want = torch.cat([w[rank * d:(rank + 1) * d], w[q + g * d:q + (g + 1) * d],
                              w[q + kv + g * d:q + kv + (g + 1) * d]])
            assert torch.equal(layer.self_attn.qkv_proj.weight, want), rank
            assert torch.equal(layer.self_attn.o_proj.weight, ref.self_attn.o_proj.weight[:, rank * d:(rank + 1) * d])


@contextmanager
def recording_reads(monkeypatch, reads: list[tuple[str, str, int]]):
    """Wrap the loader's `safe_open` so every read records (tensor name, 'whole' | 'slice', elements)."""
    import specstep.engine.loader as loader

    class Slice:
        def __init__(self, view, name):
            self._view, self._name = view, name

        def get_shape(self):
            return self._view.get_shape()

        def __getitem__(self, index):
            t = self._view[index]
            reads.append((self._name, "slice", t.numel()))
            return t

    class File:
        def __init__(self, f):
            self._f = f

        def keys(self):
            return self._f.keys()

        def get_tensor(self, name):
            t = self._f.get_tensor(name)
            reads.append((name, "whole", t.numel()))
            return t

        def get_slice(self, name):
            return Slice(self._f.get_slice(name), name)

    @contextmanager
    def opener(path, framework):
        with safe_open(path, framework=framework) as f:
            yield File(f)

    monkeypatch.setattr(loader, "safe_open", opener)
    yield


def param_elements(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # parameters() yields a tied weight once


@pytest.mark.parametrize("shape", ["gqa", "llama_bias", "odd_vocab_tied"])
def test_each_rank_reads_and_holds_only_its_shard(checkpoints, monkeypatch, shape):
    folder, _, _ = checkpoints[shape]
    full = load_model(folder, cpu_linear="matmul")
    cfg, n = full.cfg, 2
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        file_numel = {k: f.get_slice(k).get_shape() for k in f.keys()}  # noqa: SIM118
    file_numel = {k: int(torch.Size(s).numel()) for k, s in file_numel.items()}
    replicated = sum(p.numel() for name, p in full.named_parameters() if name.endswith("norm.weight"))
    vocab_rows = -(-cfg.vocab_size // n)
    padding = (n * vocab_rows - cfg.vocab_size) * cfg.hidden_size * (1 if cfg.tie_word_embeddings else 2)
    biases = sum(p.numel() for name, p in full.named_parameters() if name.endswith(("o_proj.bias", "down_proj.bias")))
    for rank in range(n):
        reads: list[tuple[str, str, int]] = []
        with recording_reads(monkeypatch, reads):
            model = load_model(folder, cpu_linear="matmul", tp=TPGroup(ParallelConfig(n, rank)))
        assert reads, "the recorder saw no reads: the test would prove nothing"
        for name, how, numel in reads:
            local = name.removeprefix("model.")
            share = rank_slice(local, cfg, ParallelConfig(n, rank))
            if share is None:
                assert name.endswith("norm.weight") or (rank == 0 and name.endswith("bias")), name
            else:
                assert how == "slice", f"rank {rank} read all of sharded tensor {name}"
                want = (share.stop - share.start) * file_numel[name] // share.global_size
                assert numel == want, f"rank {rank} read {numel} of {name}'s {file_numel[name]} elements"
        # 1/N of the sharded weights (the padded vocabulary's), all of the norms and row-parallel biases (zeros
        # beyond rank 0).
        sharded = param_elements(full) - replicated - biases
        assert param_elements(model) == (sharded + padding) // n + replicated + biases, rank
        assert sum(numel for _, _, numel in reads) <= param_elements(model)


def test_tp1_shares_are_the_whole_model(checkpoints):
    folder, _, _ = checkpoints["gqa"]
    model = load_model(folder, cpu_linear="matmul")
    assert model.rank_cfg is model.cfg and model.tp is SINGLE
    x = torch.ones(3)
    assert SINGLE.all_reduce(x) is x and SINGLE.all_gather(x) is x and SINGLE.broadcast(x) is x


def test_heads_that_do_not_split_are_a_startup_error(checkpoints):
    folder, _, head = checkpoints["gqa"]  # 4 heads, 2 KV heads, MLP width 128
    with pytest.raises(ParallelError, match="4 attention heads do not split over tensor-parallel size 3"):
        load_model(folder, tp=TPGroup(ParallelConfig(3, 0)))
    target_cfg = ModelConfig.from_folder(folder)
    with pytest.raises(ParallelError, match="attention heads"):
        load_mtp_head(head, target_cfg, tp=TPGroup(ParallelConfig(3, 1)))
    base = dict(architecture="llama", vocab_size=64, hidden_size=48, intermediate_size=96, num_layers=1,
                head_dim=8)
    with pytest.raises(ParallelError, match="2 KV heads do not split over tensor-parallel size 3"):
        ModelConfig(**base, num_heads=6, num_kv_heads=2).shard(3)
    with pytest.raises(ParallelError, match="MLP width 90 does not split"):
        ModelConfig(**{**base, "intermediate_size": 90}, num_heads=8, num_kv_heads=8).shard(4)
    share = ModelConfig(**base, num_heads=8, num_kv_heads=2).shard(4)  # KV heads replicated, one per rank
    assert (share.num_heads, share.num_kv_heads, share.intermediate_size, share.tp_size) == (2, 1, 24, 4)


def test_a_described_group_cannot_run_collectives():
    with pytest.raises(ParallelError, match="never formed"):
        TPGroup(ParallelConfig(2, 1)).all_reduce(torch.ones(2))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("init", ["tcp", "file"])
def test_leader_alone_fails_naming_the_missing_rank(tmp_path, init):
    method = f"tcp://127.0.0.1:{free_port()}" if init == "tcp" else f"file://{tmp_path / 'store'}"
    t0 = time.monotonic()
    with pytest.raises(ParallelError, match=r"rank\(s\) \[1\] of the tensor-parallel group .* did not join"):
        init_tp_group(2, 0, method, backend="gloo", join_timeout_s=2, timeout_s=2)
    assert time.monotonic() - t0 < 15
    assert not torch.distributed.is_initialized()


def test_follower_without_a_leader_fails_in_bounded_time():
    t0 = time.monotonic()
    with pytest.raises(ParallelError, match="could not reach the tensor-parallel group's store"):
        init_tp_group(2, 1, f"tcp://127.0.0.1:{free_port()}", backend="gloo", join_timeout_s=2, timeout_s=2)
    assert time.monotonic() - t0 < 15
