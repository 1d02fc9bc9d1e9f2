"""Records that travel up inside a RequestOutput, defined below the layers that make them: a token's
logprobs (the model runner makes them for prompt tokens, the engine for sampled ones) and a
sequence's timestamps."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: the engine's Request is a layer above
    from pyengine.engine.request import Request


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
    num_disk_cached_tokens: int = 0  # of num_cached_tokens, those read back from the KV disk tier
    num_draft_tokens: int = 0  # speculative decoding: draft tokens verified
    num_accepted_tokens: int = 0  # of which accepted
    num_host_cached_tokens: int = 0  # of num_cached_tokens, those read back from the KV host-memory tier

    @classmethod
    def of(cls, r: Request) -> "RequestMetrics":
        drafted, accepted = (r.spec.num_draft_tokens, r.spec.num_accepted_tokens) if r.spec is not None else (0, 0)
        return cls(r.arrival_time, r.queued_time, r.first_scheduled_time, r.first_token_time,
                   r.last_token_time, r.finished_time, r.num_prompt_tokens, r.num_cached_tokens,
                   r.num_output_tokens, r.num_preemptions, min(r.num_disk_cached_tokens, r.num_cached_tokens),
                   drafted, accepted, min(r.num_host_cached_tokens, r.num_cached_tokens - r.num_disk_cached_tokens))

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
