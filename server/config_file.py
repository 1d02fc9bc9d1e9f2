"""`python -m server --config server.toml`: several models, API keys with tiers, routing rules.

    [[models]]                 # one table per model, each with its own engine and KV budget
    name = "small"             # the name clients send (required)
    path = "smollm2.gguf"      # .gguf file or HF folder, relative to this file; omitted: the bundled model
    aliases = ["mini"]
    tier = "pro"               # only keys of this tier may use it; omitted: every key
    kv_cache_memory = "64MiB"  # and any of the engine settings in ENGINE_KEYS (default: the command line's)
    speculative = {method = "ngram", num_speculative_tokens = 5}  # as --speculative-config's JSON

    [api_keys]                 # key = tier; these keys are accepted as well as --api-key ones
    "sk-team-1" = "pro"

    [routing]
    name = "auto"              # the model name that asks for routing (default "auto")
    default = "small"          # when no rule matches (default: the first model)

    [[routing.rules]]          # tried in order; the first whose conditions all hold picks `model`
    name = "long-prompts"
    model = "large"
    min_prompt_tokens = 1000   # also max_prompt_tokens, tier = "pro" (or a list), metadata = {task = "code"}

    [[routing.canary]]         # 10% of the routed traffic for "small" goes to "small-next"
    name = "small-next-canary"
    model = "small"
    canary = "small-next"
    weight = 0.1

A mistake fails at start-up with the file, the line and the entry (ConfigError).
"""
from __future__ import annotations

import argparse
import os
import re
import tomllib
from dataclasses import dataclass, field
from typing import Any

from pyengine.config import EngineConfig, memory_size
from server.models import ConfigError, check_config
from server.routing import CanarySplit, RoutingConfig, Rule

ENGINE_KEYS = {"dtype": str, "weights": str, "device": str, "max_model_len": int, "block_size": int,
               "kv_cache_memory": (str, int, float), "kv_cache_dtype": str, "enable_prefix_caching": bool,
               "max_num_seqs": int, "max_num_batched_tokens": int, "long_prefill_tokens": int,
               "solo_prefill_tokens": int, "scheduling_policy": str, "seed": int, "cuda_graphs": bool,
               "tensor_core_prefill": bool, "speculative": (dict, str)}
_MODEL_KEYS = {"name": str, "path": str, "aliases": list, "tier": str}
_RULE_KEYS = {"name": str, "model": str, "min_prompt_tokens": int, "max_prompt_tokens": int,
              "tier": (str, list), "metadata": dict}
_CANARY_KEYS = {"name": str, "model": str, "canary": str, "weight": (int, float)}


@dataclass
class ModelSpec:
    name: str
    path: str | None  # None: the bundled default model
    aliases: list[str] = field(default_factory=list)
    tier: str | None = None
    engine: dict[str, Any] = field(default_factory=dict)  # EngineConfig fields that differ from the defaults


@dataclass
class ServeFile:
    models: list[ModelSpec]
    key_tiers: dict[str, str]
    routing: RoutingConfig


def load(path: str) -> ServeFile:
    """Read and check a server TOML file; ConfigError names the file and line of a mistake."""
    try:
        with open(path, "rb") as f:
            text = f.read().decode()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot read the config file: {e}") from None
    lines = _Lines(text)
    try:
        doc = tomllib.loads(text)
        return _parse(doc, os.path.dirname(os.path.abspath(path)))
    except tomllib.TOMLDecodeError as e:  # its message says "(at line L, column C)"
        raise ConfigError(f"{path}: {e}") from None
    except ConfigError as e:
        line = lines.find(e.where)
        raise ConfigError(f"{path}:{line}: {_entry(e.where)}{e}" if line else f"{path}: {_entry(e.where)}{e}",
                          e.where) from None


def _parse(doc: dict, base: str) -> ServeFile:
    _check_keys(doc, {"models": list, "api_keys": dict, "routing": dict}, ())
    if not doc.get("models"):
        raise ConfigError("at least one [[models]] table is required")
    models = [_model(m, i, base) for i, m in enumerate(doc["models"])]
    key_tiers = doc.get("api_keys", {})
    for k, v in key_tiers.items():
        if not isinstance(v, str):
            raise ConfigError(f"a key's tier must be a string, got {v!r}", ("api_keys", None, k))
    r = doc.get("routing", {})
    _check_keys(r, {"name": str, "default": str, "rules": list, "canary": list}, ("routing", None))
    rules = []
    for i, t in enumerate(r.get("rules", [])):
        where = ("routing.rules", i)
        _check_keys(t, _RULE_KEYS, where)
        _require(t, ("name", "model"), where)
        tiers = t.get("tier")
        if isinstance(tiers, str):
            tiers = [tiers]
        if tiers is not None and not all(isinstance(v, str) for v in tiers):
            raise ConfigError("tier must be a string or a list of strings", (*where, "tier"))
        metadata = t.get("metadata")
        if metadata is not None and not all(isinstance(v, str) for v in metadata.values()):
            raise ConfigError("metadata values must be strings", (*where, "metadata"))
        rules.append(Rule(t["name"], t["model"], t.get("min_prompt_tokens"), t.get("max_prompt_tokens"),
                          tiers, metadata))
    canaries = []
    for i, t in enumerate(r.get("canary", [])):
        where = ("routing.canary", i)
        _check_keys(t, _CANARY_KEYS, where)
        _require(t, ("name", "model", "canary", "weight"), where)
        canaries.append(CanarySplit(t["name"], t["model"], t["canary"], float(t["weight"])))
    routing = RoutingConfig(r.get("name", "auto"), r.get("default"), rules, canaries)
    check_config([(m.name, m.aliases, m.tier) for m in models], routing, key_tiers)
    return ServeFile(models, key_tiers, routing)


def _model(t: dict, i: int, base: str) -> ModelSpec:
    from pyengine.model.loader import resolve_model_path

    where = ("models", i)
    _check_keys(t, _MODEL_KEYS | ENGINE_KEYS, where)
    _require(t, ("name",), where)
    if not all(isinstance(a, str) for a in t.get("aliases", [])):
        raise ConfigError("aliases must be strings", (*where, "aliases"))
    path = t.get("path")
    if path is not None:
        path = os.path.join(base, os.path.expanduser(path))
        try:
            resolve_model_path(path)
        except (FileNotFoundError, ValueError) as e:
            raise ConfigError(str(e), (*where, "path")) from None
    engine = {k: t[k] for k in ENGINE_KEYS if k in t}
    if isinstance(engine.get("kv_cache_memory"), str):
        try:
            engine["kv_cache_memory"] = memory_size(engine["kv_cache_memory"])
        except argparse.ArgumentTypeError as e:
            raise ConfigError(str(e), (*where, "kv_cache_memory")) from None
    try:  # the values' ranges, checked now rather than after the models before it have loaded
        EngineConfig(**engine)
    except ValueError as e:  # EngineConfig's messages start with the field's name
        field_name = str(e).split(" ", 1)[0]
        raise ConfigError(str(e), (*where, field_name) if field_name in engine else where) from None
    return ModelSpec(t["name"], path, list(t.get("aliases", [])), t.get("tier"), engine)


def _check_keys(t: Any, allowed: dict[str, Any], where: tuple) -> None:
    if not isinstance(t, dict):
        raise ConfigError("expected a table", where)
    for k, v in t.items():
        if k not in allowed:
            raise ConfigError(f"unknown setting {k!r} (allowed: {', '.join(allowed)})", (*where, k))
        if not isinstance(v, allowed[k]) or (isinstance(v, bool) and allowed[k] in (int, (int, float))):
            raise ConfigError(f"{k} = {v!r} has the wrong type", (*where, k))


def _require(t: dict, keys: tuple[str, ...], where: tuple) -> None:
    for k in keys:
        if k not in t:
            raise ConfigError(f"{k!r} is required", where)


def _entry(where: tuple) -> str:
    """("models", 1, "path") -> "models[1].path: "."""
    if len(where) < 2:
        return f"{where[0]}: " if where else ""
    table, index, *key = where
    return f"{table}{'' if index is None else f'[{index}]'}{'.' + key[0] if key else ''}: "


class _Lines:
    """Line numbers of tables and keys in the TOML text, to point at the line an error is about.
    Finds `[table]`, `[[array]]` headers and `key =` lines (keys inline or on continuation lines
    of a multi-line value are reported at their table's header)."""

    _HEADER = re.compile(r"\s*(\[\[?)\s*([^\]]+?)\s*\]\]?")
    _KEY = re.compile(r"""\s*("[^"]*"|'[^']*'|[A-Za-z0-9_-]+)\s*=""")

    def __init__(self, text: str) -> None:
        self.at: dict[tuple, int] = {}
        counts: dict[str, int] = {}
        table: tuple = ()
        for n, line in enumerate(text.splitlines(), 1):
            if m := self._HEADER.match(line):
                name = m.group(2)
                if m.group(1) == "[[":
                    counts[name] = counts.get(name, 0) + 1
                    table = (name, counts[name] - 1)
                else:
                    table = (name, None)
                self.at.setdefault(table, n)
            elif (m := self._KEY.match(line)) and table:
                self.at.setdefault((*table, m.group(1).strip("\"'")), n)
            elif (m := self._KEY.match(line)):
                self.at.setdefault((m.group(1).strip("\"'"),), n)

    def find(self, where: tuple) -> int | None:
        while where:
            if where in self.at:
                return self.at[where]
            where = where[:-1] if len(where) != 2 else ()
        return None
