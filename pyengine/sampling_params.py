"""Per-request sampling parameters, validated up front (vLLM names and semantics)."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

_MAX_LOGPROBS = 20
LOGIT_BIAS_RANGE = (-100.0, 100.0)  # OpenAI's


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
        """(kind, canonical text): what the compiled grammar depends on."""
        if self.json is not None:
            text = self.json if isinstance(self.json, str) else json.dumps(self.json, sort_keys=True)
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
    """How to pick tokens and when to stop.

    temperature 0 means greedy (exact argmax). top_k <= 0 and top_p == 1 and min_p == 0 turn the
    filters off. seed None draws a random seed when the request is created, so every request has
    a reproducible stream keyed by (seed, output position) whatever the batch it runs in.
    logprobs: None = none; 0 = the sampled token's; N = also the top N.
    prompt_logprobs: the same for each prompt token (given the tokens before it; the first has
    none). Such a request computes its whole prompt: it takes nothing from the prefix cache.
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
        self.stop_strings = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self._validate()

    def _validate(self) -> None:
        def bad(name: str, allowed: str) -> ValueError:
            return ValueError(f"{name} must be {allowed}, got {getattr(self, name)!r}")

        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", "an integer >= 1")
        if not 0.0 <= self.temperature <= 100.0:
            raise bad("temperature", "in [0, 100]")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise bad("top_k", "an integer >= -1 (0 or -1 = off)")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "in [0, 1]")
        if self.seed is not None and (not isinstance(self.seed, int) or not 0 <= self.seed < 2**63):
            raise bad("seed", "None or an integer in [0, 2**63)")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise bad("max_tokens", "None or an integer >= 1")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad("min_tokens", "an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", "in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", "in [-2, 2]")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise bad("repetition_penalty", "in (0, 2]")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= _MAX_LOGPROBS):
            raise bad("logprobs", f"None or an integer in [0, {_MAX_LOGPROBS}]")
        if self.prompt_logprobs is not None and (not isinstance(self.prompt_logprobs, int)
                                                 or not 0 <= self.prompt_logprobs <= _MAX_LOGPROBS):
            raise bad("prompt_logprobs", f"None or an integer in [0, {_MAX_LOGPROBS}]")
        if any(not isinstance(s, str) or not s for s in self.stop_strings):
            raise bad("stop", "a non-empty string or a list of non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "a list of non-negative token ids")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise bad("structured_outputs", "None or a StructuredOutputsParams")
        if self.logit_bias is not None:
            lo, hi = LOGIT_BIAS_RANGE
            if not isinstance(self.logit_bias, dict) or not all(
                    _is_int(t) and t >= 0 and _is_number(v) and lo <= v <= hi for t, v in self.logit_bias.items()):
                raise bad("logit_bias", f"None or a dict of token id (int >= 0) -> bias in [{lo:g}, {hi:g}]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v
