"""Build a model from a folder: parse its config, construct on `meta`, assign the checkpoint's tensors.

With a tensor-parallel group `tp`, each rank builds and loads only its own shard (`engine.parallel.shard`); a
model whose heads do not split over the group fails here with `ParallelError`, before any tensor is read."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from specstep.engine.attention import cpu_attention as attention_kernel
from specstep.engine.attention.torch_backend import TorchAttention
from specstep.engine.config import DTYPES, ModelConfig
from specstep.engine.cpu_kernels import CpuKernels
from specstep.engine.errors import CheckpointError, ConfigError
from specstep.engine.gguf_checkpoint import fp32_folder, is_partial
from specstep.engine.loader import load_state_dict, resolve_dtype
from specstep.engine.model_source import resolve_model
from specstep.engine.models.cpu_linear import describe_linears, plan_linears
from specstep.engine.models.decode_layers import use_native_layers
from specstep.engine.models.gguf_block_params import block_params
from specstep.engine.models.gguf_model_linears import use_gguf_linears
from specstep.engine.models.half_linears import half_format, use_half_linears
from specstep.engine.models.llama import LlamaForCausalLM
from specstep.engine.models.mtp_head import MTPHead
from specstep.engine.models.q8_0_linears import use_q8_0_linears
from specstep.engine.parallel.group import SINGLE, TPGroup


def load_model(model: str | Path, device: str | torch.device = "cpu", dtype: str = "auto",
               cpu_linear: str | CpuKernels = "auto", tp: TPGroup = SINGLE) -> LlamaForCausalLM:
    """`model`: a Hugging Face-format folder or a GGUF file (converted once, see `engine.gguf_checkpoint`).
    `cpu_linear`: the CPU kernels (`EngineConfig.cpu_kernels`), or a bare `--cpu-linear` mode (that linear plan,
    batch invariance off: see `plan_linears`)."""
    folder = resolve_model(model)
    if not folder.is_dir():
        raise CheckpointError(f"model {str(folder)!r} is neither a model folder nor a GGUF file")
    cfg = ModelConfig.from_folder(folder)
    if cfg.architecture == "mtp":
        raise CheckpointError(f"{folder}: is an MTP head, not a language model (use it as --draft with --spec mtp)")
    device = torch.device(device)
    torch_dtype = resolve_dtype(dtype, cfg, device)
    quantize = isinstance(cpu_linear, CpuKernels) and cpu_linear.quantization == "q8_0"
    if quantize:
        _check_quantize(folder, device, torch_dtype, tp)
    # a bf16 / fp16 folder computed in fp32 on CPU keeps its 16-bit weights: read as the file holds them
    half = half_format(folder, cfg, cpu_linear, torch_dtype, tp.world_size) if device.type == "cpu" else None
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, tp)
    gguf = _gguf_source(folder, cpu_linear, tp, torch_dtype) if device.type == "cpu" else None
    if gguf is None:
        folder = fp32_folder(folder)  # (a GGUF file whose blocks no kernel reads here: its fp32 checkpoint)
    # a GGUF file's block-quantised weights are read as blocks only: never as fp32 tensors
    skip = block_params(model, gguf) if gguf is not None else frozenset()
    folder = _load_weights(model, folder, torch_dtype if half is None else DTYPES[cfg.torch_dtype], skip=skip)
    # Buffers (rotary tables) were built on meta; rebuild them for real on the target device.
    model.rotary.build_tables()
    if device.type == "cpu":
        if quantize:
            model.gguf_note = use_q8_0_linears(model, cpu_linear.activations)
        else:
            model.gguf_note = (use_half_linears(model, half, cpu_linear.activations) if half is not None
                               else _quantized(model, folder, cpu_linear, tp, torch_dtype))
        unread = frozenset(n for n, t in model.state_dict().items() if t.is_meta)  # what the blocks did not take
        if unread:
            _load_weights(model, folder, torch_dtype, only=unread)
    model = model.to(device).eval().requires_grad_(False)  # serving weights; training heads keep the target frozen
    if device.type == "cpu":
        use_cpu_kernels(model, cpu_linear)
        layers = cpu_linear.layers if isinstance(cpu_linear, CpuKernels) else "torch"
        model.layers_note = use_native_layers(model, layers)
    return model


def _load_weights(model: torch.nn.Module, folder: Path, dtype: torch.dtype, skip: frozenset[str] = frozenset(),
                  only: frozenset[str] | None = None) -> Path:
    """`load_state_dict` from `folder`, or where a partial GGUF conversion lacks a tensor the blocks do not supply
    on this host, from its fp32 checkpoint (converted then); the folder read."""
    try:
        load_state_dict(model, folder, dtype, skip=skip, only=only)
        return folder
    except CheckpointError:
        if not is_partial(folder):
            raise
    folder = fp32_folder(folder)
    load_state_dict(model, folder, dtype, skip=skip, only=only)
    return folder


def _check_quantize(folder: Path, device: torch.device, dtype: torch.dtype, tp: TPGroup) -> None:
    """`--quantization q8_0` quantises a Hugging Face folder's linears for the CPU's GGUF kernel: one rank,
    fp32 compute."""
    if (folder / "specstep_source.json").is_file():
        raise ConfigError(f"--quantization q8_0 quantises a Hugging Face folder; {folder} holds a GGUF file's "
                          "blocks already (--quantization auto runs them as they are)")
    if device.type != "cpu":
        raise ConfigError(f"--quantization q8_0 runs in the CPU's GGUF kernel, not on {device.type}")
    if dtype != torch.float32:
        raise ConfigError(f"--quantization q8_0 runs in the GGUF kernel, which takes float32 activations: not with "
                          f"--dtype {str(dtype).removeprefix('torch.')}")
    if tp.world_size > 1:
        raise ConfigError("--quantization q8_0 does not run with --tensor-parallel-size > 1 (blocks are not "
                          "sharded)")


def _gguf_source(folder: Path, kernels: str | CpuKernels, tp: TPGroup, dtype: torch.dtype) -> Path | None:
    """The GGUF file a converted folder came from, where its blocks may replace the fp32 weights (the same
    conditions as `_quantized`'s), else None."""
    source = folder / "specstep_source.json"
    if (not isinstance(kernels, CpuKernels) or kernels.quantization == "none" or not source.is_file()
            or dtype != torch.float32 or tp.world_size > 1):
        return None
    return Path(json.loads(source.read_text())["gguf"])


def _quantized(model: LlamaForCausalLM, folder: Path, kernels: str | CpuKernels, tp: TPGroup,
               dtype: torch.dtype = torch.float32) -> str:
    """Read a GGUF checkpoint's quantised blocks as they are where `kernels.quantization` allows it (a bare
    `--cpu-linear` mode keeps the fp32 plans it names); the ready line's note."""
    source = folder / "specstep_source.json"
    if not isinstance(kernels, CpuKernels) or kernels.quantization == "none":
        return ""
    if not source.is_file():  # a Hugging Face folder (a draft beside a GGUF target, say): fp32 throughout
        return "" if kernels.activations in ("fp32", "auto") else "fp32 activations (not a GGUF checkpoint)"
    if dtype != torch.float32:
        # The GGUF kernel multiplies fp32 activations: a 16-bit model keeps the converted checkpoint's weights,
        # dequantised from the blocks and rounded to its dtype at load.
        name = str(dtype).removeprefix("torch.")
        if kernels.quantization == "gguf" or kernels.activations not in ("fp32", "auto"):
            flag = ("--quantization gguf" if kernels.activations in ("fp32", "auto")
                    else f"--activations {kernels.activations}")
            raise ConfigError(f"{flag} runs the GGUF kernel, which takes float32 activations: not with --dtype "
                              f"{name} (--dtype float32 or auto for the kernel; --quantization auto for {name} "
                              "weights dequantised from the file)")
        return f"{name} weights dequantised from the GGUF blocks (the GGUF kernel takes float32 activations)"
    if tp.world_size > 1:  # shards would cut blocks: tensor-parallel ranks keep fp32 weights
        if kernels.quantization == "gguf" or kernels.activations not in ("fp32", "auto"):
            raise ConfigError(f"--quantization gguf / --activations {kernels.activations} do not run with "
                              "--tensor-parallel-size > 1")
        return "fp32 weights (GGUF blocks are not sharded across tensor-parallel ranks)"
    gguf_path = Path(json.loads(source.read_text())["gguf"])
    return use_gguf_linears(model, folder, gguf_path, required=kernels.quantization == "gguf",
                            activations=kernels.activations)


def use_cpu_kernels(net: torch.nn.Module, kernels: str | CpuKernels) -> None:
    """Plan a CPU model's linears (`plan_linears`: kernel and weight dtype per host) and give it the attention
    that goes with them: batch-invariant or SDPA (`TorchAttention`)."""
    plan_linears(net, kernels)
    invariant = kernels.batch_invariant if isinstance(kernels, CpuKernels) else False
    cfg = net.rank_cfg
    # Prompts may take the C++ attention kernel where it runs for this model: fp32 activations (its queries), a
    # head size it takes, a host that builds it
    runs = attention_kernel.runs(torch.zeros(1, dtype=net.norm.weight.dtype), torch.zeros(1, 1, cfg.head_dim))
    group = cfg.num_heads // cfg.num_kv_heads if runs else None
    net.attention = TorchAttention(batch_invariant=invariant, kernel_group=group)


def describe_cpu_kernels(net: torch.nn.Module) -> str:
    """For the ready line: a CPU model's linears (dtype, kernel, why) and attention; "" elsewhere."""
    linears = "; ".join(x for x in (getattr(net, "gguf_note", ""), describe_linears(net),
                                    getattr(net, "layers_note", "")) if x)
    if not linears:
        return ""
    att = net.attention
    return f"{linears}; {att.describe()}" if isinstance(att, TorchAttention) else linears


def load_mtp_head(folder: str | Path, target_cfg: ModelConfig, device: str | torch.device = "cpu",
                  dtype: torch.dtype = torch.float32, cpu_linear: str | CpuKernels = "auto",
                  tp: TPGroup = SINGLE) -> MTPHead:
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"head folder {str(folder)!r} does not exist")
    cfg = ModelConfig.from_folder(folder)
    if cfg.architecture != "mtp":
        raise CheckpointError(f"{folder}: not an MTP head (architectures must be ['SpecstepMTPHead'])")
    if cfg.hidden_size != target_cfg.hidden_size or cfg.vocab_size != target_cfg.vocab_size:
        raise CheckpointError(
            f"{folder}: head (hidden {cfg.hidden_size}, vocab {cfg.vocab_size}) does not fit the target "
            f"(hidden {target_cfg.hidden_size}, vocab {target_cfg.vocab_size})")
    with torch.device("meta"):
        head = MTPHead(cfg, tp)  # the target's group: the head shards with it
    load_state_dict(head, folder, dtype)
    head.rotary.build_tables()
    head = head.to(device).eval()
    if torch.device(device).type == "cpu":
        use_cpu_kernels(head, cpu_linear)
    return head
