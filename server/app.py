"""aiohttp application factory: routes, the gateway middleware, health, metrics.

The engine is passed in (any object with the AsyncLLM interface), so tests can run the whole HTTP
layer over a small fake. The app starts the engine on start-up and shuts it down on cleanup, i.e.
after in-flight requests have drained.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest
from prometheus_client.core import GaugeMetricFamily

from server import gateway
from server.connections import SERVER_NAME, ConnectionGuard, ConnectionLimits, GuardedSite
from server.openai_api import RATE_KEY, OpenAIServing
from server.protocol import APIError

log = logging.getLogger("server")
OPEN_PATHS = {"/health"}
SERVING = web.AppKey("serving", OpenAIServing)
CONNECTIONS = web.AppKey("connections", ConnectionGuard)


@dataclass
class ServerConfig:
    served_model_name: str | None = None  # None: the engine's model name
    max_n: int = 16
    gateway: gateway.GatewayConfig = field(default_factory=gateway.GatewayConfig)
    connections: ConnectionLimits = field(default_factory=ConnectionLimits)


def create_app(engine: Any, config: ServerConfig | None = None) -> web.Application:
    config = config or ServerConfig()
    gw = config.gateway
    serving = OpenAIServing(engine, config.served_model_name or engine.model_name, gw, max_n=config.max_n,
                            read_timeout=config.connections.read_timeout)
    guard = ConnectionGuard(config.connections)
    registry = CollectorRegistry()
    responses = Counter("pyengine_server:responses", "HTTP responses by path and status",
                        ["path", "status"], registry=registry)
    registry.register(_PoolCollector(engine, serving))

    @web.middleware
    async def middleware(request: web.Request, handler) -> web.StreamResponse:
        with guard.busy(request):
            resp = await respond(request, handler)
        route = request.match_info.route.resource
        responses.labels(route.canonical if route else "unmatched", str(resp.status)).inc()
        return resp

    async def respond(request: web.Request, handler) -> web.StreamResponse:
        try:
            key = "" if request.path in OPEN_PATHS else gateway.authenticate(
                request.headers.get("Authorization"), gw.api_keys)
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

    async def health(request: web.Request) -> web.Response:
        ok = engine.is_healthy() and not serving.admission.draining
        return web.json_response({"status": "ok" if ok else "unavailable"}, status=200 if ok else 503)

    async def metrics(request: web.Request) -> web.Response:
        text = generate_latest(engine.metrics.registry) + generate_latest(registry)
        return web.Response(body=text, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def stats(request: web.Request) -> web.Response:
        return web.json_response({"engine": _as_dict(engine.stats()),
                                  "gateway": {"waiting": serving.admission.waiting,
                                              "in_flight": serving.admission.in_flight}})

    async def start_engine(app: web.Application) -> None:
        await engine.start()

    async def stop_engine(app: web.Application) -> None:
        await engine.shutdown()

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
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/stats", stats)
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
            g = GaugeMetricFamily(name, doc)
            g.add_metric([], value)
            yield g
