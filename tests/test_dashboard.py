"""dashboards/grafana_pyengine.json queries only series the server exports (after one request, over
the PagedEcho stand-in engine), filtered by the model_name variable they all carry."""
from __future__ import annotations

import json
import os
import re

from aiohttp.test_utils import TestClient, TestServer

from engine_fakes import fake_engine
from pyengine.engine.async_engine import AsyncLLM
from server.app import create_app

DASHBOARD = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "dashboards",
                         "grafana_pyengine.json")


def queries(dash: dict) -> list[str]:
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    exprs += [v["query"]["query"] for v in dash["templating"]["list"] if isinstance(v.get("query"), dict)]
    return exprs


async def test_every_dashboard_query_names_an_exported_metric():
    llm = AsyncLLM(engine=fake_engine())
    client = TestClient(TestServer(create_app(llm)))
    await client.start_server()
    try:
        r = await client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 4, "temperature": 0})
        assert r.status == 200
        text = await (await client.get("/metrics")).text()
    finally:
        await client.close()
    exported = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}
    with open(DASHBOARD) as f:
        dash = json.load(f)
    exprs = queries(dash)
    assert len(exprs) >= 12
    used = set()
    for e in exprs:
        names = re.findall(r"pyengine(?:_server)?:[a-zA-Z0-9_]+", e)
        assert names, e
        used.update(names)
        if "label_values" not in e:
            assert 'model_name=~"$model_name"' in e, e
    missing = sorted(used - exported)
    assert not missing, missing
    for must in ("time_to_first_token_seconds_bucket", "inter_token_latency_seconds_bucket",
                 "num_requests_running", "kv_cache_usage_perc", "prefix_cache_hits_total"):
        assert f"pyengine:{must}" in used


# The series vLLM's example Grafana dashboard (examples/online_serving/prometheus_grafana/grafana.json
# in vLLM's repository) queries, and those vLLM dashboards built on its metrics docs look for.
VLLM_DASHBOARD_SERIES = [
    "vllm:e2e_request_latency_seconds_bucket", "vllm:e2e_request_latency_seconds_sum",
    "vllm:e2e_request_latency_seconds_count", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
    "vllm:time_per_output_token_seconds_bucket", "vllm:time_per_output_token_seconds_sum",
    "vllm:time_per_output_token_seconds_count", "vllm:num_requests_running", "vllm:num_requests_waiting",
    "vllm:time_to_first_token_seconds_bucket", "vllm:time_to_first_token_seconds_sum",
    "vllm:time_to_first_token_seconds_count", "vllm:gpu_cache_usage_perc", "vllm:request_prompt_tokens_bucket",
    "vllm:request_generation_tokens_bucket", "vllm:request_success_total", "vllm:request_queue_time_seconds_sum",
    "vllm:request_prefill_time_seconds_sum", "vllm:request_decode_time_seconds_sum",
    "vllm:request_max_num_generation_tokens_sum", "vllm:iteration_tokens_total_bucket",
    "vllm:request_params_n_bucket", "vllm:request_params_max_tokens_bucket", "vllm:kv_cache_usage_perc",
    "vllm:inter_token_latency_seconds_bucket",
]


async def test_vllm_prefix_exports_what_vllms_dashboard_queries():
    from server.app import ServerConfig

    llm = AsyncLLM(engine=fake_engine())
    client = TestClient(TestServer(create_app(llm, ServerConfig(metrics_prefix="vllm"))))
    await client.start_server()
    try:
        r = await client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 4, "temperature": 0, "n": 2})
        assert r.status == 200
        text = await (await client.get("/metrics")).text()
    finally:
        await client.close()
    exported = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}
    assert not sorted(set(VLLM_DASHBOARD_SERIES) - exported)
    assert not [n for n in exported if n.startswith("pyengine:")]  # every engine series renamed
    assert "pyengine_server:requests_in_flight" in exported  # the server's own keep their names
    assert 'vllm:request_params_n_count{model_name=' in text and 'vllm:request_params_n_sum{model_name="' in text
    sums = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith(("vllm:request_params_n_sum", "vllm:request_max_num_generation_tokens_sum"))}
    assert sums == {"vllm:request_params_n_sum": 2.0, "vllm:request_max_num_generation_tokens_sum": 4.0}
