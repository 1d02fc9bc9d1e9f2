"""The HTTP layer over the real AsyncLLM driving the PagedEcho stand-in model (tests/engine_fakes.py):
the real scheduler, block pool, detokenizer, abort path and metrics, without model weights."""
from __future__ import annotations

import asyncio
import json
import re

import pytest
from aiohttp.test_utils import TestClient, TestServer

from engine_fakes import FakeTokenizer, fake_engine, reference
from pyengine.engine.async_engine import AsyncLLM
from server.app import ServerConfig, create_app
from server.gateway import GatewayConfig


async def start(kv_tokens: int = 4096, **gw) -> tuple[TestClient, AsyncLLM]:
    llm = AsyncLLM(engine=fake_engine(kv_tokens=kv_tokens, max_num_batched_tokens=256))
    app = create_app(llm, ServerConfig(gateway=GatewayConfig(**gw)))
    client = TestClient(TestServer(app, handler_cancellation=True))
    await client.start_server()  # starts the engine's step thread too
    return client, llm


@pytest.fixture
async def served():
    client, llm = await start()
    yield client, llm
    await client.close()


async def wait_idle(client: TestClient) -> dict:
    for _ in range(200):
        s = (await (await client.get("/stats")).json())["engine"]
        if s["num_running"] == s["num_waiting"] == 0 and s["num_free_blocks"] == s["num_total_blocks"]:
            return s
        await asyncio.sleep(0.02)
    raise AssertionError(f"engine not idle: {s}")


async def test_completion_matches_engine_reference(served):
    client, llm = served
    r = await client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 6, "n": 2,
                                                   "ignore_eos": True, "temperature": 0})
    body = await r.json()
    prompt = FakeTokenizer().encode("hello")
    want = FakeTokenizer().decode(reference(prompt, 6))
    assert [c["text"] for c in body["choices"]] == [want, want]
    assert body["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": 12,
                             "total_tokens": len(prompt) + 12}


async def test_32_streams_a_third_disconnect(served):
    client, llm = served

    async def one(i: int) -> str | None:
        r = await client.post("/v1/completions", json={"prompt": f"story {i}", "max_tokens": 30,
                                                       "ignore_eos": True, "stream": True, "seed": i})
        assert r.status == 200
        finish, seen = None, 0
        async for line in r.content:
            if not line.startswith(b"data: "):
                continue
            if line.strip() == b"data: [DONE]":
                return finish
            seen += 1
            finish = json.loads(line[6:])["choices"][0]["finish_reason"] or finish
            if i % 3 == 0 and seen == 3:
                r.close()
                return "left"
        return None

    results = await asyncio.gather(*(one(i) for i in range(32)))
    assert results.count("left") == 11
    assert all(r == "length" for i, r in enumerate(results) if i % 3)
    await wait_idle(client)
    metrics = await (await client.get("/metrics")).text()
    assert re.search(r"^pyengine:num_requests_running 0\.0$", metrics, re.M)
    assert re.search(r"^pyengine_server:engine_requests_running 0\.0$", metrics, re.M)


async def test_prompt_beyond_kv_pool_is_400():
    client, llm = await start(kv_tokens=64)
    try:
        r = await client.post("/v1/completions", json={"prompt": "x" * 100, "max_tokens": 1})
        err = (await r.json())["error"]
        assert r.status == 400 and "maximum context length is 64 tokens" in err["message"]  # = the pool
        r = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert r.status == 200
    finally:
        await client.close()


async def test_timeout_aborts_in_engine():
    client, llm = await start(request_timeout=0.3)
    try:
        # No max_tokens: the rest of the 4096-token window, far beyond 0.3 s.
        r = await client.post("/v1/completions", json={"prompt": "x", "ignore_eos": True})
        assert r.status == 504 and (await r.json())["error"]["code"] == "request_timeout"
        await wait_idle(client)
    finally:
        await client.close()
