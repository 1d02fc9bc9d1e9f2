"""Per-request sampling parameters, validated up front (vLLM names and semantics).

Every numeric field is checked in the type the native step converts it to (LIMITS below: int32,
int64 or float32), so a request that passes can never fail inside a shared step. The server's 400s
(server/protocol.py) read the same LIMITS.
"""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from typing import Any

INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1
MAX_LOGPROBS = 20  # OpenAI's bound on top logprobs
MAX_N = 128  # OpenAI's bound on choices per request
# repetition_penalty divides a seen token's positive logit: at 1e-38 (a normal float32) a logit of 4
# becomes inf and the row's logprobs NaN. From 0.01 up a logit grows at most 100-fold, far from overflow.
MIN_REPETITION_PENALTY = 0.01


def _float32(v: float) -> float:
    """v rounded to float32 (|v| must be within float32's range)."""
    return struct.unpack("f", struct.pack("f", v))[0]


@dataclass(frozen=True)
class Range:
    """A numeric field's allowed values in the native type the engine hands it to.

    kind "int32"/"int64": an int (not a bool) in [lo, hi]. kind "float32": a finite int or float;
    it is taken as float32, so a nonzero value that underflows to 0 there *is* 0 (then checked
    against the range: temperature and min_p accept 0, top_p refuses it).
    """

    kind: str  # "int32" | "int64" | "float32"
    lo: float
    hi: float
    lo_open: bool = False

    def describe(self) -> str:
        if self.kind == "float32":
            return f"a number in {'(' if self.lo_open else '['}{self.lo:g}, {self.hi:g}]"
        return f"an integer in [{self.lo}, {self.hi}]"

    def convert(self, value: Any) -> int | float:
        """The value as the engine keeps it, or ValueError("must be ..., got ...") (no field name)."""
        types = (int, float) if self.kind == "float32" else int
        v = value
        ok = isinstance(value, types) and not isinstance(value, bool) and self.lo <= value <= self.hi  # NaN fails
        if ok and self.kind == "float32":
            v = float(value)
            if abs(v) < 1.0 and _float32(v) == 0.0:  # underflows in float32
                v = 0.0
        if not ok or (self.lo_open and v == self.lo):
            shown = f"{value!r} ({v:g} as float32)" if ok and v != value else repr(value)[:40]
            raise ValueError(f"must be {self.describe()}, got {shown}")
        return v


# The one definition of every numeric sampling field's range (ranges are OpenAI's where it defines them).
LIMITS: dict[str, Range] = {
    "n": Range("int32", 1, MAX_N),
    "temperature": Range("float32", 0.0, 2.0),
    "top_p": Range("float32", 0.0, 1.0, lo_open=True),
    "top_k": Range("int32", -1, INT32_MAX),
    "min_p": Range("float32", 0.0, 1.0),
    "seed": Range("int64", 0, INT64_MAX),
    "max_tokens": Range("int32", 1, INT32_MAX),
    "min_tokens": Range("int32", 0, INT32_MAX),
    "presence_penalty": Range("float32", -2.0, 2.0),
    "frequency_penalty": Range("float32", -2.0, 2.0),
    "repetition_penalty": Range("float32", MIN_REPETITION_PENALTY, 2.0),
    "logprobs": Range("int32", 0, MAX_LOGPROBS),
    "prompt_logprobs": Range("int32", 0, MAX_LOGPROBS),
    "stop_token_ids": Range("int32", 0, INT32_MAX),  # each id; the engine checks it against its vocabulary
    "logit_bias": Range("float32", -100.0, 100.0),  # each bias (its keys: token ids, as stop_token_ids)
}
_OPTIONAL = ("seed", "max_tokens", "logprobs", "prompt_logprobs")  # None allowed
_FLAGS = ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Constrain the output to a grammar (vLLM's names); exactly one of the fields is set.

    json: a JSON schema (dict or JSON string); json_object: any JSON object; regex: a regular
    expression the whole output matches; choice: one of these strings; grammar: EBNF (GBNF style,
    a `root` rule). The engine compiles it with xgrammar (pyengine.structured) when the request is
    added; an invalid or unsupported grammar raises ValueError there.
    """

    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        kinds = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        kinds += ["json_object"] if self.json_object else []
        if len(kinds) != 1:
            raise ValueError("structured_outputs must set exactly one of json, json_object, regex, choice, "
                             f"grammar; got {kinds or 'none'}")
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise ValueError(f"structured_outputs.json must be a JSON schema (dict or string), got {type(self.json).__name__}")
        if self.regex is not None and not isinstance(self.regex, str):
            raise ValueError("structured_outputs.regex must be a string")
        if self.grammar is not None and not isinstance(self.grammar, str):
            raise ValueError("structured_outputs.grammar must be a string")
        if self.choice is not None and (not isinstance(self.choice, (list, tuple)) or not self.choice
                                        or not all(isinstance(c, str) for c in self.choice)):
            raise ValueError("structured_outputs.choice must be a non-empty list of strings")

    @property
    def key(self) -> tuple[str, str]:
        """(kind, text): what the compiled grammar depends on. A schema keeps its key order: xgrammar
        writes properties in the schema's order (a tool call's name before its arguments)."""
        if self.json is not None:
            text = self.json if isinstance(self.json, str) else json.dumps(self.json)
            return "json", text
        if self.json_object:
            return "json_object", ""
        if self.regex is not None:
            return "regex", self.regex
        if self.choice is not None:
            return "choice", json.dumps(list(self.choice))
        return "grammar", self.grammar


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop. Numeric ranges: LIMITS.

    temperature 0 means greedy (exact argmax). top_k <= 0 and top_p == 1 and min_p == 0 turn the
    filters off. Floats are taken as float32: a positive temperature or min_p too small for float32
    becomes 0 (greedy; min-p off), a positive top_p that small is refused. repetition_penalty is at
    least 0.01 (MIN_REPETITION_PENALTY): a smaller one can push a logit past float32's range.
    seed None: the engine draws one when the request is queued (from its own RNG, seeded by
    EngineConfig.seed), so every request has a reproducible stream keyed by (seed, output position)
    whatever the batch it runs in.
    logprobs: None = none; 0 = the sampled token's; N = also the top N.
    prompt_logprobs: the same for each prompt token (given the tokens before it; the first has none).
    structured_outputs: constrain the output to a JSON schema, regex, choice or grammar.
    logit_bias: token id -> bias in [-100, 100], added to the logits before sampling (ids must be
    below the model's vocabulary size; the engine checks that when the request is added).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    logit_bias: dict[int, float] | None = None
    stop_strings: list[str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        stops = [self.stop] if isinstance(self.stop, str) else self.stop
        if not isinstance(stops, (list, tuple, type(None))) or any(not isinstance(s, str) or not s for s in stops or ()):
            raise ValueError(f"stop must be a non-empty string or a list of non-empty strings, got {self.stop!r}")
        self.stop_strings = list(stops or [])
        ids = self.stop_token_ids
        if not isinstance(ids, (list, tuple, type(None))):
            raise ValueError(f"stop_token_ids must be a list of token ids, got {ids!r}")
        self.stop_token_ids = [self._convert("stop_token_ids", t) for t in ids or ()]
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError(f"logit_bias must be a dict of token id -> bias, got {self.logit_bias!r}")
            self.logit_bias = {self._convert("stop_token_ids", t, "logit_bias token id"): self._convert("logit_bias", v)
                               for t, v in self.logit_bias.items()}
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError(f"structured_outputs must be None or a StructuredOutputsParams, got {self.structured_outputs!r}")
        for name in LIMITS.keys() - {"stop_token_ids", "logit_bias"}:
            value = getattr(self, name)
            if value is not None or name not in _OPTIONAL:
                setattr(self, name, self._convert(name, value))
        for name in _FLAGS:
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")

    @staticmethod
    def _convert(name: str, value: Any, label: str | None = None) -> int | float:
        try:
            return LIMITS[name].convert(value)
        except ValueError as e:
            raise ValueError(f"{label or name} {e}") from None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0
