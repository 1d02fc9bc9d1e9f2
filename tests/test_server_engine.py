"""The HTTP layer over the real AsyncLLM driving the PagedEcho stand-in model (tests/engine_fakes.py):
the real scheduler, block pool, detokenizer, abort path and metrics, without model weights."""
from __future__ import annotations

import asyncio
import gc
import json
import re
import time

import aiohttp
import pytest
from aiohttp.test_utils import TestClient, TestServer

from engine_fakes import FakeTokenizer, fake_engine, reference
from pyengine.engine.async_engine import AsyncLLM
from pyengine.engine.engine import Engine
from server.app import STATIC_DIR, ServerConfig, create_app
from server.gateway import GatewayConfig


async def start(kv_tokens: int = 4096, engine: Engine | None = None, **gw) -> tuple[TestClient, AsyncLLM]:
    llm = AsyncLLM(engine=engine or fake_engine(kv_tokens=kv_tokens, max_num_batched_tokens=256))
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
                             "total_tokens": len(prompt) + 12, "prompt_tokens_details": {"cached_tokens": 0}}


async def live_spec(client: TestClient, drafted: float) -> dict | None:
    """/stats' speculation figures once the observer's 1 s sample has seen `drafted` draft tokens."""
    for _ in range(100):
        spec = (await (await client.get("/stats")).json())["live"]["spec"]
        if spec is None or spec["draft_tokens"] == drafted:
            return spec
        await asyncio.sleep(0.05)
    raise AssertionError(f"/stats never showed {drafted} draft tokens: {spec}")


async def test_web_page_shows_speculation_only_when_on(served):
    """The live panel's speculative decoding figures come from /stats: draft and accepted tokens, acceptance rate
    and mean accepted length after a speculative request; none from a server without speculation."""
    plain, _ = served
    assert await live_spec(plain, 0) is None
    engine = fake_engine(max_num_batched_tokens=256, speculative={"num_speculative_tokens": 5, "prompt_lookup_min": 1})
    client, llm = await start(engine=engine)
    try:
        r = await client.post("/v1/completions", json={"prompt": "abcdefghi" * 4, "max_tokens": 40,
                                                       "ignore_eos": True, "temperature": 0})
        assert r.status == 200
        drafted, accepted = llm.metrics.spec_draft_tokens._value.get(), llm.metrics.spec_accepted_tokens._value.get()
        assert drafted > 0
        spec = await live_spec(client, drafted)
        assert spec["accepted_tokens"] == accepted and spec["acceptance_rate"] == accepted / drafted
        assert spec["mean_accepted_length"] >= 1
    finally:
        await client.close()
    with open(f"{STATIC_DIR}/app.js") as f:
        script = f.read()
    assert all(f"spec.{key}" in script for key in spec)


async def test_32_streams_a_third_disconnect(served):
    client, llm = served

    async def one(i: int) -> str | None:
        # A leaver asks for far more tokens than the engine makes while its client reads three: with
        # 30, a loop that ran the server ahead of the client finished the stream (200, not 499) first.
        leaves = i % 3 == 0
        r = await client.post("/v1/completions", json={"prompt": f"story {i}", "max_tokens": 4000 if leaves else 30,
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
            if leaves and seen == 3:
                r.close()
                return "left"
        return None

    results = await asyncio.gather(*(one(i) for i in range(32)))
    assert results.count("left") == 11
    assert all(r == "length" for i, r in enumerate(results) if i % 3)
    await wait_idle(client)
    metrics = await (await client.get("/metrics")).text()
    assert re.search(r'^pyengine:num_requests_running\{model_name="paged-echo"\} 0\.0$', metrics, re.M)
    assert re.search(r'^pyengine_server:engine_requests_running\{model_name="paged-echo"\} 0\.0$', metrics, re.M)
    assert re.search(r'^pyengine_server:responses_total\{model_name="paged-echo",path="/v1/completions",status="499"\} 11\.0$',
                     metrics, re.M)


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


def slow_fake(delay: float, **config) -> Engine:
    """fake_engine whose model sleeps `delay` seconds per step, so requests overlap long enough to race."""
    engine = fake_engine(**config)
    forward = engine.runner.model.forward

    def slow(*args, **kwargs):
        time.sleep(delay)
        return forward(*args, **kwargs)

    engine.runner.model.forward = slow
    return engine


async def until(predicate, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.002)


def expected(prompt: str | list[int], n: int) -> str:
    ids = FakeTokenizer().encode(prompt) if isinstance(prompt, str) else prompt
    return FakeTokenizer().decode(reference(ids, n))


async def test_priority_over_http_overtakes():
    """scheduling_policy priority, one sequence at a time: a request with a lower `priority` value
    preempts the running one and finishes first; equal priorities keep arrival order."""
    engine = slow_fake(0.005, max_num_seqs=1, max_num_batched_tokens=256, scheduling_policy="priority")
    client, llm = await start(engine=engine)
    done: list[str] = []

    async def run(name: str, priority: int, max_tokens: int) -> None:
        body = {"prompt": name, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0,
                "priority": priority}
        r = await client.post("/v1/completions", json=body)
        assert r.status == 200
        assert (await r.json())["choices"][0]["text"] == expected(name, max_tokens)  # preemption kept it right
        done.append(name)

    try:
        first = asyncio.create_task(run("first", 5, 60))
        await until(lambda: engine.scheduler.num_running == 1)
        second = asyncio.create_task(run("second", 5, 5))
        await until(lambda: engine.scheduler.num_waiting == 1)
        urgent = asyncio.create_task(run("urgent", 0, 5))
        await asyncio.gather(first, second, urgent)
        assert done == ["urgent", "first", "second"]
        assert engine.scheduler.num_preemptions >= 1
        await wait_idle(client)
    finally:
        await client.close()


async def test_abort_a_stream_while_another_is_mid_prefill():
    """Chunked prefill of a long prompt (64 tokens a step); a decoding stream's client leaves in the
    middle of it. The long request finishes with the right tokens and the pool is all free."""
    engine = slow_fake(0.01, max_num_batched_tokens=64)
    client, llm = await start(engine=engine)
    long_prompt = [3 + (7 * i) % 490 for i in range(1500)]

    def long_request():
        return next((r for g in list(engine.groups.values()) for r in g.children
                     if r.num_prompt_tokens == len(long_prompt)), None)

    try:
        stream = await client.post("/v1/completions", json={"prompt": "leaving", "max_tokens": 1000,
                                                            "ignore_eos": True, "stream": True})
        await stream.content.readuntil(b"\n\n")  # decoding
        keeper = asyncio.create_task(client.post("/v1/completions", json={
            "prompt": long_prompt, "max_tokens": 8, "ignore_eos": True, "temperature": 0}))
        await until(lambda: (r := long_request()) is not None and 0 < r.num_computed_tokens)
        stream.close()  # the client leaves: the server aborts its request
        await until(lambda: len(engine.groups) == 1)
        r = long_request()
        assert r is not None and r.num_computed_tokens < len(long_prompt)  # the abort landed mid-prefill
        resp = await keeper
        assert resp.status == 200
        assert (await resp.json())["choices"][0]["text"] == expected(long_prompt, 8)
        s = await wait_idle(client)
        assert s["num_free_blocks"] == s["num_total_blocks"]
    finally:
        await client.close()


def _rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


@pytest.mark.slow
async def test_soak_memory_and_blocks_return_to_baseline():
    """Rounds of 60 concurrent requests (streams, a third of them left mid-stream, and plain ones
    with n=2) over the real scheduler, pool and detokenizer: after each round the KV pool is full
    again and nothing is left in the engine; RSS and the count of live Python objects stay at the
    level of the first rounds (a request that leaks its state costs tens of objects)."""
    client, llm = await start(kv_tokens=2048)
    engine = llm.engine
    session = aiohttp.ClientSession()  # unlike the TestClient, it keeps no reference to old responses
    url = str(client.make_url("/v1/completions"))

    async def one(i: int) -> None:
        body = {"prompt": f"request {i} " * (1 + i % 7), "max_tokens": 24, "ignore_eos": True, "seed": i,
                "temperature": 0.8}
        if i % 2:
            async with session.post(url, json={**body, "n": 2}) as r:
                assert r.status == 200 and len((await r.json())["choices"]) == 2
            return
        r = await session.post(url, json={**body, "stream": True})
        seen = 0
        async for line in r.content:
            seen += line.startswith(b"data: ")
            if i % 3 == 0 and seen == 3:
                r.close()  # the client leaves mid-stream
                return

    async def round_() -> None:
        await asyncio.gather(*(one(i) for i in range(60)))
        s = await wait_idle(client)
        assert s["num_free_blocks"] == s["num_total_blocks"]
        assert not engine.groups and not llm._streams

    def live_objects() -> int:
        gc.collect()
        return len(gc.get_objects())

    try:
        for _ in range(3):  # warm-up: caches, pools, lazily built state
            await round_()
        rss, objects = _rss(), live_objects()
        start_time = time.monotonic()
        rounds = 0
        while rounds < 40 and time.monotonic() - start_time < 30:
            await round_()
            rounds += 1
        assert rounds >= 5
        assert live_objects() - objects < 1000, f"{live_objects() - objects} more objects after {rounds} rounds"
        assert _rss() - rss < 32 << 20, f"RSS grew by {(_rss() - rss) >> 20} MiB over {rounds} rounds"
    finally:
        await session.close()
        await client.close()
