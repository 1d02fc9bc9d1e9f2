"""Routing: which model serves a request that names the router (model "auto" by default).

Rules are tried in the configured order; the first whose conditions all hold picks the model (a rule
sets any of: prompt token thresholds, the API key's tier, request metadata values). No rule: the
default model. Then a canary split on the chosen model may send a fixed share of its traffic to a
canary model. The share is drawn from a hash of the conversation (or user, or key), not from random
state, so a conversation or user stays on one side of the split for as long as the weight is unchanged.

Everything here is pure (no aiohttp, no engines): the registry (server/models.py) extracts a
RouteRequest from the HTTP request and asks Router.route.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Callable

from server.protocol import APIError

DEFAULT_RULE = "default"  # the rule name reported when no rule matched


@dataclass
class Rule:
    """Send a routed request to `model` when every condition set here holds."""

    name: str
    model: str
    min_prompt_tokens: int | None = None  # prompt tokens >= this
    max_prompt_tokens: int | None = None  # prompt tokens <= this
    tiers: list[str] | None = None  # the caller's key has one of these tiers
    metadata: dict[str, str] | None = None  # request `metadata` holds these values

    @property
    def counts_tokens(self) -> bool:
        return self.min_prompt_tokens is not None or self.max_prompt_tokens is not None

    def matches(self, req: "RouteRequest") -> bool:
        n = req.prompt_tokens
        if self.min_prompt_tokens is not None and n < self.min_prompt_tokens:
            return False
        if self.max_prompt_tokens is not None and n > self.max_prompt_tokens:
            return False
        if self.tiers is not None and req.tier not in self.tiers:
            return False
        return all(req.metadata.get(k) == v for k, v in (self.metadata or {}).items())


@dataclass
class CanarySplit:
    """Send `weight` (0..1) of the routed traffic that chose `model` to `canary` instead."""

    name: str
    model: str
    canary: str
    weight: float

    def diverts(self, sticky_id: str) -> bool:
        return bucket(self.name, sticky_id) < self.weight


@dataclass
class RoutingConfig:
    name: str = "auto"  # the model name that asks for routing
    default: str | None = None  # the model when no rule matches; None: the first model
    rules: list[Rule] = field(default_factory=list)
    canaries: list[CanarySplit] = field(default_factory=list)


@dataclass
class RouteRequest:
    """What the rules look at."""

    prompt_tokens: int = 0
    tier: str | None = None
    metadata: dict[str, str] = field(default_factory=dict)
    sticky_id: str = ""  # the conversation, else the user, else the API key / client address


class Router:
    def __init__(self, config: RoutingConfig, default_model: str) -> None:
        self.name = config.name
        self.default = config.default or default_model
        self.rules = config.rules
        self.canaries = {c.model: c for c in config.canaries}
        self.counts_tokens = any(r.counts_tokens for r in self.rules)

    def route(self, req: RouteRequest, allowed: Callable[[str], bool] = lambda m: True) -> tuple[str, str]:
        """(model name, rule name). Rules and splits that lead to a model the caller may not use
        are passed over."""
        model, rule = self.default, DEFAULT_RULE
        for r in self.rules:
            if r.matches(req) and allowed(r.model):
                model, rule = r.model, r.name
                break
        split = self.canaries.get(model)
        if split is not None and allowed(split.canary) and split.diverts(req.sticky_id):
            return split.canary, split.name
        return model, rule


def bucket(salt: str, sticky_id: str) -> float:
    """A number in [0, 1) fixed by (salt, sticky_id), uniform over ids."""
    digest = hashlib.blake2b(f"{salt}\0{sticky_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2.0**64


def route_request(body: dict[str, Any], key: str, tier: str | None, prompt_tokens: int) -> RouteRequest:
    """The routing features of a request body. `metadata` must map strings to strings (as OpenAI's
    does); the sticky id is the first of: `conversation` (an id or {"id": ...}, Responses API),
    metadata `conversation_id`, `user`, `safety_identifier`, else the caller's key (or address)."""
    metadata = body.get("metadata") or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise APIError(400, "'metadata' must be an object whose values are strings.", param="metadata",
                       code="invalid_value")
    conv = body.get("conversation")
    if isinstance(conv, dict):
        conv = conv.get("id")
    candidates = [("conversation", conv), ("conversation", metadata.get("conversation_id")),
                  ("user", body.get("user")), ("user", body.get("safety_identifier"))]
    sticky = next((f"{kind}:{v}" for kind, v in candidates if isinstance(v, str) and v), f"key:{key}")
    return RouteRequest(prompt_tokens, tier, metadata, sticky)
