"""Speculative decoding with n-gram (prompt lookup) drafts, verified inside the engine's step.

After a step, each eligible running request gets up to k draft tokens (Request.spec_token_ids): the
tokens that followed the latest earlier occurrence of its last n tokens (n from prompt_lookup_max down
to prompt_lookup_min) in its prompt and output. The next step computes the request's last token and
its drafts as one sequence of 1 + k query tokens, beside the other requests' decodes and prompt chunks
under the one token budget, and samples a token at each of the 1 + k rows, row i as the request's step
after its first i drafts (ModelRunner.sample: that output position's seeded draw, penalties, min_tokens).
Verification keeps the drafts up to the first that differs from the token sampled at the row before it,
then the token sampled at that row; each step emits 1 to k + 1 tokens. The scheduler rolls the rejected
drafts' KV slots back (Scheduler.update_from_output).

Exactness: row i's token is the one the non-speculative engine draws at that position (the sampler's
draw depends only on the row's logits, parameters, seed and position), so the output is the
non-speculative engine's, token for token, greedy or seeded, whatever the batch. For a draft that is a
point mass q, rejection sampling (accept with min(1, p/q) = p(draft), else resample from p without the
draft) is exactly this: the draw from p equals the draft with probability p(draft), and otherwise is a
draw from p conditioned on not being it.

Structured output: a request's drafts are cut at the first token its grammar refuses
(accepted_prefix), and each of its rows is sampled under the mask of the grammar state after
the drafts before it (StructuredOutputs.fill_bitmask), so verification samples exactly as without
speculation. Jump-forward (as SGLang does): where the grammar forces the next text (a fixed key, a
closing bracket), its tokens (StructuredOutputs.jump_forward_tokens) are the request's drafts instead of
the n-gram ones, with or without n-gram speculation, whatever the batch size; they are verified like any
draft, so a forced text the model would tokenize otherwise costs rows, never exactness. They do not count
in the request's acceptance (SpecState) or the spec_decode metrics: the speculator counts them apart
(num_forced_tokens, num_forced_accepted).

k adapts per request (SpecState): from the request's recent acceptance rate it picks the k (0 to
num_speculative_tokens) with the most expected tokens per unit of step time, a step of 1 + k tokens
costing 1 + VERIFY_TOKEN_COST * k one-token steps. At 0 the request stops proposing for PAUSE_TOKENS
output tokens, then starts over.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from pyengine.config import SpeculativeConfig
from pyengine.engine.request import Request, RequestStatus

# Output tokens a request whose drafts keep failing (k fell to 0) decodes without proposing.
PAUSE_TOKENS = 16
# What each draft adds to a batch-1 step, in one-token steps: 1 + k tokens cost ~1 + 0.12 k on the CPU (the
# default model in bf16, 2 threads: a small model's step is not all weight reads).
VERIFY_TOKEN_COST = 0.12
# Weight of past verifications in the acceptance estimate (each one's counts decay by this per verification).
DECAY = 0.8


def ngram_propose(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the longest suffix of `tokens` of
    min_n..max_n tokens; [] when no such suffix occurs earlier."""
    L = len(tokens)
    if k <= 0 or L < min_n + 1:
        return []
    arr = np.asarray(tokens, dtype=np.int64)
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        # windows arr[i:i+n] for i in [0, L-n-1]: each has at least one token after it
        windows = sliding_window_view(arr[: L - 1], n)
        hits = np.flatnonzero((windows == arr[L - n :]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return arr[start : start + k].tolist()
    return []


def best_k(alpha: float, max_k: int, token_cost: float = VERIFY_TOKEN_COST) -> int:
    """The number of drafts (0..max_k) with the most expected tokens per step time, when each draft is
    accepted with probability alpha (given those before it were): (1 + alpha + ... + alpha^k) / (1 + cost k)."""
    best, best_rate, expected = 0, 1.0, 1.0
    for k in range(1, max_k + 1):
        expected += alpha**k
        rate = expected / (1 + token_cost * k)
        if rate > best_rate:
            best, best_rate = k, rate
    return best


@dataclass
class SpecState:
    """One request's speculation: its current k, its acceptance estimate, what it proposed and got accepted."""

    k: int
    accepts: float = 1.0  # decayed counts of accepted drafts and of rejections (a prior of one each:
    rejects: float = 1.0  # acceptance 0.5); a draft's acceptance rate is accepts / (accepts + rejects)
    pause_until: int = 0  # no proposals before this many output tokens (k fell to 0)
    num_drafts: int = 0  # verification steps with at least one draft
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # [i]: drafts accepted at position i

    def record(self, proposed: int, accepted: int, max_k: int, num_output_tokens: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += proposed
        self.num_accepted_tokens += accepted
        if len(self.accepted_per_pos) < max_k:
            self.accepted_per_pos += [0] * (max_k - len(self.accepted_per_pos))
        for i in range(accepted):
            self.accepted_per_pos[i] += 1
        self.accepts = DECAY * self.accepts + accepted
        self.rejects = DECAY * self.rejects + (accepted < proposed)
        self.k = best_k(self.accepts / (self.accepts + self.rejects), max_k)
        if self.k == 0:  # pause, then start over from the prior
            self.pause_until = num_output_tokens + PAUSE_TOKENS
            self.accepts = self.rejects = 1.0

    @property
    def acceptance_rate(self) -> float | None:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None


@dataclass
class Verified:
    """A step's sampled rows turned into per-request tokens (in order of the sampling requests)."""

    sampled: list[int]  # the token each request samples at the row after its accepted drafts
    accepted: list[list[int]]  # each request's accepted drafts (a prefix of its spec_token_ids)
    rows: list[int]  # the logits row each request's sampled token came from


def accepted_prefix(matcher, tokens: list[int]) -> list[int]:
    """The longest prefix of tokens that the grammar accepts from matcher's state (an xgrammar GrammarMatcher), ending at a token that
    terminates it (a stop token); matcher is left as it was. A terminated grammar constrains nothing."""
    if matcher.is_terminated():
        return tokens
    n = 0
    for tok in tokens:
        if not matcher.accept_token(tok):
            break
        n += 1
        if matcher.is_terminated():
            break
    if n:
        matcher.rollback(n)
    return tokens[:n]


class NgramSpeculator:
    """Proposes drafts for running requests and verifies them against the step's sampled rows."""

    def __init__(self, config: SpeculativeConfig | None, metrics=None,
                 jump_forward: Callable[[object], list[int]] | None = None) -> None:
        """config: n-gram speculation (None: jump-forward only). jump_forward: a grammar matcher -> the tokens
        its grammar forces next (StructuredOutputs.jump_forward_tokens), or None for no jump-forward."""
        self.config = config
        self.metrics = metrics  # pyengine.metrics.EngineMetrics (on_spec_verified), or None
        self.jump_forward = jump_forward
        self._forced: set[Request] = set()  # requests whose drafts this step are jump-forward tokens
        self.num_forced_tokens = 0  # jump-forward drafts verified, all requests and steps
        self.num_forced_accepted = 0

    def propose(self, running: list[Request]) -> None:
        """Set spec_token_ids of each running request that decodes next (all of its tokens but the last
        computed): the tokens its grammar forces, if any, else n-gram drafts (none while more than
        disable_by_batch_size sequences run), cut where its grammar refuses one."""
        cfg = self.config
        off = cfg is None or len(running) > cfg.disable_by_batch_size
        self._forced.clear()
        if cfg is None:  # jump-forward alone: only a request under a grammar ever gets drafts
            running = [r for r in running if r.grammar is not None]
        for req in running:
            req.spec_token_ids = []
            if req.status is not RequestStatus.RUNNING or req.num_computed_tokens != req.num_tokens - 1:
                continue
            # every draft accepted still leaves room for the token sampled after them (max_tokens, context)
            room = req.max_total_tokens - req.num_tokens - 1
            if req.grammar is not None and self.jump_forward is not None and room > 0:
                forced = accepted_prefix(req.grammar, self.jump_forward(req.grammar)[:room])
                if forced:
                    req.spec_token_ids = forced
                    self._forced.add(req)
                    continue
            if off:
                continue
            if req.spec is None:
                req.spec = SpecState(best_k(0.5, cfg.num_speculative_tokens))
            state = req.spec
            if state.k == 0:
                if req.num_output_tokens < state.pause_until:
                    continue
                state.k = best_k(0.5, cfg.num_speculative_tokens)
            drafts = ngram_propose(req.all_token_ids, min(state.k, room), cfg.prompt_lookup_min,
                                   cfg.prompt_lookup_max)
            req.spec_token_ids = drafts if req.grammar is None else accepted_prefix(req.grammar, drafts)

    def verify(self, reqs: list[Request], sampling: list[bool], token_ids: list[int]) -> Verified:
        """token_ids: one per logits row, 1 + len(spec_token_ids) rows per sampling request. A draft is
        accepted while it equals the token sampled at the row before it."""
        sampled, accepted, rows = [], [], []
        row = 0
        max_k = self.config.num_speculative_tokens if self.config is not None else 0
        for req, samples in zip(reqs, sampling):
            if not samples:
                continue
            drafts = req.spec_token_ids
            a = 0
            while a < len(drafts) and drafts[a] == token_ids[row + a]:
                a += 1
            sampled.append(token_ids[row + a])
            accepted.append(drafts[:a])
            rows.append(row + a)
            if req in self._forced:
                self.num_forced_tokens += len(drafts)
                self.num_forced_accepted += a
            elif drafts:
                req.spec.record(len(drafts), a, max_k, req.num_output_tokens + a + 1)
                if self.metrics is not None:
                    self.metrics.on_spec_verified(len(drafts), a)
            row += 1 + len(drafts)
        return Verified(sampled, accepted, rows)
