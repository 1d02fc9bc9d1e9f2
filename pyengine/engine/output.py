"""Turning sampled tokens into user-visible output: incremental detokenization, stop checks,
finish reasons, and the RequestOutput / CompletionOutput records (vLLM-compatible shapes)."""
from __future__ import annotations

from dataclasses import dataclass, field

from pyengine.engine.request import Request, RequestStatus

# Prompt tokens decoded with the first output tokens, so word-boundary spaces come out right.
_CONTEXT_TOKENS = 5


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (token id, logprob), best first


@dataclass
class RequestMetrics:
    """perf_counter timestamps (seconds) and counts of one sequence."""

    arrival_time: float
    queued_time: float | None
    first_scheduled_time: float | None
    first_token_time: float | None
    last_token_time: float | None
    finished_time: float | None
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    num_preemptions: int
    num_draft_tokens: int = 0  # speculative decoding: draft tokens verified
    num_accepted_tokens: int = 0  # of which accepted

    @classmethod
    def of(cls, r: Request) -> "RequestMetrics":
        drafted, accepted = (r.spec.num_draft_tokens, r.spec.num_accepted_tokens) if r.spec is not None else (0, 0)
        return cls(r.arrival_time, r.queued_time, r.first_scheduled_time, r.first_token_time,
                   r.last_token_time, r.finished_time, r.num_prompt_tokens, r.num_cached_tokens,
                   r.num_output_tokens, r.num_preemptions, drafted, accepted)

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        if self.first_token_time is None or self.last_token_time is None or self.num_output_tokens < 2:
            return None
        return (self.last_token_time - self.first_token_time) / (self.num_output_tokens - 1)

    @property
    def e2e(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time

    @property
    def queue_time(self) -> float | None:
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    logprobs: list[TokenLogprob] | None = None
    cumulative_logprob: float | None = None  # sum of the output tokens' logprobs so far (with logprobs)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    # with SamplingParams.prompt_logprobs: per prompt token (None for the first), in one output
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # set (with finished=True, every unfinished sequence "abort") when a model step failed because
    # of this request; other requests in that step are unaffected
    error: str | None = None

    @property
    def num_cached_tokens(self) -> int:
        return self.metrics.num_cached_tokens if self.metrics else 0


class IncrementalDetokenizer:
    """Decodes one sequence's output tokens as they come, right across multi-byte characters
    split over tokens (a trailing U+FFFD means "incomplete, wait"), and applies stop strings.

    Text is produced with the vLLM offsets method: decode ids[prefix:] and ids[prefix:read]; the
    difference is the new text. `text` is the output so far, already cut at a matched stop string.
    While streaming, `pop_delta` holds back a tail that could still grow into a stop string.
    """

    __slots__ = ("tok", "ids", "prefix_offset", "read_offset", "text", "sent", "stops", "max_stop",
                 "include_stop", "skip_special")

    def __init__(self, tokenizer, prompt_ids: list[int], stop: list[str], include_stop: bool,
                 skip_special_tokens: bool) -> None:
        self.tok = tokenizer
        self.ids = list(prompt_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""
        self.sent = 0
        self.stops = stop
        self.max_stop = max((len(s) for s in stop), default=0)
        self.include_stop = include_stop
        self.skip_special = skip_special_tokens

    def add(self, token_id: int) -> str | None:
        """Append one token; returns the stop string it completed, if any."""
        self.ids.append(token_id)
        prefix_text = self.tok.decode(self.ids[self.prefix_offset:self.read_offset], skip_special_tokens=self.skip_special)
        new_text = self.tok.decode(self.ids[self.prefix_offset:], skip_special_tokens=self.skip_special)
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return None
        old_len = len(self.text)
        self.text += new_text[len(prefix_text):]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        if not self.stops:
            return None
        begin = max(0, old_len - self.max_stop + 1)
        best, best_at = None, -1
        for s in self.stops:
            at = self.text.find(s, begin)
            if at >= 0 and (best_at < 0 or at < best_at):
                best, best_at = s, at
        if best is not None:
            self.text = self.text[: best_at + len(best) if self.include_stop else best_at]
        return best

    def pop_delta(self, finished: bool) -> str:
        """New text since the last call. Unfinished: keep back a tail that is a prefix of a stop."""
        end = len(self.text)
        if not finished and self.stops and not self.include_stop:
            for k in range(min(self.max_stop - 1, end - self.sent), 0, -1):
                tail = self.text[end - k:]
                if any(s.startswith(tail) for s in self.stops):
                    end -= k
                    break
        delta = self.text[self.sent:end]
        self.sent = end
        return delta


def check_token_stop(req: Request, token_id: int, eos_ids: frozenset[int]) -> tuple[RequestStatus, int | None] | None:
    """EOS / stop token / length checks for the token just appended (vLLM order)."""
    p = req.params
    if req.num_output_tokens >= p.min_tokens:
        if not p.ignore_eos and token_id in eos_ids:
            return RequestStatus.FINISHED_STOPPED, None
        if p.stop_token_ids and token_id in p.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED, token_id
    if req.num_tokens >= req.max_total_tokens:
        return RequestStatus.FINISHED_LENGTH, None
    return None
