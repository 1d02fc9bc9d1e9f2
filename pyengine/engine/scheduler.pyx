# cython: language_level=3, boundscheck=False, wraparound=False
"""Continuous-batching scheduler (vLLM v1 style).

One step = one token budget (max_num_batched_tokens) shared by every running sequence. Running
sequences go first, each asking for all its not-yet-computed tokens (1 for a decode, the rest of
the prompt for a chunked prefill) capped by what is left of the budget; then waiting requests are
admitted in policy order (FCFS: arrival; priority: (priority, arrival), lower first) while budget,
max_num_seqs and free blocks allow. When a running sequence needs a block and none is free, the
last running sequence — in priority mode the running list is kept sorted, so that is the lowest
priority, latest admitted — is preempted: its blocks are freed and it goes back to the front of
the waiting queue to be recomputed later (its full blocks usually come back from the prefix cache).
A step that preempted admits nobody. long_prefill_tokens (> 0) caps the tokens one sequence computes
in a step, so a long prompt is chunked and cannot hold a step (and the requests waiting behind it)
for long. A prompt that has the engine to itself (the only sequence running or waiting) may take up
to solo_prefill_tokens instead: its chunk stalls no decodes, and larger chunks spend less per token
(fixed costs per step, weight streams, dequantized weight strips). Such a step is marked solo: a request
that arrives during it may interrupt it (pyengine/interrupt.py), and the step is scheduled again.
A waiting request that can be admitted goes first: a running prompt's next chunk shrinks by the
newcomer's first chunk (to nothing if need be), so the step stays about one chunk long and
the newcomer's first token comes after about one chunk's time, not two. A prompt chunk yields so
in at most every other step, so a stream of newcomers cannot starve a long prompt. A token of a
request owing prompt logprobs counts twice against long_prefill_tokens and the budget: it also
computes a logits row over the whole vocabulary, so a step holding such a chunk costs less than a
plain chunk's and the request that waits behind it, less than its own prefill.

A child of an n > 1 request forks from its first sibling once that one has computed the prompt: it
shares the sibling's blocks, gets a copy of the block holding the last prompt token
(SchedulerOutput.copies, made before the step runs) and computes only that token, for its own
first draw.
"""
import heapq
import time
from collections import deque

from pyengine.engine.block_pool cimport BlockPool
from pyengine.engine.request import Request, RequestStatus

cdef object WAITING = RequestStatus.WAITING
cdef object RUNNING = RequestStatus.RUNNING
cdef object PREEMPTED = RequestStatus.PREEMPTED
cdef object ABORTED = RequestStatus.FINISHED_ABORTED


cdef inline Py_ssize_t cdiv(Py_ssize_t a, Py_ssize_t b):
    return (a + b - 1) // b


class SchedulerOutput:
    """What runs this step: reqs[i] computes num_new[i] tokens starting at its num_computed_tokens;
    sampling[i] says whether that reaches its last known token (so a token is sampled). copies:
    (source, destination) KV blocks to copy before the step runs (forked children). solo: the step is
    one prompt chunk of the only request running or waiting (a newcomer may interrupt it)."""

    __slots__ = ("reqs", "num_new", "sampling", "num_tokens", "num_sampling", "preempted", "copies", "solo")

    def __init__(self, list reqs, list num_new, list sampling, int num_tokens, int num_sampling, list preempted,
                 list copies, bint solo=False):
        self.reqs = reqs
        self.num_new = num_new
        self.sampling = sampling
        self.num_tokens = num_tokens
        self.num_sampling = num_sampling
        self.preempted = preempted
        self.copies = copies
        self.solo = solo

    def __len__(self):
        return len(self.reqs)


cdef class Scheduler:
    cdef readonly BlockPool pool
    cdef readonly int max_num_seqs
    cdef readonly int max_num_batched_tokens
    cdef readonly bint priority_policy
    cdef readonly list running
    cdef object waiting  # deque (fcfs) or heap list of (priority, arrival_seq, req) (priority)
    cdef readonly dict requests  # request_id -> Request, every unfinished request
    cdef readonly int num_waiting
    cdef readonly long long num_preemptions
    cdef readonly int long_prefill_tokens  # most tokens one sequence computes per step (0: no cap)
    cdef readonly int solo_prefill_tokens  # the same for the only sequence running or waiting
    cdef int chunk_cap  # this step's cap: one of the two
    cdef readonly long long prefix_query_tokens  # prompt tokens of admissions that looked up the prefix cache
    cdef readonly long long prefix_hit_tokens  # of which found cached
    cdef long long arrival_counter
    cdef long long admit_counter
    cdef bint chunks_yielded  # the last step shrank a running prompt's chunk for a newcomer

    def __init__(self, BlockPool pool, int max_num_seqs, int max_num_batched_tokens, str policy="fcfs",
                 int long_prefill_tokens=0, int solo_prefill_tokens=0):
        if policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling policy must be fcfs or priority, got {policy!r}")
        if long_prefill_tokens < 0:
            raise ValueError(f"long_prefill_tokens must be >= 0, got {long_prefill_tokens}")
        if solo_prefill_tokens < 0:
            raise ValueError(f"solo_prefill_tokens must be >= 0, got {solo_prefill_tokens}")
        self.long_prefill_tokens = long_prefill_tokens
        self.solo_prefill_tokens = max(solo_prefill_tokens, long_prefill_tokens) if long_prefill_tokens > 0 else 0
        self.chunk_cap = long_prefill_tokens
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0
        self.pool = pool
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.priority_policy = policy == "priority"
        self.running = []
        self.waiting = [] if self.priority_policy else deque()
        self.requests = {}
        self.num_waiting = 0
        self.num_preemptions = 0
        self.arrival_counter = 0
        self.admit_counter = 0
        self.chunks_yielded = False

    # ---- queues ----------------------------------------------------------------------------
    cdef void _push_waiting(self, req, bint front):
        if self.priority_policy:
            heapq.heappush(self.waiting, (req.priority, req.arrival_seq, req.index, req))
        elif front:
            self.waiting.appendleft(req)
        else:
            self.waiting.append(req)
        self.num_waiting += 1

    cdef object _peek_waiting(self):
        """The next waiting request, dropping entries of aborted ones (removed lazily)."""
        while self.waiting:
            req = self.waiting[0][3] if self.priority_policy else self.waiting[0]
            if req.status is WAITING or req.status is PREEMPTED:
                return req
            if self.priority_policy:
                heapq.heappop(self.waiting)
            else:
                self.waiting.popleft()
        return None

    cdef void _pop_waiting(self):
        if self.priority_policy:
            heapq.heappop(self.waiting)
        else:
            self.waiting.popleft()
        self.num_waiting -= 1

    cdef void _insert_running(self, req):
        cdef Py_ssize_t i = len(self.running)
        if self.priority_policy:
            while i > 0 and self.running[i - 1].priority > req.priority:
                i -= 1
        self.running.insert(i, req)

    # ---- public ----------------------------------------------------------------------------
    def add_request(self, req) -> None:
        """Queue a validated request at the back (the engine checks lengths against the context and pool)."""
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        req.arrival_seq = self.arrival_counter
        self.arrival_counter += 1
        req.queued_time = time.perf_counter()
        req.status = WAITING
        self.requests[req.request_id] = req
        self._push_waiting(req, False)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    cdef inline bint _needs_all_logits(self, req):
        """A request still owing prompt logprobs computes its whole prompt (no prefix-cache hit)."""
        return req.prompt_logprobs is not None and len(req.prompt_logprobs) < req.num_prompt_tokens

    cdef inline int _token_cost(self, req):
        """What one token of `req` counts against long_prefill_tokens and the budget: 2 while it owes
        prompt logprobs (each prompt token also gets a logits row over the vocabulary), else 1."""
        return 2 if self._needs_all_logits(req) else 1

    cdef inline int _cap(self, int budget, int cost):
        """The tokens one sequence whose tokens cost `cost` may compute this step out of `budget` (at
        least one, so a step always moves)."""
        cdef int cap = budget if self.chunk_cap == 0 or budget < self.chunk_cap else self.chunk_cap
        return max(cap // cost, 1)

    cdef int _chunk_room(self):
        """The most tokens a running prompt's chunk may take this step (long_prefill_tokens > 0):
        the step's chunk cap less the first chunk of the waiting request that this step can admit,
        unless chunks yielded in the last step already."""
        cdef int room = self.chunk_cap
        if self.chunks_yielded or len(self.running) >= self.max_num_seqs:
            return room
        req = self._peek_waiting()
        if req is None:
            return room
        hit, num_hit, n, need, copy_from = self._admission(req, self.max_num_batched_tokens)
        if need > self.pool.num_free - self.pool.num_evictable(hit):
            return room  # it waits for blocks: nobody is admitted
        return max(room - <int> n * self._token_cost(req), 0)

    cdef tuple _admission(self, req, int budget):
        """(shared blocks, tokens they hold, tokens to compute now, new blocks needed, block to copy
        into the first new one or -1) to admit `req`: a fork from its first sibling (see the module
        docstring) where that one holds the computed prompt, else a prefix-cache lookup."""
        cdef int bs = self.pool.block_size
        cdef Py_ssize_t P = len(req.all_token_ids), last
        src = req.fork_source
        if src is not None and src.status is RUNNING and src.num_computed_tokens >= P and P == req.num_prompt_tokens:
            last = (P - 1) // bs  # the block holding the last prompt token
            return src.block_ids[:last], P - 1, 1, 1, src.block_ids[last]
        hit = [] if self._needs_all_logits(req) else self.pool.lookup(req.all_token_ids, req.block_hashes)
        cdef Py_ssize_t num_hit = len(hit) * bs
        cdef Py_ssize_t n = min(P - num_hit, <Py_ssize_t> self._cap(budget, self._token_cost(req)))
        return hit, num_hit, n, cdiv(num_hit + n, bs) - len(hit), -1

    cdef void _preempt_for_priority(self, list preempted):
        """Priority policy: while the best waiting request outranks the worst running one (a
        strictly smaller priority value) and lacks a sequence slot or blocks, preempt the worst."""
        running = self.running
        while running:
            req = self._peek_waiting()
            victim = running[len(running) - 1]
            if req is None or req.priority >= victim.priority:
                return
            hit, num_hit, n, need, copy_from = self._admission(req, self.max_num_batched_tokens)
            if len(running) < self.max_num_seqs and need <= self.pool.num_free - self.pool.num_evictable(hit):
                return
            self._preempt(victim)
            preempted.append(victim)

    cdef inline void _add_to_step(self, req, Py_ssize_t n, bint samples, list reqs, list num_new, list sampling):
        """Schedule n tokens of req this step; `samples`: they reach its end, so it gets a token."""
        reqs.append(req)
        num_new.append(n)
        sampling.append(samples)

    cpdef object schedule(self):
        cdef int budget = self.max_num_batched_tokens
        cdef int bs = self.pool.block_size
        cdef list reqs = []
        cdef list num_new = []
        cdef list sampling = []
        cdef list preempted = []
        cdef list copies = []
        cdef Py_ssize_t i = 0
        cdef Py_ssize_t n, need, ntok, ncomp, num_hit, copy_from
        cdef int cost, num_tokens = 0
        cdef int chunk_room = -1  # see _chunk_room; computed on the first running prompt chunk
        cdef bint yielded = False
        cdef bint has_spec = False  # some sequence verifies drafts (never a solo step: nothing to interrupt for)
        cdef list running = self.running
        cdef BlockPool pool = self.pool
        now = None
        cdef bint alone = len(running) + self.num_waiting == 1
        self.chunk_cap = self.solo_prefill_tokens if alone else self.long_prefill_tokens
        if self.priority_policy:
            self._preempt_for_priority(preempted)
        cdef Py_ssize_t num_priority_preempted = len(preempted)

        while i < len(running) and budget > 0:
            req = running[i]
            ncomp = req.num_computed_tokens
            ntok = len(req.all_token_ids)
            cost = self._token_cost(req)
            n = min(ntok - ncomp, self._cap(budget, cost))
            if req.spec_token_ids:  # a decode verifying drafts: its last token and the drafts the budget holds
                n = min(1 + len(req.spec_token_ids), self._cap(budget, cost))
                del req.spec_token_ids[n - 1:]
                has_spec = True
            elif n > 1 and self.long_prefill_tokens > 0:  # a prompt chunk: a newcomer's first chunk goes first
                if chunk_room < 0:
                    chunk_room = self._chunk_room()
                if n > chunk_room // cost:
                    n = chunk_room // cost
                    yielded = True
                    if n == 0:
                        i += 1
                        continue
            need = cdiv(ncomp + n, bs) - len(req.block_ids)
            while need > pool.num_free:
                victim = running[len(running) - 1]
                self._preempt(victim)
                preempted.append(victim)
                if victim is req:
                    break
            if req.status is PREEMPTED:
                break
            if need > 0:
                req.block_ids.extend(pool.allocate(need))
            self._add_to_step(req, n, ncomp + n >= ntok, reqs, num_new, sampling)
            budget -= n * cost
            num_tokens += n
            i += 1

        if len(preempted) == num_priority_preempted:  # no admissions while running requests lack blocks
            while budget > 0 and len(running) < self.max_num_seqs:
                req = self._peek_waiting()
                if req is None:
                    break
                hit, num_hit, n, need, copy_from = self._admission(req, budget)
                ntok = len(req.all_token_ids)
                if need > pool.num_free - pool.num_evictable(hit):
                    break  # head-of-line: keep arrival order, wait for blocks
                self._pop_waiting()
                if pool.enable_caching and copy_from < 0 and not self._needs_all_logits(req):  # once per lookup
                    self.prefix_query_tokens += req.num_prompt_tokens
                    self.prefix_hit_tokens += min(num_hit, <Py_ssize_t> req.num_prompt_tokens)
                pool.touch(hit)
                req.block_ids = hit + pool.allocate(need) if need > 0 else hit
                if copy_from >= 0:
                    copies.append((copy_from, req.block_ids[len(hit)]))
                req.num_computed_tokens = num_hit
                req.num_hashed_blocks = len(hit)
                if now is None:
                    now = time.perf_counter()
                if req.first_scheduled_time is None:
                    req.first_scheduled_time = now
                    req.num_cached_tokens = num_hit if num_hit < req.num_prompt_tokens else req.num_prompt_tokens
                req.status = RUNNING
                req.admit_seq = self.admit_counter
                self.admit_counter += 1
                self._insert_running(req)
                self._add_to_step(req, n, num_hit + n == ntok, reqs, num_new, sampling)
                budget -= n * self._token_cost(req)
                num_tokens += n

        self.chunks_yielded = yielded
        return SchedulerOutput(reqs, num_new, sampling, num_tokens, sampling.count(True), preempted, copies,
                               alone and len(reqs) == 1 and num_tokens > 1 and not has_spec)

    cdef void _preempt(self, req):
        self.running.remove(req)
        self.pool.free_blocks(req.block_ids)
        req.block_ids = []
        req.num_computed_tokens = 0
        req.num_hashed_blocks = 0
        req.spec_token_ids = []
        req.status = PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        self._push_waiting(req, True)

    cpdef list update_from_output(self, object out, list sampled_token_ids, list accepted=None):
        """Advance every scheduled request by its computed tokens and append the sampled tokens
        (sampled_token_ids in order of the sampling requests). A request that verified drafts takes its
        accepted drafts (accepted[j], a prefix of its spec_token_ids) before its sampled token; the rejected
        drafts' KV slots are rolled back (it counts only the accepted as computed, and the blocks past them
        are freed). Registers newly full blocks of computed (so accepted) tokens in the prefix cache.
        Returns the requests that got tokens."""
        cdef list reqs = out.reqs
        cdef list num_new = out.num_new
        cdef list sampling = out.sampling
        cdef list got = []
        cdef list drafts
        cdef Py_ssize_t i, j = 0, n, start, P, end, keep
        cdef BlockPool pool = self.pool
        cdef Py_ssize_t bs = pool.block_size
        for i in range(len(reqs)):
            req = reqs[i]
            if req.status is not RUNNING:  # aborted while the step ran
                if sampling[i]:
                    j += 1
                continue
            n = num_new[i]
            start = req.num_computed_tokens
            P = req.num_prompt_tokens
            if start < P:
                req.num_computed_prompt_tokens += (start + n if start + n < P else P) - start
            end = start + n
            drafts = req.spec_token_ids
            if drafts:
                req.spec_token_ids = []
                end -= len(drafts) - len(accepted[j])  # the rejected drafts' slots are not computed
                req.all_token_ids.extend(accepted[j])
                keep = cdiv(end, bs)
                if len(req.block_ids) > keep:  # blocks that held only rejected drafts (never cached or shared)
                    pool.free_blocks(req.block_ids[keep:])
                    del req.block_ids[keep:]
            req.num_computed_tokens = end
            if pool.enable_caching and end // bs > <Py_ssize_t> req.num_hashed_blocks:
                req.num_hashed_blocks = pool.cache_full_blocks(
                    req.all_token_ids, req.block_hashes, req.block_ids, req.num_hashed_blocks, end)
            if sampling[i]:
                req.all_token_ids.append(sampled_token_ids[j])
                j += 1
                got.append(req)
        return got

    cpdef void finish(self, req, object status):
        """Finish a request with a FINISHED_* status: leave its queue, free its blocks at once."""
        if req.status.finished:
            return
        if req.status is RUNNING:
            self.running.remove(req)
        else:
            self.num_waiting -= 1  # its queue entry is dropped lazily
        self.pool.free_blocks(req.block_ids)
        req.block_ids = []
        req.status = status
        req.finished_time = time.perf_counter()
        self.requests.pop(req.request_id, None)

    def abort(self, str request_id):
        """Abort a request in any state; returns it, or None if unknown or already finished."""
        req = self.requests.get(request_id)
        if req is not None:
            self.finish(req, ABORTED)
        return req
