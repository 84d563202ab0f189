"""Model configuration parsed from a Hugging Face `config.json`, frozen after parsing."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from specstep.engine.errors import CheckpointError, ParallelError

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "MistralForCausalLM": "mistral",
    "SpecstepMTPHead": "mtp",
}

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True, slots=True)
class RopeScaling:
    rope_type: str = "default"  # default | linear | llama3
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True, slots=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = RopeScaling()
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str = "float32"
    tp_size: int = 1  # 1: the whole model; N: one rank's share of it over N tensor-parallel ranks (`shard`)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def shard(self, world_size: int) -> ModelConfig:
        """One rank's share over `world_size` tensor-parallel ranks (the same shape on every rank).

        Attention heads, KV heads and the MLP width are per rank; the hidden size and the vocabulary stay global
        (hidden states are replicated between layers, logits are gathered), so code that samples keeps reading
        the model's own `cfg`. KV pools and attention backends take this config: its `num_kv_heads` is the KV
        pool's per-rank head count. When the group is larger than the KV head count (and a multiple of it), each
        KV head is replicated on `world_size / num_kv_heads` ranks, as vLLM does: every rank then holds one."""
        if world_size == 1:
            return self
        if self.tp_size != 1:
            raise ParallelError(f"config is already one rank's share of {self.tp_size}")
        h, hkv, inter = self.num_heads, self.num_kv_heads, self.intermediate_size
        if world_size < 1 or h % world_size:
            raise ParallelError(f"{h} attention heads do not split over tensor-parallel size {world_size}")
        if hkv % world_size and world_size % hkv:
            raise ParallelError(f"{hkv} KV heads do not split over tensor-parallel size {world_size} "
                                f"(it must divide them, or be a multiple of them to replicate each)")
        if inter % world_size:
            raise ParallelError(f"MLP width {inter} does not split over tensor-parallel size {world_size}")
        return replace(self, num_heads=h // world_size, num_kv_heads=max(1, hkv // world_size),
                       intermediate_size=inter // world_size, tp_size=world_size)

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config") -> ModelConfig:
        archs = raw.get("architectures") or []
        arch = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise CheckpointError(
                f"{source}: unsupported architecture {archs or raw.get('model_type')!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        try:
            hidden = int(raw["hidden_size"])
            heads = int(raw["num_attention_heads"])
            layers = int(raw["num_hidden_layers"])
            inter = int(raw["intermediate_size"])
            vocab = int(raw["vocab_size"])
        except KeyError as e:
            raise CheckpointError(f"{source}: missing required field {e.args[0]!r}") from None
        sliding = raw.get("sliding_window")
        if arch == "mistral" and sliding is not None and raw.get("use_sliding_window", True):
            if int(sliding) < int(raw.get("max_position_embeddings", 0)):
                raise CheckpointError(f"{source}: sliding-window attention ({sliding}) is not supported")
        if arch == "qwen2" and raw.get("use_sliding_window", False):
            raise CheckpointError(f"{source}: sliding-window attention is not supported")
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        dtype = str(raw.get("torch_dtype") or raw.get("dtype") or "float32").replace("torch.", "")
        return cls(
            architecture=arch,
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=inter,
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(raw.get("rope_theta") or (raw.get("rope_parameters") or {}).get("rope_theta", 1e4)),
            rope_scaling=_parse_rope_scaling(raw, source),
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v biases; Llama declares them with `attention_bias`.
            attention_bias=arch == "qwen2" or bool(raw.get("attention_bias", False)),
            mlp_bias=bool(raw.get("mlp_bias", False)),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_ids,
            torch_dtype=dtype if dtype in DTYPES else "float32",
        )

    @classmethod
    def from_folder(cls, folder: str | Path) -> ModelConfig:
        path = Path(folder) / "config.json"
        if not path.is_file():
            raise CheckpointError(f"{folder}: no config.json (is this a Hugging Face model folder?)")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{path}: invalid JSON ({e})") from None
        return cls.from_dict(raw, source=str(path))


def _parse_rope_scaling(raw: dict[str, Any], source: str) -> RopeScaling:
    rs = raw.get("rope_scaling") or raw.get("rope_parameters")
    if not rs:
        return RopeScaling()
    kind = rs.get("rope_type") or rs.get("type") or "default"
    if kind == "default":
        return RopeScaling()
    if kind == "linear":
        return RopeScaling("linear", float(rs["factor"]))
    if kind == "llama3":
        return RopeScaling(
            "llama3",
            float(rs["factor"]),
            float(rs.get("low_freq_factor", 1.0)),
            float(rs.get("high_freq_factor", 4.0)),
            int(rs.get("original_max_position_embeddings", 8192)),
        )
    raise CheckpointError(f"{source}: unsupported rope_scaling type {kind!r} (supported: linear, llama3)")
