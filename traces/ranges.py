"""One vocabulary of range names for every stage, used by NVTX, the trace recorder and the report.

Where each range goes (what `traces.report` relies on):
  * CPU threads (one track per thread): SCHEDULE .. SEND. Ranges on one track must nest properly.
  * the device track (DEVICE_TRACK): one top-level range per device step (PREFILL, DECODE, MIXED: a decode step
    and prompt chunks in one forward, or CATCH_UP: a proposer consuming the tokens it skipped while its refill
    was dropped), with args
    {"batch": B, "k": k} (and optionally "kind"), and the stages DRAFT .. REFILL nested inside it.
  * WAIT is the host sync on a step's accepted lengths; the report counts it per device step.
"""

from __future__ import annotations

# scheduler thread (CPU)
SCHEDULE = "schedule"  # admission, k choice, page reservation
BUILD_BATCH = "build_batch"  # host-side layout / sampling tensors for the next step
PLAN = "plan"  # attention-backend planning (FlashInfer plan() on CUDA)
COPY_TO_DEVICE = "copy_to_device"
PATCH = "patch"  # fix the prepared batch once the previous step's accepted lengths are known
WAIT = "wait_accepted"  # the host sync on a step's accepted lengths
PROCESS_OUTPUT = "process_output"  # append tokens, stop checks, stats
DETOKENIZE = "detokenize"
SEND = "send"
CAPTURE = "capture_graphs"  # start-up: CUDA graph capture (GraphRunner)
# device work (device track: the stream's worker thread on CPU, CUDA events on GPU)
PREFILL = "prefill"
DECODE = "decode"
MIXED = "mixed"
DRAFT = "draft"
VERIFY = "verify"
ACCEPT = "accept"
REFILL = "refill"
CATCH_UP = "catch_up"

CPU_PREP = (SCHEDULE, BUILD_BATCH, PLAN, COPY_TO_DEVICE, PATCH)
DEVICE_STEPS = (PREFILL, DECODE, MIXED, CATCH_UP)
DEVICE_STAGES = (DRAFT, VERIFY, ACCEPT, REFILL)
DEVICE_TRACK = "device"
