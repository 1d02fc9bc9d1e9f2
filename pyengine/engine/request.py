"""A request (one sequence) through its whole life: tokens, KV blocks, state and timestamps.

A user request with n > 1 becomes n Request objects ("children") that share the prompt and run
independently; their ids are "<id>" for n == 1 and "<id>#<i>" otherwise.
"""
from __future__ import annotations

import enum
import random
import time

import numpy as np

from pyengine.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2  # back in the waiting queue, its KV freed; recomputed when readmitted
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED


FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


class Request:
    __slots__ = (
        "request_id", "parent_id", "index", "prompt", "prompt_token_ids", "params", "priority",
        "seed", "all_token_ids", "num_prompt_tokens", "num_computed_tokens", "num_cached_tokens",
        "block_ids", "block_hashes", "num_hashed_blocks", "status", "stop_reason", "num_preemptions",
        "arrival_time", "queued_time", "first_scheduled_time", "first_token_time", "last_token_time",
        "finished_time", "max_total_tokens", "logprobs", "cumulative_logprob", "prompt_logprobs", "detok",
        "arrival_seq", "admit_seq", "disk_keys", "num_disk_offered", "num_disk_cached_tokens",
        "num_host_cached_tokens",
        "num_computed_prompt_tokens", "sampling_row", "grammar", "logit_bias", "fork_source",
        "spec_token_ids", "spec",
    )

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 params: SamplingParams, *, priority: int = 0, index: int = 0, parent_id: str | None = None,
                 arrival_time: float | None = None, max_model_len: int = 1 << 30, seed: int | None = None) -> None:
        """seed: the stream's seed when params.seed is None (the engine draws it); random if both are None."""
        self.request_id = request_id
        self.parent_id = parent_id if parent_id is not None else request_id
        self.index = index
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.priority = priority
        # Children of one request get distinct streams from one seed.
        if params.seed is not None:
            seed = params.seed
        elif seed is None:
            seed = random.getrandbits(63)
        self.seed = (seed + index) % (1 << 63)
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0  # tokens whose K/V sit in the cache
        self.num_cached_tokens = 0  # prompt tokens served by the prefix cache at first admission
        self.num_computed_prompt_tokens = 0  # prompt tokens actually run through the model (all admissions)
        self.block_ids: list[int] = []
        self.block_hashes: list = []  # chained hashes of this sequence's full blocks, computed lazily
        self.num_hashed_blocks = 0  # leading blocks already registered in the prefix cache
        # The KV tier under the prefix cache (engine/kv_tiers.py): the blocks' store keys (computed lazily), how many
        # leading blocks were handed to it for writing, and the prompt tokens read back from it at admission, from
        # the disk and from host memory.
        self.disk_keys: list[bytes] = []
        self.num_disk_offered = 0
        self.num_disk_cached_tokens = 0
        self.num_host_cached_tokens = 0
        self.status = RequestStatus.WAITING
        self.stop_reason: str | int | None = None
        self.num_preemptions = 0
        self.arrival_time = arrival_time if arrival_time is not None else time.perf_counter()
        self.queued_time: float | None = None
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.finished_time: float | None = None
        max_tokens = params.max_tokens if params.max_tokens is not None else max_model_len
        self.max_total_tokens = min(self.num_prompt_tokens + max_tokens, max_model_len)
        self.logprobs: list | None = [] if params.logprobs is not None else None
        self.cumulative_logprob = 0.0  # sum of the sampled tokens' logprobs (kept when logprobs is asked for)
        # per prompt token, filled as the prompt is computed; the first token has none. Only the first
        # child computes them (the prompt is shared): the others take the prompt from the prefix cache.
        want = params.prompt_logprobs is not None and index == 0
        self.prompt_logprobs: list | None = [None] if want else None
        self.detok = None  # the output processor's incremental detokenizer
        # What the batch builder reads every step, in one tuple: temperature, top_k, top_p, min_p,
        # seed, has_penalties, logprobs (-1 = none).
        self.sampling_row = (params.temperature, params.top_k, params.top_p, params.min_p, self.seed,
                             params.has_penalties, -1 if params.logprobs is None else params.logprobs)
        self.grammar = None  # an xgrammar GrammarMatcher (pyengine.structured) under structured_outputs
        # logit_bias as (token ids int64, biases fp32) arrays, built once for the runner
        self.logit_bias = None if not params.logit_bias else (
            np.fromiter(params.logit_bias.keys(), np.int64, len(params.logit_bias)),
            np.fromiter(params.logit_bias.values(), np.float32, len(params.logit_bias)))
        # n > 1: child 0, for children 1..n-1, which fork from its computed prompt (see the scheduler)
        self.fork_source: Request | None = None
        # Speculative decoding: draft tokens to verify in the next step after the last token (the scheduler
        # trims them to what the step holds), and the per-request state (pyengine.engine.spec_decode.SpecState)
        self.spec_token_ids: list[int] = []
        self.spec = None
        self.arrival_seq = 0  # set by the scheduler: FCFS order
        self.admit_seq = 0  # set by the scheduler on each admission

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens:]

    @property
    def finished(self) -> bool:
        return self.status >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASONS.get(self.status)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, status={self.status.name}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, blocks={len(self.block_ids)})")
