"""Prometheus metrics of one engine, in its own CollectorRegistry (several engines per process,
e.g. in tests, never clash). Names and labels follow vLLM's (`vllm:` -> `pyengine:`), so a vLLM
Grafana dashboard works after renaming the prefix; every series carries `model_name`.

Counting rules: a user request with n > 1 counts once for its prompt tokens and in the running /
waiting gauges; per-sequence latencies (TTFT, e2e, ...) are observed per sequence, as vLLM does.
"""
from __future__ import annotations

import logging
from typing import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pyengine.engine.request import Request, RequestStatus

log = logging.getLogger("pyengine.requests")

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                   7.5, 10.0, 20.0, 40.0, 80.0, 160.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15,
                 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
LABELS = ["model_name"]


def count_requests(groups: Iterable) -> tuple[int, int]:
    """(running, waiting) in user requests: running when any child sequence is in the batch."""
    running = waiting = 0
    for g in groups:
        if any(c.status == RequestStatus.RUNNING for c in g.children):
            running += 1
        elif not all(c.finished for c in g.children):
            waiting += 1
    return running, waiting


class EngineMetrics:
    def __init__(self, model_name: str = "") -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()

        def metric(cls, name: str, doc: str, extra: list[str] | None = None, **kw):
            m = cls(f"pyengine:{name}", doc, LABELS + (extra or []), registry=self.registry, **kw)
            return m if extra else m.labels(model_name)

        def hist(name: str, doc: str, buckets=LATENCY_BUCKETS):
            return metric(Histogram, name, doc, buckets=buckets)

        self.running = metric(Gauge, "num_requests_running", "Requests with a sequence in the running batch")
        self.waiting = metric(Gauge, "num_requests_waiting", "Requests waiting to be scheduled (incl. preempted)")
        self.kv_usage = metric(Gauge, "kv_cache_usage_perc", "Fraction of KV blocks in use (0..1)")
        self.prompt_tokens = metric(Counter, "prompt_tokens", "Prompt tokens received (once per request)")
        self.generation_tokens = metric(Counter, "generation_tokens", "Tokens generated")
        self.prefix_queries = metric(Counter, "prefix_cache_queries", "Prompt tokens looked up in the prefix cache")
        self.prefix_hits = metric(Counter, "prefix_cache_hits", "Prompt tokens found in the prefix cache")
        self.preemptions = metric(Counter, "num_preemptions", "Sequences preempted (recomputed later)")
        self.interrupted_steps = metric(Counter, "num_interrupted_steps",
                                        "Lone prompt chunks stopped for a newcomer (computed again later)")
        self._finished = metric(Counter, "request_success", "Finished sequences", ["finished_reason"])
        # speculative decoding (vLLM's spec_decode_* series)
        self.spec_drafts = metric(Counter, "spec_decode_num_drafts", "Verifications of at least one draft token")
        self.spec_draft_tokens = metric(Counter, "spec_decode_num_draft_tokens", "Draft tokens verified")
        self.spec_accepted_tokens = metric(Counter, "spec_decode_num_accepted_tokens", "Draft tokens accepted")
        self._spec_accepted_per_pos = metric(Counter, "spec_decode_num_accepted_tokens_per_pos",
                                             "Draft tokens accepted at each draft position (0: the first)",
                                             ["position"])
        self.ttft = hist("time_to_first_token_seconds", "Arrival to first token")
        self.itl = hist("inter_token_latency_seconds", "Time between two tokens of a sequence (one per gap)",
                        _TPOT_BUCKETS)
        self.tpot = hist("request_time_per_output_token_seconds", "(last - first token) / (n - 1) per sequence",
                         _TPOT_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "Arrival to finish")
        self.queue_time = hist("request_queue_time_seconds", "Arrival to first scheduled")
        self.prefill_time = hist("request_prefill_time_seconds", "First scheduled to first token")
        self.decode_time = hist("request_decode_time_seconds", "First token to finish")
        self.inference_time = hist("request_inference_time_seconds", "First scheduled to finish")
        self.request_prompt_tokens = hist("request_prompt_tokens", "Prompt tokens per request", _TOKEN_BUCKETS)
        self.request_generation_tokens = hist("request_generation_tokens",
                                              "Generated tokens per request (all n sequences)", _TOKEN_BUCKETS)
        # Names vLLM's dashboards also query: vLLM's older names for two of the above, the tokens of
        # each engine step, the request parameters and the longest sequence of a request.
        self.time_per_output_token = hist("time_per_output_token_seconds",
                                          "Time between two tokens of a sequence (vLLM's older name of "
                                          "inter_token_latency_seconds)", _TPOT_BUCKETS)
        self.gpu_cache_usage = metric(Gauge, "gpu_cache_usage_perc",
                                      "Fraction of KV blocks in use (vLLM's older name of kv_cache_usage_perc)")
        self.iteration_tokens = hist("iteration_tokens_total", "Tokens computed in one engine step",
                                     _TOKEN_BUCKETS)
        self.params_n = hist("request_params_n", "The n of each request", (1, 2, 5, 10, 20))
        self.params_max_tokens = hist("request_params_max_tokens", "The max_tokens of each request", _TOKEN_BUCKETS)
        self.max_num_generation_tokens = hist("request_max_num_generation_tokens",
                                              "Tokens of the longest sequence of each request", _TOKEN_BUCKETS)
        # The tiers under the prefix cache (engine/kv_tiers.py), host memory and disk; prefix_cache_hits counts
        # their tokens too, once they are back in the pool.
        self.kv_host_hit_tokens = metric(Counter, "kv_host_hit_tokens",
                                         "Prompt tokens read back from the host-memory tier instead of computed")
        self.kv_host_usage = metric(Gauge, "kv_host_usage_bytes", "Bytes the host-memory tier holds")
        self.kv_host_spilled = metric(Counter, "kv_host_spilled_blocks",
                                      "Blocks the host-memory tier evicted and wrote down to the disk tier")
        self.kv_disk_hit_tokens = metric(Counter, "kv_disk_hit_tokens",
                                         "Prompt tokens read back from the disk tier instead of computed")
        self.kv_disk_read_bytes = metric(Counter, "kv_disk_read_bytes", "Bytes read from the disk tier")
        self.kv_disk_written_bytes = metric(Counter, "kv_disk_written_bytes", "Bytes written to the disk tier")
        self.kv_disk_usage = metric(Gauge, "kv_disk_usage_bytes", "Bytes the disk tier holds")
        self.kv_disk_failures = metric(
            Counter, "kv_disk_failures", "Disk tier faults that cost a recompute, by kind: blocks not stored "
            "(dropped_write: write queue full; write_error) or found damaged (bad_file); requests whose read was "
            "too slow or failed (read_timeout) or whose loaded blocks found no room in time (no_turn)", ["kind"])
        self._kv_last: dict[str, int] = {}
        self._last_queries = 0
        self._last_hits = 0
        self._last_preemptions = 0

    def on_step(self, num_running: int, num_waiting: int, kv_usage: float, num_generated: int,
                query_tokens: int, hit_tokens: int, num_preemptions: int) -> None:
        """Once per engine step; running / waiting are in requests; cumulative counters come in as
        totals and are added as deltas."""
        self.running.set(num_running)
        self.waiting.set(num_waiting)
        self.kv_usage.set(kv_usage)
        self.gpu_cache_usage.set(kv_usage)
        if num_generated:
            self.generation_tokens.inc(num_generated)
        if query_tokens != self._last_queries:
            self.prefix_queries.inc(query_tokens - self._last_queries)
            self._last_queries = query_tokens
        if hit_tokens != self._last_hits:
            self.prefix_hits.inc(hit_tokens - self._last_hits)
            self._last_hits = hit_tokens
        if num_preemptions != self._last_preemptions:
            self.preemptions.inc(num_preemptions - self._last_preemptions)
            self._last_preemptions = num_preemptions

    def on_kv_tier(self, tier, disk, host) -> None:
        """Once per step with a KV tier: its TierStats and its stores, the DiskKVStore and the HostKVStore (either
        may be None); their counters are totals, added as deltas."""
        totals = {"hit_tokens": tier.hit_tokens - tier.host_hit_tokens, "host_hit_tokens": tier.host_hit_tokens,
                  "dropped_write": tier.dropped_writes, "read_timeout": tier.read_timeouts + tier.read_errors,
                  "no_turn": tier.gave_up}
        if disk is not None:
            self.kv_disk_usage.set(disk.stats.bytes_used)
            totals.update(read=disk.stats.bytes_read, written=disk.stats.bytes_written,
                          write_error=disk.stats.write_errors, bad_file=disk.stats.bad_files)
        if host is not None:
            self.kv_host_usage.set(host.stats.bytes_used)
            totals["spilled"] = host.stats.spilled
        counters = {"hit_tokens": self.kv_disk_hit_tokens, "read": self.kv_disk_read_bytes,
                    "written": self.kv_disk_written_bytes, "host_hit_tokens": self.kv_host_hit_tokens,
                    "spilled": self.kv_host_spilled}
        for name, total in totals.items():
            delta = total - self._kv_last.get(name, 0)
            if delta:
                counter = counters.get(name) or self.kv_disk_failures.labels(self.model_name, name)
                counter.inc(delta)
                self._kv_last[name] = total

    def on_spec_verified(self, num_draft_tokens: int, num_accepted: int) -> None:
        """A request's drafts were verified: the first num_accepted of its num_draft_tokens were kept."""
        self.spec_drafts.inc()
        self.spec_draft_tokens.inc(num_draft_tokens)
        if num_accepted:
            self.spec_accepted_tokens.inc(num_accepted)
            for pos in range(num_accepted):
                self._spec_accepted_per_pos.labels(self.model_name, str(pos)).inc()

    def on_added(self, num_prompt_tokens: int, params=None) -> None:
        """Once per user request, whatever its n; params: its SamplingParams."""
        self.prompt_tokens.inc(num_prompt_tokens)
        self.request_prompt_tokens.observe(num_prompt_tokens)
        if params is not None:
            self.params_n.observe(params.n)
            if params.max_tokens is not None:
                self.params_max_tokens.observe(params.max_tokens)

    def on_token(self, req: Request, now: float) -> None:
        """A sequence got a token at `now` (before req.*_token_time are updated)."""
        if req.first_token_time is None:
            self.ttft.observe(now - req.arrival_time)
        else:
            self.itl.observe(now - req.last_token_time)
            self.time_per_output_token.observe(now - req.last_token_time)

    def on_finished(self, req: Request) -> None:
        self._finished.labels(self.model_name, req.finish_reason).inc()
        t = req.finished_time
        if t is not None:
            self.e2e.observe(t - req.arrival_time)
        if req.first_scheduled_time is not None:
            self.queue_time.observe(req.first_scheduled_time - req.arrival_time)
            if req.first_token_time is not None:
                self.prefill_time.observe(req.first_token_time - req.first_scheduled_time)
            if t is not None:
                self.inference_time.observe(t - req.first_scheduled_time)
        if req.first_token_time is not None and t is not None:
            self.decode_time.observe(t - req.first_token_time)
        n = req.num_output_tokens
        if n > 1 and req.first_token_time is not None and req.last_token_time is not None:
            self.tpot.observe((req.last_token_time - req.first_token_time) / (n - 1))
        if log.isEnabledFor(logging.DEBUG):
            log.debug("request %s %s: prompt=%d cached=%d output=%d preempted=%d queue=%s ttft=%s e2e=%s",
                      req.request_id, req.finish_reason, req.num_prompt_tokens, req.num_cached_tokens, n,
                      req.num_preemptions, _ms(req.first_scheduled_time, req.arrival_time),
                      _ms(req.first_token_time, req.arrival_time), _ms(req.finished_time, req.arrival_time))

    def on_request_finished(self, children: list[Request]) -> None:
        """Once per user request, when its last sequence finished."""
        self.request_generation_tokens.observe(sum(c.num_output_tokens for c in children))
        self.max_num_generation_tokens.observe(max((c.num_output_tokens for c in children), default=0))


def _ms(t: float | None, t0: float) -> str:
    return "-" if t is None else f"{(t - t0) * 1e3:.1f}ms"
