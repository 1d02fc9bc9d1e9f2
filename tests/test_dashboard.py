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
