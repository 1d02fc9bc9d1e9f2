"""What the server tells its operator: one access-log line and one request-log row per request,
server-side Prometheus series (responses, tokenize and stream stage times), a periodic stats line,
and a rolling window of samples for the /stats endpoint (and the web page).

Timestamps are time.perf_counter() values (the engine's clock too) until they are written out;
EPOCH_OFFSET turns them into Unix time.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import time
from typing import Any

import numpy as np
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Histogram

from pyengine.metrics import LABELS, LATENCY_BUCKETS
from pyengine.request_log import RequestLog, RequestRecord

access_log = logging.getLogger("server.access")
stats_log = logging.getLogger("server.stats")
EPOCH_OFFSET = time.time() - time.perf_counter()
_QUIET_PATHS = {"/metrics", "/stats", "/health"}  # polled: logged at DEBUG only


def _epoch(t: float | None) -> float | None:
    return None if t is None else round(t + EPOCH_OFFSET, 6)


def _diff(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else round(b - a, 6)


class Observer:
    def __init__(self, engine: Any, model: str, registry: CollectorRegistry, *,
                 request_log: RequestLog | None = None, stats_interval: float = 10.0,
                 window_s: float = 300.0) -> None:
        self.engine, self.model = engine, model
        self.request_log = request_log
        self.stats_interval = stats_interval
        self.responses = Counter("pyengine_server:responses", "HTTP responses by path and status (499: client left)",
                                 LABELS + ["path", "status"], registry=registry)
        self.tokenize_time = Histogram("pyengine:request_tokenize_time_seconds",
                                       "HTTP arrival to engine queue (chat template + tokenize)",
                                       LABELS, buckets=LATENCY_BUCKETS, registry=registry).labels(model)
        self.stream_time = Histogram("pyengine:request_stream_time_seconds",
                                     "Last token to response complete (detokenize + stream)",
                                     LABELS, buckets=LATENCY_BUCKETS, registry=registry).labels(model)
        self.window_s = window_s
        # SpeculativeConfig or None; engines that do not say (Ray replicas) show figures once they draft
        self.speculative = getattr(engine, "speculative", None) is not None
        self.samples: collections.deque[dict] = collections.deque(maxlen=int(window_s) + 1)
        self.latencies: collections.deque[tuple[float, float | None, float | None]] = collections.deque()
        self._last_line: dict | None = None

    # ---- per request --------------------------------------------------------------------------
    def finish(self, request: web.Request, status: int, start: float, job: Any | None, path: str) -> None:
        """Called by the middleware once the response is complete (status 499: the client left)."""
        end = time.perf_counter()
        self.responses.labels(self.model, path, str(status)).inc()
        rec = self._record(request, status, start, end, job) if job is not None else None
        if rec is not None:
            if rec.tokenize_s is not None:
                self.tokenize_time.observe(rec.tokenize_s)
            if rec.stream_s is not None and status == 200:
                self.stream_time.observe(rec.stream_s)
            if status == 200:
                ttft = None if rec.first_token_ts is None else rec.first_token_ts - rec.start_ts
                tpot = (rec.end_ts - rec.first_token_ts) / (rec.output_tokens - 1) \
                    if ttft is not None and rec.output_tokens > 1 else None
                self.latencies.append((end, ttft, tpot))
            if self.request_log is not None:
                self.request_log.write(rec)
        level = logging.DEBUG if request.path in _QUIET_PATHS else logging.INFO
        if access_log.isEnabledFor(level):
            extra = ""
            if rec is not None:
                ttft = "-" if rec.first_token_ts is None else f"{1e3 * (rec.first_token_ts - rec.start_ts):.0f}ms"
                disk = f" disk={rec.disk_cached_tokens}" if rec.disk_cached_tokens else ""  # of cached, from disk
                disk += f" host={rec.host_cached_tokens}" if rec.host_cached_tokens else ""  # from host memory
                extra = (f" model={rec.model} in={rec.input_tokens} out={rec.output_tokens} "
                         f"cached={rec.cached_tokens}{disk} ttft={ttft}")
            access_log.log(level, '%s "%s %s" %d%s e2e=%.0fms', request.remote, request.method, request.path,
                           status, extra, 1e3 * (end - start))

    def _record(self, request: web.Request, status: int, start: float, end: float, job: Any) -> RequestRecord:
        ms = list(job.metrics.values())
        queued = min((m.arrival_time for m in ms), default=None)
        scheduled = min((m.first_scheduled_time for m in ms if m.first_scheduled_time is not None), default=None)
        first = min((m.first_token_time for m in ms if m.first_token_time is not None), default=None)
        last = max((m.last_token_time for m in ms if m.last_token_time is not None), default=None)
        reasons = sorted({c.finish_reason for c in job.choices.values() if c.finish_reason})
        first_text = job.first_token_time if job.first_token_time is not None else first  # no text: the engine's
        usage = job.usage
        return RequestRecord(
            request_id=job.request_id, start_ts=_epoch(start), first_token_ts=_epoch(first_text),
            end_ts=_epoch(end), input_tokens=usage["prompt_tokens"], output_tokens=usage["completion_tokens"],
            queued_ts=_epoch(queued), scheduled_ts=_epoch(scheduled),
            cached_tokens=usage["prompt_tokens_details"]["cached_tokens"], model=self.model, status=status,
            finish_reason=",".join(reasons) or None, client_request_id=request.headers.get("X-Request-Id"),
            endpoint=request.path, tokenize_s=_diff(start, queued), queue_s=_diff(queued, scheduled),
            prefill_s=_diff(scheduled, first), decode_s=_diff(first, last),
            stream_s=_diff(last, end) if status == 200 else None,
            disk_cached_tokens=usage["prompt_tokens_details"].get("disk_cached_tokens", 0),
            host_cached_tokens=usage["prompt_tokens_details"].get("host_cached_tokens", 0),
            draft_tokens=sum(m.num_draft_tokens for m in ms), accepted_tokens=sum(m.num_accepted_tokens for m in ms))

    # ---- rolling stats ------------------------------------------------------------------------
    _SAMPLED = {"pyengine:prompt_tokens_total": "prompt_tokens",
                "pyengine:generation_tokens_total": "generation_tokens",
                "pyengine:num_requests_running": "running", "pyengine:num_requests_waiting": "waiting",
                "pyengine:kv_cache_usage_perc": "kv_usage", "pyengine:prefix_cache_queries_total": "prefix_queries",
                "pyengine:prefix_cache_hits_total": "prefix_hits", "pyengine:kv_disk_hit_tokens_total": "disk_hits",
                "pyengine:spec_decode_num_drafts_total": "spec_drafts",
                "pyengine:spec_decode_num_draft_tokens_total": "spec_draft_tokens",
                "pyengine:spec_decode_num_accepted_tokens_total": "spec_accepted_tokens"}

    def sample(self) -> dict:
        """Cumulative counters and gauges now (one pass over the engine's registry); rates are
        differences of two samples. Series of several engine replicas (server/ray.py) add up; the KV
        usage is the pooled one from engine.stats()."""
        out = {"t": time.time(), **{k: 0.0 for k in self._SAMPLED.values()}}
        for metric in self.engine.metrics.registry.collect():
            for s in metric.samples:
                key = self._SAMPLED.get(s.name)
                if key is not None and s.labels.get("model_name", self.engine.model_name) == self.engine.model_name:
                    out[key] += s.value
        out["kv_usage"] = self.engine.stats().kv_usage
        return out

    @staticmethod
    def rates(a: dict, b: dict) -> dict:
        dt = max(b["t"] - a["t"], 1e-9)
        q = b["prefix_queries"] - a["prefix_queries"]
        return {"t": b["t"], "prompt_tps": (b["prompt_tokens"] - a["prompt_tokens"]) / dt,
                "generation_tps": (b["generation_tokens"] - a["generation_tokens"]) / dt,
                "running": b["running"], "waiting": b["waiting"], "kv_usage": b["kv_usage"],
                "prefix_hit_rate": (b["prefix_hits"] - a["prefix_hits"]) / q if q else None,
                "disk_hit_rate": (b["disk_hits"] - a["disk_hits"]) / q if q else None}  # a part of prefix_hit_rate

    async def run(self, period: float = 1.0) -> None:
        """Sample every `period` seconds; log a stats line every stats_interval when anything moved."""
        self.samples.append(self.sample())
        self._last_line = self.samples[-1]
        while True:
            await asyncio.sleep(period)
            self.samples.append(self.sample())
            now = self.samples[-1]
            if self.stats_interval and now["t"] - self._last_line["t"] >= self.stats_interval:
                r = self.rates(self._last_line, now)
                if r["prompt_tps"] or r["generation_tps"] or r["running"] or r["waiting"]:
                    hit = "-" if r["prefix_hit_rate"] is None else f"{100 * r['prefix_hit_rate']:.1f}%"
                    stats_log.info("%s: prompt %.1f tok/s, generation %.1f tok/s, running %d, waiting %d "
                                   "requests, KV cache %.1f%%, prefix hit rate %s", self.model, r["prompt_tps"],
                                   r["generation_tps"], r["running"], r["waiting"], 100 * r["kv_usage"], hit)
                self._last_line = now

    def snapshot(self) -> dict:
        """The live panel's data: per-second rates over the window, and TTFT / TPOT percentiles of
        the requests that finished in it."""
        horizon = time.perf_counter() - self.window_s
        while self.latencies and self.latencies[0][0] < horizon:
            self.latencies.popleft()
        s = list(self.samples)
        series = [self.rates(a, b) for a, b in zip(s, s[1:])]
        lat = {}
        for i, name in ((1, "ttft"), (2, "tpot")):
            vals = [x[i] for x in self.latencies if x[i] is not None]
            lat[name] = {f"p{p}": float(np.percentile(vals, p)) if vals else None for p in (50, 95)}
        return {"model": self.model, "window_s": self.window_s, "series": series,
                "latency": lat, "requests": len(self.latencies),
                "spec": self.speculation(s[0], s[-1]) if s else None}

    def speculation(self, a: dict, b: dict) -> dict | None:
        """Speculative decoding between two samples (the window's first and last), from vLLM's spec_decode_*
        counters: None when speculation is off and nothing was ever drafted, so the page leaves it out. The
        mean accepted length is vLLM's mean acceptance length: tokens per verification, the bonus included."""
        if not self.speculative and not b["spec_draft_tokens"]:
            return None
        drafts = b["spec_drafts"] - a["spec_drafts"]
        drafted = b["spec_draft_tokens"] - a["spec_draft_tokens"]
        accepted = b["spec_accepted_tokens"] - a["spec_accepted_tokens"]
        return {"draft_tokens": drafted, "accepted_tokens": accepted,
                "acceptance_rate": accepted / drafted if drafted else None,
                "mean_accepted_length": 1 + accepted / drafts if drafts else None}

    def close(self) -> None:
        if self.request_log is not None:
            self.request_log.close()
