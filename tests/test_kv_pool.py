"""The KV pool on CPU: zeroed (masked keys are multiplied by an exact zero weight and must be finite) and
committed lazily, so a pool costs resident memory as requests fill it, not at start-up (`kv_cache.zeros`).
Measured in a fresh process: in a long test session freed memory and huge pages blur RSS."""

from __future__ import annotations

import subprocess
import sys

PROBE = """
import re
from pathlib import Path
import torch
from specstep.engine.config import ModelConfig
from specstep.engine.kv_cache import KVPool
def rss():
    return int(re.search(r"^VmRSS:\\s+(\\d+) kB", Path("/proc/self/status").read_text(), re.M).group(1)) * 1024
cfg = ModelConfig(architecture="LlamaForCausalLM", vocab_size=64, hidden_size=128, intermediate_size=256,
                  num_layers=4, num_heads=4, num_kv_heads=2, head_dim=64, max_position_embeddings=8192)
before = rss()
pool = KVPool(cfg, num_layers=4, num_pages=65536, page_size=16, dtype=torch.bfloat16, device="cpu")
size = 65536 * pool.page_bytes
assert size == 2 << 30
assert rss() - before < size // 16, "allocating the pool wrote every page"
pool.k[0][:16].fill_(1.0)
assert rss() - before < size // 16
assert all(t.dtype == torch.bfloat16 and t.is_contiguous() for t in pool.k + pool.v)
assert not pool.v[3].any() and not pool.k[0][16:].any()
print("ok")
"""


def test_a_cpu_pool_is_zero_and_resident_only_where_written():
    r = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]
