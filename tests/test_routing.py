"""Several models behind one server, and the router that picks one for model "auto".

The HTTP tests run three fake engines (test_server_api.FakeEngine: no model, fast), so 400 routed
requests cost a second or two; test_two_bundled_models_* runs `python -m server --config` with two
configurations of the bundled model.
"""
from __future__ import annotations

import re

import openai
import pytest
from aiohttp.test_utils import TestClient, TestServer

from server.app import ServerConfig, create_app
from server.gateway import GatewayConfig
from server.models import ModelEntry
from server.routing import CanarySplit, RouteRequest, Router, RoutingConfig, Rule, bucket
from test_server_api import FakeEngine

ROUTING = RoutingConfig(rules=[
    Rule("long-prompts", "large", min_prompt_tokens=200),
    Rule("pro-keys", "large", tiers=["pro"]),
    Rule("code", "large", metadata={"task": "code"}),
], canaries=[CanarySplit("small-canary", "small", "small-next", 0.2)])


# ---------------------------------------------------------------- the router alone
def test_rules_in_order_then_default():
    r = Router(ROUTING, "small")
    assert r.route(RouteRequest(prompt_tokens=500, sticky_id="u"))[1] == "long-prompts"
    assert r.route(RouteRequest(prompt_tokens=500, tier="pro", sticky_id="u")) == ("large", "long-prompts")
    assert r.route(RouteRequest(prompt_tokens=10, tier="pro", sticky_id="u")) == ("large", "pro-keys")
    assert r.route(RouteRequest(metadata={"task": "code"}, sticky_id="u")) == ("large", "code")
    assert r.route(RouteRequest(metadata={"task": "chat"}, sticky_id="u"))[0] in ("small", "small-next")
    # a rule whose model the caller may not use is passed over
    assert r.route(RouteRequest(prompt_tokens=500, sticky_id="u"), lambda m: m != "large")[1] != "long-prompts"


def test_canary_weight_and_stickiness():
    r = Router(ROUTING, "small")
    picks = {f"user:{i}": r.route(RouteRequest(sticky_id=f"user:{i}"))[0] for i in range(400)}
    share = sum(m == "small-next" for m in picks.values()) / 400
    assert abs(share - 0.2) <= 0.05, share
    for sticky, model in picks.items():  # the same user always lands on the same side
        assert r.route(RouteRequest(sticky_id=sticky))[0] == model
    # splits are independent: another split's name reshuffles who is diverted
    assert [bucket("a", s) < 0.5 for s in picks] != [bucket("b", s) < 0.5 for s in picks]


# ---------------------------------------------------------------- over HTTP, fake engines
async def start(routing: RoutingConfig = ROUTING, tiers: dict[str, str | None] | None = None,
                key_tiers: dict[str, str] | None = None) -> tuple[TestClient, dict[str, FakeEngine]]:
    engines = {"small": FakeEngine(step_delay=0.0), "large": FakeEngine(step_delay=0.0),
               "small-next": FakeEngine(step_delay=0.0)}
    tiers = tiers or {}
    entries = [ModelEntry(e, name, aliases=["big"] if name == "large" else [], tier=tiers.get(name))
               for name, e in engines.items()]
    cfg = ServerConfig(max_n=4, routing=routing, key_tiers=key_tiers or {},
                       gateway=GatewayConfig(api_keys=["free-key"] if key_tiers else []))
    client = TestClient(TestServer(create_app(entries, cfg)))
    await client.start_server()
    return client, engines


def chat(content: str = "hi", model: str = "auto", **kw) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 2, **kw}


async def test_short_prompt_small_long_prompt_large():
    client, engines = await start(RoutingConfig(rules=ROUTING.rules))
    try:
        r = await client.post("/v1/chat/completions", json=chat("hi"))
        assert r.status == 200 and r.headers["X-Route-Rule"] == "default"
        assert (await r.json())["model"] == "small"
        r = await client.post("/v1/completions", json={"model": "auto", "prompt": "x" * 210, "max_tokens": 2,
                                                       "stream": True})
        assert r.status == 200 and r.headers["X-Route-Rule"] == "long-prompts"
        assert '"model": "large"' in await r.text()
        r = await client.post("/v1/chat/completions", json=chat(metadata={"task": "code"}))
        assert (await r.json())["model"] == "large" and r.headers["X-Route-Rule"] == "code"
        # naming a model (or an alias) skips the router; the response names the model
        r = await client.post("/v1/chat/completions", json=chat("x" * 210, model="big"))
        assert (await r.json())["model"] == "large" and "X-Route-Rule" not in r.headers
        r = await client.post("/v1/chat/completions", json=chat(model="nope"))
        assert r.status == 404 and (await r.json())["error"]["code"] == "model_not_found"
        r = await client.post("/v1/chat/completions", json=chat(metadata={"task": 3}))
        assert r.status == 400 and (await r.json())["error"]["param"] == "metadata"

        ids = [m["id"] for m in (await (await client.get("/v1/models")).json())["data"]]
        assert ids == ["small", "large", "small-next", "auto"]
        card = await (await client.get("/v1/models/big")).json()
        assert card["id"] == "large" and card["aliases"] == ["big"]
        assert (await client.get("/v1/models/nope")).status == 404

        text = await (await client.get("/metrics")).text()
        assert 'pyengine_server:routed_requests_total{model_name="small",rule="default"} 1.0' in text
        assert 'pyengine_server:routed_requests_total{model_name="large",rule="long-prompts"} 1.0' in text
        assert ('pyengine_server:responses_total{model_name="large",path="/v1/chat/completions",status="200"} 2.0'
                in text)
        for name in engines:  # each engine's series, under its served name (all three call themselves fake-model)
            assert f'pyengine_server:kv_total_blocks{{model_name="{name}"}} 64.0' in text
        assert len(re.findall(r"^# TYPE pyengine_server:kv_total_blocks gauge$", text, re.M)) == 1
        stats = await (await client.get("/stats?model=large")).json()
        assert stats["model"] == "large" and stats["models"] == list(engines)
    finally:
        await client.close()


async def test_responses_api_is_routed_too():
    client, _ = await start(RoutingConfig(rules=ROUTING.rules))
    try:
        r = await client.post("/v1/responses", json={"model": "auto", "input": "hi", "max_output_tokens": 2,
                                                     "metadata": {"task": "code"}})
        assert r.status == 200 and r.headers["X-Route-Rule"] == "code"
        assert (await r.json())["model"] == "large"
        r = await client.post("/v1/responses", json={"model": "auto", "input": "x" * 210, "max_output_tokens": 2})
        assert r.status == 200 and r.headers["X-Route-Rule"] == "long-prompts"
        assert (await r.json())["model"] == "large"
        r = await client.post("/v1/responses", json={"model": "auto", "input": "hi", "max_output_tokens": 2})
        assert r.headers["X-Route-Rule"] == "default" and (await r.json())["model"] == "small"
    finally:
        await client.close()


async def test_canary_split_over_400_requests_sticky_per_user_and_conversation():
    client, _ = await start()
    try:
        served = {}
        for i in range(400):
            r = await client.post("/v1/chat/completions", json=chat(f"hello {i}", user=f"user-{i}", max_tokens=1))
            body = await r.json()
            served[i] = body["model"]
            assert r.headers["X-Route-Rule"] == ("small-canary" if body["model"] == "small-next" else "default")
        share = sum(m == "small-next" for m in served.values()) / 400
        assert abs(share - 0.2) <= 0.05, share
        for i in range(0, 400, 8):  # sticky per user, whatever the prompt
            r = await client.post("/v1/chat/completions", json=chat("again", user=f"user-{i}", max_tokens=1))
            assert (await r.json())["model"] == served[i]
        # sticky per conversation: one conversation, many users, one model
        seen = set()
        for i in range(20):
            r = await client.post("/v1/chat/completions", json=chat(
                user=f"other-{i}", metadata={"conversation_id": "conv-7"}, max_tokens=1))
            seen.add((await r.json())["model"])
        assert len(seen) == 1
        text = await (await client.get("/metrics")).text()
        canary = float(re.search(r'routed_requests_total\{model_name="small-next",rule="small-canary"\} (\S+)',
                                 text).group(1))
        assert canary >= sum(m == "small-next" for m in served.values())
    finally:
        await client.close()


async def test_key_tiers_reserve_a_model():
    routing = RoutingConfig(rules=[Rule("pro-keys", "large", tiers=["pro"]),
                                   Rule("long-prompts", "large", min_prompt_tokens=200)])
    client, _ = await start(routing, tiers={"large": "pro"}, key_tiers={"pro-key": "pro"})
    try:
        pro, free = {"Authorization": "Bearer pro-key"}, {"Authorization": "Bearer free-key"}
        r = await client.post("/v1/chat/completions", json=chat(), headers=pro)
        assert (await r.json())["model"] == "large" and r.headers["X-Route-Rule"] == "pro-keys"
        # a free key's long prompt may not reach the reserved model: the rule is passed over
        r = await client.post("/v1/chat/completions", json=chat("x" * 210), headers=free)
        assert (await r.json())["model"] == "small" and r.headers["X-Route-Rule"] == "default"
        r = await client.post("/v1/chat/completions", json=chat(model="large"), headers=free)
        assert r.status == 404 and "do not have access" in (await r.json())["error"]["message"]
        ids = [m["id"] for m in (await (await client.get("/v1/models", headers=free)).json())["data"]]
        assert "large" not in ids
        assert (await client.get("/v1/models/large", headers=pro)).status == 200
        assert (await client.post("/v1/chat/completions", json=chat(), headers={"Authorization": "Bearer x"})
                ).status == 401
    finally:
        await client.close()


def test_registry_refuses_bad_models():
    e = FakeEngine()
    with pytest.raises(ValueError, match="already claims the name 'a'"):
        create_app([ModelEntry(e, "a"), ModelEntry(FakeEngine(), "b", aliases=["a"])])
    with pytest.raises(ValueError, match="unknown model 'c'"):
        create_app([ModelEntry(e, "a")], ServerConfig(routing=RoutingConfig(rules=[Rule("r", "c")])))
