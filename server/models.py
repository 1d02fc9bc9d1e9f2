"""The served models: each with its own engine (and so its own KV budget) and OpenAIServing, found by
name or alias, optionally reserved to API keys of one tier; and `resolve`, which picks the model for
a request body (by name, or through the router when the body names it).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter

from server.openai_api import OpenAIServing
from server.protocol import APIError, get_str
from server.routing import Router, RoutingConfig, route_request

MODEL_KEY = web.RequestKey("model", str)  # the served model's name, once the request chose one
RULE_KEY = web.RequestKey("route_rule", str)  # the routing rule that chose it (routed requests only)


class ConfigError(ValueError):
    """A configuration mistake; `where` names the entry, e.g. ("models", 1, "name")."""

    def __init__(self, message: str, where: tuple = ()) -> None:
        super().__init__(message)
        self.where = where


@dataclass
class ModelEntry:
    """One model to serve: an engine with the AsyncLLM interface and the names clients use for it."""

    engine: Any
    name: str | None = None  # None: the engine's model name
    aliases: list[str] = field(default_factory=list)
    tier: str | None = None  # None: open to every caller; else only keys of this tier may use it


@dataclass
class ServedModel:
    name: str
    aliases: list[str]
    tier: str | None
    serving: OpenAIServing

    @property
    def engine(self) -> Any:
        return self.serving.engine


def check_config(models: list[tuple[str, list[str], str | None]], routing: RoutingConfig,
                 key_tiers: dict[str, str]) -> None:
    """Raise ConfigError for names two models claim, rules or splits naming unknown models, and
    tiers no key has. `models`: (name, aliases, tier) in order."""
    if not models:
        raise ConfigError("no models to serve")
    owner: dict[str, int] = {}
    for i, (name, aliases, _) in enumerate(models):
        for field_name, n in [("name", name)] + [("aliases", a) for a in aliases]:
            if n == routing.name:
                raise ConfigError(f"the name {n!r} is the router's", ("models", i, field_name))
            if n in owner:
                raise ConfigError(f"models[{owner[n]}] already claims the name {n!r}", ("models", i, field_name))
            owner[n] = i
    canonical = {name for name, _, _ in models}
    key_tier_values = set(key_tiers.values())
    for i, (_, _, tier) in enumerate(models):
        if tier is not None and tier not in key_tier_values:
            raise ConfigError(f"no API key has the tier {tier!r}, so nobody could use this model",
                              ("models", i, "tier"))

    def known(name: str, where: tuple) -> None:
        if name not in canonical:
            raise ConfigError(f"unknown model {name!r} (models: {', '.join(sorted(canonical))})", where)

    if routing.default is not None:
        known(routing.default, ("routing", None, "default"))
    default = routing.default or models[0][0]
    if dict((n, t) for n, _, t in models)[default] is not None:
        raise ConfigError(f"the default model {default!r} must be open to every key (no tier)",
                          ("routing", None, "default"))
    for i, rule in enumerate(routing.rules):
        known(rule.model, ("routing.rules", i, "model"))
    split_of: dict[str, int] = {}
    for i, split in enumerate(routing.canaries):
        known(split.model, ("routing.canary", i, "model"))
        known(split.canary, ("routing.canary", i, "canary"))
        if not 0.0 <= split.weight <= 1.0:
            raise ConfigError(f"weight must be in [0, 1], got {split.weight}", ("routing.canary", i, "weight"))
        if split.model in split_of:
            raise ConfigError(f"routing.canary[{split_of[split.model]}] already splits {split.model!r}",
                              ("routing.canary", i, "model"))
        split_of[split.model] = i


class ModelRegistry:
    """The served models by name and alias, the key tiers and the router. Handlers get a request's
    model with `choose` (or `resolve` outside HTTP); the app holds it as app[server.app.MODELS]."""

    def __init__(self, models: list[ServedModel], routing: RoutingConfig, key_tiers: dict[str, str],
                 metrics: CollectorRegistry) -> None:
        check_config([(m.name, m.aliases, m.tier) for m in models], routing, key_tiers)
        self.routed = Counter("pyengine_server:routed_requests", "Requests the router sent to a model, by rule",
                              ["model_name", "rule"], registry=metrics)
        self.models = {m.name: m for m in models}
        self._by_name = {n: m for m in models for n in [m.name, *m.aliases]}
        self.key_tiers = key_tiers
        self.router = Router(routing, models[0].name)
        self.default = self.models[self.router.default]

    def __iter__(self):
        return iter(self.models.values())

    def allowed(self, model: ServedModel, key: str) -> bool:
        return model.tier is None or self.key_tiers.get(key) == model.tier

    def get(self, name: str, key: str) -> ServedModel:
        """The model called `name` (or an alias) that `key` may use; 404 otherwise."""
        m = self._by_name.get(name)
        if m is None or not self.allowed(m, key):
            raise APIError(404, f"The model `{name}` does not exist or you do not have access to it.",
                           param="model", code="model_not_found")
        return m

    async def resolve(self, body: dict[str, Any], key: str,
                      prompt_tokens: int | None = None) -> tuple[OpenAIServing, str | None]:
        """The serving for a request body and the routing rule that chose it (None: the body named
        the model). A body naming the router, or no model, is routed; `prompt_tokens` (else counted
        here with the default model's tokenizer, when a rule needs it) feeds the token thresholds."""
        name = get_str(body, "model")
        if name is not None and name != self.router.name:
            return self.get(name, key).serving, None
        if prompt_tokens is None:
            prompt_tokens = await self.default.serving.prompt_tokens(body) if self.router.counts_tokens else 0
        req = route_request(body, key, self.key_tiers.get(key), prompt_tokens)
        model, rule = self.router.route(req, lambda m: self.allowed(self.models[m], key))
        return self.models[model].serving, rule

    async def choose(self, request: web.Request, body: dict[str, Any], key: str,
                     prompt_tokens: int | None = None) -> OpenAIServing:
        """resolve() for an HTTP request: notes the model on the request (access log, per-model
        metrics) and the rule (the X-Route-Rule header, the routed-requests counter)."""
        serving, rule = await self.resolve(body, key, prompt_tokens)
        request[MODEL_KEY] = serving.model
        if rule is not None:
            request[RULE_KEY] = rule
            self.routed.labels(serving.model, rule).inc()
        return serving

    def listing(self, key: str) -> list[dict]:
        """/v1/models entries: the models `key` may use, then the router when there is a choice."""
        out = [m.serving.model_card() | {"aliases": m.aliases} for m in self if self.allowed(m, key)]
        if len(self.models) > 1:
            out.append({"id": self.router.name, "object": "model", "created": self.default.serving.created,
                        "owned_by": "pyengine", "root": "router"})
        return out

    def card(self, name: str, key: str) -> dict:
        if name == self.router.name and len(self.models) > 1:
            return self.listing(key)[-1]
        m = self.get(name, key)
        return m.serving.model_card() | {"aliases": m.aliases}
