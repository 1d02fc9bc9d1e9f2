"""One bad request fails alone, against a real `python -m server` (default model, small KV budget).

Each class of bad input -- values that overflow or underflow the engine's native types (int32,
int64, float32), token ids beyond the vocabulary, malformed JSON and message structure, slow, idle
and surplus connections -- is sent while a streaming completion runs beside it. Every bad request
gets its 4xx (or, where SamplingParams documents it, is clamped and served), and the stream still
completes all its tokens with finish_reason "length". A hypothesis fuzz over every sampling field
(500 requests) must produce no 5xx while streams keep completing beside it.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import math
import threading
import urllib.request

import aiohttp
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pyengine.sampling_params import LIMITS
from tests.test_server_e2e import ServerProcess, http

pytestmark = pytest.mark.e2e  # a `python -m server` subprocess (pyproject's markers)
KEY = "poison-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
VOCAB = 49152  # SmolLM2's
READ_TIMEOUT, KEEPALIVE, MAX_CONNECTIONS = 1.0, 2.0, 32
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


@pytest.fixture(scope="module")
def server():
    # 128 MiB: 2,048 tokens of an fp32 cache, the auto dtype on a CPU without bf16 dot products (AVX2)
    srv = ServerProcess(KEY, "--max-num-seqs", "8", "--max-model-len", "2048", "--kv-cache-memory", "128MiB",
                        "--max-n", "4", "--read-timeout", str(READ_TIMEOUT), "--keepalive-timeout",
                        str(KEEPALIVE), "--max-connections", str(MAX_CONNECTIONS))
    try:
        yield srv.wait_ready()
    finally:
        srv.stop()


def completion(**kw) -> dict:
    return {"prompt": "Hello", "max_tokens": 2, **kw}


def chat(**kw) -> dict:
    return {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2, **kw}


# ------------------------------------------------------------------ the stream beside
@contextlib.asynccontextmanager
async def stream_beside(server: ServerProcess, max_tokens: int = 128):
    """A streaming completion that is under way when the block starts and must still be running when
    it ends (else the block proved nothing); then it must complete all its tokens, without an error."""
    body = {"prompt": "Once upon a time", "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
            "temperature": 0, "stream_options": {"include_usage": True}}
    async with aiohttp.ClientSession(headers=AUTH, timeout=aiohttp.ClientTimeout(total=300),
                                     connector=aiohttp.TCPConnector(force_close=True)) as session:
        async with session.post(server.url + COMPLETIONS, json=body) as r:
            assert r.status == 200 and r.headers["Server"] == "pyengine"
            first = await r.content.readuntil(b"\n\n")
            yield
            async with session.get(server.url + "/stats") as s:
                running = (await s.json())["engine"]["num_running"] >= 1
            events = [json.loads(block[len("data: "):]) for block in (first + await r.read()).decode().split("\n\n")
                      if block.startswith("data: {")]
    errors = [e["error"] for e in events if "error" in e]
    assert not errors, f"the stream beside failed: {errors}"
    finish = [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]]
    assert finish == ["length"] and events[-1]["usage"]["completion_tokens"] == max_tokens
    assert running, "the stream finished before the block did: it proved nothing (make it longer)"


async def call(path: str, body: dict | bytes, server: ServerProcess) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with aiohttp.ClientSession(headers={**AUTH, "Content-Type": "application/json"},
                                     connector=aiohttp.TCPConnector(force_close=True)) as session:
        async with session.post(server.url + path, data=data) as r:
            assert r.headers["Server"] == "pyengine"
            return r.status, await r.json(content_type=None)


async def check_cases(server: ServerProcess, cases: list[tuple[str, str, dict | bytes, int]]) -> None:
    """Send each (name, path, body, expected status) beside a stream; report every mismatch at once."""
    got = {}
    async with stream_beside(server):
        for name, path, body, _ in cases:
            got[name] = await call(path, body, server)
    wrong = {name: got[name] for name, _, _, status in cases if got[name][0] != status}
    assert not wrong, f"unexpected answers: {wrong}"
    for name, _, _, status in cases:
        body = got[name][1]
        if status >= 400:
            assert set(body["error"]) == {"message", "type", "param", "code"}, name
        else:
            assert body["choices"][0]["finish_reason"] in ("length", "stop"), name


# ------------------------------------------------------------------ classes of bad input
OVERFLOW = [
    ("top_k 2^31", COMPLETIONS, completion(top_k=2**31), 400),
    ("top_k 2^63", COMPLETIONS, completion(top_k=2**63), 400),
    ("seed 2^63", COMPLETIONS, completion(seed=2**63), 400),
    ("seed 2^64", CHAT, chat(seed=2**64), 400),
    ("n 2^31", COMPLETIONS, completion(n=2**31), 400),
    ("max_tokens 2^31", COMPLETIONS, completion(max_tokens=2**31), 400),
    ("max_tokens 2^63", CHAT, chat(max_tokens=2**63), 400),
    ("min_tokens 2^31", COMPLETIONS, completion(min_tokens=2**31), 400),
    ("logprobs 2^31", COMPLETIONS, completion(logprobs=2**31), 400),
    ("top_logprobs 2^31", CHAT, chat(logprobs=True, top_logprobs=2**31), 400),
    ("priority 2^63", COMPLETIONS, completion(priority=2**63), 400),
    ("stop_token_ids 2^31", COMPLETIONS, completion(stop_token_ids=[2**31]), 400),
    ("stop_token_ids 2^64", CHAT, chat(stop_token_ids=[2**64]), 400),
    ("temperature 3.5e38", COMPLETIONS, completion(temperature=3.5e38), 400),
    ("presence_penalty 1e308", CHAT, chat(presence_penalty=1e308), 400),
    ("frequency_penalty -1e308", COMPLETIONS, completion(frequency_penalty=-1e308), 400),
    ("prompt id 2^31", COMPLETIONS, completion(prompt=[1, 2**31]), 400),
    ("detokenize 2^63", "/detokenize", {"tokens": [2**63]}, 400),
    ("float 1e400", COMPLETIONS, b'{"prompt": "x", "max_tokens": 2, "top_p": 1e400}', 400),
    # a normal float32, but dividing a logit of 4 by it overflows float32 to inf
    ("repetition_penalty 1e-38", COMPLETIONS, completion(repetition_penalty=1e-38, logprobs=1), 400),
    ("repetition_penalty 1e-30 chat", CHAT, chat(repetition_penalty=1e-30, logprobs=True), 400),
    ("repetition_penalty 0.009", COMPLETIONS, completion(repetition_penalty=0.009), 400),
]
UNDERFLOW = [  # positive in float64, 0 in float32: refused where 0 is invalid, clamped to 0 where valid
    ("top_p 1e-46", COMPLETIONS, completion(top_p=1e-46), 400),
    ("top_p 5e-324", CHAT, chat(top_p=5e-324), 400),
    ("repetition_penalty 1e-46", COMPLETIONS, completion(repetition_penalty=1e-46), 400),
    ("repetition_penalty 1e-46 chat", CHAT, chat(repetition_penalty=1e-46), 400),
    ("temperature 1e-46 (greedy)", COMPLETIONS, completion(temperature=1e-46), 200),
    ("min_p 1e-46 (off)", CHAT, chat(min_p=1e-46), 200),
    ("presence_penalty 1e-46 (none)", COMPLETIONS, completion(presence_penalty=1e-46), 200),
    ("frequency_penalty -1e-46 (none)", COMPLETIONS, completion(frequency_penalty=-1e-46), 200),
]
OUT_OF_VOCAB = [
    ("stop id 10^6 + min_tokens", COMPLETIONS, completion(stop_token_ids=[10**6], min_tokens=1), 400),
    ("stop id = vocab + min_tokens", CHAT, chat(stop_token_ids=[VOCAB], min_tokens=2), 400),
    ("stop id 10^6", COMPLETIONS, completion(stop_token_ids=[5, 10**6]), 400),
    ("stop id 10^6 streaming", COMPLETIONS, completion(stop_token_ids=[10**6], min_tokens=1, stream=True), 400),
    ("prompt id = vocab", COMPLETIONS, completion(prompt=[1, VOCAB]), 400),
    ("prompt ids 10^6", COMPLETIONS, completion(prompt=[[1, 2], [10**6]]), 400),
    ("detokenize vocab", "/detokenize", {"tokens": [1, VOCAB]}, 400),
]
MALFORMED = [
    ("chat lone surrogate", CHAT, b'{"messages": [{"role": "user", "content": "hi \\ud800"}], "max_tokens": 2}', 400),
    ("chat part lone surrogate", CHAT,
     b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udfff"}]}], "max_tokens": 2}', 400),
    ("prompt lone surrogate", COMPLETIONS, b'{"prompt": "\\ud83d", "max_tokens": 2}', 400),
    ("prompt reversed pair", COMPLETIONS, b'{"prompt": "\\ude00\\ud83d", "max_tokens": 2}', 400),
    ("surrogate as UTF-8", COMPLETIONS, b'{"prompt": "\xed\xa0\x80", "max_tokens": 2}', 400),
    ("invalid UTF-8", COMPLETIONS, b'{"prompt": "\xff", "max_tokens": 2}', 400),
    ("tokenize lone surrogate", "/tokenize", b'{"prompt": "\\ud800"}', 400),
    ("tokenize messages surrogate", "/tokenize", b'{"messages": [{"role": "user", "content": "\\udbff"}]}', 400),
    ("detokenize surrogate", "/detokenize", b'{"tokens": [1], "model": "\\ud800"}', 400),
    ("nested arrays 5000", COMPLETIONS, b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}", 400),
    ("nested objects 3000", CHAT, b'{"m": ' * 3000 + b"1" + b"}" * 3000, 400),
    ("unclosed nesting", "/tokenize", b'{"prompt": ' + b"[" * 100_000, 400),
    ("NaN", COMPLETIONS, b'{"prompt": "x", "max_tokens": 2, "temperature": NaN}', 400),
    ("Infinity", CHAT, b'{"messages": [{"role": "user", "content": "x"}], "top_p": Infinity}', 400),
    ("integer of 5000 digits", COMPLETIONS, b'{"prompt": "x", "seed": ' + b"7" * 5000 + b"}", 400),
    ("not an object", COMPLETIONS, b"[1, 2]", 400),
    ("empty body", CHAT, b"", 400),
    ("messages a string", CHAT, {"messages": "hi"}, 400),
    ("messages of strings", CHAT, {"messages": ["hi"]}, 400),
    ("message without role", CHAT, {"messages": [{"content": "hi"}]}, 400),
    ("content a number", CHAT, {"messages": [{"role": "user", "content": 5}]}, 400),
    ("content parts of strings", CHAT, {"messages": [{"role": "user", "content": ["hi"]}]}, 400),
    ("content part image", CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]}, 400),
    ("content part text a list", CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": ["a"]}]}]}, 400),
    ("prompt an object", COMPLETIONS, {"prompt": {"a": 1}}, 400),
    ("prompt empty id list", COMPLETIONS, {"prompt": [[]]}, 400),
    ("prompt float ids", COMPLETIONS, {"prompt": [1.5, 2]}, 400),
    ("prompt mixed", COMPLETIONS, {"prompt": ["a", 1]}, 400),
    ("stop of numbers", COMPLETIONS, completion(stop=[1]), 400),
    ("stream_options a string", CHAT, chat(stream_options="yes"), 400),
    ("tokenize messages a dict", "/tokenize", {"messages": {"role": "user"}}, 400),
    ("detokenize tokens a string", "/detokenize", {"tokens": "1 2"}, 400),
]


@pytest.mark.parametrize("cases", [OVERFLOW, UNDERFLOW, OUT_OF_VOCAB, MALFORMED],
                         ids=["overflow", "underflow", "out-of-vocab", "malformed"])
async def test_bad_requests_fail_alone(server, cases):
    await check_cases(server, cases)


# ------------------------------------------------------------------ connections
async def _slow_headers(server: ServerProcess) -> bytes:
    """A request whose headers trickle in a byte every 0.2 s: what the server answers."""
    reader, writer = await asyncio.open_connection(*_host_port(server))
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")

    async def trickle() -> None:
        for b in b"X-Slow: " + b"a" * 200:
            writer.write(bytes([b]))
            await asyncio.sleep(0.2)

    task = asyncio.create_task(trickle())
    try:
        async with asyncio.timeout(READ_TIMEOUT + 10):
            return await reader.read()  # the answer, then EOF: the server closed the connection
    finally:
        task.cancel()
        writer.close()


async def _slow_body(server: ServerProcess) -> bytes:
    reader, writer = await asyncio.open_connection(*_host_port(server))
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode() +
                 b"\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{")
    try:
        async with asyncio.timeout(2 * READ_TIMEOUT + 10):
            head = await reader.readuntil(b"\r\n\r\n")  # sent nothing more: the body times out
            return head
    finally:
        writer.close()


async def _idle(server: ServerProcess) -> bytes:
    reader, writer = await asyncio.open_connection(*_host_port(server))
    try:
        async with asyncio.timeout(KEEPALIVE + 10):
            return await reader.read()  # EOF: closed without a word
    finally:
        writer.close()


def _host_port(server: ServerProcess) -> tuple[str, int]:
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


async def test_slow_and_idle_clients_are_cut_off_while_others_are_served(server):
    """20 clients trickling headers, 5 a body, 1 silent: a stream started among them completes, and
    each of them gets 408 (the silent one: closed) after the read (keep-alive) timeout."""
    slow = asyncio.gather(*[_slow_headers(server) for _ in range(20)], *[_slow_body(server) for _ in range(5)],
                          _idle(server))
    await asyncio.sleep(0.1)  # connected and trickling
    async with stream_beside(server):
        pass
    answers = await slow
    assert all(a.startswith(b"HTTP/1.1 408 ") and b"request_read_timeout" in a for a in answers[:20])
    assert all(a.startswith(b"HTTP/1.1 408 ") for a in answers[20:25])
    assert answers[25] == b""


async def test_connections_past_the_cap_get_503(server):
    # the block waits 1 s on silent sockets: 1,000 tokens outlast it 2-3x on a fast host (256 did not),
    # where 2,000 cost ~40 s of a slow one finishing the stream
    async with stream_beside(server, max_tokens=1000):
        opened = [await asyncio.open_connection(*_host_port(server)) for _ in range(MAX_CONNECTIONS + 4)]

        async def first_bytes(reader: asyncio.StreamReader) -> bytes:
            with contextlib.suppress(TimeoutError):  # an accepted connection stays open and silent
                async with asyncio.timeout(1.0):
                    return await reader.read()
            return b""

        answers = await asyncio.gather(*[first_bytes(r) for r, _ in opened])
        for _, writer in opened:
            writer.close()
        refused = [a for a in answers if a]
        assert len(refused) >= 5  # the stream holds one of the MAX_CONNECTIONS too
        assert all(a.startswith(b"HTTP/1.1 503 ") and b"too_many_connections" in a for a in refused)
        await asyncio.sleep(0.2)
        assert (await call(COMPLETIONS, completion(), server))[0] == 200


# ------------------------------------------------------------------ fuzz
INTS = [0, 1, -1, 2, 20, 21, 2**15, 2**31 - 1, 2**31, 2**32, 2**53 + 1, 2**63 - 1, 2**63, 2**64, -2**31 - 1,
        -2**63 - 1, 10**30, VOCAB - 1, VOCAB, 10**6]
FLOATS = [0.0, -0.0, 5e-324, 1e-46, 1.4e-45, 1e-38, 1.1754943e-38, 1e-8, 0.5, 0.9999999, 1.0, 1.0000001, 2.0,
          2.0000002, 65504.0, 3.4028235e38, 3.5e38, 1e308, -1e308, -1e-46, -2.0000002, float("inf"),
          float("-inf"), float("nan")]
JUNK = [None, True, False, "", "1", "x", [], {}, [1], {"a": 1}]
VALUE = st.one_of(st.sampled_from(INTS), st.sampled_from(FLOATS), st.sampled_from(JUNK), st.integers(),
                  st.floats(), st.lists(st.sampled_from(INTS + JUNK[:4]), max_size=3),
                  st.dictionaries(st.sampled_from(["0", "1", str(VOCAB), "-1", "x"]), st.sampled_from(INTS + FLOATS),
                                  max_size=2))


def _edges(name: str) -> st.SearchStrategy:
    """Values at and just past the edges of a field's range in its native type (SamplingParams'
    LIMITS): the values most likely to pass validation and still break a step."""
    r = LIMITS.get("logprobs" if name == "top_logprobs" else name)
    if r is None:
        return VALUE
    if r.kind == "float32":
        points = [r.lo, r.hi, (r.lo + r.hi) / 2, r.lo + 1e-46, r.lo + 1.4e-45, r.hi - 1e-46]
        points += [math.nextafter(x, d) for x in (r.lo, r.hi) for d in (-math.inf, math.inf)]
    else:
        points = [r.lo - 1, r.lo, r.lo + 1, r.hi - 1, r.hi, r.hi + 1, VOCAB - 1, VOCAB]
    one = st.sampled_from(points)
    return st.lists(one, min_size=1, max_size=3) if name == "stop_token_ids" else one


SAMPLING_FIELDS = ["temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                   "repetition_penalty", "seed", "min_tokens", "max_tokens", "n", "ignore_eos", "stop",
                   "stop_token_ids", "include_stop_str_in_output", "skip_special_tokens", "logprobs",
                   "top_logprobs", "echo", "priority", "logit_bias", "stream"]


FIELD_VALUES = {name: st.one_of(_edges(name), VALUE) for name in SAMPLING_FIELDS}


def _bounded(max_tokens):
    """Extreme max_tokens values stay; a valid large one becomes 2, so each request stays short."""
    if max_tokens is None or (isinstance(max_tokens, (int, float)) and not isinstance(max_tokens, bool)
                              and 2 < max_tokens < 2**31):
        return 2
    return max_tokens


class BackgroundStreams(threading.Thread):
    """Streams of 16 tokens, one after another, until stopped; records how each ended."""

    def __init__(self, server: ServerProcess) -> None:
        super().__init__(daemon=True)
        self.server = server
        self.stop = threading.Event()
        self.endings: list[str] = []

    def run(self) -> None:
        body = json.dumps({"prompt": "Once upon a time", "max_tokens": 16, "ignore_eos": True,
                           "stream": True}).encode()
        while not self.stop.is_set():
            req = urllib.request.Request(self.server.url + COMPLETIONS, data=body, method="POST",
                                         headers={**AUTH, "Content-Type": "application/json"})
            ending = "no finish_reason"
            with urllib.request.urlopen(req, timeout=120) as r:
                for line in r:
                    if line.startswith(b"data: {"):
                        event = json.loads(line[len(b"data: "):])
                        if "error" in event:
                            ending = f"error: {event['error']['message']}"
                        elif event["choices"][0]["finish_reason"]:
                            ending = event["choices"][0]["finish_reason"]
            self.endings.append(ending)


def test_fuzz_sampling_fields_no_5xx(server):
    streams = BackgroundStreams(server)
    streams.start()

    @settings(max_examples=500, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(path=st.sampled_from([COMPLETIONS, CHAT]),
           fields=st.lists(st.sampled_from(SAMPLING_FIELDS), min_size=1, max_size=4, unique=True).flatmap(
               lambda names: st.fixed_dictionaries({name: FIELD_VALUES[name] for name in names})))
    def one(path, fields):
        fields["max_tokens"] = _bounded(fields.get("max_tokens"))
        body = {**(completion() if path == COMPLETIONS else chat()), **fields}
        r = http("POST", server.url + path, KEY, json.dumps(body).encode())
        assert r.status_code < 500, (body, r.text)

        if r.status_code >= 400:
            assert set(r.json()["error"]) == {"message", "type", "param", "code"}, (body, r.text)
        elif fields.get("stream") is True:
            events = [json.loads(b[len("data: "):]) for b in r.text.split("\n\n") if b.startswith("data: {")]
            assert not [e for e in events if "error" in e] and r.text.endswith("data: [DONE]\n\n"), (body, r.text)
        else:
            assert all(c["finish_reason"] in ("length", "stop") for c in r.json()["choices"]), (body, r.text)

    try:
        one()
    finally:
        streams.stop.set()
        streams.join(120)
    assert streams.endings and set(streams.endings) == {"length"}, streams.endings
    assert http("POST", server.url + COMPLETIONS, KEY, json.dumps(completion()).encode()).status_code == 200
