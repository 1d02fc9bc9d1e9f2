"""Engine: requests in, one step at a time (schedule -> run model -> sample -> update), deltas out.

Not thread-safe by itself: one thread calls step(). Aborts from other threads go through
queue_abort() and are applied at the start of the next step, never while a batch is in flight.
"""
from __future__ import annotations

import collections
import logging
import os
import random
import threading
import time
from dataclasses import dataclass

import torch

from pyengine.config import LONG_PREFILL_TOKENS, SOLO_PREFILL_TOKENS_CPU, EngineConfig
from pyengine.dtypes import cache_dtype_of, resolve_dtype
from pyengine.engine.block_pool import BlockPool
from pyengine.engine.output import CompletionOutput, IncrementalDetokenizer, RequestOutput, check_token_stop
from pyengine.engine.request import Request, RequestStatus
from pyengine.engine.scheduler import Scheduler, SchedulerOutput
from pyengine.engine.spec_decode import NgramSpeculator
from pyengine.interrupt import StepInterrupt, StepInterrupted
from pyengine.metrics import EngineMetrics, count_requests
from pyengine.model.metadata import allocate_kv_caches, copy_blocks
from pyengine.output_types import RequestMetrics, TokenLogprob
from pyengine.plan import available_memory, plan_memory
from pyengine.sampling_params import SamplingParams

log = logging.getLogger("pyengine.engine")

# Steps in a row in which every model run failed before the engine calls itself broken (step() raises).
MAX_FAILED_STEPS = 3


class EngineBrokenError(RuntimeError):
    """Model steps keep failing whatever runs in them: the engine cannot serve anything."""


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_total_blocks: int
    kv_usage: float
    num_preemptions: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_steps: int
    num_computed_tokens: int  # tokens run through the model (prompt chunks + decodes), all steps
    num_interrupted_steps: int  # lone prompt chunks a newcomer stopped (computed again later)


def _cumulative(req: Request) -> float | None:
    """The running cumulative logprob of a request's output, where it asked for logprobs."""
    return req.cumulative_logprob if req.logprobs is not None else None


class _Group:
    """A user request: its n child sequences and what the consumer has seen."""

    __slots__ = ("request_id", "prompt", "prompt_token_ids", "children", "num_finished", "deferred",
                 "sent_prompt_logprobs")

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int]) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.children: list[Request] = []
        self.num_finished = 0
        # n > 1: children 1..n-1 are queued (at the back, like a new request) once child 0 has
        # computed the prompt, so they fork from it instead of recomputing it.
        self.deferred: list[Request] = []
        self.sent_prompt_logprobs = False


class Engine:
    def __init__(self, config: EngineConfig, *, parts: tuple | None = None) -> None:
        """parts: (model_config, model, tokenizer, name) to use instead of loading config.model
        (tests drive the engine with small stand-ins this way)."""
        from pyengine.model.runner import ModelRunner

        self.config = config
        self.device = torch.device(config.device)
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
            from pyengine import _C

            _C.set_num_threads(config.num_threads)
        self.dtype = resolve_dtype(config.dtype, self.device)
        if parts is None:
            from pyengine.model.loader import load_model, resolve_model_path
            from pyengine.tokenizer import Tokenizer

            path = resolve_model_path(config.model)
            weights_id: str | list = path
            self.model_name = config.model or os.path.splitext(os.path.basename(path))[0]
            self.model_config, self.model = load_model(path, self.dtype, self.device, config.weights)
            self.tokenizer = Tokenizer.from_model_path(path)
        else:
            self.model_config, self.model, self.tokenizer, self.model_name = parts
            weights_id = ["parts", self.model_name]
        cfg = self.model_config
        self.max_model_len = config.max_model_len or cfg.max_position_embeddings
        if self.max_model_len > cfg.max_position_embeddings:
            raise ValueError(f"max_model_len {self.max_model_len} exceeds the model's maximum context "
                             f"length of {cfg.max_position_embeddings} tokens")
        # Weights are loaded already, so the free memory measured now is what is left after them.
        self.plan = plan_memory(cfg, config, self.dtype, self.max_model_len, self.model.weight_bytes(),
                                lambda: available_memory(self.device))
        bs, num_blocks = config.block_size, self.plan.num_blocks
        kv_caches = allocate_kv_caches(cfg, num_blocks, bs, cache_dtype_of(config, self.dtype), self.device,
                                       config.kv_cache_prefault)
        log.info("%s", self.plan.summary())
        self.pool = BlockPool(num_blocks, bs, config.enable_prefix_caching)
        long_prefill = config.long_prefill_tokens
        if long_prefill is None:
            long_prefill = LONG_PREFILL_TOKENS[self.device.type]
        solo_prefill = config.solo_prefill_tokens
        if solo_prefill is None:  # a newcomer interrupts such a chunk (pyengine/interrupt.py)
            solo_prefill = long_prefill if self.device.type == "cuda" else SOLO_PREFILL_TOKENS_CPU
        self.scheduler = Scheduler(self.pool, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.scheduling_policy, long_prefill, solo_prefill)
        self._seeds = random.Random(config.seed)  # seeds for requests that bring none
        self.eos_ids = frozenset(self.tokenizer.eos_token_ids) | frozenset(cfg.eos_token_ids)
        self.runner = ModelRunner(self.model, kv_caches, block_size=bs, max_num_seqs=config.max_num_seqs,
                                  max_num_batched_tokens=config.max_num_batched_tokens,
                                  max_model_len=self.max_model_len, vocab_size=cfg.vocab_size,
                                  eos_ids=sorted(self.eos_ids), device=self.device,
                                  cuda_graphs=config.cuda_graphs, tensor_cores=config.tensor_core_prefill)
        self.metrics = EngineMetrics(self.model_name)
        self.kv_tier = None  # host memory and/or disk under the prefix cache (config.kv_host_bytes, kv_disk_path)
        if config.kv_disk_path is not None or config.kv_host_bytes:
            from pyengine.engine.kv_tiers import open_kv_tier

            self.kv_tier = open_kv_tier(config, cfg, weights_id, self.dtype,
                                        cache_dtype_of(config, self.dtype), self.pool, kv_caches)
        # drafts: a draft model's (config.speculative with a model), or n-gram ones (config.speculative) and
        # grammar-forced ones (config.jump_forward)
        self.speculator = None
        if config.speculative is not None and config.speculative.method == "draft_model":
            from pyengine.engine.draft_model import DraftModelSpeculator

            self.speculator = DraftModelSpeculator(config, cfg, self.tokenizer, self.dtype, self.device, num_blocks,
                                                   self.max_model_len, self.metrics)
        elif config.speculative is not None or config.jump_forward:
            jump = (lambda matcher: self.structured.jump_forward_tokens(matcher)) if config.jump_forward else None
            self.speculator = NgramSpeculator(config.speculative, self.metrics, jump)
        self._structured = None  # pyengine.structured.StructuredOutputs, built on first use
        self._structured_lock = threading.Lock()
        self.groups: dict[str, _Group] = {}
        self._pending_aborts: collections.deque[str] = collections.deque()
        self.num_steps = 0
        self.num_computed_tokens = 0
        self.num_interrupted_steps = 0
        # Set by the thread that queues requests (AsyncLLM) to stop a solo step (see pyengine/interrupt.py).
        # A solo step right after an interrupted one runs to its end, so commands that leave the prompt alone
        # again (a request aborted as soon as it came) cannot starve it.
        self.interrupt = StepInterrupt()
        self._last_interrupted = False
        self._failed_steps = 0  # steps in a row in which every model run failed

    # ---- requests ------------------------------------------------------------------------------
    def tokenize_prompt(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        ids = [int(t) for t in prompt]
        vocab = self.model_config.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        return None, ids

    def check_prompt(self, n: int) -> None:
        """Reject prompts that can never run, with the numbers, before anything is queued."""
        if n == 0:
            raise ValueError("the prompt is empty; it must have at least one token")
        if n >= self.max_model_len:
            raise ValueError(f"prompt has {n} tokens; this model's maximum context length is {self.max_model_len} "
                             f"tokens (prompt plus at least one generated token)")
        capacity = self.pool.num_blocks * self.pool.block_size
        if n + 1 > capacity:
            raise ValueError(f"prompt has {n} tokens but the KV cache holds only {capacity} tokens "
                             f"({self.pool.num_blocks} blocks of {self.pool.block_size}); raise kv_cache_memory")

    @property
    def structured(self):
        """Grammar compiler and bitmask filler (xgrammar), built on the first structured request."""
        with self._structured_lock:  # two first structured requests at once build it once
            if self._structured is None:
                self._build_structured()
        return self._structured

    def _build_structured(self) -> None:
        from pyengine.structured import StructuredOutputs

        self._structured = StructuredOutputs(self.tokenizer, self.model_config.vocab_size, sorted(self.eos_ids),
                                             compile_workers=self.config.grammar_compile_workers,
                                             compile_timeout=self.config.grammar_compile_timeout)
        self.runner.structured = self._structured

    def check_params(self, params: SamplingParams, compile_grammar: bool = True) -> None:
        """What SamplingParams cannot check alone: token ids and logprob counts against this vocabulary,
        and (compile_grammar) the grammar, compiled here so that a later add_request finds it cached."""
        vocab = self.model_config.vocab_size
        bad = [t for t in params.stop_token_ids if t >= vocab]
        if bad:
            raise ValueError(f"stop_token_ids must be token ids in [0, {vocab}), got {bad[0]}")
        bad = [t for t in (params.logit_bias or {}) if t >= vocab]
        if bad:
            raise ValueError(f"logit_bias has token id {bad[0]}, outside this model's vocabulary [0, {vocab})")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(params, name)
            if k is not None and k > vocab:
                raise ValueError(f"{name} must be at most the vocabulary size {vocab}, got {k}")
        if compile_grammar and params.structured_outputs is not None:
            self.structured.compile(params.structured_outputs)

    def close_structured(self) -> None:
        """Stop the grammar compile workers, if any were started (compiles in flight fail)."""
        if self._structured is not None:
            self._structured.close()
            self._structured = None  # a restarted engine starts new workers

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams, *,
                    priority: int = 0, arrival_time: float | None = None,
                    prompt_token_ids: list[int] | None = None) -> None:
        """Validate and queue; raises ValueError (nothing queued) for an unusable prompt."""
        arrival = arrival_time if arrival_time is not None else time.perf_counter()
        if request_id in self.groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        if prompt_token_ids is None:
            text, ids = self.tokenize_prompt(prompt)
        else:
            text, ids = (prompt if isinstance(prompt, str) else None), list(prompt_token_ids)
        self.check_prompt(len(ids))
        self.check_params(params)
        group = _Group(request_id, text, ids)
        capacity = self.pool.num_blocks * self.pool.block_size
        seed = self._seeds.getrandbits(63) if params.seed is None else None
        for i in range(params.n):
            rid = request_id if params.n == 1 else f"{request_id}#{i}"
            req = Request(rid, text, ids, params, priority=priority, index=i, parent_id=request_id,
                          arrival_time=arrival, max_model_len=min(self.max_model_len, capacity), seed=seed)
            req.detok = IncrementalDetokenizer(self.tokenizer, ids, params.stop_strings,
                                               params.include_stop_str_in_output, params.skip_special_tokens)
            if params.structured_outputs is not None:
                req.grammar = self.structured.matcher(params.structured_outputs)
            group.children.append(req)
        self.groups[request_id] = group
        first, *rest = group.children
        if self.kv_tier is None or not self.kv_tier.admit(first):  # else queued once its blocks are read
            self.scheduler.add_request(first)
        for req in rest:
            req.fork_source = first
        group.deferred = rest
        self.metrics.on_added(len(ids), params)

    def queue_abort(self, request_id: str) -> None:
        """Thread-safe: the abort is applied at the start of the next step."""
        self._pending_aborts.append(request_id)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Abort every unfinished child now (call from the stepping thread only)."""
        group = self.groups.get(request_id)
        if group is None:
            return None
        outs = []
        for req in group.children:
            if req.finished:
                continue
            if req in group.deferred or (self.kv_tier is not None and self.kv_tier.cancel(req)):  # never queued
                req.status = RequestStatus.FINISHED_ABORTED
                req.finished_time = time.perf_counter()
            else:
                self.scheduler.finish(req, RequestStatus.FINISHED_ABORTED)
            outs.append(self._finish(group, req, [], []))
        group.deferred = []
        return self._request_output(group, outs)

    def has_unfinished(self) -> bool:
        return bool(self.groups) or bool(self._pending_aborts)

    # ---- the step ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One step. A model run that raises fails only the requests it can be blamed on (see
        _run_isolating); step() itself raises EngineBrokenError once MAX_FAILED_STEPS steps in a
        row failed for everything in them."""
        outputs: list[RequestOutput] = []
        while self._pending_aborts:
            o = self.abort_request(self._pending_aborts.popleft())
            if o is not None:
                outputs.append(o)
        if self.kv_tier is not None:  # requests whose blocks came back from disk (or gave up) join the queue
            for req in self.kv_tier.ready(self.scheduler):
                self.scheduler.add_request(req)
        step_start = time.perf_counter()
        sched = self.scheduler.schedule()
        if self.kv_tier is not None:
            self.kv_tier.unpin()
        if sched.copies:
            copy_blocks(self.runner.kv_caches, sched.copies)
        num_got = 0
        if len(sched):
            interruptible = sched.solo and not self._last_interrupted
            try:
                done, blamed = self._run_isolating(sched, step_start, self.interrupt if interruptible else None)
            except StepInterrupted:  # a newcomer stopped a lone prompt's chunk: nothing is committed; it reruns
                self.num_interrupted_steps += 1
                self.metrics.interrupted_steps.inc()
                self._last_interrupted = True
                done, blamed = [], []
            else:
                self._last_interrupted = False
                self.num_steps += 1
                self.num_computed_tokens += sched.num_tokens
                self.metrics.iteration_tokens.observe(sched.num_tokens)
                self._failed_steps = 0 if done else self._failed_steps + 1
            for part, result in done:
                for req, entries in (result.prompt_logprobs or ()) if result else ():
                    req.prompt_logprobs.extend(entries)
                token_ids = result.token_ids if result else []
                if self.speculator is None or not any(r.spec_token_ids for r in part.reqs):  # nothing to verify
                    got = self.scheduler.update_from_output(part, token_ids)
                    new = None
                else:
                    v = self.speculator.verify(part.reqs, part.sampling, token_ids)
                    new = {req: (row, len(acc) + 1) for req, row, acc in
                           zip((r for r, s in zip(part.reqs, part.sampling) if s), v.rows, v.accepted)}
                    got = self.scheduler.update_from_output(part, v.sampled, v.accepted)
                if self.kv_tier is not None:  # write newly cached blocks through, before finishes free them
                    self.kv_tier.offer(part.reqs)
                num_got += sum(new[r][1] for r in got) if new else len(got)
                outputs += self._process(got, result, new)
            for req, exc in blamed:
                o = self._fail_group(req.parent_id, exc)
                if o is not None:
                    outputs.append(o)
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running)
        s = self.scheduler
        self.metrics.on_step(*count_requests(self.groups.values()), self.pool.usage, num_got,
                             s.prefix_query_tokens, s.prefix_hit_tokens, s.num_preemptions)
        if self.kv_tier is not None:
            self.metrics.on_kv_tier(self.kv_tier.stats, self.kv_tier.disk, self.kv_tier.host)
        if self._failed_steps >= MAX_FAILED_STEPS:
            raise EngineBrokenError(f"{self._failed_steps} model steps in a row failed for every request in them")
        return outputs

    def _run_isolating(self, sched: SchedulerOutput, step_start: float,
                       interrupt: StepInterrupt | None = None) -> tuple[list, list]:
        """Run the step's model; returns ([(part, result)] that ran, [(request, error)] to blame).

        Re-running is safe: a model run changes nothing but KV slots at or after each request's
        num_computed_tokens (its own blocks, never a shared prefix-cache block), which the next run
        overwrites; blocks, scheduler state and the prefix cache change only when a result is
        committed. When the whole step raises, the requests first scheduled in it are tried apart
        from the others, then each failing part is re-run in halves down to single requests. The same
        makes an interrupted run (StepInterrupted, raised on) safe to drop."""
        try:
            return [(sched, self.runner.execute(sched, interrupt))], []
        except StepInterrupted:
            raise
        except Exception as exc:
            log.warning("model step of %d sequences failed (%r); isolating the cause", len(sched), exc)
            idx = range(len(sched))
            new = [i for i in idx if sched.reqs[i].first_scheduled_time >= step_start]
            old = [i for i in idx if sched.reqs[i].first_scheduled_time < step_start]
            done: list = []
            blamed: list = []
            self._bisect(sched, list(idx), exc, done, blamed, (old, new) if old and new else None)
            return done, blamed

    def _bisect(self, sched: SchedulerOutput, idx: list[int], exc: Exception, done: list, blamed: list,
                split: tuple[list[int], list[int]] | None = None) -> None:
        if len(idx) == 1:
            blamed.append((sched.reqs[idx[0]], exc))
            return
        for part_idx in split or (idx[: len(idx) // 2], idx[len(idx) // 2 :]):
            num_new = [sched.num_new[i] for i in part_idx]
            sampling = [sched.sampling[i] for i in part_idx]
            part = SchedulerOutput([sched.reqs[i] for i in part_idx], num_new, sampling, sum(num_new),
                                   sampling.count(True), [], [])
            try:
                done.append((part, self.runner.execute(part)))
            except Exception as e:
                self._bisect(sched, part_idx, e, done, blamed)

    def _fail_group(self, request_id: str, exc: Exception) -> RequestOutput | None:
        """Abort a request that a failed model step is blamed on; its output carries the error."""
        log.error("request %s failed a model step: %r", request_id, exc)
        out = self.abort_request(request_id)
        if out is not None:
            out.error = f"{type(exc).__name__}: {exc}"
        return out

    def _process(self, got: list[Request], result, new: dict | None = None) -> list[RequestOutput]:
        """Stop checks, logprobs and text of the tokens each request in `got` just got. new: per request
        (its sampled token's logits row, tokens appended this step) where drafts were verified (the accepted
        drafts' rows come just before); else each got one token, from row i of got[i]. Of several tokens,
        those after a stop are dropped."""
        now = time.perf_counter()
        by_group: dict[str, tuple[_Group, list[CompletionOutput]]] = {}
        eos = self.eos_ids
        for i, req in enumerate(got):
            row, count = new[req] if new else (i, 1)
            appended = req.all_token_ids[-count:]
            del req.all_token_ids[-count:]
            emitted, lps, stop = [], [], None
            for j, tok in enumerate(appended):  # one at a time, so every check sees the output up to this token
                req.all_token_ids.append(tok)
                emitted.append(tok)
                stop, lp = self._check_token(req, tok, eos, result, row - count + 1 + j, now)
                if lp is not None:
                    lps.append(lp)
                if stop is not None:
                    break
            group = self.groups[req.parent_id]
            if group.deferred:
                for child in group.deferred:
                    self.scheduler.add_request(child)
                group.deferred = []
            if stop is not None:
                self.scheduler.finish(req, stop[0])
                req.stop_reason = stop[1]
                out = self._finish(group, req, emitted, lps)
            else:
                out = CompletionOutput(req.index, req.detok.pop_delta(False), emitted, None, None,
                                       lps or None, _cumulative(req))
            by_group.setdefault(group.request_id, (group, []))[1].append(out)
        return [self._request_output(group, outs) for group, outs in by_group.values()]

    def _check_token(self, req: Request, tok: int, eos: frozenset[int], result, row: int,
                     now: float) -> tuple[tuple | None, TokenLogprob | None]:
        """Account one new token (the last of req.all_token_ids): timing, its logprob (from logits row
        `row`), grammar and detokenizer. Returns (stop (status, reason) or None, its TokenLogprob or None)."""
        self.metrics.on_token(req, now)
        if req.first_token_time is None:
            req.first_token_time = now
        req.last_token_time = now
        lp = None
        if req.logprobs is not None and result.logprobs is not None:
            k = req.params.logprobs
            top = list(zip(result.top_ids[row][:k], result.top_logprobs[row][:k])) if k else []
            lp = TokenLogprob(tok, result.logprobs[row], top)
            req.logprobs.append(lp)
            req.cumulative_logprob += lp.logprob
        stop = check_token_stop(req, tok, eos)
        if req.grammar is not None and not req.grammar.accept_token(tok) and stop is None:
            # only when something overrode the mask (min_tokens banning every allowed token)
            log.warning("request %s: token %d breaks its grammar; stopping it", req.request_id, tok)
            stop = (RequestStatus.FINISHED_STOPPED, None)
        if stop is None or stop[0] is RequestStatus.FINISHED_LENGTH:
            hit = req.detok.add(tok)
            if hit is not None:
                stop = (RequestStatus.FINISHED_STOPPED, hit)
        return stop, lp

    def _finish(self, group: _Group, req: Request, new_ids: list[int], lps: list | None) -> CompletionOutput:
        group.num_finished += 1
        self.metrics.on_finished(req)
        if group.num_finished == len(group.children):
            del self.groups[group.request_id]
            self.metrics.on_request_finished(group.children)
        return CompletionOutput(req.index, req.detok.pop_delta(True), new_ids, req.finish_reason,
                                req.stop_reason, lps or None, _cumulative(req))

    def _request_output(self, group: _Group, outs: list[CompletionOutput]) -> RequestOutput:
        finished = group.num_finished == len(group.children)
        first = group.children[0]
        metrics = RequestMetrics.of(first)  # n > 1: the first sequence's (it computed the prompt)
        prompt_lps = None  # once, in the first output after the prompt is done
        if not group.sent_prompt_logprobs and first.prompt_logprobs is not None \
                and len(first.prompt_logprobs) == first.num_prompt_tokens:
            prompt_lps, group.sent_prompt_logprobs = first.prompt_logprobs, True
        return RequestOutput(group.request_id, group.prompt, group.prompt_token_ids, outs, finished, metrics,
                             prompt_lps)

    def close(self) -> None:
        """Write what the disk tier has queued and stop its threads (the engine serves nothing after this)."""
        if self.kv_tier is not None:
            self.kv_tier.close()

    def stats(self) -> EngineStats:
        s, p = self.scheduler, self.pool
        return EngineStats(s.num_running, s.num_waiting, p.num_free, p.num_blocks, p.usage, s.num_preemptions,
                           s.prefix_query_tokens, s.prefix_hit_tokens, self.num_steps, self.num_computed_tokens,
                           self.num_interrupted_steps)
