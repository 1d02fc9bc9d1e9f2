"""OpenAI request parsing and validation, and OpenAI-style error bodies.

Everything here is pure (no aiohttp, no engine): a request body (already decoded JSON) goes in,
a validated ``ChatRequest``/``CompletionRequest`` comes out, or an ``APIError`` naming the field.
Unknown fields are ignored, as OpenAI's server does; known fields this server cannot honour
(best_of > n, suffix, functions, audio) are refused with a 400 naming them, never ignored.
"""
from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pyengine.sampling_params import INT64_MAX, LIMITS, StructuredOutputsParams
from server.tools import ToolSpec, parse_tools

MAX_JSON_DEPTH = 64  # nesting levels of arrays and objects in a request body
MAX_STOP = 16
CHAT_ROLES = {"system", "developer", "user", "assistant", "tool"}


class APIError(Exception):
    """An error that reaches the client as ``{"error": {message, type, param, code}}``."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def invalid(param: str, message: str) -> APIError:
    return APIError(400, message, param=param, code="invalid_value" if param else None)


def parse_json(raw: bytes) -> dict[str, Any]:
    """Decode a request body; anything but a JSON object of valid Unicode is a 400.

    Refused before they reach code that would fail on them: nesting deeper than MAX_JSON_DEPTH
    (the decoder recurses), lone UTF-16 surrogates (they are not Unicode: the tokenizer cannot
    encode them), NaN/Infinity (not JSON) and integers longer than Python converts.
    """
    try:
        text = raw.decode(json.detect_encoding(raw))  # strict: no surrogates encoded as UTF-8
        if _json_depth(text) > MAX_JSON_DEPTH:
            raise ValueError(f"it is nested deeper than {MAX_JSON_DEPTH} levels")
        body = json.loads(text, parse_constant=_no_constant)
        if _SURROGATE_ESCAPE.search(text):  # then a string may hold one alone: try to encode them all
            json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as e:
        raise APIError(400, f"The JSON body of your request holds a lone UTF-16 surrogate "
                       f"({e.object[e.start:e.end]!r}), which is not valid Unicode.",
                       code="invalid_json") from None
    except (UnicodeDecodeError, ValueError, RecursionError) as e:  # JSONDecodeError is a ValueError
        raise APIError(400, f"We could not parse the JSON body of your request: {e}",
                       code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, "The request body must be a JSON object.", code="invalid_json")
    return body


_JSON_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_NOT_BRACKET = bytes(b for b in range(256) if b not in b"[]{}")
_BRACKET_STEP = bytes.maketrans(b"[{]}", b"\x01\x01\xff\xff")  # +1 / -1 as int8


def _json_depth(text: str) -> int:
    """Deepest nesting of arrays/objects in JSON text, without parsing it: brackets outside strings,
    summed. A body with few brackets cannot be deep, so most bodies skip the scan."""
    if text.count("[") + text.count("{") <= MAX_JSON_DEPTH:
        return 0
    steps = _JSON_STRING.sub("", text).encode("ascii", "ignore").translate(_BRACKET_STEP, _NOT_BRACKET)
    return int(np.frombuffer(steps, np.int8).cumsum(dtype=np.int64).max(initial=0))


def _no_constant(name: str) -> float:
    raise ValueError(f"{name} is not a JSON value")


# ---------------------------------------------------------------- typed field getters
def _typename(v: Any) -> str:
    return "null" if v is None else type(v).__name__


def get_bool(body: dict, name: str, default: bool | None = None) -> bool | None:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise invalid(name, f"'{name}' must be a boolean, got {_typename(v)}")
    return v


def get_int(body: dict, name: str, default: int, *, lo: int, hi: int) -> int:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int):
        raise invalid(name, f"'{name}' must be an integer, got {_typename(v)}")
    if not lo <= v <= hi:
        raise invalid(name, f"'{name}' must be in [{lo}, {hi}], got {v}")
    return v


def get_param(body: dict, name: str, default: Any = None, *, limit: str | None = None,
              hi: int | None = None) -> Any:
    """A sampling field, checked against SamplingParams' LIMITS[limit or name] (the engine's own
    native-type ranges, one definition); `hi` tightens the upper bound (the server's max n)."""
    v = body.get(name)
    if v is None:
        return default
    rng = LIMITS[limit or name]
    if hi is not None:
        rng = dataclasses.replace(rng, hi=min(rng.hi, hi))
    if rng.kind != "float32" and isinstance(v, float) and v.is_integer():
        v = int(v)
    try:
        return rng.convert(v)
    except ValueError as e:
        raise invalid(name, f"'{name}' {e}") from None


def get_str(body: dict, name: str, default: str | None = None) -> str | None:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, str):
        raise invalid(name, f"'{name}' must be a string, got {_typename(v)}")
    return v


# ---------------------------------------------------------------- requests
@dataclass
class GenerationRequest:
    """Fields shared by chat and completions requests, validated."""

    model: str | None
    n: int
    stream: bool
    include_usage: bool
    max_tokens: int | None  # None: what is left of the context window
    priority: int
    # Keyword arguments for SamplingParams (max_tokens and logprobs are added by the handler).
    sampling: dict[str, Any] = field(default_factory=dict)
    num_logprobs: int | None = None  # None: no logprobs; N: sampled token + top N
    structured_param: str | None = None  # the field that asked for structured output (names its errors)


@dataclass
class ChatRequest(GenerationRequest):
    messages: list[dict[str, Any]] = field(default_factory=list)
    tools: ToolSpec | None = None


@dataclass
class CompletionRequest(GenerationRequest):
    # One engine request per prompt: text or token ids.
    prompts: list[str | list[int]] = field(default_factory=list)
    echo: bool = False  # the prompt text comes first in each choice's text
    # max_tokens 0 with echo (the legacy API's prompt scoring): the engine generates one token for the
    # prompt's logprobs, and the answer leaves it out
    score_only: bool = False


def _common(body: dict, max_n: int) -> dict[str, Any]:
    """Validate the fields both endpoints share; return GenerationRequest kwargs."""
    model = get_str(body, "model")
    n = get_param(body, "n", 1, hi=max_n)
    stream = get_bool(body, "stream", False)
    opts = body.get("stream_options")
    include_usage = False
    if opts is not None:
        if not isinstance(opts, dict):
            raise invalid("stream_options", "'stream_options' must be an object")
        include_usage = bool(get_bool(opts, "include_usage", False)) and stream
    max_tokens = get_param(body, "max_completion_tokens", limit="max_tokens")
    if max_tokens is None:
        max_tokens = get_param(body, "max_tokens")
    get_str(body, "user")
    s: dict[str, Any] = {
        "temperature": get_param(body, "temperature", 1.0),
        "top_p": get_param(body, "top_p", 1.0),
        "top_k": get_param(body, "top_k", 0),
        "min_p": get_param(body, "min_p", 0.0),
        "presence_penalty": get_param(body, "presence_penalty", 0.0),
        "frequency_penalty": get_param(body, "frequency_penalty", 0.0),
        "repetition_penalty": get_param(body, "repetition_penalty", 1.0),
        "seed": get_param(body, "seed"),
        "min_tokens": get_param(body, "min_tokens", 0),
        "ignore_eos": get_bool(body, "ignore_eos", False),
        "stop": _stop(body.get("stop")),
        "stop_token_ids": _int_list(body, "stop_token_ids"),
        "include_stop_str_in_output": get_bool(body, "include_stop_str_in_output", False),
        "skip_special_tokens": get_bool(body, "skip_special_tokens", True),
    }
    if s["top_k"] == -1:
        s["top_k"] = 0
    s["n"] = n
    if max_tokens is not None and s["min_tokens"] > max_tokens:
        raise invalid("min_tokens", f"'min_tokens' ({s['min_tokens']}) must not exceed "
                      f"max_tokens ({max_tokens})")
    _refuse_unsupported(body, n)
    s["logit_bias"] = _logit_bias(body.get("logit_bias"))
    s["structured_outputs"], structured_param = _structured(body)
    return dict(model=model, n=n, stream=stream, include_usage=include_usage, max_tokens=max_tokens,
                priority=get_int(body, "priority", 0, lo=-INT64_MAX - 1, hi=INT64_MAX), sampling=s,
                structured_param=structured_param)


def _refuse_unsupported(body: dict, n: int) -> None:
    """Fields OpenAI defines that this server cannot honour: a 400 naming each, never a silent ignore."""
    best_of = get_param(body, "best_of", None, limit="n")
    if best_of is not None and best_of != n:
        raise APIError(400, f"'best_of' ({best_of}) other than n ({n}) is not supported; ask for n choices "
                       "and pick among them", param="best_of", code="unsupported_parameter")
    if body.get("suffix"):
        raise APIError(400, "'suffix' (insertion) is not supported", param="suffix", code="unsupported_parameter")
    for name in ("functions", "function_call"):
        if body.get(name) is not None:
            raise APIError(400, f"'{name}' is deprecated and not supported; use 'tools' and 'tool_choice'",
                           param=name, code="unsupported_parameter")
    modalities = body.get("modalities")
    if body.get("audio") is not None or (isinstance(modalities, list) and "audio" in modalities):
        raise APIError(400, "audio output is not supported ('audio' / 'modalities')",
                       param="audio" if body.get("audio") is not None else "modalities", code="unsupported_parameter")


def _logit_bias(v: Any) -> dict[int, float] | None:
    """{"token id": bias} -> {id: bias}; ids beyond the vocabulary are refused by the engine."""
    if v is None:
        return None
    if not isinstance(v, dict):
        raise invalid("logit_bias", "'logit_bias' must be an object mapping token ids to biases")
    out = {}
    for k, b in v.items():
        try:
            tid = LIMITS["stop_token_ids"].convert(int(k) if str(k).strip().isdigit() else k)
            out[tid] = LIMITS["logit_bias"].convert(b)
        except ValueError as e:
            raise invalid("logit_bias", f"'logit_bias' {'values' if str(k).strip().isdigit() else 'keys'} {e} "
                          f"(entry {k!r})") from None
    return out or None


_STRUCTURED_KEYS = ("json", "json_object", "regex", "choice", "grammar")


def _structured(body: dict) -> tuple[StructuredOutputsParams | None, str | None]:
    """response_format (OpenAI) or structured_outputs (vLLM) -> (StructuredOutputsParams, field name)."""
    rf, so = body.get("response_format"), body.get("structured_outputs")
    if rf is not None and so is not None:
        raise invalid("structured_outputs", "use either 'response_format' or 'structured_outputs', not both")
    if rf is not None:
        if not isinstance(rf, dict) or rf.get("type") not in ("text", "json_object", "json_schema"):
            raise invalid("response_format", "'response_format' must be {\"type\": \"text\"}, "
                          "{\"type\": \"json_object\"} or {\"type\": \"json_schema\", \"json_schema\": {...}}")
        if rf["type"] == "text":
            return None, None
        if rf["type"] == "json_object":
            return StructuredOutputsParams(json_object=True), "response_format"
        js = rf.get("json_schema")
        if not isinstance(js, dict) or not isinstance(js.get("name"), str):
            raise invalid("response_format.json_schema", "'response_format.json_schema' must be an object with "
                          "a 'name' and a 'schema'")
        schema = js.get("schema")
        if schema is None:
            return StructuredOutputsParams(json_object=True), "response_format"
        if not isinstance(schema, dict):
            raise invalid("response_format.json_schema.schema", "'response_format.json_schema.schema' must be "
                          "a JSON schema object")
        return StructuredOutputsParams(json=schema), "response_format"
    if so is None:
        return None, None
    if not isinstance(so, dict):
        raise invalid("structured_outputs", f"'structured_outputs' must be an object with one of {list(_STRUCTURED_KEYS)}")
    unknown = sorted(set(so) - set(_STRUCTURED_KEYS))
    if unknown:
        raise invalid("structured_outputs", f"'structured_outputs' has unsupported key {unknown[0]!r}; "
                      f"supported: {list(_STRUCTURED_KEYS)}")
    kw = {k: v for k, v in so.items() if v is not None and v is not False}
    try:
        return StructuredOutputsParams(**kw), "structured_outputs"
    except ValueError as e:
        raise invalid("structured_outputs", str(e)) from None


def _stop(v: Any) -> list[str] | None:
    if v is None:
        return None
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        raise invalid("stop", "'stop' must be a string or a list of strings")
    if len(v) > MAX_STOP:
        raise invalid("stop", f"'stop' may hold at most {MAX_STOP} strings, got {len(v)}")
    v = [x for x in v if x]
    return v or None


def _int_list(body: dict, name: str) -> list[int] | None:
    v = body.get(name)
    if v is None:
        return None
    rng = LIMITS[name]
    if not isinstance(v, list):
        raise invalid(name, f"'{name}' must be a list of token ids")
    for i, x in enumerate(v):
        try:
            rng.convert(x)
        except ValueError as e:
            raise invalid(name, f"'{name}[{i}]' {e}") from None
    return v or None


def parse_chat(body: dict, max_n: int) -> ChatRequest:
    common = _common(body, max_n)
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise invalid("messages", "'messages' must be a non-empty list of messages")
    messages = [_message(m, i) for i, m in enumerate(msgs)]
    tools = parse_tools(body, invalid)
    if tools is not None and tools.schema() is not None:
        if common["structured_param"] is not None:
            raise invalid(common["structured_param"], f"'{common['structured_param']}' cannot be combined with "
                          f"tool_choice {tools.choice if tools.choice != 'named' else 'naming a function'}")
        common["sampling"]["structured_outputs"] = StructuredOutputsParams(json=tools.schema())
        common["structured_param"] = "tools"
    num_logprobs = None
    if get_bool(body, "logprobs", False):
        num_logprobs = get_param(body, "top_logprobs", 0, limit="logprobs")
    elif body.get("top_logprobs") is not None:
        get_param(body, "top_logprobs", limit="logprobs")
        raise invalid("top_logprobs", "'top_logprobs' requires 'logprobs' to be true")
    return ChatRequest(**common, num_logprobs=num_logprobs, messages=messages, tools=tools)


def _message(m: Any, i: int) -> dict[str, Any]:
    p = f"messages[{i}]"
    if not isinstance(m, dict):
        raise invalid(p, f"'{p}' must be an object with 'role' and 'content'")
    role = m.get("role")
    if not isinstance(role, str) or role not in CHAT_ROLES:
        raise invalid(f"{p}.role", f"'{p}.role' must be one of {sorted(CHAT_ROLES)}, got {role!r}")
    content = m.get("content")
    if content is None and role == "assistant":
        content = ""
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text" and isinstance(kind, str):
                raise APIError(400, f"'{p}.content[{j}]' is a '{kind}' part; this model reads only text parts",
                               param=f"{p}.content[{j}]", code="unsupported_parameter")
            if kind != "text" or not isinstance(part.get("text"), str):
                raise invalid(f"{p}.content[{j}]", f"'{p}.content[{j}]' must be a text part "
                              "{\"type\": \"text\", \"text\": ...}")
            parts.append(part["text"])
        content = "".join(parts)
    if not isinstance(content, str):
        raise invalid(f"{p}.content", f"'{p}.content' must be a string or a list of text parts")
    msg: dict[str, Any] = {"role": "system" if role == "developer" else role, "content": content}
    calls = m.get("tool_calls")
    if calls is not None:
        if role != "assistant" or not isinstance(calls, list) or not all(
                isinstance(c, dict) and isinstance(c.get("function"), dict) and isinstance(c["function"].get("name"), str)
                for c in calls):
            raise invalid(f"{p}.tool_calls", f"'{p}.tool_calls' must be a list of "
                          "{\"id\", \"type\": \"function\", \"function\": {\"name\", \"arguments\"}} on an assistant message")
        msg["tool_calls"] = calls
    if role == "tool":
        msg["tool_call_id"] = get_str(m, "tool_call_id")
    return msg


def parse_completion(body: dict, max_n: int, vocab_size: int) -> CompletionRequest:
    echo = bool(get_bool(body, "echo", False))
    zero = body.get("max_tokens")
    score_only = (echo and type(zero) in (int, float) and zero == 0  # (not False, which == 0 too)
                  and body.get("max_completion_tokens") is None)
    common = _common({**body, "max_tokens": 1} if score_only else body, max_n)
    prompts = _prompts(body.get("prompt"), vocab_size)
    num_logprobs = get_param(body, "logprobs")
    return CompletionRequest(**common, num_logprobs=num_logprobs, prompts=prompts, echo=echo, score_only=score_only)


def _prompts(v: Any, vocab_size: int) -> list[str | list[int]]:
    def ids_ok(x: Any) -> bool:
        return (isinstance(x, list) and len(x) > 0 and
                all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in x))

    if isinstance(v, str):
        return [v]
    if isinstance(v, list) and v:
        if all(isinstance(x, str) for x in v):
            return list(v)
        if ids_ok(v):
            return [v]
        if all(ids_ok(x) for x in v):
            return list(v)
    raise invalid("prompt", "'prompt' must be a string, a non-empty list of strings, a list of token "
                  f"ids in [0, {vocab_size}) or a list of such lists")


# ---------------------------------------------------------------- /tokenize, /detokenize
def parse_detokenize(body: dict, vocab_size: int) -> list[int]:
    v = body.get("tokens")
    if not isinstance(v, list) or not all(isinstance(t, int) and not isinstance(t, bool) and
                                          0 <= t < vocab_size for t in v):
        raise invalid("tokens", f"'tokens' must be a list of token ids in [0, {vocab_size})")
    return v

