"""The CPU counterpart of graph capture: each registered step compiled by `torch.compile` (inductor's C++
backend) per (step kind, batch bucket, q), behind the same interface as the CUDA graphs and the stand-in.

"Capture" compiles the step function for the key's static shapes (`dynamic=False`) and runs it once; "replay"
calls the compiled function on the same static inputs and copies its outputs into the static outputs captured
the first time, so callers read them exactly as on CUDA. Fused C++ kernels replace the ~40 small ops a layer
that eager dispatches one by one from Python. Linears stay oneDNN's prepacked kernel through a custom op
(`engine.models.onednn_op`) and attention's GEMMs stay MKL's batched GEMMs (extern calls), so batch invariance
holds; the elementwise and reduction kernels inductor generates sum each row in a fixed order whatever the
number of rows, provided no reduction is split across threads (`_configure` keeps them whole).

Each key gets its own code object (`_entry`), so dynamo keeps one cache entry per graph: no recompile limit is
hit and a replay checks one set of guards. Compiled artifacts are cached on disk per host (`cache_dir`: inductor's
FX graph cache and AOTAutograd's cache under the specstep cache), so a second start with the same model and
buckets loads kernels instead of compiling them; `CompiledBackend.describe` says how many came from the cache.
"""

from __future__ import annotations

import logging
import os
import platform
from collections.abc import Mapping
from pathlib import Path

import torch

from specstep.cuda_graphs.contract import GraphContractError, GraphKey, StepFn

log = logging.getLogger("specstep.graphs")


def specstep_cache_root() -> Path:
    """The root `engine.model_source.cache_root` names, restated because `cuda_graphs` imports nothing from the
    engine (tests/test_import_direction.py, which also keeps the two equal); a caller that knows the root passes
    it to `CompiledBackend` instead."""
    return Path(os.environ.get("SPECSTEP_CACHE") or Path.home() / ".cache" / "specstep")


def cache_dir(root: Path) -> Path:
    """Inductor's caches, per host: generated C++ is built for this CPU (its ISA) and this torch."""
    return root / f"inductor-{torch.__version__}-{platform.machine()}-{os.cpu_count()}"


def _configure(cache: Path) -> None:
    """Inductor settings the compiled steps rely on (process-wide: inductor has no per-compile scope for these)."""
    import torch._dynamo.config as dynamo_config
    import torch._inductor.config as inductor_config

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache)  # read by inductor at each compile
    inductor_config.fx_graph_cache = True
    # One entry per code object (see the module docstring); a replay never recompiles (`fail_on_recompile`).
    dynamo_config.cache_size_limit = max(dynamo_config.cache_size_limit, 64)
    # Batch invariance: a reduction split into per-thread partials sums a row in an order that follows the number
    # of rows (few rows -> split). Kept whole, every row is summed alike.
    inductor_config.split_reductions = False


def _entry(fn: StepFn, key: GraphKey):
    """A fresh function (own code object, so its own dynamo cache) calling fn(inputs, key)."""
    scope: dict = {"fn": fn, "key": key}
    exec(f"def step_{abs(hash(key))}(inputs):\n    return fn(inputs, key)\n", scope)  # noqa: S102
    return next(v for k, v in scope.items() if k.startswith("step_"))


class CompiledGraph:
    """One compiled step: `outputs` are static (the first run's), `replay()` recomputes them in place. A replay
    that would recompile (its guards failed: something the step read changed) runs the step eagerly instead,
    with one warning: recompiling inside a step would stall serving for minutes."""

    def __init__(self, compiled, fn: StepFn, inputs: Mapping[str, torch.Tensor], key: GraphKey) -> None:
        self.key = key
        self.inputs = dict(inputs)
        self._compiled = compiled
        self._fn = fn
        outs = self._run(compiled)
        # Static outputs of our own: the compiled function may return its internal buffers or views of inputs.
        self.outputs = {n: t.clone() for n, t in outs.items()}
        self.nbytes = sum(t.numel() * t.element_size() for t in self.outputs.values())

    def _run(self, compiled) -> dict[str, torch.Tensor]:
        outs = compiled(dict(self.inputs))
        if not isinstance(outs, Mapping) or not all(isinstance(t, torch.Tensor) for t in outs.values()):
            raise GraphContractError(f"step {self.key} must return a mapping of name -> tensor")
        return dict(outs)

    def replay(self) -> None:
        if self._compiled is None:
            outs = self._fn(dict(self.inputs), self.key)
        else:
            try:
                with torch.compiler.set_stance("fail_on_recompile"):
                    outs = self._run(self._compiled)
            except RuntimeError as e:
                if "recompil" not in str(e).lower():
                    raise
                log.warning("compiled step %s would recompile (%s); it runs eagerly from now on", self.key,
                            str(e).splitlines()[0][:200])
                self._compiled = None
                outs = self._fn(dict(self.inputs), self.key)
        for n, t in outs.items():
            self.outputs[n].copy_(t)


class CompiledBackend:
    """Compiles `CompiledGraph`s with inductor. A step that does not compile (or compiles into more than one
    graph: `fullgraph`) is skipped with one warning and runs eagerly; `describe()` says how many compiled steps
    came from the disk cache and how many failed."""

    name = "cpu-inductor"

    def __init__(self, cache_root: Path | None = None) -> None:
        self.cache_dir = cache_dir(cache_root or specstep_cache_root())
        _configure(self.cache_dir)
        self.compiled = 0
        self.cached = 0  # compiled steps whose kernels came from the FX graph cache on disk
        self.failed: list[GraphKey] = []

    @staticmethod
    def cache_hits() -> int:
        """Inductor's FX graph cache hits in this process (compiled graphs loaded from disk)."""
        from torch._dynamo.utils import counters

        return counters["inductor"]["fxgraph_cache_hit"]

    def warmup(self, fn: StepFn, inputs: Mapping[str, torch.Tensor], key: GraphKey, runs: int) -> None:
        # Lazily built state (attention's measured row padding, plans) exists before tracing, as before a capture.
        fn(dict(inputs), key)

    def capture(self, fn: StepFn, inputs: Mapping[str, torch.Tensor], key: GraphKey) -> CompiledGraph | None:
        hits = self.cache_hits()
        try:
            graph = CompiledGraph(torch.compile(_entry(fn, key), dynamic=False, fullgraph=True), fn, inputs, key)
        except Exception as e:  # noqa: BLE001 (any compiler failure: eager is the reference and the fallback)
            if not self.failed:
                log.warning("compiling step %s failed (%s: %s); it and any other step that fails runs eagerly",
                            key, type(e).__name__, str(e).strip().splitlines()[0][:300] if str(e).strip() else "")
            self.failed.append(key)
            return None
        self.compiled += 1
        self.cached += self.cache_hits() > hits
        return graph

    def describe(self) -> str:
        text = f"inductor C++, {self.cached} of {self.compiled} from the disk cache {self.cache_dir}"
        return text + (f"; {len(self.failed)} failed to compile, eager" if self.failed else "")
