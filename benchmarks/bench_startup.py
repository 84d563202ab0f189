"""Start-up time and resident memory of `specstep serve` with default flags: the pretrained default (SmolLM2-135M,
8k context) and a 32k-context model (one that starts at its full context). No 32k checkpoint ships in a
package, so the second is random weights of Qwen2.5-0.5B's shape (494 M parameters, 24 layers, 14 query heads
over 2 KV heads, 32,768 positions, tied embeddings), saved once as safetensors under --work.

Each run starts a fresh server from a cold process, waits for its ready line, reads the scheduler process's
VmHWM / VmRSS (its peak and current resident set: the weights, the KV pools, what start-up allocated), answers
one short request, and stops. Models alternate in rounds; the table gives medians with the spread.

    python -m benchmarks.bench_startup [--rounds 2] [--work /tmp/specstep-bench-startup]
"""

from __future__ import annotations

import argparse
import asyncio
import re
import statistics
import time
from pathlib import Path

from specstep.loadgen.client import Client
from specstep.loadgen.server import ServerProcess
from specstep.scheduler.server.protocol import GenerateRequest

QWEN_0_5B = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                 num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                 tie_word_embeddings=True, rope_theta=1000000.0, rms_norm_eps=1e-6)


def qwen_shaped_checkpoint(folder: Path) -> Path:
    if (folder / "config.json").is_file():
        return folder
    import torch
    import transformers

    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**QWEN_0_5B)).eval()
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    return folder


def kib_field(pid: int, name: str) -> int:
    text = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(rf"^{name}:\s+(\d+) kB", text, re.M).group(1)) * 1024


async def one_run(args: list[str]) -> dict:
    srv = ServerProcess(args)
    t0 = time.monotonic()
    srv.start(timeout_s=900)
    ready_s = time.monotonic() - t0
    c = Client(srv.address)
    try:
        pid = (await c.stats()).engine.pid
        hwm, rss = kib_field(pid, "VmHWM"), kib_field(pid, "VmRSS")
        final = await c.complete(GenerateRequest("r", prompt_token_ids=[3, 1, 4, 1, 5], max_tokens=4,
                                                 temperature=0.0, ignore_eos=True), 300)
        assert len(final.token_ids) == 4
        ready = next((line for line in srv.log().splitlines() if "specstep serve: ready" in line), "")
        health = await c.health()
    finally:
        c.close()
        srv.stop()
    return dict(ready_s=ready_s, hwm=hwm, rss=rss, max_model_len=health.max_model_len, ready=ready)


def fmt(xs: list[float], unit: str) -> str:
    return f"{statistics.median(xs):.1f} {unit} ({min(xs):.1f}-{max(xs):.1f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--work", default="/tmp/specstep-bench-startup")
    a = ap.parse_args()
    qwen = qwen_shaped_checkpoint(Path(a.work) / "qwen2.5-0.5b-shape")
    settings = {"SmolLM2-135M (default)": [], "Qwen2.5-0.5B shape, 32k": ["--model", str(qwen)]}
    results: dict[str, list[dict]] = {k: [] for k in settings}
    for _ in range(a.rounds):
        for name, extra in settings.items():
            results[name].append(asyncio.run(one_run(["--device", "cpu", *extra])))
    print("| model | max_model_len | start-up to ready | peak RSS (VmHWM) | RSS when ready |")
    print("| --- | --- | --- | --- | --- |")
    for name, rs in results.items():
        print(f"| {name} | {rs[0]['max_model_len']:,} | {fmt([r['ready_s'] for r in rs], 's')} | "
              f"{fmt([r['hwm'] / 2**30 for r in rs], 'GiB')} | {fmt([r['rss'] / 2**30 for r in rs], 'GiB')} |")
    for name, rs in results.items():
        print(f"{name}: {rs[-1]['ready']}")


if __name__ == "__main__":
    main()
