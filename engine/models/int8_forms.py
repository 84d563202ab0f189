"""Which int8 form the GGUF kernels take on this host (`--activations int8|auto`, `SPECSTEP_CPU_ISA`): AMX tiles,
else AVX-512 VNNI lanes, else AVX2 lanes; a pinned form the host cannot run is an error that names the flag."""

from __future__ import annotations

from specstep.engine.errors import ConfigError
from specstep.engine.kernels import binding as kernel_layer
from specstep.engine.models.gguf_kernel import tiles_unavailable, vnni_unavailable


def kernel_activations(activations: str, flag: str) -> tuple[str, str]:
    """`activations` (fp32 | int8 | auto) as the kernels run them on this host: int8 and auto take the fastest
    int8 form (AMX tiles, else AVX-512 VNNI lanes, else AVX2 lanes) unless `SPECSTEP_CPU_ISA` pins one; with a
    note on the forms the host lacks. A pinned form the host cannot run is a ConfigError naming `flag`."""
    if kernel_layer.pinned_isa() and activations in ("int8", "auto"):
        flag = f"{kernel_layer.ISA_ENV}={kernel_layer.pinned_isa()}"
    activations = _pinned_isa(activations)  # before the checks: a pinned ISA the host lacks is refused by them
    if activations == "int8-tiles" and tiles_unavailable():
        raise ConfigError(f"{flag}: AMX tiles cannot run here: {tiles_unavailable()} ({kernel_layer.ISA_ENV}=avx2 "
                          "runs in AVX2 lanes)")
    if activations == "int8-vnni" and vnni_unavailable():
        raise ConfigError(f"{flag}: AVX-512 VNNI lanes cannot run here: {vnni_unavailable()} "
                          f"({kernel_layer.ISA_ENV}=avx2 runs in AVX2 lanes)")
    host_note = ""
    if activations in ("int8", "auto"):  # the host's fastest: AMX tiles, else AVX-512 VNNI lanes, else AVX2 lanes
        if not tiles_unavailable():
            activations = "int8-tiles"
        elif not vnni_unavailable():
            activations, host_note = "int8-vnni", f" (AMX tiles: {tiles_unavailable()})"
        else:
            activations = "int8"
            host_note = f" (AMX tiles: {tiles_unavailable()}; AVX-512 VNNI: {vnni_unavailable()})"
    return {"int8-lanes": "int8"}.get(activations, activations), host_note  # the AVX2 pin -> the kernel's name


# SPECSTEP_CPU_ISA (engine.kernels.binding) -> the older Q4_1 / Q8_0 kernel's int8 form on that ISA
_OLD_KERNEL_INT8 = {"amx": "int8-tiles", "avx512": "int8-vnni", "avx2": "int8-lanes"}


def _pinned_isa(activations: str) -> str:
    """`int8` / `auto` where `SPECSTEP_CPU_ISA` pins an ISA: the older kernel's form on it (`amx` is that kernel's
    only: the kernel layer has no AMX rows)."""
    isa = kernel_layer.pinned_isa()
    if activations not in ("int8", "auto") or not isa:
        return activations
    return _OLD_KERNEL_INT8[isa]
