"""Load and save Hugging Face-format checkpoints from local folders (no hub).

Hugging Face tensor names map onto ours; q/k/v and gate/up are concatenated into the merged projections.
Every expected tensor must be present with the right shape, and no unexpected tensor may be left over:
a partial load is always an error that names the tensor.

Under tensor parallelism each rank reads only its part of each tensor (`engine.parallel.shard`) through
safetensors' lazy slices, so no rank ever holds a whole sharded weight; merged projections concatenate the rank's
slice of each piece. Sliced tensors are checked against the whole model's shape before anything is read.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from specstep.engine.config import DTYPES, ModelConfig
from specstep.engine.errors import CheckpointError
from specstep.engine.parallel.group import SINGLE
from specstep.engine.parallel.shard import ZEROS, RankSlice, rank_slice

_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")
# merged parameter -> the Hugging Face pieces, in concatenation order
_MERGED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}


def resolve_dtype(name: str, cfg: ModelConfig, device: torch.device) -> torch.dtype:
    """`auto`: on CUDA the checkpoint's half dtype, and bfloat16 for a float32 checkpoint (as vLLM does: fp32
    serving halves throughput and FlashInfer needs 16-bit); float32 on CPU, where bf16/fp16 matmuls are unusably
    slow. An explicit dtype is taken as given: `float32` on CUDA stays exact fp32 (no TF32), which the GPU
    equality tests rely on."""
    if name == "auto":
        if device.type != "cuda":
            return torch.float32
        dtype = DTYPES[cfg.torch_dtype]
        return torch.bfloat16 if dtype == torch.float32 else dtype
    if name not in DTYPES:
        raise CheckpointError(f"unsupported dtype {name!r}; choose from auto, {', '.join(DTYPES)}")
    return DTYPES[name]


def safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = sorted({folder / f for f in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{folder}: shard(s) listed in the index are missing: {', '.join(missing)}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{folder}: no *.safetensors weights found")
    return files


def hf_to_local(name: str) -> str:
    """`model.layers.3.self_attn.q_proj.weight` -> `layers.3.self_attn.q_proj.weight` (pre-merge name)."""
    return name[len("model."):] if name.startswith("model.") else name


def load_state_dict(module: torch.nn.Module, folder: Path, dtype: torch.dtype, skip: frozenset[str] = frozenset(),
                    only: frozenset[str] | None = None) -> None:
    """Fill `module` (built on the meta device) from the folder's tensors, merging split projections.

    The module's tensor-parallel group (`module.tp`, a single rank if absent) decides which slices are read; the
    module's own parameters have that rank's shapes. `skip`: parameters left on meta, unread (a GGUF file's
    blocks supply them); `only`: read just these (the ones a first pass skipped and the blocks did not take)."""
    cfg = getattr(module, "cfg", None)
    tp = getattr(module, "tp", SINGLE).config
    expected = {k: v for k, v in module.state_dict().items()
                if k not in skip and (only is None or k in only)}
    wanted = set(expected) if only is not None else None
    tied = hasattr(module, "lm_head") and getattr(cfg, "tie_word_embeddings", False)
    if tied:
        expected.pop("lm_head.weight", None)
    pieces: dict[str, dict[str, torch.Tensor]] = {}
    out: dict[str, torch.Tensor] = {}
    for path in safetensors_files(folder):
        with safe_open(str(path), framework="pt") as f:
            for hf_name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                if _IGNORED.match(hf_name):
                    continue
                name = hf_to_local(hf_name)
                if tied and name == "lm_head.weight":
                    continue  # some tied checkpoints still store it; the embedding is the source of truth
                merged = next(((m, p) for m, parts in _MERGED.items() for p in parts if f".{p}." in f".{name}"), None)
                target = name.replace(merged[1], merged[0]) if merged else name
                if target in skip or (wanted is not None and target not in wanted):
                    continue
                if not merged and name not in expected:
                    raise CheckpointError(f"{folder}: unexpected tensor {hf_name!r} for this architecture")
                share = rank_slice(name, cfg, tp) if cfg is not None else None
                ref = expected.get(target)
                tensor = _read_share(f, hf_name, share, None if ref is None else tuple(ref.shape), folder)
                if merged:
                    pieces.setdefault(target, {})[merged[1]] = tensor
                else:
                    out[name] = tensor
    out |= _merge(pieces, expected, folder)
    for name, ref in expected.items():
        if name not in out:
            raise CheckpointError(f"{folder}: missing tensor {name!r}")
        if tuple(out[name].shape) != tuple(ref.shape):
            raise CheckpointError(
                f"{folder}: tensor {name!r} has shape {tuple(out[name].shape)}, config expects {tuple(ref.shape)}"
            )
        out[name] = out[name].to(dtype)
    module.load_state_dict(out, strict=False, assign=True)
    if tied and "embed_tokens.weight" in out:  # (read now: not skipped, nor read by an earlier pass)
        module.lm_head.weight = module.embed_tokens.weight


def _merge(pieces: dict[str, dict[str, torch.Tensor]], expected: dict[str, torch.Tensor],
           folder: Path) -> dict[str, torch.Tensor]:
    """Each merged parameter from its Hugging Face pieces (`pieces[merged name][piece]`), concatenated in
    `_MERGED` order: every piece present, and the merged parameter one the module has."""
    out: dict[str, torch.Tensor] = {}
    for target, parts in pieces.items():
        merged_name = next(m for m in _MERGED if m in target)
        order = _MERGED[merged_name]
        missing = [p for p in order if p not in parts]
        if missing:
            raise CheckpointError(f"{folder}: missing tensor(s) {[target.replace(merged_name, p) for p in missing]}")
        if target not in expected:
            raise CheckpointError(f"{folder}: unexpected tensor(s) for {target!r} (e.g. biases this config lacks)")
        out[target] = torch.cat([parts[p] for p in order], dim=0)
    return out


def _read_share(f, hf_name: str, share: RankSlice | str | None, ref: tuple[int, ...] | None,
                folder: Path) -> torch.Tensor:
    """This rank's part of one checkpoint tensor, read lazily. `ref`: the rank's parameter shape (merged pieces:
    the merged parameter's; None: a piece no parameter takes, which the caller reports), from which the whole
    tensor's expected shape follows: only the split dimension differs."""
    if share is None:
        return f.get_tensor(hf_name)
    view = f.get_slice(hf_name)
    shape = tuple(view.get_shape())
    if share == ZEROS:
        return torch.zeros(shape)  # the caller's final check compares it with the (unsplit) parameter
    if ref is None:
        return torch.empty(0)
    whole = ref[:share.dim] + (share.global_size,) + ref[share.dim + 1:]
    if shape != whole:
        raise CheckpointError(f"{folder}: tensor {hf_name!r} has shape {shape}, config expects {whole}")
    tensor = view[(slice(None),) * share.dim + (slice(share.start, share.stop),)]
    pad = share.size - tensor.shape[share.dim]
    if pad:  # the vocabulary's last shard: zero rows that no token id reaches
        pad_shape = tensor.shape[:share.dim] + (pad,) + tensor.shape[share.dim + 1:]
        tensor = torch.cat([tensor, tensor.new_zeros(pad_shape)], dim=share.dim)
    return tensor


def local_to_hf(state: dict[str, torch.Tensor], cfg: ModelConfig, prefix: str = "model.") -> dict[str, torch.Tensor]:
    """Split merged projections and add Hugging Face prefixes (inverse of `load_state_dict`)."""
    sizes = {
        "self_attn.qkv_proj": [cfg.q_size, cfg.kv_size, cfg.kv_size],
        "mlp.gate_up_proj": [cfg.intermediate_size, cfg.intermediate_size],
    }
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        merged = next((m for m in _MERGED if m in name), None)
        full = name if name.startswith("lm_head") else prefix + name
        if merged:
            for part, chunk in zip(_MERGED[merged], t.split(sizes[merged], dim=0)):
                out[full.replace(merged, part)] = chunk.contiguous()
        else:
            out[full] = t.contiguous()
    return out


def save_checkpoint(state: dict[str, torch.Tensor], config: dict, folder: str | Path) -> None:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().cpu() for k, v in state.items()}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
