"""aiohttp application factory: routes, the gateway middleware, health, metrics.

The engine is passed in (any object with the AsyncLLM interface), so tests can run the whole HTTP
layer over a small fake. The app starts the engine on start-up and shuts it down on cleanup, i.e.
after in-flight requests have drained.
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
from prometheus_client.core import GaugeMetricFamily

from pyengine.request_log import RequestLog
from server import gateway
from server.connections import SERVER_NAME, ConnectionGuard, ConnectionLimits, GuardedSite
from server.observe import Observer
from server.openai_api import API_KEY, JOB_KEY, RATE_KEY, OpenAIServing
from server.protocol import APIError, get_str
from server.responses import ResponsesAPI
from server.store import ConversationStore, SQLiteStore

log = logging.getLogger("server")
OPEN_PATHS = {"/health", "/"}  # and the web page's files under /static/ (the page asks for the key)
STATIC_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "static")
SERVING = web.AppKey("serving", OpenAIServing)
CONNECTIONS = web.AppKey("connections", ConnectionGuard)
_SAMPLER = web.AppKey("stats_sampler", asyncio.Task)


@dataclass
class ServerConfig:
    served_model_name: str | None = None  # None: the engine's model name
    max_n: int = 16
    tool_call_parser: str | None = None  # None: chosen by the model's chat template (server/tools.py)
    gateway: gateway.GatewayConfig = field(default_factory=gateway.GatewayConfig)
    connections: ConnectionLimits = field(default_factory=ConnectionLimits)
    request_log: RequestLog | None = None  # one row per generation request; closed on cleanup
    stats_interval: float = 10.0  # seconds between console stats lines; 0: none
    store: ConversationStore | None = None  # stored responses and conversations; None: SQLite in memory


def create_app(engine: Any, config: ServerConfig | None = None) -> web.Application:
    config = config or ServerConfig()
    gw = config.gateway
    serving = OpenAIServing(engine, config.served_model_name or engine.model_name, gw, max_n=config.max_n,
                            tool_call_parser=config.tool_call_parser,
                            read_timeout=config.connections.read_timeout)
    guard = ConnectionGuard(config.connections)
    registry = CollectorRegistry()
    observer = Observer(engine, serving.model, registry, request_log=config.request_log,
                        stats_interval=config.stats_interval)
    registry.register(_PoolCollector(engine, serving))
    plan = engine.plan.as_dict() if getattr(engine, "plan", None) is not None else None
    store = config.store or SQLiteStore(":memory:")

    def serving_for(body: dict, api_key: str) -> OpenAIServing:
        """The model that serves a /v1/responses request (one model here)."""
        serving._check_model(get_str(body, "model"))
        return serving

    responses = ResponsesAPI(store, serving_for, registry, read_timeout=config.connections.read_timeout)

    def route_of(request: web.Request) -> str:
        route = request.match_info.route.resource
        return route.canonical if route else "unmatched"

    @web.middleware
    async def middleware(request: web.Request, handler) -> web.StreamResponse:
        start = time.perf_counter()
        with guard.busy(request):
            try:
                resp = await respond(request, handler)
            except (asyncio.CancelledError, ConnectionResetError):  # the client left (nginx's 499)
                observer.finish(request, 499, start, request.get(JOB_KEY), route_of(request))
                raise
        observer.finish(request, resp.status, start, request.get(JOB_KEY), route_of(request))
        return resp

    async def respond(request: web.Request, handler) -> web.StreamResponse:
        try:
            is_open = request.path in OPEN_PATHS or request.path.startswith("/static/")
            key = "" if is_open else gateway.authenticate(
                request.headers.get("Authorization"), gw.api_keys)
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
            return web.json_response(APIError(e.status, e.reason).body(), status=e.status,
                                     headers={k: v for k, v in e.headers.items() if k == "Allow"})
        except (asyncio.CancelledError, ConnectionResetError):
            raise
        except Exception:
            log.exception("unhandled error on %s", request.path)
            return web.json_response(APIError(500, "Internal server error.", type="server_error").body(),
                                     status=500)

    async def server_header(request: web.Request, response: web.StreamResponse) -> None:
        response.headers["Server"] = SERVER_NAME

    async def echo_request_id(request: web.Request, resp: web.StreamResponse) -> None:
        """X-Request-Id: the client's when it sent one, else the generation request's id."""
        job = request.get(JOB_KEY)
        rid = request.headers.get("X-Request-Id") or (job.request_id if job is not None else None)
        if rid:
            resp.headers["X-Request-Id"] = rid

    async def health(request: web.Request) -> web.Response:
        ok = engine.is_healthy() and not serving.admission.draining
        return web.json_response({"status": "ok" if ok else "unavailable"}, status=200 if ok else 503)

    async def metrics(request: web.Request) -> web.Response:
        text = generate_latest(engine.metrics.registry) + generate_latest(registry)
        return web.Response(body=text, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def stats(request: web.Request) -> web.Response:
        return web.json_response({"engine": _as_dict(engine.stats()),
                                  "gateway": {"waiting": serving.admission.waiting,
                                              "in_flight": serving.admission.in_flight},
                                  "live": observer.snapshot(), "plan": plan})

    async def index(request: web.Request) -> web.FileResponse:
        return web.FileResponse(os.path.join(STATIC_DIR, "index.html"))

    async def start_engine(app: web.Application) -> None:
        await engine.start()
        app[_SAMPLER] = asyncio.create_task(observer.run())

    async def stop_engine(app: web.Application) -> None:
        app[_SAMPLER].cancel()
        await engine.shutdown()
        await store.close()
        observer.close()

    async def draining(app: web.Application) -> None:
        serving.admission.draining = True

    app = web.Application(middlewares=[middleware], client_max_size=gw.max_body_bytes)
    app[SERVING] = serving
    app[CONNECTIONS] = guard
    app.router.add_post("/v1/chat/completions", serving.chat)
    app.router.add_post("/v1/completions", serving.completions)
    app.router.add_get("/v1/models", serving.models)
    app.router.add_post("/tokenize", serving.tokenize)
    app.router.add_post("/detokenize", serving.detokenize)
    responses.add_routes(app.router)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/stats", stats)
    app.router.add_get("/", index)
    app.router.add_static("/static/", STATIC_DIR)
    app.on_response_prepare.append(echo_request_id)
    app.on_response_prepare.append(server_header)
    app.on_startup.append(start_engine)
    app.on_shutdown.append(draining)
    app.on_cleanup.append(stop_engine)
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


def _as_dict(obj: Any) -> dict:
    if dataclasses.is_dataclass(obj):
        return dataclasses.asdict(obj)
    return dict(vars(obj))


class _PoolCollector:
    """Gateway and KV-pool gauges, read at scrape time (cheap: no state kept in between)."""

    def __init__(self, engine: Any, serving: OpenAIServing) -> None:
        self.engine, self.serving = engine, serving

    def collect(self):
        s = self.engine.stats()
        model = self.serving.model
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
            g.add_metric([model], value)
            yield g
