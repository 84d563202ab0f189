"""GraphRunner: capture / replay per (step kind, batch bucket, tokens per request); the CPU stand-in.

    contract.py     the step-function contract (static inputs, static outputs) and its types
    runner.py       GraphRunner: buckets, static buffers, capture largest-first, replay, eager fallback
    buckets.py      bucket choice under a graph-memory budget
    cuda_graph.py   CUDA graphs (one shared pool)
    cpu_standin.py  the CPU stand-in that checks the contract
"""

from specstep.cuda_graphs.contract import BufferSpec, GraphContractError, GraphKey, StepKind
from specstep.cuda_graphs.runner import CaptureInfo, GraphConfig, GraphRunner

__all__ = ["BufferSpec", "CaptureInfo", "GraphConfig", "GraphContractError", "GraphKey", "GraphRunner", "StepKind"]
