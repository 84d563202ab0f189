"""Server metrics for operators: Prometheus counters, histograms and gauges on the frontend.

Every metric, its labels and what it counts: docs/metrics.md (keep the two in step). Names follow the field's
conventions (vLLM's spec-decode counters, `_total` counters, `_seconds` units). The token and speculation counters
are fed by every engine output as the frontend reads it (`observe_engine_output`), in the order the scheduler sent
it, so at any instant with nothing in flight they equal the scheduler's own totals in EngineStats (a STATS reply
is read after every output the scheduler sent before it); requests are counted by their FINALs and errors by every
ERROR sent; histograms from each request's outputs; gauges from the scheduler's stats (polled each second). The
same figures are in the `stats` protocol message (`snapshot()`).
"""

from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, start_http_server

from specstep.scheduler.server.protocol import EngineOutput, EngineStats, ErrorCode, Final

log = logging.getLogger("specstep.metrics")

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24)


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("specstep_requests", "Requests ended with a FINAL, by finish reason",
                                ["finish_reason"], registry=r)
        self.errors = Counter("specstep_errors", "ERROR replies sent, by code name", ["code"], registry=r)
        self.prompt_tokens = Counter("specstep_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("specstep_generation_tokens", "Output tokens the scheduler sent",
                                         registry=r)
        self.drafts = Counter("specstep_spec_decode_num_drafts", "(request, decode step) pairs with drafts",
                              registry=r)
        self.draft_tokens = Counter("specstep_spec_decode_num_draft_tokens", "Drafted tokens", registry=r)
        self.accepted_tokens = Counter("specstep_spec_decode_num_accepted_tokens", "Accepted drafts", registry=r)
        self.accepted_per_pos = Counter("specstep_spec_decode_num_accepted_tokens_per_pos",
                                        "Accepted drafts by draft position", ["position"], registry=r)
        self.ttft = Histogram("specstep_time_to_first_token_seconds", "Time to first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("specstep_inter_token_latency_seconds",
                             "Time between a request's consecutive token-carrying step outputs (stream or not)",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.tokens_per_step = Histogram("specstep_spec_decode_tokens_per_step",
                                         "Tokens a request received per decode step (1 + accepted drafts)",
                                         buckets=tuple(range(1, 18)), registry=r)
        self.running = Gauge("specstep_num_requests_running", "Running requests", registry=r)
        self.waiting = Gauge("specstep_num_requests_waiting", "Waiting requests", registry=r)
        self.pages_used = Gauge("specstep_kv_pages_used", "KV pages in use", registry=r)
        self.pages_total = Gauge("specstep_kv_pages_total", "Usable KV pages", registry=r)
        self.k = Gauge("specstep_spec_decode_k", "Requests per chosen k at the last decode step", ["k"], registry=r)
        self._k_seen: set[str] = set()
        self.governor_on = Gauge("specstep_spec_governor_on", "1 while the governor allows speculation, 0 while off",
                                 registry=r)
        self.governor_ratio = Gauge("specstep_spec_governor_ratio",
                                    "Realised speculative / plain throughput in the governor's window", registry=r)
        self.governor_switches = Gauge("specstep_spec_governor_switches", "Governor on/off transitions", registry=r)
        self.requests_off = Gauge("specstep_spec_requests_off",
                                  "Policy-chosen requests drafting nothing at the last decode step", registry=r)
        self.decisions = Gauge("specstep_spec_decisions", "Speculation decisions so far, by reason", ["reason"],
                               registry=r)
        self._reasons_seen: set[str] = set()
        self.tp_size = Gauge("specstep_tensor_parallel_size", "Ranks of the engine's tensor-parallel group",
                             registry=r)
        self.prefill_budget = Gauge("specstep_prefill_budget_tokens", "Prompt tokens a step takes at context 0 "
                                    "beside the running streams (chunked prefill)", registry=r)
        self.itl_target = Gauge("specstep_prefill_itl_target_seconds", "Longest gap a mixed step is planned to "
                                "give the running streams", registry=r)
        self.prefill_efficient = Gauge("specstep_prefill_efficient_tokens", "Compute-efficient prompt forward, "
                                       "tokens", registry=r)
        self.mixed_share = Gauge("specstep_mixed_step_share", "Share of steps that mixed decode rows and prompt "
                                 "chunks", registry=r)

    # ---- feeding -------------------------------------------------------------------------------------------
    def observe_engine_output(self, out: EngineOutput) -> None:
        """One output as the scheduler sent it (whether or not its request is still open in the frontend: the
        steps the scheduler ran after a stop string or an abort count as they do in its EngineStats)."""
        self.generation_tokens.inc(len(out.token_ids))
        if out.num_draft <= 0:
            return
        self.drafts.inc()
        self.draft_tokens.inc(out.num_draft)
        self.accepted_tokens.inc(out.num_accepted)
        for pos in range(min(out.num_accepted, out.num_draft)):
            self.accepted_per_pos.labels(str(pos)).inc()

    def observe_step_output(self, num_tokens: int, gap_s: float | None, first: bool) -> None:
        """One engine output for one request (one step): tokens it brought and the time since the previous one."""
        if num_tokens <= 0:
            return
        if not first:
            self.tokens_per_step.observe(num_tokens)
            if gap_s is not None:
                self.itl.observe(gap_s)

    def observe_error(self, code: int) -> None:
        name = ErrorCode(code).name if code in ErrorCode._value2member_map_ else str(code)
        self.errors.labels(name).inc()

    def observe_final(self, final: Final) -> None:
        self.requests.labels(final.finish_reason).inc()
        self.prompt_tokens.inc(final.usage.prompt_tokens)
        if final.timings.ttft_s > 0:
            self.ttft.observe(final.timings.ttft_s)

    def update_engine(self, stats: EngineStats | None) -> None:
        if stats is None:
            return
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.pages_used.set(stats.num_usable_pages - stats.num_free_pages)
        self.pages_total.set(stats.num_usable_pages)
        current = {str(k): n for k, n in stats.k_distribution.items()}
        for k in self._k_seen | current.keys():
            self.k.labels(k).set(current.get(k, 0))
        self._k_seen |= current.keys()
        self.governor_on.set(1.0 if stats.spec_governor in ("on", "disabled") else 0.0)
        self.governor_ratio.set(stats.spec_governor_ratio)
        self.governor_switches.set(stats.spec_governor_switches)
        self.requests_off.set(stats.spec_requests_off)
        self.tp_size.set(stats.tensor_parallel_size)
        self.prefill_budget.set(stats.prefill_budget_tokens)
        self.itl_target.set(stats.prefill_itl_target_ms / 1e3)
        self.prefill_efficient.set(stats.prefill_efficient_tokens)
        self.mixed_share.set(stats.mixed_step_share)
        # A restarted scheduler counts from zero: reasons it has not reported yet are 0, not the old count.
        for reason in self._reasons_seen | stats.spec_decisions.keys():
            self.decisions.labels(reason).set(stats.spec_decisions.get(reason, 0))
        self._reasons_seen |= stats.spec_decisions.keys()

    # ---- reading -------------------------------------------------------------------------------------------
    def snapshot(self) -> dict[str, float]:
        """Every sample as name{labels} -> value (the stats message carries this)."""
        out: dict[str, float] = {}
        for family in self.registry.collect():
            for s in family.samples:
                if s.name.endswith("_created"):
                    continue
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
                out[f"{s.name}{{{labels}}}" if labels else s.name] = float(s.value)
        return out

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

    def serve_http(self, port: int, addr: str = "127.0.0.1") -> int | None:
        """Serve /metrics on (addr, port); port 0 picks a free one. Returns the port, or None if it is taken."""
        try:
            server, _ = start_http_server(port, addr=addr, registry=self.registry)
        except OSError as e:
            log.warning("metrics endpoint on %s:%d not started: %s", addr, port, e)
            return None
        return server.server_port
