"""The HTTP layer over a small fake engine (aiohttp's test client; no model, fast).

The fake follows the AsyncLLM contract: generate() yields deltas, abort() stops a request, stats()
reports a KV pool whose blocks return on every exit path, metrics.registry is a prometheus registry.
Its tokens are deterministic: a function of the prompt, the seed, the choice index and the step.
"""
from __future__ import annotations

import asyncio
import json
import math
import os
import re
import signal
import sys
from dataclasses import dataclass

import aiohttp
import openai
import pytest
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client import CollectorRegistry, Gauge

from bench.serve import serve_load
from pyengine.engine.output import CompletionOutput, RequestOutput
from pyengine.output_types import TokenLogprob
from server.app import ServerConfig, create_app
from server.gateway import GatewayConfig

ALPHABET = "abcdefghij klmnopqrstuvwxyz"
BOS, EOS = 256, 257


class FakeTokenizer:
    """Bytes are tokens 0..255; BOS/EOS special."""

    vocab_size = 258
    eos_token_ids = [EOS]
    bos_token_id = BOS
    all_special_ids = {BOS, EOS}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return ([BOS] if add_special_tokens else []) + list(text.encode())

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return bytes(i for i in ids if i < 256).decode(errors="replace")

    def apply_chat_template(self, messages, add_generation_prompt: bool = True) -> str:
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")




@dataclass
class Stats:
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_total_blocks: int


class FakeEngine:
    model_name = "fake-model"
    max_model_len = 256
    block_size = 16

    def __init__(self, num_blocks: int = 64, step_delay: float = 0.002) -> None:
        self.tokenizer = FakeTokenizer()
        self.num_blocks = num_blocks
        self.step_delay = step_delay
        self.blocks: dict[str, int] = {}
        self.aborted: set[str] = set()
        self.gate: asyncio.Event | None = None  # when set up, requests wait for it before running
        self.healthy = True
        self.waiting = 0
        self.registry = CollectorRegistry()
        Gauge("pyengine:num_requests_running", "running", registry=self.registry).set_function(
            lambda: len(self.blocks))
        self.metrics = self

    async def start(self) -> None:
        pass

    async def shutdown(self) -> None:
        pass

    def is_healthy(self) -> bool:
        return self.healthy

    def stats(self) -> Stats:
        return Stats(len(self.blocks), self.waiting, self.num_blocks - sum(self.blocks.values()),
                     self.num_blocks)

    async def abort(self, request_id: str) -> None:
        self.aborted.add(request_id)

    async def check_params(self, params) -> None:  # the real engine checks the vocabulary and grammars
        pass

    @staticmethod
    def token(prompt: list[int], seed: int | None, choice: int, step: int) -> int:
        return ord(ALPHABET[(sum(prompt) + (seed or 0) + 7 * choice + 3 * step) % len(ALPHABET)])

    async def generate(self, prompt, params, request_id: str, *, priority: int = 0):
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if math.ceil((len(ids) + 1) / self.block_size) > self.num_blocks:
            raise ValueError(f"prompt has {len(ids)} tokens; the KV pool holds "
                             f"{self.num_blocks * self.block_size}")
        self.waiting += 1
        try:
            if self.gate is not None:
                await self.gate.wait()
        finally:
            self.waiting -= 1
        texts = [""] * params.n
        done: list[str | None] = [None] * params.n
        try:
            for step in range(params.max_tokens):
                await asyncio.sleep(self.step_delay)
                if request_id in self.aborted:
                    return
                self.blocks[request_id] = math.ceil((len(ids) + step + 1) / self.block_size)
                outs = []
                for c in range(params.n):
                    if done[c]:
                        continue
                    tok = self.token(ids, params.seed, c, step)
                    piece = chr(tok)
                    texts[c] += piece
                    reason = stop_reason = None
                    for s in params.stop or []:
                        if s in texts[c]:
                            cut = texts[c].index(s)
                            piece = piece[: max(0, len(piece) - (len(texts[c]) - cut))]
                            reason, stop_reason = "stop", s
                            break
                    if reason is None and step + 1 == params.max_tokens:
                        reason = "length"
                    done[c] = reason
                    lps = None
                    if params.logprobs is not None:
                        top = [(tok, -0.25), (tok + 1, -1.5), (tok + 2, -2.5)][: params.logprobs]
                        lps = [TokenLogprob(tok, -0.25, top)]
                    outs.append(CompletionOutput(c, piece, [tok], reason, stop_reason, lps))
                finished = all(done)
                prompt_lps = None
                if step == 0 and params.prompt_logprobs is not None:
                    prompt_lps = [None] + [TokenLogprob(t, -1.0 - 0.5 * j, [(t, -1.0 - 0.5 * j), (t + 1, -9.0)]
                                                        [: params.prompt_logprobs]) for j, t in enumerate(ids[1:])]
                yield RequestOutput(request_id, None, ids, outs, finished, prompt_logprobs=prompt_lps)
                if finished:
                    return
        finally:
            self.blocks.pop(request_id, None)


def make_config(**gw) -> ServerConfig:
    return ServerConfig(max_n=4, gateway=GatewayConfig(**gw))


@pytest.fixture
async def engine():
    return FakeEngine()


async def start(engine: FakeEngine, cfg: ServerConfig | None = None) -> TestClient:
    app = create_app(engine, cfg or make_config())
    client = TestClient(TestServer(app, handler_cancellation=True))
    await client.start_server()
    return client


@pytest.fixture
async def client(engine):
    c = await start(engine)
    yield c
    await c.close()


def chat_body(**kw) -> dict:
    return {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, **kw}


async def sse_events(resp) -> list:
    """Parse an SSE body into JSON objects, with '[DONE]' kept as a string."""
    assert resp.headers["Content-Type"].startswith("text/event-stream")
    events = []
    for block in (await resp.text()).split("\n\n"):
        if block:
            assert block.startswith("data: ")
            data = block[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def expected_text(engine: FakeEngine, prompt_ids: list[int], n_tokens: int, seed=None, choice=0) -> str:
    return "".join(chr(engine.token(prompt_ids, seed, choice, s)) for s in range(n_tokens))


def chat_ids(engine: FakeEngine, content: str = "hi") -> list[int]:
    tok = engine.tokenizer
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": content}]), False)


async def test_models_health_tokenize(client, engine):
    r = await client.get("/v1/models")
    assert r.status == 200
    data = (await r.json())["data"]
    assert data[0]["id"] == "fake-model" and data[0]["max_model_len"] == 256
    assert (await client.get("/health")).status == 200
    engine.healthy = False
    assert (await client.get("/health")).status == 503
    engine.healthy = True
    r = await client.post("/tokenize", json={"prompt": "abc"})
    body = await r.json()
    assert body["tokens"] == [BOS, 97, 98, 99] and body["count"] == 4
    r = await client.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]})
    assert (await r.json())["tokens"] == chat_ids(engine)
    r = await client.post("/tokenize", json={"content": "abc", "add_special_tokens": False})  # llama.cpp
    assert (await r.json())["tokens"] == [97, 98, 99]
    r = await client.post("/detokenize", json={"tokens": [104, 105]})
    assert await r.json() == {"prompt": "hi", "content": "hi"}


async def test_chat_non_streaming(client, engine):
    r = await client.post("/v1/chat/completions", json=chat_body(seed=3))
    assert r.status == 200
    body = await r.json()
    ids = chat_ids(engine)
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert body["model"] == "fake-model"
    (choice,) = body["choices"]
    assert choice["message"] == {"role": "assistant", "content": expected_text(engine, ids, 5, seed=3)}
    assert choice["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 5, "total_tokens": len(ids) + 5,
                             "prompt_tokens_details": {"cached_tokens": 0}}


@pytest.mark.parametrize("include_usage", [False, True])
async def test_chat_streaming(client, engine, include_usage):
    r = await client.post("/v1/chat/completions", json=chat_body(
        stream=True, n=2, stream_options={"include_usage": include_usage}))
    assert r.status == 200
    events = await sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    if include_usage:
        usage = chunks.pop()
        assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 10
        assert all(c["usage"] is None for c in chunks)
    else:
        assert all("usage" not in c for c in chunks)
    ids = chat_ids(engine)
    for idx in (0, 1):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == idx]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        assert mine[-1]["finish_reason"] == "length" and mine[-1]["delta"] == {}
        assert all(m["finish_reason"] is None for m in mine[:-1])
        text = "".join(m["delta"].get("content", "") for m in mine)
        assert text == expected_text(engine, ids, 5, choice=idx)
        assert len(mine) == 5 + 2  # role chunk, one chunk per token (flushed per step), finish chunk


async def test_completions_multiple_prompts_n2_and_stop(client, engine):
    r = await client.post("/v1/completions", json={"prompt": ["ab", "cd"], "n": 2, "max_tokens": 4})
    body = await r.json()
    assert body["object"] == "text_completion"
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    prompts = [[BOS, 97, 98], [BOS, 99, 100]]
    for c in body["choices"]:
        assert c["text"] == expected_text(engine, prompts[c["index"] // 2], 4, choice=c["index"] % 2)
    assert body["usage"]["prompt_tokens"] == 6 and body["usage"]["completion_tokens"] == 16
    full = expected_text(engine, prompts[0], 8)
    stop = full[3]  # the fake does not hold back partial stop strings: one character
    r = await client.post("/v1/completions", json={"prompt": "ab", "max_tokens": 8, "stop": [stop]})
    (c,) = (await r.json())["choices"]
    assert c["finish_reason"] == "stop" and c["text"] == full[: full.index(stop)] and c["stop_reason"] == stop


async def test_completions_echo(client, engine):
    r = await client.post("/v1/completions", json={"prompt": ["ab", "cd"], "max_tokens": 2, "echo": True})
    texts = [c["text"] for c in (await r.json())["choices"]]
    assert texts == ["ab" + expected_text(engine, [BOS, 97, 98], 2), "cd" + expected_text(engine, [BOS, 99, 100], 2)]
    r = await client.post("/v1/completions", json={"prompt": [104, 105], "max_tokens": 2, "echo": True,
                                                   "stream": True})
    events = await sse_events(r)
    assert events[0]["choices"][0]["text"].startswith("hi")


async def test_completions_echo_with_logprobs_includes_the_prompt(client, engine):
    for stream in (False, True):
        r = await client.post("/v1/completions", json={"prompt": "ab", "max_tokens": 2, "echo": True,
                                                       "logprobs": 1, "stream": stream})
        assert r.status == 200
        if stream:
            events = [e for e in await sse_events(r) if e != "[DONE]"]
            chunks = [e["choices"][0]["logprobs"] for e in events if e["choices"][0]["logprobs"]]
            lp = {k: [x for c in chunks for x in c[k]] for k in ("tokens", "token_logprobs", "top_logprobs",
                                                                 "text_offset")}
        else:
            lp = (await r.json())["choices"][0]["logprobs"]
        gen = expected_text(engine, [BOS, 97, 98], 2)
        assert lp["tokens"] == ["", "a", "b", *gen]  # BOS decodes to nothing here
        assert lp["token_logprobs"][:3] == [None, -1.0, -1.5] and lp["token_logprobs"][3:] == [-0.25, -0.25]
        assert lp["top_logprobs"][0] is None and lp["top_logprobs"][1] == {"a": -1.0}
        assert lp["text_offset"] == [0, 0, 1, 2, 3]


async def test_completions_streaming(client, engine):
    r = await client.post("/v1/completions", json={"prompt": "ab", "max_tokens": 3, "stream": True})
    events = await sse_events(r)
    assert events[-1] == "[DONE]"
    texts = "".join(e["choices"][0]["text"] for e in events[:-1])
    assert texts == expected_text(engine, [BOS, 97, 98], 3)
    assert events[-2]["choices"][0]["finish_reason"] == "length"


async def test_logprobs_formats(client, engine):
    r = await client.post("/v1/chat/completions", json=chat_body(logprobs=True, top_logprobs=2, max_tokens=2))
    content = (await r.json())["choices"][0]["logprobs"]["content"]
    assert len(content) == 2
    tok = expected_text(engine, chat_ids(engine), 1)
    assert content[0]["token"] == tok and content[0]["logprob"] == -0.25
    assert content[0]["bytes"] == list(tok.encode())
    assert [t["logprob"] for t in content[0]["top_logprobs"]] == [-0.25, -1.5]
    r = await client.post("/v1/completions", json={"prompt": "ab", "max_tokens": 3, "logprobs": 1})
    lp = (await r.json())["choices"][0]["logprobs"]
    assert lp["token_logprobs"] == [-0.25] * 3 and len(lp["tokens"]) == 3
    assert lp["text_offset"] == [0, 1, 2] and all(len(t) == 1 for t in lp["top_logprobs"])
    r = await client.post("/v1/completions", json={"prompt": "ab", "max_tokens": 3, "logprobs": 0, "stream": True})
    events = (await sse_events(r))[:-1]
    assert [e["choices"][0]["logprobs"]["text_offset"] for e in events[:3]] == [[0], [1], [2]]
    r = await client.post("/v1/chat/completions", json=chat_body(max_tokens=2))
    assert (await r.json())["choices"][0]["logprobs"] is None


@pytest.mark.parametrize("path, body, status, param", [
    ("/v1/chat/completions", b"{not json", 400, None),
    ("/v1/chat/completions", chat_body(max_tokens=-1), 400, "max_tokens"),
    ("/v1/chat/completions", chat_body(temperature=-1), 400, "temperature"),
    ("/v1/chat/completions", chat_body(top_p=2), 400, "top_p"),
    ("/v1/chat/completions", chat_body(n=99), 400, "n"),
    ("/v1/chat/completions", chat_body(messages=[]), 400, "messages"),
    ("/v1/chat/completions", chat_body(messages=[{"role": "bot", "content": "x"}]), 400, "messages[0].role"),
    ("/v1/chat/completions", chat_body(model="gpt-5"), 404, "model"),
    ("/v1/chat/completions", chat_body(max_tokens=300), 400, "messages"),
    ("/v1/completions", {"prompt": "x" * 2000, "max_tokens": 1}, 400, "prompt"),  # the field that was sent
    ("/v1/completions", {"prompt": 3}, 400, "prompt"),
    ("/v1/completions", {"prompt": [99999]}, 400, "prompt"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
])
async def test_error_paths_then_good_request(client, path, body, status, param):
    kw = {"data": body} if isinstance(body, bytes) else {"json": body}
    r = await client.post(path, **kw)
    assert r.status == status
    err = (await r.json())["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param
    r = await client.post("/v1/chat/completions", json=chat_body())
    assert r.status == 200 and (await r.json())["choices"][0]["finish_reason"] == "length"


async def test_context_message_and_engine_refusal(engine):
    engine.num_blocks = 2  # the pool holds 32 tokens, less than the 256-token window
    client = await start(engine)
    try:
        r = await client.post("/v1/chat/completions", json=chat_body(max_tokens=250))
        assert (await r.json())["error"]["message"] == (
            f"This model's maximum context length is 256 tokens. However, you requested "
            f"{len(chat_ids(engine)) + 250} tokens ({len(chat_ids(engine))} in the messages, 250 in the "
            "completion).")
        r = await client.post("/v1/completions", json={"prompt": "x" * 100, "max_tokens": 1})
        assert r.status == 400 and "KV pool" in (await r.json())["error"]["message"]
    finally:
        await client.close()


async def test_unknown_route_and_body_limit(engine):
    client = await start(engine, make_config(max_body_bytes=1000))
    try:
        r = await client.get("/v1/nothing")
        assert r.status == 404 and "error" in await r.json()
        r = await client.post("/v1/embeddings", json={"input": "x"})
        err = (await r.json())["error"]  # OpenAI's words, naming what was asked for
        assert r.status == 404 and err["message"].startswith("Invalid URL (POST /v1/embeddings)")
        assert err["type"] == "invalid_request_error"
        r = await client.get("/v1/chat/completions")
        assert r.status == 405 and "GET" in (await r.json())["error"]["message"]
        assert "/v1/chat/completions" in (await r.json())["error"]["message"]
        r = await client.post("/v1/completions", json={"prompt": "x" * 2000})
        assert r.status == 413 and (await r.json())["error"]["code"] == "request_too_large"

        async def chunks():  # no Content-Length: the limit applies while reading
            for _ in range(4):
                yield b" " * 500

        r = await client.post("/v1/completions", data=chunks())
        assert r.status == 413
        r = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert r.status == 200
    finally:
        await client.close()


async def test_auth(engine):
    client = await start(engine, make_config(api_keys=["sekrit"]))
    try:
        assert (await client.get("/health")).status == 200
        r = await client.get("/v1/models")
        assert r.status == 401 and (await r.json())["error"]["code"] == "invalid_api_key"
        r = await client.post("/v1/chat/completions", json=chat_body(), headers={"Authorization": "Bearer nope"})
        assert r.status == 401
        r = await client.post("/v1/chat/completions", json=chat_body(), headers={"Authorization": "Bearer sekrit"})
        assert r.status == 200
    finally:
        await client.close()


async def test_rate_limits(engine):
    client = await start(engine, make_config(api_keys=["a", "b"], rate_limit_rpm=2, rate_limit_tpm=60))
    try:
        hdr = {"Authorization": "Bearer a"}
        for _ in range(2):
            r = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}, headers=hdr)
            assert r.status == 200
        r = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}, headers=hdr)
        assert r.status == 429 and int(r.headers["Retry-After"]) >= 1
        assert (await r.json())["error"]["type"] == "requests"
        # Key b has its own buckets. A request larger than the token bucket passes when the bucket
        # is full (it would never pass otherwise) and leaves it in debt: the next one waits.
        hdr = {"Authorization": "Bearer b"}
        r = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 98}, headers=hdr)
        assert r.status == 200
        r = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}, headers=hdr)
        assert r.status == 429 and (await r.json())["error"]["type"] == "tokens"
    finally:
        await client.close()


async def test_back_pressure_and_timeout(engine):
    engine.gate = asyncio.Event()
    client = await start(engine, make_config(max_queue=2, request_timeout=0.5))
    try:
        body = {"prompt": "x", "max_tokens": 2}
        first = [asyncio.create_task(client.post("/v1/completions", json=body)) for _ in range(2)]
        while engine.waiting < 2:
            await asyncio.sleep(0.01)
        r = await client.post("/v1/completions", json=body)
        assert r.status == 503 and r.headers["Retry-After"] and (await r.json())["error"]["code"] == "server_overloaded"
        for t in first:  # the engine never started them: 504, and they were aborted
            r = await t
            assert r.status == 504 and (await r.json())["error"]["type"] == "timeout"
        assert len(engine.aborted) == 2
        engine.gate = None
        r = await client.post("/v1/completions", json=body)
        assert r.status == 200
        stats = await (await client.get("/stats")).json()
        assert stats["gateway"] == {"waiting": 0, "in_flight": 0}
    finally:
        await client.close()


async def test_disconnect_aborts_and_frees_blocks(engine):
    engine.step_delay = 0.02
    client = await start(engine)
    try:
        streams = []
        for i in range(6):
            r = await client.post("/v1/completions", json={"prompt": f"p{i}", "max_tokens": 40, "stream": True})
            assert r.status == 200
            streams.append(r)
        for r in streams:
            await r.content.readuntil(b"\n\n")  # each has produced a token
        for r in streams[:3]:
            r.close()  # client leaves mid-stream
        for r in streams[3:]:
            events = await sse_events(r)
            assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"
        for _ in range(100):
            if engine.stats().num_free_blocks == engine.num_blocks:
                break
            await asyncio.sleep(0.02)
        assert engine.stats().num_free_blocks == engine.num_blocks
        assert len(engine.aborted) == 3
        text = await (await client.get("/metrics")).text()
        assert 'pyengine:num_requests_running{model_name="fake-model"} 0.0' in text
        assert f'pyengine_server:kv_free_blocks{{model_name="fake-model"}} {float(engine.num_blocks)}' in text
        assert 'pyengine_server:requests_in_flight{model_name="fake-model"} 0.0' in text
    finally:
        await client.close()


async def test_stream_error_after_headers(engine):
    client = await start(engine)

    async def broken(prompt, params, request_id, *, priority=0):
        yield RequestOutput(request_id, None, [1], [CompletionOutput(0, "a", [97])], False)
        raise RuntimeError("device lost")

    engine.generate = broken
    try:
        r = await client.post("/v1/completions", json={"prompt": "x", "stream": True})
        events = await sse_events(r)
        assert events[-1] == "[DONE]" and "device lost" in events[-2]["error"]["message"]
        r = await client.post("/v1/completions", json={"prompt": "x"})
        assert r.status == 500 and (await r.json())["error"]["type"] == "server_error"
    finally:
        await client.close()


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
async def test_load_generator_against_fake(client, endpoint):
    ns = serve_load.build_parser().parse_args([
        "--url", str(client.make_url("")), "--endpoint", endpoint, "--concurrency", "4", "--num-requests", "8",
        "--prompt-len", "5", "--output-len", "6", "--warmup", "0", "--timeout", "30"])
    rep = await serve_load.run(ns)
    assert rep["completed"] == 8 and rep["failed"] == 0 and rep["output_tokens"] == 48
    assert rep["ttft_s"]["p50"] > 0 and rep["tpot_s"]["p99"] >= rep["tpot_s"]["p50"] > 0
    assert "TTFT" in serve_load.table(rep)


async def test_official_openai_client(client, engine):
    oa = openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="none", max_retries=0)
    r = await oa.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "hi"}],
                                         max_tokens=4, n=2, logprobs=True, top_logprobs=1)
    assert [c.index for c in r.choices] == [0, 1] and r.usage.completion_tokens == 8
    assert r.choices[0].message.content == expected_text(engine, chat_ids(engine), 4)
    assert len(r.choices[1].logprobs.content) == 4
    chunks = [c async for c in await oa.chat.completions.create(
        model="fake-model", messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True,
        stream_options={"include_usage": True})]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == len(chat_ids(engine)) + 4
    c = await oa.completions.create(model="fake-model", prompt="ab", max_tokens=3, logprobs=1)
    assert c.choices[0].text == expected_text(engine, [BOS, 97, 98], 3) and c.choices[0].logprobs.tokens
    with pytest.raises(openai.BadRequestError) as e:
        await oa.completions.create(model="fake-model", prompt="ab", temperature=5)
    assert e.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError):
        await oa.completions.create(model="other", prompt="ab")
    await oa.close()


SERVE_SCRIPT = """
import asyncio, sys
sys.path[:0] = [{root!r}, {tests!r}]
from test_server_api import FakeEngine, make_config
from server.cli import serve
from server.app import create_app
app = create_app(FakeEngine(step_delay=0.05), make_config())
asyncio.run(serve(app, "127.0.0.1", 0, {grace}))
"""


@pytest.mark.e2e
@pytest.mark.parametrize("grace, completes", [(10.0, True), (0.3, False)])
async def test_sigterm_drains_then_exits_0(grace, completes):
    tests = os.path.dirname(os.path.abspath(__file__))
    script = SERVE_SCRIPT.format(root=os.path.dirname(tests), tests=tests, grace=grace)
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", script, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.STDOUT)
    try:
        banner = (await asyncio.wait_for(proc.stdout.readline(), 30)).decode()
        url = re.search(r"http://\S+", banner).group(0)
        async with aiohttp_session() as session:
            r = await session.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 30, "stream": True})
            await r.content.readuntil(b"\n\n")
            proc.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.2)
            with pytest.raises(Exception):  # no longer accepting connections
                await session.get(url + "/health")
            text = (await r.content.read()).decode()
            assert text.endswith("data: [DONE]\n\n")
            if completes:
                assert '"finish_reason": "length"' in text
            else:  # the grace period ended first: the stream says so
                assert "server_shutting_down" in text and '"finish_reason": "length"' not in text
        assert await asyncio.wait_for(proc.wait(), 30) == 0
        assert b"stopped" in await proc.stdout.read()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


def aiohttp_session() -> aiohttp.ClientSession:
    # force_close: a fresh connection per request, so the /health probe really connects anew
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True))
