"""Engine: requests in, one step at a time (schedule -> run model -> sample -> update), deltas out.

Not thread-safe by itself: one thread calls step(). Aborts from other threads go through
queue_abort() and are applied at the start of the next step, never while a batch is in flight.
"""
from __future__ import annotations

import collections
import logging
import os
import time
from dataclasses import dataclass

import torch

from pyengine.config import EngineConfig, ModelConfig
from pyengine.engine.block_pool import BlockPool
from pyengine.engine.output import (CompletionOutput, IncrementalDetokenizer, RequestMetrics, RequestOutput,
                                    TokenLogprob, check_token_stop)
from pyengine.engine.request import Request, RequestStatus
from pyengine.engine.scheduler import Scheduler
from pyengine.metrics import EngineMetrics
from pyengine.sampling_params import SamplingParams

log = logging.getLogger("pyengine.engine")

_GiB = 1 << 30
_CPU_DEFAULT_KV_BYTES = 4 * _GiB  # like vLLM-CPU's default KV space


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
        # n > 1 with prefix caching: children 1..n-1 are queued once child 0 has computed the
        # prompt, so they take its blocks from the prefix cache instead of recomputing them.
        self.deferred: list[Request] = []
        self.sent_prompt_logprobs = False


def _cpu_has_bf16() -> bool:
    """Native bf16 dot products (AVX512-BF16 or AMX); without them bf16 GEMMs are emulated and slow."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return False
    return " avx512_bf16" in flags or " amx_bf16" in flags


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """"auto": bf16 on GPUs and on CPUs with bf16 dot products (measured ~2x fp32's decode speed on the
    default model, bench/bench_decode.py), else fp32."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" or _cpu_has_bf16() else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def _available_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def activation_reserve(cfg: ModelConfig, config: EngineConfig, dtype: torch.dtype) -> int:
    """A generous bound on one step's activations: per batched token the hidden/QKV/MLP buffers,
    per sequence one fp32 logits row and its sampling copies; plus framework slack."""
    elt = torch.finfo(dtype).bits // 8
    per_token = (6 * cfg.hidden_size + 3 * cfg.intermediate_size) * elt
    per_seq = 3 * cfg.vocab_size * 4
    slack = _GiB if config.device == "cuda" else 256 << 20
    return config.max_num_batched_tokens * per_token + config.max_num_seqs * per_seq + slack


class Engine:
    def __init__(self, config: EngineConfig, *, parts: tuple | None = None) -> None:
        """parts: (model_config, model, tokenizer, name) to use instead of loading config.model
        (tests drive the engine with small stand-ins this way)."""
        from pyengine.model.metadata import allocate_kv_caches, kv_bytes_per_token
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
            self.model_name = config.model or os.path.splitext(os.path.basename(path))[0]
            self.model_config, self.model = load_model(path, self.dtype, self.device, config.weights)
            self.tokenizer = Tokenizer.from_model_path(path)
        else:
            self.model_config, self.model, self.tokenizer, self.model_name = parts
        cfg = self.model_config
        self.max_model_len = config.max_model_len or cfg.max_position_embeddings
        if self.max_model_len > cfg.max_position_embeddings:
            raise ValueError(f"max_model_len {self.max_model_len} exceeds the model's maximum context "
                             f"length of {cfg.max_position_embeddings} tokens")
        cache_dtype = {"auto": self.dtype, "fp8": torch.float8_e4m3fn, "int8": torch.int8}[config.kv_cache_dtype]
        bpt = kv_bytes_per_token(cfg, cache_dtype)
        bs = config.block_size
        num_blocks = self._num_blocks(bpt)
        kv_caches = allocate_kv_caches(cfg, num_blocks, bs, cache_dtype, self.device)
        tokens = num_blocks * bs
        log.info("KV cache: %d blocks x %d = %d tokens, %.2f GiB (%d bytes/token, %s), max %.1f sequences "
                 "at full context (%d tokens)", num_blocks, bs, tokens, tokens * bpt / _GiB, bpt,
                 str(cache_dtype).removeprefix("torch."), tokens / self.max_model_len, self.max_model_len)
        self.pool = BlockPool(num_blocks, bs, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.pool, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.scheduling_policy)
        self.eos_ids = frozenset(self.tokenizer.eos_token_ids) | frozenset(cfg.eos_token_ids)
        self.runner = ModelRunner(self.model, kv_caches, block_size=bs, max_num_seqs=config.max_num_seqs,
                                  max_num_batched_tokens=config.max_num_batched_tokens,
                                  max_model_len=self.max_model_len, vocab_size=cfg.vocab_size,
                                  eos_ids=sorted(self.eos_ids), device=self.device)
        self.metrics = EngineMetrics(self.model_name)
        self.groups: dict[str, _Group] = {}
        self._pending_aborts: collections.deque[str] = collections.deque()
        self.num_steps = 0
        self.num_computed_tokens = 0

    def _num_blocks(self, bytes_per_token: int) -> int:
        c = self.config
        mem = c.kv_cache_memory
        if mem is not None and mem > 1:
            budget = int(mem)
        else:
            free = _available_memory(self.device) - activation_reserve(self.model_config, c, self.dtype)
            if mem is not None:
                if not 0 < mem <= 1:
                    raise ValueError(f"kv_cache_memory must be a byte count > 1 or a fraction in (0, 1], got {mem}")
                budget = int(free * mem)
            else:
                budget = int(free * 0.9)
                if self.device.type == "cpu":  # what the configuration can use, at most the default space
                    usable = c.max_num_seqs * self.max_model_len * bytes_per_token
                    budget = min(budget, _CPU_DEFAULT_KV_BYTES, usable + c.block_size * bytes_per_token)
        num_blocks = budget // (bytes_per_token * c.block_size)
        if num_blocks * c.block_size < self.max_model_len:  # vLLM refuses too: never advertise what cannot fit
            need = -(-self.max_model_len // c.block_size) * c.block_size * bytes_per_token
            raise ValueError(f"the KV cache ({budget} bytes: {num_blocks * c.block_size} tokens of {bytes_per_token} "
                             f"bytes) cannot hold one sequence of max_model_len {self.max_model_len} tokens "
                             f"({need} bytes); raise kv_cache_memory or lower max_model_len")
        return num_blocks

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
        group = _Group(request_id, text, ids)
        capacity = self.pool.num_blocks * self.pool.block_size
        for i in range(params.n):
            rid = request_id if params.n == 1 else f"{request_id}#{i}"
            req = Request(rid, text, ids, params, priority=priority, index=i, parent_id=request_id,
                          arrival_time=arrival, max_model_len=min(self.max_model_len, capacity))
            req.detok = IncrementalDetokenizer(self.tokenizer, ids, params.stop_strings,
                                               params.include_stop_str_in_output, params.skip_special_tokens)
            group.children.append(req)
        self.groups[request_id] = group
        first, *rest = group.children
        self.scheduler.add_request(first)
        if rest and self.pool.enable_caching and len(ids) > self.pool.block_size:
            group.deferred = rest
        else:
            for req in rest:
                self.scheduler.add_request(req)
        self.metrics.on_added(len(ids) * params.n)

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
            if req in group.deferred:  # never queued: nothing to free
                req.status = RequestStatus.FINISHED_ABORTED
                req.finished_time = time.perf_counter()
            else:
                self.scheduler.finish(req, RequestStatus.FINISHED_ABORTED)
            outs.append(self._finish(group, req, [], None))
        group.deferred = []
        return self._request_output(group, outs)

    def has_unfinished(self) -> bool:
        return bool(self.groups) or bool(self._pending_aborts)

    # ---- the step ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        while self._pending_aborts:
            o = self.abort_request(self._pending_aborts.popleft())
            if o is not None:
                outputs.append(o)
        sched = self.scheduler.schedule()
        got: list[Request] = []
        if len(sched):
            self.num_steps += 1
            self.num_computed_tokens += sched.num_tokens
            result = self.runner.execute(sched)
            for req, entries in (result.prompt_logprobs or ()) if result else ():
                req.prompt_logprobs.extend(entries)
            got = self.scheduler.update_from_output(sched, result.token_ids if result else [])
            outputs += self._process(got, result)
        s = self.scheduler
        self.metrics.on_step(s.num_running, s.num_waiting, self.pool.usage, len(got),
                             self.pool.query_tokens, self.pool.hit_tokens, s.num_preemptions)
        return outputs

    def _process(self, got: list[Request], result) -> list[RequestOutput]:
        now = time.perf_counter()
        by_group: dict[str, tuple[_Group, list[CompletionOutput]]] = {}
        eos = self.eos_ids
        for row, req in enumerate(got):
            tok = req.all_token_ids[-1]
            if req.first_token_time is None:
                req.first_token_time = now
                self.metrics.on_first_token(req)
            req.last_token_time = now
            lp = None
            if req.logprobs is not None and result.logprobs is not None:
                k = req.params.logprobs
                top = list(zip(result.top_ids[row][:k], result.top_logprobs[row][:k])) if k else []
                lp = TokenLogprob(tok, result.logprobs[row], top)
                req.logprobs.append(lp)
                req.cumulative_logprob += lp.logprob
            stop = check_token_stop(req, tok, eos)
            if stop is None or stop[0] is RequestStatus.FINISHED_LENGTH:
                hit = req.detok.add(tok)
                if hit is not None:
                    stop = (RequestStatus.FINISHED_STOPPED, hit)
            group = self.groups[req.parent_id]
            if group.deferred:
                for child in reversed(group.deferred):  # each goes to the queue front
                    self.scheduler.add_request(child, req)
                group.deferred = []
            if stop is not None:
                self.scheduler.finish(req, stop[0])
                req.stop_reason = stop[1]
                out = self._finish(group, req, [tok], lp)
            else:
                out = CompletionOutput(req.index, req.detok.pop_delta(False), [tok], None, None,
                                       [lp] if lp is not None else None, _cumulative(req))
            by_group.setdefault(group.request_id, (group, []))[1].append(out)
        return [self._request_output(group, outs) for group, outs in by_group.values()]

    def _finish(self, group: _Group, req: Request, new_ids: list[int], lp) -> CompletionOutput:
        group.num_finished += 1
        self.metrics.on_finished(req)
        if group.num_finished == len(group.children):
            del self.groups[group.request_id]
        return CompletionOutput(req.index, req.detok.pop_delta(True), new_ids, req.finish_reason,
                                req.stop_reason, [lp] if lp is not None else None, _cumulative(req))

    def _request_output(self, group: _Group, outs: list[CompletionOutput]) -> RequestOutput:
        finished = group.num_finished == len(group.children)
        first = group.children[0]
        metrics = RequestMetrics.of(first) if len(group.children) == 1 else None
        prompt_lps = None  # once, in the first output after the prompt is done
        if not group.sent_prompt_logprobs and first.prompt_logprobs is not None \
                and len(first.prompt_logprobs) == first.num_prompt_tokens:
            prompt_lps, group.sent_prompt_logprobs = first.prompt_logprobs, True
        return RequestOutput(group.request_id, group.prompt, group.prompt_token_ids, outs, finished, metrics,
                             prompt_lps)

    def stats(self) -> EngineStats:
        s, p = self.scheduler, self.pool
        return EngineStats(s.num_running, s.num_waiting, p.num_free, p.num_blocks, p.usage, s.num_preemptions,
                           p.query_tokens, p.hit_tokens, self.num_steps, self.num_computed_tokens)
