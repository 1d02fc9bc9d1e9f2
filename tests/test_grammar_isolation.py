"""Grammar compiles run apart from everything else (pyengine/grammar_pool.py): a slow compile fails
alone at the time limit, an abandoned one stops, identical ones are merged and cached, and SIGTERM
does not wait on them. One real `python -m server` with a short compile limit, and the pool alone."""
from __future__ import annotations

import asyncio
import json
import signal
import socket
import threading
import time
import urllib.parse

import pytest

from pyengine.grammar_pool import GrammarPool
from pyengine.model.loader import resolve_model_path
from pyengine.sampling_params import StructuredOutputsParams
from pyengine.structured import StructuredOutputs
from pyengine.tokenizer import Tokenizer
from test_server_e2e import ServerProcess

KEY = "grammar-key"
LIMIT = 4.0  # the server's --grammar-compile-timeout
SMALL = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}


def slow_schema(tag: str, objects: int = 200) -> dict:
    """A schema whose compile takes minutes: an anyOf of `objects` objects of 30 properties, each an
    integer or a pattern string. `tag` makes the text (and so the compile) distinct."""
    prop = {"anyOf": [{"type": "integer"}, {"type": "string", "pattern": "[a-z]{0,50}"}]}
    return {"anyOf": [{"type": "object", "properties": {f"{tag}{i}_{j}": prop for j in range(30)},
                       "required": [f"{tag}{i}_{j}" for j in range(30)]} for i in range(objects)]}


def schema_body(model: str, schema: dict, **kw) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "Answer."}], "max_tokens": 8,
            "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}, **kw}


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess(KEY, "--grammar-compile-timeout", str(LIMIT), "--shutdown-grace", "5",
                        "--max-model-len", "4096").wait_ready()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def model(server):
    return server.get("/v1/models").json()["data"][0]["id"]


def abandon(url: str, body: dict, after: float) -> None:
    """POST body, then close the connection after `after` seconds without reading the answer."""
    u = urllib.parse.urlsplit(url)
    data = json.dumps(body).encode()
    with socket.create_connection((u.hostname, u.port)) as s:
        s.sendall(f"POST {u.path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                  f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)
        time.sleep(after)


def test_abandoned_slow_compiles_leave_the_server_responsive(server, model):
    # six distinct slow compiles (none merges with another), each abandoned after 1.5 s
    threads = [threading.Thread(target=abandon, args=(server.url + "/v1/chat/completions",
                                                      schema_body(model, slow_schema(f"a{k}_")), 1.5))
               for k in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    words = " ".join(["word"] * 3000)
    answers = {}

    def call(name: str, path: str, body: dict) -> None:
        answers[name] = server.post(path, json_body=body)

    calls = [("json_schema", "/v1/chat/completions", schema_body(model, SMALL)),
             ("chat", "/v1/chat/completions", {"model": model, "max_tokens": 1,
                                               "messages": [{"role": "user", "content": words}]}),
             ("tokenize", "/tokenize", {"model": model, "prompt": "x" * 18_000})]
    start = time.monotonic()
    workers = [threading.Thread(target=call, args=c) for c in calls]
    for t in workers:
        t.start()
    for t in workers:
        t.join(60)
    assert time.monotonic() - start < 60  # liveness: today they all wait behind the slow compiles
    assert {k: r.status_code for k, r in answers.items()} == {"json_schema": 200, "chat": 200, "tokenize": 200}


def test_a_slow_compile_gets_a_400_at_the_limit_naming_it(server, model):
    start = time.monotonic()
    r = server.post("/v1/chat/completions", json_body=schema_body(model, slow_schema("t_")))
    took = time.monotonic() - start
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "response_format" and f"{LIMIT:g} s" in err["message"]
    assert LIMIT <= took < LIMIT + 30  # killed at the limit, not left to run for minutes
    # the same schema again is refused at once (the failure is cached, no worker spends the limit again)
    start = time.monotonic()
    assert server.post("/v1/chat/completions", json_body=schema_body(model, slow_schema("t_"))).status_code == 400
    assert time.monotonic() - start < LIMIT


def test_sigterm_with_compiles_in_flight_exits_within_the_drain_timeout(server, model):
    async def run() -> None:
        import aiohttp

        async with aiohttp.ClientSession() as session:
            posts = [asyncio.create_task(session.post(server.url + "/v1/chat/completions",
                                                      json=schema_body(model, slow_schema(f"s{k}_")),
                                                      headers={"Authorization": f"Bearer {KEY}"}))
                     for k in range(3)]
            await asyncio.sleep(1.0)  # the compiles have started
            server.proc.send_signal(signal.SIGTERM)
            await asyncio.gather(*posts, return_exceptions=True)

    asyncio.run(run())
    assert server.proc.wait(5 + 10) == 0  # --shutdown-grace 5, with room for the interpreter's exit


# ---- the pool alone -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def structured():
    so = StructuredOutputs(Tokenizer.from_model_path(resolve_model_path(None)), 49152, [2], compile_timeout=60)
    yield so
    so.close()


def test_identical_compiles_in_flight_are_merged_then_cached(structured):
    params = StructuredOutputsParams(json={"type": "object", "properties": {"merged": {"type": "integer"}}})
    before = structured.pool.num_compiles

    async def both():
        return await asyncio.gather(*(structured.compile_async(params) for _ in range(4)))

    grammars = asyncio.run(both())
    assert all(g is grammars[0] for g in grammars)
    assert structured.pool.num_compiles == before + 1
    assert structured.compile(params) is grammars[0]  # cached: no worker round trip
    assert structured.pool.num_compiles == before + 1


def test_a_compile_nobody_waits_for_is_killed(structured):
    killed = structured.pool.num_killed

    async def leave():
        task = asyncio.ensure_future(structured.compile_async(StructuredOutputsParams(json=slow_schema("k_"))))
        await asyncio.sleep(1.0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(leave())
    deadline = time.monotonic() + 5
    while structured.pool.num_killed == killed and time.monotonic() < deadline:
        time.sleep(0.05)
    assert structured.pool.num_killed == killed + 1  # long before LIMIT: nobody waited any more
    assert structured.compile(StructuredOutputsParams(regex="[0-9]+")) is not None  # the next worker serves


def test_pool_refuses_bad_settings():
    with pytest.raises(ValueError, match="workers"):
        GrammarPool("{}", workers=0)
    with pytest.raises(ValueError, match="time limit"):
        GrammarPool("{}", time_limit=0)


def test_a_worker_that_dies_on_a_grammar_refuses_that_grammar_and_the_next_one_compiles(structured):
    params = StructuredOutputsParams(json=slow_schema("d_"))

    async def kill_it():
        task = asyncio.ensure_future(structured.compile_async(params))
        await asyncio.sleep(1.0)  # compiling by now
        for w in structured.pool._workers:
            if w is not None:
                w.proc.kill()  # what the kernel's OOM killer would do
        with pytest.raises(ValueError, match="process exited"):
            await task

    asyncio.run(kill_it())
    assert structured.compile(StructuredOutputsParams(regex="[a-z]+")) is not None
