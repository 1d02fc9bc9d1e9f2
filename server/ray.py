"""Replicas on Ray Serve: one pyengine engine per replica, behind the same HTTP app as `python -m server`.

    python -m server.ray --model PATH --replicas N [--address ADDR] [--num-threads T]
    serve run deploy/ray_serve.yaml

The Serve application has N engine deployments (`engine-0` ... `engine-{N-1}`, one replica each, so
the router can pick the replica) and one `ingress` deployment. The ingress runs server.app's aiohttp
application (gateway, validation, OpenAI handlers, /metrics) over a RayEngine: an object with
AsyncLLM's interface that sends each request to a replica through its deployment handle and streams
the outputs back through Serve. The router (server/replica_router.py) keeps a conversation (header
`X-Session-Id`) and prompts sharing leading KV blocks on the replica holding them.

Failures: Serve health-checks every replica (`check_health`) and restarts the ones that die. A
request whose replica dies before its first output is sent to another replica; one that had started
fails with a `replica_died` error. Requests waiting at the ingress go to healthy replicas only.
"""
from __future__ import annotations

import argparse
import asyncio
import contextvars
import dataclasses
import logging
import os
import signal
import sys
from dataclasses import dataclass
from typing import Any, AsyncIterator

import ray
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily, Metric
from ray import serve
from ray.exceptions import ActorUnavailableError, RayActorError

from pyengine.config import EngineConfig
from pyengine.engine.engine import EngineStats
from pyengine.engine.output import RequestOutput
from pyengine.sampling_params import SamplingParams
from server.cli import build_parser, engine_config, server_config
from server.app import create_app, listen
from server.protocol import APIError
from server.replica_router import Decision, PrefixRouter, Replica, RouterConfig

log = logging.getLogger("server.ray")
APP_NAME = "pyengine"
SESSION_HEADER = "X-Session-Id"
_session: contextvars.ContextVar[str | None] = contextvars.ContextVar("pyengine_session", default=None)
_REPLICA_GONE = (RayActorError, ActorUnavailableError)  # what a call to a dead or unreachable replica raises


# ------------------------------------------------------------------ the engine replica (one deployment each)
@dataclass
class _Refused:
    """The engine refused the request before queueing it (ValueError): a 400 for the client."""

    message: str


@dataclass
class _Failed:
    """The engine failed the request (e.g. its step failed)."""

    message: str


class EngineReplica:
    """One AsyncLLM in a Serve replica. Errors come back as values, not Ray's wrapped exceptions, so
    the client sees the engine's message and not a remote traceback."""

    def __init__(self, config: EngineConfig) -> None:
        from pyengine import AsyncLLM

        self.llm = AsyncLLM(config)

    def info(self) -> dict:
        return {"model_name": self.llm.model_name, "max_model_len": self.llm.max_model_len,
                "pid": os.getpid(), "plan": self.llm.plan}

    async def generate(self, prompt_ids: list[int], params: SamplingParams, request_id: str,
                       priority: int) -> AsyncIterator[RequestOutput | _Refused | _Failed]:
        try:
            async for out in self.llm.generate(prompt_ids, params, request_id, priority=priority,
                                               prompt_token_ids=prompt_ids):
                yield out
        except ValueError as e:
            yield _Refused(str(e))
        except Exception as e:  # asyncio.CancelledError (the caller left) is not an Exception: it propagates
            log.exception("request %s failed", request_id)
            yield _Failed(str(e))

    async def abort(self, request_id: str) -> None:
        await self.llm.abort(request_id)

    async def check_params(self, params: SamplingParams) -> str | None:
        try:
            await self.llm.check_params(params)
        except ValueError as e:
            return str(e)
        return None

    def stats(self) -> tuple[EngineStats, list[Metric]]:
        return self.llm.stats(), list(self.llm.metrics.registry.collect())

    def check_health(self) -> None:
        """Serve calls this every health_check_period_s; raising makes it restart the replica."""
        if not self.llm.is_healthy():
            raise RuntimeError("the engine's step loop stopped")


# ------------------------------------------------------------------ the ingress's engine: AsyncLLM over replicas
class RayEngine:
    """AsyncLLM's interface (generate, abort, check_params, stats, metrics, start/shutdown) over engine
    replicas, so that server.app.create_app serves them unchanged. Replica stats and metrics are
    polled every `poll_interval` seconds; /metrics shows each replica's series with a `replica` label
    next to the router's own counters."""

    def __init__(self, handles: list, info: dict, tokenizer: Any, router: RouterConfig, *,
                 poll_interval: float = 1.0, poll_timeout: float = 10.0, wait_for_replica: float = 60.0) -> None:
        self.handles = handles
        self.names = [h.deployment_name for h in handles]
        self.router = PrefixRouter([Replica(n) for n in self.names], router)
        self.tokenizer = tokenizer
        self.model_name = info["model_name"]
        self.max_model_len = info["max_model_len"]
        self.plan = info.get("plan")  # the first replica's memory plan (the web page shows it)
        self.poll_interval, self.poll_timeout, self.wait_for_replica = poll_interval, poll_timeout, wait_for_replica
        self._stats: list[EngineStats | None] = [None] * len(handles)
        self._families: list[list[Metric]] = [[] for _ in handles]
        self._where: dict[str, int] = {}  # request id -> replica, while it runs
        self._poller: asyncio.Task | None = None
        self.metrics = _RayMetrics(self)

    # ---- lifecycle -----------------------------------------------------------------------------
    async def start(self) -> None:
        if self._poller is None:
            self._poller = asyncio.create_task(self._poll())

    async def shutdown(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            self._poller = None

    def is_healthy(self) -> bool:
        return any(r.healthy for r in self.router.replicas)

    def stats(self) -> EngineStats:
        """Sums over the healthy replicas (as of the last poll)."""
        got = [s for s, r in zip(self._stats, self.router.replicas) if s is not None and r.healthy]
        total = EngineStats(*(sum(getattr(s, f.name) for s in got) for f in dataclasses.fields(EngineStats)))
        total.kv_usage = 1 - total.num_free_blocks / total.num_total_blocks if total.num_total_blocks else 0.0
        return total

    # ---- requests ------------------------------------------------------------------------------
    async def generate(self, prompt: str | list[int], params: SamplingParams, request_id: str, *,
                       priority: int = 0, prompt_token_ids: list[int] | None = None) -> AsyncIterator[RequestOutput]:
        if prompt_token_ids is not None:
            ids = list(prompt_token_ids)
        else:
            ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        session = _session.get()
        for _ in range(len(self.handles) + 1):  # each failed try took a replica out until it answers again
            d = await self._choose(ids, session)
            replica = self.router.replicas[d.index]
            self.metrics.routed(d, replica.name)
            stream = self.handles[d.index].options(stream=True).generate.remote(ids, params, request_id, priority)
            replica.in_flight += 1
            self._where[request_id] = d.index
            started = finished = False
            try:
                async for item in stream:
                    if isinstance(item, _Refused):
                        raise ValueError(item.message)
                    if isinstance(item, _Failed):
                        raise RuntimeError(f"engine replica {replica.name}: {item.message}")
                    started, finished = True, item.finished
                    yield item
                return
            except _REPLICA_GONE as e:
                self._lost(d.index, e)
                if started:
                    raise APIError(502, f"Engine replica {replica.name} died while generating this request; "
                                        f"the output so far is lost. Retrying may succeed on another replica.",
                                   type="server_error", code="replica_died") from None
                self.metrics.retries.inc()
                log.warning("request %s: replica %s died before it started; trying another replica",
                            request_id, replica.name)
            finally:
                replica.in_flight -= 1
                self._where.pop(request_id, None)
                if not finished:
                    stream.cancel()  # the replica's generator is cancelled: the engine aborts the request
        raise APIError(503, "Every engine replica failed this request.", type="server_error", code="no_replica")

    async def abort(self, request_id: str) -> None:
        i = self._where.get(request_id)
        if i is not None:
            await self.handles[i].abort.remote(request_id)

    async def check_params(self, params: SamplingParams) -> None:
        """Asks the least-loaded healthy replica (the vocabulary and the grammar compiler live there);
        with none healthy, generate() waits for one and checks there."""
        live = [i for i, r in enumerate(self.router.replicas) if r.healthy]
        if not live:
            return
        i = min(live, key=lambda j: self.router.replicas[j].in_flight)
        try:
            message = await self.handles[i].check_params.remote(params)
        except _REPLICA_GONE as e:
            self._lost(i, e)
            return
        if message is not None:
            raise ValueError(message)

    async def _choose(self, ids: list[int], session: str | None) -> Decision:
        """Route to a healthy replica and remember where the prompt went; when no replica is healthy,
        wait up to wait_for_replica seconds for one."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.wait_for_replica
        while (d := self.router.choose(ids, session)) is None:
            if loop.time() > deadline:
                raise APIError(503, "No engine replica is available; they are restarting.", type="server_error",
                               code="no_replica")
            await asyncio.sleep(self.poll_interval)
        self.router.record(d.index, ids, session)
        return d

    def _lost(self, index: int, exc: BaseException) -> None:
        replica = self.router.replicas[index]
        if replica.healthy:
            log.warning("engine replica %s is gone (%s); routing around it until it answers again",
                        replica.name, type(exc).__name__)
            replica.healthy = False
            self.metrics.failures.labels(self.model_name, replica.name).inc()
            self.router.forget(index)  # Serve starts a new replica, with an empty cache

    # ---- polling -------------------------------------------------------------------------------
    async def _poll(self) -> None:
        while True:
            await asyncio.gather(*(self._poll_one(i) for i in range(len(self.handles))))
            await asyncio.sleep(self.poll_interval)

    async def _poll_one(self, i: int) -> None:
        try:
            self._stats[i], self._families[i] = await asyncio.wait_for(self.handles[i].stats.remote(),
                                                                       self.poll_timeout)
        except TimeoutError:  # busy, or dead and not yet replaced: its state stays as it is
            return
        except Exception as e:  # noqa: BLE001 - any failure of the call means the replica is not serving
            self._lost(i, e)
            return
        replica = self.router.replicas[i]
        if not replica.healthy:
            log.info("engine replica %s is serving again", replica.name)
            replica.healthy = True


class _RayMetrics:
    """The ingress's /metrics: every replica's engine series (with a `replica` label), the router's
    decisions, retries and replica failures, and per-replica in-flight / health gauges."""

    def __init__(self, engine: RayEngine) -> None:
        self.engine = engine
        self.registry = CollectorRegistry()
        self.decisions = Counter("pyengine_ray:routing_decisions", "Requests routed, by reason "
                                 "(session, prefix: the replica holding the prompt's leading blocks, least_loaded)",
                                 ["model_name", "reason"], registry=self.registry)
        self.requests = Counter("pyengine_ray:replica_requests", "Requests sent to each replica",
                                ["model_name", "replica"], registry=self.registry)
        self.matched_blocks = Counter("pyengine_ray:routed_prefix_blocks",
                                      "Leading prompt blocks the chosen replica was known to hold",
                                      ["model_name"], registry=self.registry)
        self.retries = Counter("pyengine_ray:retried_requests",
                               "Requests sent to another replica because theirs died before they started",
                               ["model_name"], registry=self.registry).labels(engine.model_name)
        self.failures = Counter("pyengine_ray:replica_failures", "Times a replica was found dead or unreachable",
                                ["model_name", "replica"], registry=self.registry)
        self.registry.register(self)

    def routed(self, d: Decision, replica: str) -> None:
        model = self.engine.model_name
        self.decisions.labels(model, d.reason).inc()
        self.requests.labels(model, replica).inc()
        if d.matched_blocks:
            self.matched_blocks.labels(model).inc(d.matched_blocks)

    def collect(self):
        e = self.engine
        merged: dict[str, Metric] = {}
        for name, families in zip(e.names, e._families):
            for fam in families:
                out = merged.setdefault(fam.name, Metric(fam.name, fam.documentation, fam.type, fam.unit))
                for s in fam.samples:
                    out.add_sample(s.name, {**s.labels, "replica": name}, s.value, s.timestamp, s.exemplar)
        yield from merged.values()
        in_flight = GaugeMetricFamily("pyengine_ray:replica_in_flight", "Requests running on each replica",
                                labels=["model_name", "replica"])
        healthy = GaugeMetricFamily("pyengine_ray:replica_healthy", "1 while the replica answers, 0 while it is down",
                              labels=["model_name", "replica"])
        for r in e.router.replicas:
            in_flight.add_metric([e.model_name, r.name], r.in_flight)
            healthy.add_metric([e.model_name, r.name], int(r.healthy))
        yield in_flight
        yield healthy


# ------------------------------------------------------------------ the ingress deployment
@web.middleware
async def _session_middleware(request: web.Request, handler) -> web.StreamResponse:
    """The client's conversation id (header X-Session-Id) for the router, via a context variable:
    the handlers pass it on to RayEngine.generate without knowing about it."""
    token = _session.set(request.headers.get(SESSION_HEADER) or None)
    try:
        return await handler(request)
    finally:
        _session.reset(token)


class Ingress:
    """server.app's aiohttp application, listening on --host/--port, over a RayEngine."""

    async def __init__(self, argv: list[str], *engines) -> None:
        from pyengine.model.loader import resolve_model_path
        from pyengine.tokenizer import Tokenizer

        args = parse_ray_args(argv)
        info = await engines[0].info.remote()
        tokenizer = await asyncio.to_thread(Tokenizer.from_model_path, resolve_model_path(args.model))
        router = RouterConfig(block_size=args.block_size, max_imbalance=args.max_imbalance,
                              affinity=args.routing == "prefix")
        engine = RayEngine(list(engines), info, tokenizer, router)
        app = create_app(engine, server_config(args))
        app.middlewares.append(_session_middleware)
        self.runner = await listen(app, args.host, args.port)
        log.info("pyengine ingress listening on http://%s:%d over %d engine replicas", args.host,
                 self.runner.addresses[0][1], len(engines))

    def address(self) -> tuple[str, int]:
        return tuple(self.runner.addresses[0][:2])

    def check_health(self) -> None:
        if not self.runner.sites:
            raise RuntimeError("the HTTP server stopped")

    async def __del__(self) -> None:
        await self.runner.cleanup()  # drains connections, stops the router's poller


# ------------------------------------------------------------------ building and running the application
def build_ray_parser() -> argparse.ArgumentParser:
    p = build_parser()
    p.prog = "python -m server.ray"
    p.description = ("Serve a model over an OpenAI-compatible HTTP API from several engine replicas on "
                     "Ray Serve, with prefix-aware routing.")
    g = p.add_argument_group("Ray Serve")
    g.add_argument("--replicas", type=int, default=2, help="engine replicas (one engine process each)")
    g.add_argument("--address", default=None,
                   help="Ray cluster to join ('auto', or HOST:PORT of `ray start --head`); default: start a "
                        "local Ray instance")
    g.add_argument("--num-cpus", type=float, default=None,
                   help="CPUs Ray reserves per replica; default: --num-threads, else 1")
    g.add_argument("--num-gpus", type=float, default=None,
                   help="GPUs Ray reserves per replica; default: 1 with --device cuda, else 0")
    g.add_argument("--max-imbalance", type=int, default=RouterConfig.max_imbalance,
                   help="in-flight requests the replica holding a prefix (or session) may have beyond the "
                        "least-loaded replica before the request goes to the least-loaded one")
    g.add_argument("--routing", default="prefix", choices=["prefix", "least-loaded"],
                   help="prefix: by session and cached prompt blocks, else least-loaded; least-loaded: "
                        "always the replica with the fewest requests in flight")
    return p


def parse_ray_args(argv: list[str]) -> argparse.Namespace:
    """The command line, with `model` as one path (or None): each replica serves the same one model."""
    a = build_ray_parser().parse_args(argv)
    if getattr(a, "config", None) or (a.model and (len(a.model) > 1 or "=" in a.model[0])):
        raise ValueError("python -m server.ray serves one model (--model PATH) on every replica; "
                         "several models and --config are for python -m server")
    a.model = a.model[0] if a.model else None
    return a


def build_app(args: dict[str, Any]) -> serve.Application:
    """The Serve application (the import path of a Serve config file); `args` are the command line's
    options by name, e.g. {"model": "m.gguf", "replicas": 2, "num_threads": 1}."""
    return application(_as_argv(args))


def application(argv: list[str]) -> serve.Application:
    """The Serve application for a `python -m server.ray` command line."""
    a = parse_ray_args(argv)
    if a.replicas < 1:
        raise ValueError(f"replicas must be at least 1, got {a.replicas}")
    num_cpus = a.num_cpus if a.num_cpus is not None else (a.num_threads or 1)
    num_gpus = a.num_gpus if a.num_gpus is not None else (1 if a.device == "cuda" else 0)
    if a.num_threads is None:  # as many threads as the CPUs reserved, not every core of the node
        a.num_threads = max(1, int(num_cpus))
    engine = serve.deployment(EngineReplica).options(
        num_replicas=1, max_ongoing_requests=a.max_num_seqs + a.max_queue, health_check_period_s=5,
        logging_config={"enable_access_log": False},  # the ingress polls stats every second
        ray_actor_options={"num_cpus": num_cpus, "num_gpus": num_gpus})
    engines = [engine.options(name=f"engine-{i}").bind(engine_config(a, a.model)) for i in range(a.replicas)]
    ingress = serve.deployment(Ingress).options(
        name="ingress", num_replicas=1, max_ongoing_requests=4,
        # on the head node, so that `--address` users find it where they started the cluster
        ray_actor_options={"num_cpus": 0, "resources": {"node:__internal_head__": 0.001}})
    return ingress.bind(argv, *engines)


def _as_argv(args: dict[str, Any]) -> list[str]:
    argv = []
    for key, value in args.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            argv.append(flag)
        elif value is False:
            argv.append("--no-" + flag[2:])
        elif value is not None:
            for v in value if isinstance(value, list) else [value]:
                argv += [flag, str(v)]
    return argv


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        args = parse_ray_args(argv)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        app = application(argv)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    ray.init(address=args.address, logging_level=logging.WARNING)
    serve.start(proxy_location="Disabled")
    ingress = serve.run(app, name=APP_NAME, route_prefix=None)
    host, port = ingress.address.remote().result()
    print(f"pyengine server listening on http://{host}:{port} ({args.replicas} engine replicas on Ray Serve)",
          flush=True)
    stop = asyncio.Event()

    async def wait() -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()

    asyncio.run(wait())
    print("shutting down", flush=True)
    serve.delete(APP_NAME)
    ray.shutdown()
    return 0


if __name__ == "__main__":
    from server.ray import main as imported_main  # classes Ray pickles by reference must live in server.ray, not __main__

    sys.exit(imported_main())
