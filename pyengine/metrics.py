"""Prometheus metrics of one engine, in its own CollectorRegistry (several engines per process,
e.g. in tests, never clash). Names follow vLLM's with a `pyengine:` prefix."""
from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pyengine.engine.request import Request

log = logging.getLogger("pyengine.requests")

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0, 160.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15,
                 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)


class EngineMetrics:
    def __init__(self, model_name: str = "") -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.running = Gauge("pyengine:num_requests_running", "Sequences in the running batch", registry=r)
        self.waiting = Gauge("pyengine:num_requests_waiting", "Sequences waiting (incl. preempted)", registry=r)
        self.kv_usage = Gauge("pyengine:kv_cache_usage_perc", "Fraction of KV blocks in use (0..1)", registry=r)
        self.prompt_tokens = Counter("pyengine:prompt_tokens", "Prompt tokens received", registry=r)
        self.generation_tokens = Counter("pyengine:generation_tokens", "Tokens generated", registry=r)
        self.prefix_queries = Counter("pyengine:prefix_cache_queries", "Prompt tokens looked up in the prefix cache", registry=r)
        self.prefix_hits = Counter("pyengine:prefix_cache_hits", "Prompt tokens found in the prefix cache", registry=r)
        self.preemptions = Counter("pyengine:num_preemptions", "Sequences preempted (recomputed later)", registry=r)
        self.finished = Counter("pyengine:request_success", "Finished sequences", ["finished_reason"], registry=r)
        self.ttft = Histogram("pyengine:time_to_first_token_seconds", "Arrival to first token", buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("pyengine:time_per_output_token_seconds", "(last - first token) / (n - 1)", buckets=_TPOT_BUCKETS, registry=r)
        self.e2e = Histogram("pyengine:e2e_request_latency_seconds", "Arrival to finish", buckets=_LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram("pyengine:request_queue_time_seconds", "Arrival to first scheduled", buckets=_LATENCY_BUCKETS, registry=r)
        self._last_queries = 0
        self._last_hits = 0
        self._last_preemptions = 0

    def on_step(self, num_running: int, num_waiting: int, kv_usage: float, num_generated: int,
                query_tokens: int, hit_tokens: int, num_preemptions: int) -> None:
        """Once per engine step; cumulative counters come in as totals and are added as deltas."""
        self.running.set(num_running)
        self.waiting.set(num_waiting)
        self.kv_usage.set(kv_usage)
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

    def on_added(self, num_prompt_tokens: int) -> None:
        self.prompt_tokens.inc(num_prompt_tokens)

    def on_first_token(self, req: Request) -> None:
        self.ttft.observe(req.first_token_time - req.arrival_time)

    def on_finished(self, req: Request) -> None:
        self.finished.labels(req.finish_reason).inc()
        if req.finished_time is not None:
            self.e2e.observe(req.finished_time - req.arrival_time)
        if req.first_scheduled_time is not None:
            self.queue_time.observe(req.first_scheduled_time - req.arrival_time)
        n = req.num_output_tokens
        if n > 1 and req.first_token_time is not None and req.last_token_time is not None:
            self.tpot.observe((req.last_token_time - req.first_token_time) / (n - 1))
        if log.isEnabledFor(logging.DEBUG):
            log.debug("request %s %s: prompt=%d cached=%d output=%d preempted=%d queue=%s ttft=%s e2e=%s",
                      req.request_id, req.finish_reason, req.num_prompt_tokens, req.num_cached_tokens, n,
                      req.num_preemptions, _ms(req.first_scheduled_time, req.arrival_time),
                      _ms(req.first_token_time, req.arrival_time), _ms(req.finished_time, req.arrival_time))


def _ms(t: float | None, t0: float) -> str:
    return "-" if t is None else f"{(t - t0) * 1e3:.1f}ms"
