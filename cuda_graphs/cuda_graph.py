"""CUDA graphs behind the same interface as the CPU stand-in (`capture` -> object with `outputs`, `replay()`).

All graphs share one memory pool, and the runner captures the largest bucket first: smaller graphs then fit
in memory the larger ones already reserved. Warm-up runs on a side stream (as PyTorch's capture recipe asks),
so lazily built state (cuBLAS handles, autotuning, workspace) exists before capture.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from specstep.cuda_graphs.contract import GraphContractError, GraphKey, StepFn


class CudaGraph:
    def __init__(self, graph: torch.cuda.CUDAGraph, inputs: dict[str, torch.Tensor],
                 outputs: dict[str, torch.Tensor], key: GraphKey, nbytes: int) -> None:
        self._graph = graph
        self.inputs = inputs
        self.outputs = outputs
        self.key = key
        self.nbytes = nbytes  # device memory the capture took (pool growth + graph object), measured

    def replay(self) -> None:
        self._graph.replay()  # on the current stream: the caller's device stream


class CudaGraphBackend:
    name = "cuda"

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()
        self._side = torch.cuda.Stream(device=device)

    def warmup(self, fn: StepFn, inputs: Mapping[str, torch.Tensor], key: GraphKey, runs: int) -> None:
        self._side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._side):
            for _ in range(runs):
                fn(dict(inputs), key)
        torch.cuda.current_stream(self.device).wait_stream(self._side)

    def capture(self, fn: StepFn, inputs: Mapping[str, torch.Tensor], key: GraphKey) -> CudaGraph:
        torch.cuda.synchronize(self.device)
        free_before = torch.cuda.mem_get_info(self.device)[0]
        graph = torch.cuda.CUDAGraph()
        args = dict(inputs)
        with torch.cuda.graph(graph, pool=self.pool):
            outs = fn(args, key)
        torch.cuda.synchronize(self.device)
        if not isinstance(outs, Mapping):
            raise GraphContractError(f"step {key} must return a mapping of name -> tensor")
        nbytes = max(free_before - torch.cuda.mem_get_info(self.device)[0], 0)
        return CudaGraph(graph, dict(inputs), dict(outs), key, nbytes)
