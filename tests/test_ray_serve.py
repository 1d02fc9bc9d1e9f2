"""`server.ray` on a local Ray instance: 2 engine replicas x 1 thread behind the ingress (the same
aiohttp app as `python -m server`), prefix-aware routing, metrics per replica, and a replica killed
under load. One Ray instance and one Serve application for the whole module (starting them takes
most of its time)."""
from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import time
import urllib.request

import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
openai = pytest.importorskip("openai")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from server.ray import APP_NAME, build_app  # noqa: E402

# the first test also starts Ray and two replicas; the kill test waits up to 2 minutes for a new replica
pytestmark = [pytest.mark.ray, pytest.mark.timeout(600)]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPLICAS = ["engine-0", "engine-1"]


@pytest.fixture(scope="module")
def url():
    ray.init(address="local", num_cpus=4, include_dashboard=False, logging_level=logging.WARNING,
             runtime_env={"env_vars": {"PYTHONPATH": ROOT}})  # a new instance; the replicas import this checkout
    try:
        serve.start(proxy_location="Disabled")
        app = build_app({"replicas": 2, "num_threads": 1, "port": 0, "kv_cache_memory": "128MiB",
                         "max_model_len": 2048, "stats_interval": 0})
        ingress = serve.run(app, name=APP_NAME, route_prefix=None)
        host, port = ingress.address.remote().result()
        yield f"http://{host}:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def metrics(url: str) -> dict[tuple[str, frozenset], float]:
    text = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def metrics_when(url: str, done, timeout: float = 30.0) -> dict[tuple[str, frozenset], float]:
    """The first /metrics sample for which done(sample) holds, or the last one after `timeout` s: the
    ingress polls the replicas' series (every second, longer while a busy replica answers late), so
    they lag the requests."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(url)
        if done(m) or time.monotonic() > deadline:
            return m
        time.sleep(0.5)


def per_replica(m: dict, name: str) -> dict[str, float]:
    return {r: sum(v for (n, labels), v in m.items() if n == name and ("replica", r) in labels) for r in REPLICAS}


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_openai_client_streams_through_serve(url):
    c = client(url)
    model = c.models.list().data[0].id
    chunks = list(c.chat.completions.create(model=model, messages=[{"role": "user", "content": "Say hi."}],
                                            max_tokens=8, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text and sum(1 for ch in chunks if ch.choices and ch.choices[0].delta.content) >= 2
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    m = metrics(url)
    assert sum(per_replica(m, "pyengine_ray:replica_requests_total").values()) >= 1
    assert ("pyengine_ray:replica_healthy", frozenset({("model_name", model), ("replica", "engine-1")})) in m
    stats = json.load(urllib.request.urlopen(f"{url}/stats", timeout=10))
    assert stats["engine"]["num_total_blocks"] == 2 * stats["plan"]["num_blocks"] > 0  # both replicas' pools


def test_conversations_stay_on_their_replica_and_hit_its_prefix_cache(url):
    """Two interleaved 5-turn conversations, one with a session id (X-Session-Id), one without: each
    stays on one replica (a different one each, the first turns having gone to the least-loaded), and
    every later turn reuses its cached prefix."""
    c = client(url)
    model = c.models.list().data[0].id
    convs = {name: [{"role": "system", "content": f"{name} is your name. You answer in one short sentence."}]
             for name in ("Ada", "Bob")}
    where = {name: [] for name in convs}
    before_decisions = metrics(url)
    for turn in range(5):
        for name, messages in convs.items():
            messages.append({"role": "user", "content": f"Question {turn + 1}: what is {turn} plus {turn}?"})
            before = per_replica(metrics(url), "pyengine_ray:replica_requests_total")
            headers = {"X-Session-Id": "ada-1"} if name == "Ada" else None
            r = c.chat.completions.create(model=model, messages=messages, max_tokens=6, temperature=0,
                                          extra_headers=headers)
            after = per_replica(metrics(url), "pyengine_ray:replica_requests_total")
            where[name].append([rep for rep in REPLICAS if after[rep] > before[rep]])
            messages.append({"role": "assistant", "content": r.choices[0].message.content})
            cached = r.usage.prompt_tokens_details.cached_tokens
            if turn > 0:
                assert cached >= 16 * (r.usage.prompt_tokens // 16 - 3), (name, turn, r.usage)
    assert all(len(w) == 1 for ws in where.values() for w in ws), where
    assert len({w[0] for w in where["Ada"]}) == 1 and len({w[0] for w in where["Bob"]}) == 1, where
    assert where["Ada"][0] != where["Bob"][0], where
    m = metrics(url)
    for reason in ("session", "prefix"):  # turns 2-5 of Ada, of Bob
        key = ("pyengine_ray:routing_decisions_total", frozenset({("model_name", model), ("reason", reason)}))
        assert m[key] - before_decisions.get(key, 0) >= 4, reason
    used = (where["Ada"][0][0], where["Bob"][0][0])

    def hit(m):
        return all(per_replica(m, "pyengine:prefix_cache_hits_total")[r] > 0 for r in used)
    assert hit(metrics_when(url, hit)), used


def test_client_disconnect_frees_the_replicas_blocks(url):
    c = client(url)
    model = c.models.list().data[0].id
    stream = c.completions.create(model=model, prompt="Count from one to one thousand:", max_tokens=400,
                                  stream=True, temperature=0)
    next(iter(stream))
    stream.close()
    def idle(m):
        return not any(per_replica(m, "pyengine:num_requests_running").values()) \
            and not any(per_replica(m, "pyengine:kv_cache_usage_perc").values())
    m = metrics_when(url, idle)
    assert idle(m), (per_replica(m, "pyengine:num_requests_running"), per_replica(m, "pyengine:kv_cache_usage_perc"))


async def _stream(url: str, model: str, prompt: str, max_tokens: int, started: set, i: int) -> str | None:
    """Stream one completion of exactly max_tokens tokens (EOS ignored); None when it finished, else the error
    message."""
    c = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    try:
        stream = await c.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, stream=True,
                                            temperature=0, extra_body={"ignore_eos": True})
        n = 0
        async for ch in stream:
            if ch.choices and ch.choices[0].text:
                started.add(i)
                n += 1
        return None if n else "no tokens"
    except openai.APIError as e:
        return str(e)
    finally:
        await c.close()


def test_killed_replica_loses_only_its_started_requests_and_serve_restarts_it(url):
    model = client(url).models.list().data[0].id

    async def scenario():
        started: set[int] = set()
        # distinct short prompts: no shared block, so the router spreads them by load. 512 tokens each, so
        # that every stream is still generating when the victim is killed (a few seconds after the last
        # one started); the survivors then finish them, which with 1,024 took most of this test's time
        first = [asyncio.create_task(_stream(url, model, f"{i} little {['cats', 'dogs', 'owls', 'foxes'][i % 4]} "
                                             f"went out to", 512, started, i)) for i in range(8)]
        deadline = time.monotonic() + 60
        while len(started) < len(first) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        assert len(started) == len(first), f"only {len(started)} of {len(first)} streams started within 60 s"
        # every stream has had a token, so each one on the victim fails rather than being sent elsewhere (a
        # replica that dies before a request's first token only costs a retry: that once made this test
        # kill a replica whose requests were all still waiting, and nothing failed)
        in_flight = per_replica(await asyncio.to_thread(metrics, url), "pyengine_ray:replica_in_flight")
        victim = next(r for r in REPLICAS if in_flight[r])
        assert not any(t.done() for t in first), "a 512-token stream finished before the kill"
        handle = serve.get_deployment_handle(victim, app_name=APP_NAME)
        pid = (await handle.info.remote())["pid"]
        os.kill(pid, signal.SIGKILL)
        later = [asyncio.create_task(_stream(url, model, f"Later request {i}: the sky is", 8, started, 100 + i))
                 for i in range(4)]
        return victim, pid, in_flight[victim], await asyncio.gather(*first), await asyncio.gather(*later)

    victim, pid, victim_in_flight, first, later = asyncio.run(scenario())
    failed = [e for e in first if e is not None]
    assert all("died while generating" in e for e in failed), failed
    assert len(failed) == victim_in_flight >= 1, (failed, victim_in_flight)  # every one of its streams had started
    assert later == [None] * 4  # queued after the kill: served by a healthy replica
    m = metrics(url)
    assert per_replica(m, "pyengine_ray:replica_failures_total")[victim] >= 1

    deadline = time.monotonic() + 120  # Serve replaces the replica (a new process loads the model)
    while time.monotonic() < deadline:
        healthy = per_replica(metrics(url), "pyengine_ray:replica_healthy")
        if healthy[victim] == 1:
            break
        time.sleep(1)
    assert healthy[victim] == 1
    handle = serve.get_deployment_handle(victim, app_name=APP_NAME)
    assert handle.info.remote().result(timeout_s=60)["pid"] != pid
