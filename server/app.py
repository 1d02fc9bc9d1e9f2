"""aiohttp application factory: routes, the gateway middleware, health, metrics.

The engines are passed in (any object with the AsyncLLM interface), so tests can run the whole HTTP
layer over a small fake. The app starts them on start-up and shuts them down on cleanup, i.e. after
in-flight requests have drained.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric

from pyengine.request_log import RequestLog
from server import gateway
from server.connections import SERVER_NAME, ConnectionGuard, ConnectionLimits, GuardedSite
from server.models import MODEL_KEY, RULE_KEY, ModelEntry, ModelRegistry, ServedModel
from server.observe import Observer
from server.openai_api import API_KEY, JOB_KEY, RATE_KEY, OpenAIServing, read_json
from server.protocol import APIError
from server.responses import ResponsesAPI
from server.routing import RoutingConfig
from server.store import ConversationStore, SQLiteStore

log = logging.getLogger("server")
OPEN_PATHS = {"/health", "/"}  # and the web page's files under /static/ (the page asks for the key)
STATIC_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "static")
MODELS = web.AppKey("models", ModelRegistry)
CONNECTIONS = web.AppKey("connections", ConnectionGuard)
_SAMPLERS = web.AppKey("stats_samplers", list)


@dataclass
class ServerConfig:
    served_model_name: str | None = None  # one engine: the name it is served as; None: the engine's model name
    max_n: int = 16
    tool_call_parser: str | None = None  # None: chosen by the model's chat template (server/tools.py)
    gateway: gateway.GatewayConfig = field(default_factory=gateway.GatewayConfig)
    connections: ConnectionLimits = field(default_factory=ConnectionLimits)
    request_log: RequestLog | None = None  # one row per generation request; closed on cleanup
    stats_interval: float = 10.0  # seconds between console stats lines; 0: none
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    key_tiers: dict[str, str] = field(default_factory=dict)  # API key -> tier; these keys are valid too
    store: ConversationStore | None = None  # stored responses and conversations; None: SQLite in memory
    # /metrics names the engine's series "<metrics_prefix>:name": "pyengine", or "vllm" so that an
    # unchanged vLLM Grafana dashboard finds them (the server's own pyengine_server: series keep theirs)
    metrics_prefix: str = "pyengine"


def create_app(engine: Any | list[ModelEntry], config: ServerConfig | None = None) -> web.Application:
    """An app serving one engine (named config.served_model_name or its model name), or several
    models, each a ModelEntry with its own engine; config.routing routes requests for the router."""
    config = config or ServerConfig()
    gw = config.gateway
    api_keys = gw.api_keys + [k for k in config.key_tiers if k not in gw.api_keys]
    entries = engine if isinstance(engine, list) else [ModelEntry(engine, config.served_model_name)]
    limiter = gateway.RateLimiter(gw.rate_limit_rpm, gw.rate_limit_tpm)
    served = []
    for e in entries:
        name = e.name or e.engine.model_name
        served.append(ServedModel(name, list(e.aliases), e.tier, OpenAIServing(
            e.engine, name, gw, max_n=config.max_n, tool_call_parser=config.tool_call_parser, limiter=limiter)))
    registry = CollectorRegistry()  # what /metrics shows: the app's series and every model's, merged by name
    models = ModelRegistry(served, config.routing, config.key_tiers, registry)
    guard = ConnectionGuard(config.connections)
    observers: dict[str, Observer] = {}
    sources = []
    for m in models:
        own = CollectorRegistry()
        observers[m.name] = Observer(m.engine, m.name, own, request_log=config.request_log,
                                     stats_interval=config.stats_interval)
        own.register(_PoolCollector(m.serving))
        sources += [(m.engine.metrics.registry, m.name), (own, m.name)]
    registry.register(_MergedMetrics(sources, config.metrics_prefix))
    store = config.store or SQLiteStore(":memory:")
    responses = ResponsesAPI(store, models.choose, limiter, registry,
                             read_timeout=config.connections.read_timeout)

    def route_of(request: web.Request) -> str:
        route = request.match_info.route.resource
        return route.canonical if route else "unmatched"

    def observer_of(request: web.Request) -> Observer:
        return observers[request.get(MODEL_KEY, models.default.name)]

    @web.middleware
    async def middleware(request: web.Request, handler) -> web.StreamResponse:
        start = time.perf_counter()
        with guard.busy(request):
            try:
                resp = await respond(request, handler)
            except (asyncio.CancelledError, ConnectionResetError):  # the client left (nginx's 499)
                observer_of(request).finish(request, 499, start, request.get(JOB_KEY), route_of(request))
                raise
        observer_of(request).finish(request, resp.status, start, request.get(JOB_KEY), route_of(request))
        return resp

    async def respond(request: web.Request, handler) -> web.StreamResponse:
        try:
            is_open = request.path in OPEN_PATHS or request.path.startswith("/static/")
            key = "" if is_open else gateway.authenticate(request.headers.get("Authorization"), api_keys)
            request[API_KEY] = key
            request[RATE_KEY] = key or (request.remote or "")
            if request.content_length is not None and request.content_length > gw.max_body_bytes:
                raise APIError(413, f"The request body is larger than {gw.max_body_bytes} bytes.",
                               code="request_too_large")
            return await handler(request)
        except APIError as e:
            return web.json_response(e.body(), status=e.status, headers=e.headers)
        except web.HTTPException as e:  # routing: unknown path, wrong method
            if e.status < 400:
                raise
            return web.json_response(APIError(e.status, _routing_message(request, e)).body(), status=e.status,
                                     headers={k: v for k, v in e.headers.items() if k == "Allow"})
        except (asyncio.CancelledError, ConnectionResetError):
            raise
        except Exception:
            log.exception("unhandled error on %s", request.path)
            return web.json_response(APIError(500, "Internal server error.", type="server_error").body(),
                                     status=500)

    def on_model(method: str):
        """A handler that reads the body, charges the key, picks the model (by name or by the router)
        and hands over to that model's OpenAIServing method."""

        async def handler(request: web.Request) -> web.StreamResponse:
            key = request[RATE_KEY]
            with limiter.charged(key):
                body = await read_json(request, config.connections.read_timeout)
                serving = await models.choose(request, body, key)
                return await getattr(serving, method)(request, key, body)

        return handler

    async def response_headers(request: web.Request, resp: web.StreamResponse) -> None:
        """Server; X-Request-Id: the client's when it sent one, else the generation request's id;
        X-Route-Rule: the routing rule that chose the model."""
        resp.headers["Server"] = SERVER_NAME
        job = request.get(JOB_KEY)
        rid = request.headers.get("X-Request-Id") or (job.request_id if job is not None else None)
        if rid:
            resp.headers["X-Request-Id"] = rid
        if RULE_KEY in request:
            resp.headers["X-Route-Rule"] = request[RULE_KEY]

    async def list_models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": models.listing(request[RATE_KEY])})

    async def get_model(request: web.Request) -> web.Response:
        return web.json_response(models.card(request.match_info["id"], request[RATE_KEY]))

    async def health(request: web.Request) -> web.Response:
        ok = all(m.engine.is_healthy() and not m.serving.admission.draining for m in models)
        return web.json_response({"status": "ok" if ok else "unavailable"}, status=200 if ok else 503)

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def stats(request: web.Request) -> web.Response:
        """One model's numbers (?model=NAME; default: the default model)."""
        name = request.query.get("model", models.default.name)
        m = models.get(name, request[RATE_KEY])
        plan = m.engine.plan.as_dict() if getattr(m.engine, "plan", None) is not None else None
        return web.json_response({"model": m.name, "models": list(models.models),
                                  "engine": _as_dict(m.engine.stats()),
                                  "gateway": {"waiting": m.serving.admission.waiting,
                                              "in_flight": m.serving.admission.in_flight},
                                  "live": observers[m.name].snapshot(), "plan": plan})

    async def tokenizer_info(request: web.Request) -> web.Response:
        """One model's tokenizer settings (?model=NAME; default: the default model), as vLLM's
        /tokenizer_info and lm-eval's "remote" tokenizer have them."""
        m = models.get(request.query.get("model", models.default.name), request[RATE_KEY])
        return web.json_response(m.serving.tokenizer_info())

    async def index(request: web.Request) -> web.FileResponse:
        return web.FileResponse(os.path.join(STATIC_DIR, "index.html"))

    async def start_engines(app: web.Application) -> None:
        app[_SAMPLERS] = []
        for m in models:
            await m.engine.start()
            app[_SAMPLERS].append(asyncio.create_task(observers[m.name].run()))

    async def stop_engines(app: web.Application) -> None:
        for task in app[_SAMPLERS]:
            task.cancel()
        for m in models:
            await m.engine.shutdown()
            observers[m.name].close()
        await store.close()

    async def draining(app: web.Application) -> None:
        for m in models:
            m.serving.admission.draining = True

    app = web.Application(middlewares=[middleware], client_max_size=gw.max_body_bytes)
    app[MODELS] = models
    app[CONNECTIONS] = guard
    app.router.add_post("/v1/chat/completions", on_model("chat"))
    app.router.add_post("/v1/completions", on_model("completions"))
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/models/{id:.+}", get_model)
    app.router.add_post("/tokenize", on_model("tokenize"))
    app.router.add_post("/detokenize", on_model("detokenize"))
    app.router.add_get("/tokenizer_info", tokenizer_info)
    responses.add_routes(app.router)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/stats", stats)
    app.router.add_get("/", index)
    app.router.add_static("/static/", STATIC_DIR)
    app.on_response_prepare.append(response_headers)
    app.on_startup.append(start_engines)
    app.on_shutdown.append(draining)
    app.on_cleanup.append(stop_engines)
    return app


async def listen(app: web.Application, host: str, port: int) -> web.AppRunner:
    """Start the app (and so its engine) and listen on host:port, every connection held to the
    app's ConnectionLimits. Stop with runner.cleanup()."""
    guard = app[CONNECTIONS]
    runner = web.AppRunner(app, handle_signals=False, handler_cancellation=True, shutdown_timeout=1.0,
                           access_log=None, keepalive_timeout=guard.limits.handler_keepalive)
    await runner.setup()
    try:
        await GuardedSite(runner, host, port, guard).start()
    except OSError:  # e.g. the port is taken: stop the engine before reporting it
        await runner.cleanup()
        raise
    return runner


def _routing_message(request: web.Request, e: web.HTTPException) -> str:
    """OpenAI's words for a path it does not serve ("Invalid URL (POST /v1/embeddings)"), naming the
    method and path; other routing errors keep their reason, with the path."""
    where = f"{request.method} {request.path}"
    if e.status == 404:
        return f"Invalid URL ({where}): this server has no such endpoint."
    if e.status == 405:
        return f"Method {request.method} is not allowed on {request.path}; allowed: {e.headers.get('Allow', '')}."
    return f"{e.reason} ({where})"


def _as_dict(obj: Any) -> dict:
    if dataclasses.is_dataclass(obj):
        return dataclasses.asdict(obj)
    return dict(vars(obj))


class _PoolCollector:
    """Gateway and KV-pool gauges of one model, read at scrape time (cheap: no state kept in between)."""

    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving

    def collect(self):
        s = self.serving.engine.stats()
        for name, doc, value in [
            ("pyengine_server:requests_waiting", "Admitted requests without a first token yet",
             self.serving.admission.waiting),
            ("pyengine_server:requests_in_flight", "Admitted requests not finished yet",
             self.serving.admission.in_flight),
            ("pyengine_server:engine_requests_running", "Engine requests running", s.num_running),
            ("pyengine_server:engine_requests_waiting", "Engine requests waiting", s.num_waiting),
            ("pyengine_server:kv_free_blocks", "Free KV-cache blocks", s.num_free_blocks),
            ("pyengine_server:kv_total_blocks", "KV-cache blocks in the pool", s.num_total_blocks),
        ]:
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric([self.serving.model], value)
            yield g


class _MergedMetrics:
    """The series of several registries, one family per metric name (the text format allows each
    name once), every sample labelled model_name with its model's served name (an engine labels
    its own series with its model's name, which two configurations of one model share)."""

    def __init__(self, sources: list[tuple[CollectorRegistry, str]], prefix: str = "pyengine") -> None:
        if prefix not in ("pyengine", "vllm"):
            raise ValueError(f"metrics prefix must be pyengine or vllm, got {prefix!r}")
        self.sources = sources
        self.prefix = prefix

    def _name(self, name: str) -> str:
        """The engine's "pyengine:" series under the configured prefix."""
        if self.prefix != "pyengine" and name.startswith("pyengine:"):
            return f"{self.prefix}:{name[len('pyengine:'):]}"
        return name

    def collect(self):
        families: dict[str, Metric] = {}
        for registry, model in self.sources:
            for metric in registry.collect():
                name = self._name(metric.name)
                family = families.get(name)
                if family is None:
                    family = families[name] = Metric(name, metric.documentation, metric.type, metric.unit)
                for s in metric.samples:
                    family.add_sample(self._name(s.name), {**s.labels, "model_name": model}, s.value, s.timestamp,
                                      s.exemplar)
        yield from families.values()
