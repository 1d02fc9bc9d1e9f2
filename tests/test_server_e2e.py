"""End to end: real `python -m server` processes with the default model, driven by the official
`openai` client and raw HTTP. Two servers per module: a main one, and a tight one (queue of 1,
one sequence at a time, 3 requests/minute, short timeout) for the gateway's limits.
"""
from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

import aiohttp
import openai
import pytest

from pyengine.model.loader import resolve_model_path
from pyengine.tokenizer import Tokenizer

pytestmark = pytest.mark.e2e  # a `python -m server` subprocess (pyproject's markers)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KEY = "test-key"


class ServerProcess:
    """`python -m server` on a free port; stdout is collected by a thread (the pipe never fills)."""

    def __init__(self, key: str, *args: str) -> None:
        self.key = key
        self.url = ""
        self.lines: list[str] = []
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "server", "--port", "0", "--log-level", "warning", "--api-key", key, *args],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        threading.Thread(target=self._pump, daemon=True).start()

    def wait_ready(self) -> "ServerProcess":
        deadline = time.monotonic() + 240
        while not self.url:
            m = re.search(r"listening on (http://\S+)", "".join(self.lines))
            if m:
                self.url = m.group(1)
            elif self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("server did not start:\n" + "".join(self.lines))
            time.sleep(0.1)
        return self

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.wait()

    def get(self, path: str, key: str | None = "") -> "Response":
        """key "": the server's own key; None: no Authorization header."""
        return http("GET", self.url + path, self.key if key == "" else key)

    def post(self, path: str, key: str | None = "", json_body: dict | None = None,
             content: bytes | None = None) -> "Response":
        data = content if content is not None else json.dumps(json_body).encode()
        return http("POST", self.url + path, self.key if key == "" else key, data)


@dataclass
class Response:
    status_code: int
    headers: dict
    text: str

    def json(self):
        return json.loads(self.text)


def http(method: str, url: str, key: str | None, data: bytes | None = None) -> Response:
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json", **_auth(key)})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return Response(r.status, dict(r.headers), r.read().decode())
    except urllib.error.HTTPError as e:
        return Response(e.code, dict(e.headers), e.read().decode())


def _auth(key: str | None) -> dict:
    return {"Authorization": f"Bearer {key}"} if key else {}


@pytest.fixture(scope="module")
def servers():
    """Both servers load the model at the same time (start-up dominates this module's runtime)."""
    main = ServerProcess(KEY, "--max-num-seqs", "32", "--max-model-len", "1024", "--kv-cache-memory", "256MiB")
    tight = ServerProcess("k1", "--api-key", "k2", "--max-queue", "1", "--max-num-seqs", "1",
                          "--rate-limit-rpm", "3", "--request-timeout", "2", "--max-model-len", "1024",
                          "--kv-cache-memory", "64MiB")
    try:
        yield main.wait_ready(), tight.wait_ready()
    finally:
        main.stop()
        tight.stop()


@pytest.fixture(scope="module")
def server(servers):
    return servers[0]


@pytest.fixture(scope="module")
def tight(servers):
    return servers[1]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_model_path(resolve_model_path(None))


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def stats(server: ServerProcess) -> dict:
    return server.get("/stats").json()["engine"]


def wait_idle(server: ServerProcess) -> dict:
    """Poll until the engine runs nothing and the KV pool is full again; return the stats."""
    for _ in range(200):
        s = stats(server)
        if s["num_running"] == 0 and s["num_waiting"] == 0 and s["num_free_blocks"] == s["num_total_blocks"]:
            return s
        time.sleep(0.05)
    raise AssertionError(f"engine not idle: {s}")


MESSAGES = [{"role": "user", "content": "Name three colours."}]


def test_startup_banner_and_endpoints(server, model):
    banner = "".join(server.lines)
    assert re.search(r"listening on http://127\.0\.0\.1:\d+", banner)
    assert f"model: {model}" in banner and re.search(r"KV cache: \d+ blocks x 16 tokens", banner)
    assert server.get("/health", key=None).status_code == 200
    assert server.get("/v1/models", key=None).status_code == 401
    assert "pyengine:" in server.get("/metrics").text


def test_chat_usage_matches_tokenizer(client, model, tokenizer):
    r = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=8, temperature=0,
                                       logprobs=True, top_logprobs=3)
    prompt = tokenizer.encode(tokenizer.apply_chat_template(MESSAGES), add_special_tokens=False)
    assert r.usage.prompt_tokens == len(prompt)
    (c,) = r.choices
    assert c.message.role == "assistant" and c.message.content
    assert r.usage.completion_tokens == len(c.logprobs.content) <= 8
    assert c.finish_reason in ("stop", "length")
    for e in c.logprobs.content:  # greedy: the sampled token is the most likely one
        assert len(e.top_logprobs) == 3
        assert e.logprob == pytest.approx(max(t.logprob for t in e.top_logprobs), abs=1e-4)


def test_chat_streaming_with_usage(client, model):
    chunks = list(client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=6, n=2,
                                                 temperature=0.8, seed=1, stream=True,
                                                 stream_options={"include_usage": True}))
    usage = chunks[-1]
    assert usage.choices == [] and usage.usage.completion_tokens > 0
    for idx in (0, 1):
        mine = [ch.choices[0] for ch in chunks[:-1] if ch.choices[0].index == idx]
        assert mine[0].delta.role == "assistant"
        assert mine[-1].finish_reason in ("stop", "length")
    plain = list(client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=3, stream=True))
    assert all(ch.usage is None and ch.choices for ch in plain)


def test_completions_n2_seed_and_stop(client, model, tokenizer):
    kw = dict(model=model, prompt="Once upon a time", max_tokens=8, temperature=1.0, seed=1234)
    a = client.completions.create(n=2, **kw)
    b = client.completions.create(n=2, **kw)
    assert [c.index for c in a.choices] == [0, 1]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]  # same seed, same text
    assert a.usage.prompt_tokens == len(tokenizer.encode("Once upon a time"))
    # Streamed with the same n, so the batch is the same: bf16 GEMMs are not batch-invariant.
    chunks = list(client.completions.create(n=2, stream=True, **kw))
    for choice in a.choices:
        assert "".join(c.text for ch in chunks for c in ch.choices if c.index == choice.index) == choice.text
    # expected texts written by hand (what any sane model continues with), not taken from our output
    greedy = client.completions.create(model=model, prompt="1, 2, 3, 4,", max_tokens=8, temperature=0)
    assert greedy.choices[0].text == " 5, 6, 7"
    cut = client.completions.create(model=model, prompt="1, 2, 3, 4,", max_tokens=8, temperature=0, stop=["6, 7"])
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].text == " 5, "


def test_completions_logprobs(client, model):
    r = client.completions.create(model=model, prompt="The sky is", max_tokens=4, temperature=0,
                                  logprobs=2, extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert r.usage.completion_tokens == 4 == len(lp.tokens) == len(lp.token_logprobs)
    assert all(len(t) <= 2 for t in lp.top_logprobs) and all(x <= 0 for x in lp.token_logprobs)
    echo = client.completions.create(model=model, prompt="The sky is", max_tokens=4, temperature=0,
                                     logprobs=2, echo=True, extra_body={"ignore_eos": True})
    elp = echo.choices[0].logprobs
    n_prompt = echo.usage.prompt_tokens
    assert len(elp.tokens) == n_prompt + 4 and elp.token_logprobs[0] is None and elp.top_logprobs[0] is None
    assert all(x <= 0 for x in elp.token_logprobs[1:]) and elp.token_logprobs[n_prompt:] == lp.token_logprobs
    assert echo.choices[0].text == "The sky is" + r.choices[0].text


def test_max_tokens_0_with_echo_scores_the_prompt(client, model):
    full = client.completions.create(model=model, prompt="The sky is blue", max_tokens=1, temperature=0,
                                     logprobs=1, echo=True)
    r = client.completions.create(model=model, prompt="The sky is blue", max_tokens=0, logprobs=1, echo=True)
    c, n = r.choices[0], r.usage.prompt_tokens
    assert c.text == "The sky is blue" and r.usage.completion_tokens == 0 and c.finish_reason == "length"
    assert len(c.logprobs.tokens) == n and c.logprobs.token_logprobs[0] is None
    assert c.logprobs.token_logprobs == full.choices[0].logprobs.token_logprobs[:n]
    with pytest.raises(openai.BadRequestError) as e:  # without echo there is nothing to return
        client.completions.create(model=model, prompt="x", max_tokens=0)
    assert e.value.body["param"] == "max_tokens"


def test_context_errors_name_the_field_that_holds_the_prompt(client, model):
    long = "word " * 1100  # over the 1024-token window
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model, prompt=long, max_tokens=4)
    assert e.value.body["code"] == "context_length_exceeded" and e.value.body["param"] == "prompt"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": long}], max_tokens=4)
    assert e.value.body["param"] == "messages"
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=model, input=long, max_output_tokens=4, store=False)
    assert e.value.body["code"] == "context_length_exceeded" and e.value.body["param"] == "input"
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=model, input="hi", max_output_tokens=4, store=False, text={"format": {
            "type": "json_schema", "name": "x", "schema": {"type": "object", "properties": {"a": {"$ref": "#/x"}}}}})
    assert e.value.body["param"] == "text.format"


def test_error_paths_then_good_request(server, client, model):
    cases = [
        (lambda: client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=-1),
         openai.BadRequestError, "max_tokens"),
        (lambda: client.chat.completions.create(model=model, messages=MESSAGES, temperature=-1),
         openai.BadRequestError, "temperature"),
        (lambda: client.chat.completions.create(model=model, messages=[]), openai.BadRequestError, "messages"),
        (lambda: client.chat.completions.create(model="no-such-model", messages=MESSAGES),
         openai.NotFoundError, "model"),
        (lambda: client.completions.create(model=model, prompt="hi " * 2000, max_tokens=5),
         openai.BadRequestError, "prompt"),  # the field that held the prompt
    ]
    for call, exc, param in cases:
        with pytest.raises(exc) as e:
            call()
        assert e.value.body["param"] == param and e.value.body["message"]
        assert client.completions.create(model=model, prompt="Hi", max_tokens=2).choices[0].text is not None
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model, prompt="hi " * 1100)
    assert re.match(r"This model's maximum context length is 1024 tokens\. However, you requested "
                    r"\d+ tokens \(\d+ in the messages, 1 in the completion\)\.", e.value.body["message"])
    r = server.post("/v1/completions", content=b"{oops")
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    r = server.post("/v1/completions", content=b"x" * (5 * 2**20))
    assert r.status_code == 413 and "error" in r.json()
    r = server.post("/v1/completions", key="wrong", json_body={"prompt": "hi"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert client.completions.create(model=model, prompt="Hi", max_tokens=2).usage.completion_tokens >= 1
    wait_idle(server)


def test_tokenize_detokenize(server, tokenizer):
    r = server.post("/tokenize", json_body={"prompt": "hello world"}).json()
    assert r["tokens"] == tokenizer.encode("hello world") and r["count"] == len(r["tokens"])
    assert server.post("/detokenize", json_body={"tokens": r["tokens"]}).json()["prompt"].endswith("hello world")


def test_tokenizer_info_and_the_exported_folder_tokenize_as_the_server(server, model, tmp_path):
    from transformers import AutoTokenizer

    from pyengine.tokenizer import main as tokenizer_main

    info = server.get("/tokenizer_info").json()  # what lm-eval's "remote" tokenizer reads
    assert info["eos_token"] == "<|im_end|>" and "<|im_start|>" in info["chat_template"]
    assert info["model"] == model and info["model_max_length"] == 1024
    assert server.get(f"/tokenizer_info?model={model}").json() == info
    assert server.get("/tokenizer_info?model=nope").status_code == 404
    assert server.get("/tokenizer_info", key=None).status_code == 401

    assert tokenizer_main(["export", str(tmp_path)]) == 0
    hf = AutoTokenizer.from_pretrained(str(tmp_path))  # what guidellm / aiperf / lm-eval load with --tokenizer
    for text in ["hello world", "  two  spaces\tand\nlines", "héllo 日本語 🙂", "<|im_start|>user\nhi<|im_end|>"]:
        for special in (True, False):  # lm-eval's remote backend asks for add_special_tokens false
            served = server.post("/tokenize", json_body={"prompt": text, "add_special_tokens": special}).json()
            assert hf(text, add_special_tokens=special)["input_ids"] == served["tokens"]
        assert hf.decode(served["tokens"]) == server.post("/detokenize", json_body={
            "tokens": served["tokens"]}).json()["prompt"]
    messages = [{"role": "user", "content": "hi"}]
    assert hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)["input_ids"] == \
        server.post("/tokenize", json_body={"messages": messages}).json()["tokens"]
    assert hf.eos_token == info["eos_token"]


def test_32_streams_a_third_disconnect(server, model):
    async def one(session: aiohttp.ClientSession, i: int) -> str | None:
        body = {"model": model, "prompt": f"Story number {i}:", "max_tokens": 16, "stream": True,
                "ignore_eos": True, "temperature": 0.7, "seed": i}
        async with session.post(server.url + "/v1/completions", json=body, headers=_auth(KEY)) as r:
            assert r.status == 200
            finish, seen = None, 0
            async for line in r.content:
                if not line.startswith(b"data: "):
                    continue
                if line.strip() == b"data: [DONE]":
                    return finish
                chunk = json.loads(line[6:])
                seen += 1
                finish = chunk["choices"][0]["finish_reason"] or finish
                if i % 3 == 0 and seen == 3:
                    r.close()  # leave mid-stream
                    return "left"
        return None

    async def run() -> list:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=240)) as session:
            return await asyncio.gather(*(one(session, i) for i in range(32)))

    def aborted() -> float:
        m = re.search(r'^pyengine:request_success_total\{finished_reason="abort",model_name="[^"]+"\} (\S+)$',
                      server.get("/metrics").text, re.M)
        return float(m.group(1)) if m else 0.0

    before = aborted()
    results = asyncio.run(run())
    assert results.count("left") == 11
    assert all(r == "length" for i, r in enumerate(results) if i % 3)
    s = wait_idle(server)
    assert s["num_free_blocks"] == s["num_total_blocks"]
    metrics = server.get("/metrics").text
    assert re.search(r"^pyengine:num_requests_running(\{[^}]*\})? 0\.0$", metrics, re.M)
    assert re.search(r'^pyengine_server:requests_in_flight\{model_name="[^"]+"\} 0\.0$', metrics, re.M)
    assert aborted() - before == 11  # the engine stopped each stream whose client left


def test_back_pressure_timeout_and_rate_limit(tight):
    async def run():
        hdr = _auth("k1")
        long = {"prompt": "Count:", "max_tokens": 900, "ignore_eos": True, "temperature": 0}
        async with aiohttp.ClientSession() as session:
            a = await session.post(tight.url + "/v1/completions", json={**long, "stream": True}, headers=hdr)
            assert a.status == 200
            await a.content.readuntil(b"\n\n")  # A runs; its first token is out
            b = asyncio.ensure_future(session.post(tight.url + "/v1/completions", json=long, headers=hdr))
            while (await (await session.get(tight.url + "/stats", headers=hdr)).json())["gateway"]["waiting"] < 1:
                await asyncio.sleep(0.02)
            c = await session.post(tight.url + "/v1/completions", json=long, headers=hdr)  # B waits: full
            assert c.status == 503 and c.headers["Retry-After"]
            assert (await c.json())["error"]["code"] == "server_overloaded"
            text = await a.text()  # A is cut by the 2 s timeout: an error event, then [DONE]
            assert '"type": "timeout"' in text and text.endswith("data: [DONE]\n\n")
            b = await b
            assert b.status == 504 and (await b.json())["error"]["type"] == "timeout"

    asyncio.run(run())
    wait_idle(tight)
    for _ in range(3):
        assert tight.post("/v1/completions", key="k2", json_body={"prompt": "Hi", "max_tokens": 1}).status_code == 200
    r = tight.post("/v1/completions", key="k2", json_body={"prompt": "Hi", "max_tokens": 1})
    assert r.status_code == 429 and int(r.headers["Retry-After"]) >= 1
    assert r.json()["error"]["code"] == "rate_limit_exceeded"


async def sse_texts(session: aiohttp.ClientSession, url: str, body: dict) -> tuple[bytes, list[str]]:
    """The raw SSE body of a streamed completion and its text deltas."""
    async with session.post(url, json={**body, "stream": True}, headers=_auth(KEY)) as r:
        assert r.status == 200
        raw = await r.read()
    events = [json.loads(line[6:]) for line in raw.split(b"\n\n") if line.startswith(b"data: {")]
    return raw, [e["choices"][0]["text"] for e in events if e["choices"]]


@pytest.mark.parametrize("prompt, max_tokens, char", [("😀" * 10, 15, "😀"), ("你好！" * 5, 16, "！"),
                                                     ("日本の首都は東京です。中国の首都は", 16, None)])
def test_multibyte_characters_stream_whole(server, model, prompt, max_tokens, char):
    """Emoji and CJK characters take several byte-level tokens each: the stream holds a partial
    character back until it is complete, so every delta is valid UTF-8 text without U+FFFD and the
    deltas add up to the non-streamed text. (max_tokens ends each on a whole character.)

    The plain request runs twice first, so that it and the streamed one both find the prompt's full
    blocks in the prefix cache: a prompt computed whole and one computed from cached blocks go
    through different attention kernels (prefill tiles vs the decode kernel), and in bf16 a near-tie
    (this CJK prompt has one, 0.0015 nats apart at token 14) can then go either way."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    server.post("/v1/completions", json_body=body)
    plain = server.post("/v1/completions", json_body=body).json()["choices"][0]["text"]

    async def run():
        async with aiohttp.ClientSession() as session:
            return await sse_texts(session, server.url + "/v1/completions", body)

    raw, deltas = asyncio.run(run())
    raw.decode("utf-8")  # strict: the SSE body is valid UTF-8
    assert "".join(deltas) == plain
    assert "\ufffd" not in plain and not any("\ufffd" in d for d in deltas)
    assert len(plain.encode()) > len(plain)  # multi-byte characters did come out
    if char is not None:
        assert char in plain


def test_sigterm_drains_in_flight_then_exits_0(server, model):
    async def run():
        async with aiohttp.ClientSession() as session:
            body = {"model": model, "prompt": "Go", "max_tokens": 16, "ignore_eos": True, "stream": True}
            r = await session.post(server.url + "/v1/completions", json=body, headers=_auth(KEY))
            await r.content.readuntil(b"\n\n")
            server.proc.send_signal(signal.SIGTERM)
            text = await r.text()
            assert '"finish_reason": "length"' in text and text.endswith("data: [DONE]\n\n")

    asyncio.run(run())
    assert server.proc.wait(30) == 0
    with pytest.raises(urllib.error.URLError):
        http("GET", server.url + "/health", None)
