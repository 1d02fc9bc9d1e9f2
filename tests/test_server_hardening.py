"""Connection hygiene, the event loop, rate-limit charging and headers, over the fake engine.

The connection tests listen the way `python -m server` does (server.app.listen: the guarded site)
and talk raw HTTP over sockets, so that they can be as slow as a hostile client.
"""
from __future__ import annotations

import asyncio
import json
import threading

import pytest

from server.app import ServerConfig, create_app, listen
from server.connections import ConnectionLimits
from server.gateway import GatewayConfig
from tests.test_server_api import FakeEngine, FakeTokenizer, chat_body, start

LIMITS = ConnectionLimits(read_timeout=0.5, keepalive_timeout=0.5, max_connections=4)
POST = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"


class Listening:
    """A guarded server over a FakeEngine on a free port."""

    def __init__(self, engine: FakeEngine, limits: ConnectionLimits = LIMITS, **gw) -> None:
        self.engine, self.limits, self.gw = engine, limits, gw

    async def __aenter__(self) -> "Listening":
        app = create_app(self.engine, ServerConfig(max_n=4, gateway=GatewayConfig(**self.gw),
                                                   connections=self.limits))
        self.runner = await listen(app, "127.0.0.1", 0)
        self.port = self.runner.addresses[0][1]
        return self

    async def __aexit__(self, *exc) -> None:
        await self.runner.cleanup()

    async def connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        return await asyncio.open_connection("127.0.0.1", self.port)


async def read_response(reader: asyncio.StreamReader, timeout: float = 10.0) -> tuple[int, dict, bytes]:
    """One HTTP/1.1 response with a Content-Length body: (status, headers, body)."""
    async with asyncio.timeout(timeout):
        head = await reader.readuntil(b"\r\n\r\n")
        lines = head.decode().split("\r\n")
        headers = dict(line.split(": ", 1) for line in lines[1:] if line)
        body = await reader.readexactly(int(headers.get("Content-Length", 0)))
    return int(lines[0].split()[1]), headers, body


async def closed(reader: asyncio.StreamReader, timeout: float = 10.0) -> bool:
    """Whether the server closes the connection within `timeout` (EOF or reset)."""
    try:
        async with asyncio.timeout(timeout):
            return await reader.read() == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def request_bytes(body: dict) -> bytes:
    data = json.dumps(body).encode()
    return POST + f"Content-Length: {len(data)}\r\n\r\n".encode() + data


async def test_slow_headers_get_408_and_the_connection_closes():
    async with Listening(FakeEngine()) as srv:
        reader, writer = await srv.connect()
        writer.write(b"POST /v1/completions HTTP/1.1\r\n")
        trickle = asyncio.create_task(_trickle(writer, b"X-Slow: " + b"a" * 100))  # a byte every 50 ms
        status, headers, body = await read_response(reader)
        trickle.cancel()
        assert status == 408 and headers["Connection"] == "close"
        assert json.loads(body)["error"]["code"] == "request_read_timeout"
        assert await closed(reader)
        # Everyone else is served as before.
        reader, writer = await srv.connect()
        writer.write(request_bytes({"prompt": "x", "max_tokens": 2}))
        assert (await read_response(reader))[0] == 200


async def _trickle(writer: asyncio.StreamWriter, data: bytes, every: float = 0.05) -> None:
    for i in range(len(data)):
        writer.write(data[i:i + 1])
        await asyncio.sleep(every)


async def test_slow_body_gets_408():
    async with Listening(FakeEngine()) as srv:
        reader, writer = await srv.connect()
        writer.write(POST + b"Content-Length: 100\r\n\r\n{")
        trickle = asyncio.create_task(_trickle(writer, b" " * 99))
        status, _, body = await read_response(reader)
        trickle.cancel()
        assert status == 408 and json.loads(body)["error"]["type"] == "timeout"


async def test_idle_connections_close_after_the_keepalive_timeout():
    async with Listening(FakeEngine()) as srv:
        silent_reader, _ = await srv.connect()  # never sends anything
        reader, writer = await srv.connect()
        for _ in range(2):  # keep-alive: a second request on the same connection, within the timeout
            writer.write(request_bytes({"prompt": "x", "max_tokens": 2}))
            assert (await read_response(reader))[0] == 200
        assert await closed(reader, timeout=5) and await closed(silent_reader, timeout=5)


async def test_connections_beyond_the_cap_get_503():
    limits = ConnectionLimits(read_timeout=5, keepalive_timeout=5, max_connections=4)
    async with Listening(FakeEngine(), limits) as srv:
        held = [await srv.connect() for _ in range(4)]
        reader, _ = await srv.connect()
        status, _, body = await read_response(reader)
        assert status == 503 and json.loads(body)["error"]["code"] == "too_many_connections"
        assert await closed(reader)
        held[0][1].close()  # one leaves: a new connection is served
        await asyncio.sleep(0.1)
        reader, writer = await srv.connect()
        writer.write(request_bytes({"prompt": "x", "max_tokens": 2}))
        assert (await read_response(reader))[0] == 200


MALFORMED_HTTP = [  # aiohttp answers these 400 itself, before any middleware or signal of ours runs
    b"GARBAGE\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost: x\r\nNo colon here\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n",
    b"GET / HTTP/9.9\r\nHost: x\r\n\r\n",
]


async def test_server_header_names_no_versions():
    async with Listening(FakeEngine()) as srv:
        for req in (request_bytes({"prompt": "x", "max_tokens": 2}), request_bytes({"prompt": 3}),
                    b"GET /nothing HTTP/1.1\r\nHost: x\r\n\r\n", b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n",
                    *MALFORMED_HTTP):
            reader, writer = await srv.connect()
            writer.write(req)
            status, headers, _ = await read_response(reader)
            assert headers["Server"] == "pyengine", (req, status, headers["Server"])
            assert status == 400 or req not in MALFORMED_HTTP, (req, status)


async def test_malformed_http_gets_an_openai_style_json_400_and_the_server_keeps_serving():
    """aiohttp's parser answers malformed HTTP itself, before any handler of ours: the answer is
    still JSON {"error": {message, type, param, code}} and the connection closes."""
    async with Listening(FakeEngine()) as srv:
        for req in MALFORMED_HTTP:
            reader, writer = await srv.connect()
            writer.write(req)
            status, headers, body = await read_response(reader)
            assert status == 400 and headers["Content-Type"].startswith("application/json"), (req, headers)
            err = json.loads(body)["error"]
            assert set(err) == {"message", "type", "param", "code"}, err
            assert err["type"] == "invalid_request_error" and err["param"] is None
            assert err["code"] == "invalid_http_request" and err["message"].startswith("Malformed HTTP request"), err
            assert await closed(reader)
        reader, writer = await srv.connect()
        writer.write(request_bytes({"prompt": "x", "max_tokens": 2}))
        assert (await read_response(reader))[0] == 200


class GatedTemplateTokenizer(FakeTokenizer):
    """apply_chat_template on a long conversation waits (up to 10 s) until the test lets it go."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        self.released_in_time = False

    def apply_chat_template(self, messages, add_generation_prompt: bool = True) -> str:
        if len(messages[0]["content"]) > 10_000:
            self.entered.set()
            self.released_in_time = self.release.wait(10)
        return super().apply_chat_template(messages, add_generation_prompt)


async def test_chat_template_of_a_long_prompt_runs_off_the_event_loop():
    """Ordering, not timing: while the template works on a long prompt, another stream keeps
    receiving chunks. On the event loop, the template would hold every stream until it returned."""
    engine = FakeEngine()
    engine.tokenizer = GatedTemplateTokenizer()
    client = await start(engine)
    try:
        stream = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 200, "stream": True})
        await stream.content.readuntil(b"\n\n")
        long = asyncio.create_task(client.post("/v1/chat/completions", json=chat_body(
            messages=[{"role": "user", "content": "y" * 20_000}], max_tokens=1)))
        while not engine.tokenizer.entered.is_set():
            await asyncio.sleep(0.01)
        for _ in range(3):  # the stream goes on while the template is busy
            await stream.content.readuntil(b"\n\n")
        engine.tokenizer.release.set()
        assert (await long).status == 400  # 20k characters do not fit the fake's 256-token window
        assert engine.tokenizer.released_in_time
        await stream.read()
    finally:
        await client.close()


async def test_tokenize_and_detokenize_are_rate_limited():
    client = await start(FakeEngine(), ServerConfig(max_n=4, gateway=GatewayConfig(rate_limit_rpm=2)))
    try:
        assert (await client.post("/tokenize", json={"prompt": "a"})).status == 200
        assert (await client.post("/detokenize", json={"tokens": [97]})).status == 200
        r = await client.post("/tokenize", json={"prompt": "a"})
        assert r.status == 429 and r.headers["Retry-After"]
        assert (await client.post("/detokenize", json={"tokens": [97]})).status == 429
    finally:
        await client.close()


async def test_refused_requests_are_not_charged():
    """400s and 503s (queue full) leave the key's request and token budgets as they were."""
    engine = FakeEngine()
    cfg = ServerConfig(max_n=4, gateway=GatewayConfig(rate_limit_rpm=3, rate_limit_tpm=100, max_queue=1))
    client = await start(engine, cfg)
    try:
        for bad in ({"prompt": 3}, {"prompt": "x", "temperature": -1}, {"prompt": "x", "max_tokens": 500},
                    {"prompt": "\ud800"}):
            r = await client.post("/v1/completions", json=bad)
            assert r.status == 400
        engine.gate = asyncio.Event()  # the next request waits in the queue, so the one after gets 503
        waiting = asyncio.create_task(client.post("/v1/completions", json={"prompt": "x", "max_tokens": 40}))
        while engine.waiting < 1:
            await asyncio.sleep(0.01)
        for _ in range(3):
            r = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 40})
            assert r.status == 503
        engine.gate.set()
        engine.gate = None
        assert (await waiting).status == 200
        # Spent so far: one request of 3, and 2 + 40 tokens of 100 (less what it did not generate).
        for _ in range(2):
            r = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 20})
            assert r.status == 200
        r = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
        assert r.status == 429 and (await r.json())["error"]["type"] == "requests"
    finally:
        await client.close()


@pytest.mark.parametrize("bad", [dict(read_timeout=0), dict(keepalive_timeout=-1), dict(max_connections=0)])
def test_connection_limits_must_be_positive(bad):
    with pytest.raises(ValueError):
        ConnectionLimits(**bad)


@pytest.fixture
async def client():
    c = await start(FakeEngine())
    yield c
    await c.close()


@pytest.mark.parametrize("path, raw", [
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "a\\ud800"}], "max_tokens": 2}'),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udfff"}]}]}'),
    ("/v1/completions", b'{"prompt": "\\ud800", "max_tokens": 2}'),
    ("/v1/completions", b'{"prompt": "\xed\xa0\x80", "max_tokens": 2}'),  # a surrogate encoded as UTF-8
    ("/tokenize", b'{"prompt": "\\ud800"}'),
    ("/tokenize", b'{"messages": [{"role": "user", "content": "\\ud800"}]}'),
    ("/v1/completions", b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}"),
    ("/detokenize", b'{"tokens": ' + b"[" * 100_000 + b"}"),
    ("/v1/completions", b'{"a": ' * 3000 + b"1" + b"}" * 3000),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}"),  # beyond int conversion
    ("/v1/completions", b'{"prompt": "x", "temperature": NaN}'),
    ("/v1/completions", b'{"prompt": "x", "top_p": -Infinity}'),
])
async def test_malformed_json_gets_400(client, path, raw):
    r = await client.post(path, data=raw)
    assert r.status == 400
    err = (await r.json())["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == "invalid_json"


def test_json_depth_counts_brackets_outside_strings_only():
    from server.protocol import MAX_JSON_DEPTH, parse_json

    deep = MAX_JSON_DEPTH - 1  # plus the body's own object
    assert parse_json(b'{"a": ' + b"[" * deep + b"]" * deep + b"}")
    assert parse_json(b'{"a": "' + b"[{" * 1000 + b'\\"[[[["}') == {"a": "[{" * 1000 + '"[[[['}


@pytest.mark.parametrize("head, body, status", [
    (b"Content-Encoding: gzip\r\n", b"not gzip at all", 400),
    (b"Content-Encoding: deflate\r\n", b"not deflate either", 400),
    (b"Authorization: Bearer \xff\xfe\r\n", b'{"prompt": "x", "max_tokens": 2}', 401),  # not UTF-8
])
async def test_undecodable_bodies_and_headers_get_4xx(head, body, status):
    async with Listening(FakeEngine(), api_keys=["k"]) as srv:
        reader, writer = await srv.connect()
        auth = b"" if b"Authorization" in head else b"Authorization: Bearer k\r\n"
        writer.write(POST + head + auth + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        got, _, answer = await read_response(reader)
        assert got == status and set(json.loads(answer)["error"]) == {"message", "type", "param", "code"}
