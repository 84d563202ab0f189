"""Peak resident memory of starting on a GGUF file: a fresh conversion (an empty cache) and a CPU load with the
default kernels, as the process's peak RSS (`ru_maxrss`) after each stage. Memory, not time: quiet or loaded
hosts give the same figures, up to the allocator.

    python -m benchmarks.bench_load_memory [--model FILE.gguf]     # default: the embedded SmolLM2 Q4_1 file
    python -m benchmarks.random_gguf --shape qwen2.5-1.5b --out /tmp/q15.gguf
    python -m benchmarks.bench_load_memory --model /tmp/q15.gguf
"""

from __future__ import annotations

import argparse
import os
import resource
import tempfile
from pathlib import Path


def peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, default=None)
    args = ap.parse_args()
    cache = tempfile.mkdtemp(prefix="specstep-load-memory-")
    os.environ["SPECSTEP_CACHE"] = cache  # a fresh conversion, away from the user's cache

    from specstep.engine.cpu_kernels import CpuKernels
    from specstep.engine.gguf_checkpoint import converted_folder
    from specstep.engine.memory_probe import resident_bytes
    from specstep.engine.model_loader import load_model
    from specstep.engine.model_source import pretrained_gguf

    path = args.model or pretrained_gguf()
    imports = peak_mib()
    converted_folder(path, full=False)  # what a start converts (the kernels read the blocks from the file)
    converted = peak_mib()
    model = load_model(path, "cpu", "float32", CpuKernels())
    loaded = peak_mib()
    print(f"{path} ({path.stat().st_size / 2**20:.0f} MiB): peak RSS {imports:.0f} MiB after imports, "
          f"{converted:.0f} MiB after the conversion, {loaded:.0f} MiB after the load; resident weights "
          f"{resident_bytes(model) / 2**20:.0f} MiB (cache {cache}: delete it)")


if __name__ == "__main__":
    main()
