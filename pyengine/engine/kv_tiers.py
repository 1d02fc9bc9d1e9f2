"""A KV tier under the prefix cache: blocks written through to a store, read back on a pool miss.

Write-through: when a step registers full blocks in the prefix cache, the engine hands the requests to
offer(); their new blocks are copied out of the cache (on the step thread, a memcpy per tensor, before
anything can reuse the blocks) and queued for the writer thread. A full queue drops the block (counted).
Writing at registration rather than at eviction means the store already holds a block when the pool
evicts it, and a crash or restart loses at most the queue.

Read-back: when a request arrives (admit()), the pool's prefix-cache hit is extended with the blocks
that follow it on disk: the reader thread loads them while the request stays out of the scheduler, so
steps of other requests go on. At the start of a step in which nothing waits in the scheduler's queue,
ready() installs what finished loading into free pool blocks, registers them in the prefix cache, pins
them through that step's schedule() and returns the requests to queue: next in line, they are admitted
in that step, and the scheduler's own prefix-cache lookup finds the blocks. A failed, slow or missing read,
or a pool without room in time, only means recomputing.

The store is a DiskKVStore, or a HostKVStore (kv_host.py: host memory, in front of the disk or alone) with the
same get/put/__contains__; BlockCopier is the one place that touches the cache tensors.
"""
from __future__ import annotations

import logging
import os
import queue
import threading
import time
import weakref
from dataclasses import dataclass, field

import numpy as np
import torch

from pyengine.engine.block_pool import BlockPool
from pyengine.engine.kv_disk import DiskKVStore, chain_keys
from pyengine.engine.kv_host import HostKVStore
from pyengine.engine.request import Request
from pyengine.model.metadata import KVCache

log = logging.getLogger("pyengine.kv_tiers")

# How long ready() waits for a load when no request can run meanwhile (the step loop would spin).
IDLE_WAIT_SECONDS = 0.01
# A read is cut short read_timeout seconds after the reader took it up, or this many times that after the request
# arrived (queued behind other reads, or behind a read that hangs).
QUEUE_TIMEOUT_FACTOR = 5
# How long closing waits for the write queue to drain.
CLOSE_TIMEOUT_SECONDS = 30.0


def pinned_buffer(nbytes: int) -> np.ndarray:
    """A uint8 buffer in pinned (page-locked) host memory: the GPU copies it asynchronously. The host tier keeps
    its blocks in such buffers on a GPU."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).numpy()  # the array keeps the tensor alive


class BlockCopier:
    """Whole KV blocks (every layer's K, V and fp8/int8 scales) to and from flat host bytes, one row per block.

    The block is the leading dimension of every cache layout. On the CPU the copies are numpy fancy-index
    copies of byte views (plain memcpys; torch's index_copy_ on byte views is several times slower). On a GPU
    they go through pinned host buffers on a copy stream of their own, which first waits for the work already
    queued on the compute stream (that writes or reads the blocks); each call waits for its copies to finish
    before it returns, so the rows it hands out are complete and the blocks it fills are ready for the next
    step's kernels."""

    def __init__(self, kv_caches: list[KVCache]) -> None:
        self.tensors = [t.view(torch.uint8) for c in kv_caches for t in (c.k, c.v, c.k_scales, c.v_scales)
                        if t is not None]
        self.sizes = [t[0].numel() for t in self.tensors]
        self.block_bytes = sum(self.sizes)
        self.on_cpu = self.tensors[0].device.type == "cpu"
        # [num_blocks, bytes per block] views of the CPU caches
        self.arrays = [t.numpy().reshape(t.shape[0], -1) for t in self.tensors] if self.on_cpu else []
        self.stream = None if self.on_cpu else torch.cuda.Stream(self.tensors[0].device)

    def gather(self, blocks: list[int]) -> np.ndarray:
        """[len(blocks), block_bytes] uint8 on the host: a copy of the blocks' contents."""
        out = np.empty((len(blocks), self.block_bytes), dtype=np.uint8)
        off = 0
        if self.on_cpu:
            idx = np.asarray(blocks)
            for a, size in zip(self.arrays, self.sizes):
                out[:, off:off + size] = a[idx]
                off += size
            return out
        pinned = pinned_buffer(len(blocks) * self.block_bytes).reshape(len(blocks), self.block_bytes)
        device = self.tensors[0].device
        self.stream.wait_stream(torch.cuda.current_stream(device))  # the blocks' contents are written
        with torch.cuda.stream(self.stream):
            idx = torch.tensor(blocks, dtype=torch.int64, device=device)
            rows = torch.cat([t.index_select(0, idx).reshape(len(blocks), size)
                              for t, size in zip(self.tensors, self.sizes)], dim=1)
            torch.from_numpy(pinned).copy_(rows, non_blocking=True)
        self.stream.synchronize()  # the pinned rows are complete (and rows, idx no longer in use)
        return pinned

    def scatter(self, blocks: list[int], rows: list) -> None:
        """Write rows (one buffer of block_bytes per block, as gather's rows or the store's payloads) into the
        blocks. Row by row: no staging copy of them all."""
        if not self.on_cpu:
            pinned = pinned_buffer(len(blocks) * self.block_bytes).reshape(len(blocks), self.block_bytes)
            for i, row in enumerate(rows):
                pinned[i] = np.frombuffer(row, dtype=np.uint8)
            device = self.tensors[0].device
            self.stream.wait_stream(torch.cuda.current_stream(device))  # earlier kernels are done with the blocks
            with torch.cuda.stream(self.stream):
                idx = torch.tensor(blocks, dtype=torch.int64, device=device)
                data, off = torch.from_numpy(pinned).to(device, non_blocking=True), 0
                for t, size in zip(self.tensors, self.sizes):
                    t.index_copy_(0, idx, data[:, off:off + size].reshape((len(blocks),) + t.shape[1:]))
                    off += size
            self.stream.synchronize()  # the blocks are filled before any later kernel reads them
            return
        for b, row in zip(blocks, rows):
            row = np.frombuffer(row, dtype=np.uint8)
            off = 0
            for a, size in zip(self.arrays, self.sizes):
                a[b] = row[off:off + size]
                off += size


def _write_loop(writes: queue.Queue, store: DiskKVStore | HostKVStore, pending: set) -> None:
    while True:
        item = writes.get()
        if item is None:
            return
        key, tokens, row = item
        try:
            store.put(key, tokens, memoryview(row))
        except Exception:  # a store must not kill the writer: the block is just not stored
            log.exception("kv tier: storing a block failed")
        finally:
            pending.discard(key)


def _read_loop(reads: queue.Queue, store: DiskKVStore | HostKVStore) -> None:
    """Loads in order; each fills its payloads (and the tier each came from) up to its first miss (or until
    cancelled)."""
    while True:
        load = reads.get()
        if load is None:
            return
        load.read_started = time.perf_counter()
        try:
            for key, tokens in zip(load.keys, load.tokens):
                if load.cancelled:
                    break
                payload, tier = store.get_tiered(key, tokens)
                if payload is None:
                    break
                load.payloads.append(payload)
                load.tiers.append(tier)
        except Exception:
            log.exception("kv tier: reading blocks failed; recomputing them")
            load.failed = True
        finally:
            load.done.set()


def _stop(writes: queue.Queue, reads: queue.Queue, writer: threading.Thread,
          store: DiskKVStore | HostKVStore) -> None:
    reads.put(None)
    try:
        writes.put(None, timeout=CLOSE_TIMEOUT_SECONDS)
    except queue.Full:
        log.warning("kv tier: the write queue did not drain in %.0f s; %d blocks not stored", CLOSE_TIMEOUT_SECONDS,
                    writes.qsize())
        return
    writer.join(CLOSE_TIMEOUT_SECONDS)
    if isinstance(store, HostKVStore):  # host memory is gone after this: its blocks go down to the disk
        store.flush()


@dataclass
class TierStats:
    """Counters of the tier's traffic (the store keeps its own: files, bytes, hits, bad files)."""

    hit_tokens: int = 0  # prompt tokens installed from the store instead of computed
    host_hit_tokens: int = 0  # of hit_tokens, those served from host memory (the rest came from the disk)
    loads: int = 0  # requests that waited for a read
    read_timeouts: int = 0  # loads cut short by read_timeout (the rest recomputed)
    gave_up: int = 0  # loaded requests that found no turn within read_timeout (recomputed)
    read_errors: int = 0  # loads whose reader raised (recomputed)
    dropped_writes: int = 0  # blocks not written because the write queue was full


@dataclass
class _Load:
    """One request's read: blocks first..first+len(keys) of its prompt, filled in order by the reader."""

    req: Request
    first: int
    keys: list[bytes]
    tokens: list[list[int]]
    started: float
    payloads: list = field(default_factory=list)
    tiers: list[str] = field(default_factory=list)  # "host" or "disk", one per payload
    done: threading.Event = field(default_factory=threading.Event)
    cancelled: bool = False
    failed: bool = False
    read_started: float | None = None  # when the reader took it up
    held_since: float | None = None  # since when, loaded, it has been the oldest request waiting for its turn


class KVTier:
    def __init__(self, store: DiskKVStore | HostKVStore, pool: BlockPool, kv_caches: list[KVCache], *,
                 write_queue_blocks: int = 256, read_timeout: float = 2.0) -> None:
        self.store = store
        self.pool = pool
        self.copier = BlockCopier(kv_caches)
        self.read_timeout = read_timeout
        # A read waiting behind others (or a reader stuck on a hung disk) gives up after this long.
        self.queue_timeout = QUEUE_TIMEOUT_FACTOR * read_timeout
        self.stats = TierStats()
        self.loading: dict[str, _Load] = {}  # request id -> its read, in arrival order
        self._pending: set[bytes] = set()  # keys queued for writing
        self._pinned: list[int] = []  # blocks ready() installed, referenced until unpin()
        self._writes: queue.Queue = queue.Queue(maxsize=max(write_queue_blocks, 1))
        self._reads: queue.Queue = queue.Queue()
        # The threads hold the queues and the store, not the tier, so an engine dropped without close() is
        # collected, and the finalizer stops them (and writes the queue at interpreter exit).
        writer = threading.Thread(target=_write_loop, args=(self._writes, store, self._pending),
                                  name="pyengine-kv-writer", daemon=True)
        reader = threading.Thread(target=_read_loop, args=(self._reads, store), name="pyengine-kv-reader", daemon=True)
        writer.start()
        reader.start()
        self._closed = False
        self._finalizer = weakref.finalize(self, _stop, self._writes, self._reads, writer, store)

    @property
    def host(self) -> HostKVStore | None:
        """The host-memory store, when there is one."""
        return self.store if isinstance(self.store, HostKVStore) else None

    @property
    def disk(self) -> DiskKVStore | None:
        """The disk store, when there is one."""
        return self.store.disk if isinstance(self.store, HostKVStore) else self.store

    def _keys(self, req: Request, num_blocks: int) -> list[bytes]:
        return chain_keys(self.store.fingerprint, req.all_token_ids, self.pool.block_size, num_blocks, req.disk_keys)

    # ---- writes ----------------------------------------------------------------------------
    def offer(self, reqs: list[Request]) -> None:
        """Queue the blocks that reqs registered in the prefix cache since their last offer (step thread,
        right after the scheduler registered them, while their block ids are valid)."""
        if self._closed:
            return
        bs = self.pool.block_size
        todo: list[tuple[bytes, list[int], int]] = []
        for req in reqs:
            n = req.num_hashed_blocks
            if n <= req.num_disk_offered:
                continue
            keys = self._keys(req, n)
            ids = req.all_token_ids
            for i in range(req.num_disk_offered, n):
                key = keys[i]
                if key not in self._pending and key not in self.store:
                    todo.append((key, ids[i * bs:(i + 1) * bs], req.block_ids[i]))
                    self._pending.add(key)
            req.num_disk_offered = n
        room = self._writes.maxsize - self._writes.qsize()  # copy no block that the full queue would drop
        for key, _, _ in todo[max(room, 0):]:
            self._pending.discard(key)
            self.stats.dropped_writes += 1
        todo = todo[:max(room, 0)]
        if not todo:
            return
        rows = self.copier.gather([b for _, _, b in todo])
        for (key, tokens, _), row in zip(todo, rows):
            try:
                self._writes.put_nowait((key, tokens, row))
            except queue.Full:
                self._pending.discard(key)
                self.stats.dropped_writes += 1

    # ---- reads -----------------------------------------------------------------------------
    def admit(self, req: Request) -> bool:
        """Start reading the blocks that follow req's pool hit from the store. True: req is held here until
        ready() returns it (the caller must not queue it); False: nothing to read, queue it now."""
        if req.prompt_logprobs is not None or self._closed:
            return False  # it computes every prompt token anyway
        bs = self.pool.block_size
        ids = req.all_token_ids
        max_blocks = (len(ids) - 1) // bs  # a lookup leaves the last token to compute
        first = len(self.pool.lookup(ids, req.block_hashes))
        if first >= max_blocks:
            return False
        keys = self._keys(req, max_blocks)
        if keys[first] not in self.store:
            return False
        load = _Load(req, first, keys[first:], [ids[i * bs:(i + 1) * bs] for i in range(first, max_blocks)],
                     time.perf_counter())
        self.loading[req.request_id] = load
        self.stats.loads += 1
        self._reads.put(load)
        return True

    def cancel(self, req: Request) -> bool:
        """Forget a held request (aborted while loading). True if it was held here."""
        load = self.loading.pop(req.request_id, None)
        if load is None:
            return False
        load.cancelled = True
        return True

    def ready(self, scheduler) -> list[Request]:
        """Held requests to queue now, their loaded blocks installed in the pool and pinned (referenced) through
        this step's schedule() (call unpin() after it), in which they are next in line for admission.

        A loaded request is released when nothing waits in the scheduler's queue (so it is admitted in this step
        if any request can be: blocks installed for a request that then waits could be evicted before it runs),
        while it has a sequence slot and the pool room for its blocks (beside one free block per running
        sequence, for its next token). A read still running read_timeout seconds after it began (or
        queue_timeout after the request came) is cut short. The oldest loaded request waits at most read_timeout
        seconds for its turn; then it is queued without its blocks and recomputes them."""
        if not self.loading:
            return []
        if not scheduler.has_unfinished():  # nothing else runs: wait a little for the oldest read, not spin
            next(iter(self.loading.values())).done.wait(IDLE_WAIT_SECONDS)
        reserve = scheduler.num_running
        slots = scheduler.max_num_seqs - scheduler.num_running
        queue_empty = scheduler.num_waiting == 0
        now = time.perf_counter()
        out = []
        oldest = True  # the first loaded request that is still held
        for rid, load in list(self.loading.items()):
            if not load.done.is_set():
                begun = load.read_started
                if (begun is None or now - begun < self.read_timeout) and now - load.started < self.queue_timeout:
                    continue
                if not load.cancelled:
                    load.cancelled = True  # the reader stops at its next block
                    self.stats.read_timeouts += 1
            payloads = list(zip(load.payloads, load.tiers))
            if queue_empty and len(out) < slots and len(payloads) < self.pool.num_free - reserve:
                del self.loading[rid]
                if load.failed:
                    self.stats.read_errors += 1
                else:
                    self._install(load, payloads, reserve)
                out.append(load.req)
                continue
            if oldest:
                oldest = False
                load.held_since = load.held_since or now
                if now - load.held_since >= self.read_timeout:  # no turn in time: recompute instead
                    del self.loading[rid]
                    self.stats.gave_up += 1
                    out.append(load.req)
        return out

    def unpin(self) -> None:
        """Drop the references ready() took on installed blocks: the requests admitted hold their own now.
        Call after each schedule()."""
        if self._pinned:
            self.pool.free_blocks(self._pinned)
            self._pinned = []

    def _install(self, load: _Load, payloads: list, reserve: int) -> None:
        """Copy loaded blocks into free pool blocks and register them in the prefix cache, where the
        scheduler's lookup finds them. Blocks the pool holds by now are skipped; a gap (the pool evicted
        blocks before `first` meanwhile) makes the loaded ones useless, so they are dropped. `reserve` free blocks
        are left for the running requests (a decode's next block), which must not be preempted for a newcomer."""
        pool, req, bs = self.pool, load.req, self.pool.block_size
        ids = req.all_token_ids
        hit = pool.lookup(ids, req.block_hashes)
        if len(hit) < load.first:
            return
        payloads = payloads[len(hit) - load.first:]  # (payload, tier) pairs
        size = self.copier.block_bytes
        payloads = payloads[:next((i for i, (p, _) in enumerate(payloads) if len(p) != size), len(payloads))]
        pool.touch(hit)  # pinned: neither allocating here nor other requests can evict what the request will use
        n = max(min(len(payloads), pool.num_free - reserve), 0)
        blocks = pool.allocate(n) if n else []
        if n:
            self.copier.scatter(blocks, [p for p, _ in payloads[:n]])
            pool.cache_full_blocks(ids, req.block_hashes, hit + blocks, len(hit), (len(hit) + n) * bs)
            from_host = sum(tier == "host" for _, tier in payloads[:n]) * bs
            req.num_disk_cached_tokens = n * bs - from_host
            req.num_host_cached_tokens = from_host
            req.num_disk_offered = len(hit) + n  # in the store already
            self.stats.hit_tokens += n * bs
            self.stats.host_hit_tokens += from_host
        self._pinned += hit + blocks

    # ---- lifetime --------------------------------------------------------------------------
    def close(self) -> None:
        """Write what is queued (waiting up to CLOSE_TIMEOUT_SECONDS), then stop both threads. Also runs when
        the tier is garbage collected or the interpreter exits."""
        self._closed = True
        for load in self.loading.values():
            load.cancelled = True
        self._finalizer()


def open_kv_tier(config, model_config, weights: str | list, dtype: torch.dtype, cache_dtype: torch.dtype,
                 pool: BlockPool, kv_caches: list[KVCache]) -> KVTier:
    """The engine's tier under the prefix cache: host memory (config.kv_host_bytes) in front of the disk
    (config.kv_disk_path, config.kv_disk_bytes), either alone or both. weights: the weights file or folder (its
    path, size and mtime go into the fingerprint), or a name standing for the model (engines on parts)."""
    from dataclasses import asdict

    from pyengine.engine.kv_disk import model_fingerprint, weights_identity

    identity = {
        "weights": weights_identity(weights) if isinstance(weights, str) and os.path.exists(weights) else weights,
        "weights_mode": config.weights,
        "model": asdict(model_config),  # shapes, RoPE settings, norms
        "dtype": str(dtype), "kv_dtype": str(cache_dtype), "block_size": pool.block_size,
        "layout": [(tuple(t.shape[1:]), str(t.dtype)) for c in kv_caches[:1]
                   for t in (c.k, c.v, c.k_scales, c.v_scales) if t is not None],
        "device": kv_caches[0].k.device.type,
    }
    fingerprint = model_fingerprint(identity)
    store = None
    if config.kv_disk_path is not None:
        store = DiskKVStore(config.kv_disk_path, fingerprint, config.kv_disk_bytes)
        log.info("kv disk tier: %s, %d blocks (%.1f MiB of %.1f MiB) found", store.dir, len(store),
                 store.stats.bytes_used / 2**20, store.budget_bytes / 2**20)
    if config.kv_host_bytes:
        on_gpu = kv_caches[0].k.device.type == "cuda"
        store = HostKVStore(fingerprint, config.kv_host_bytes, store,
                            alloc=pinned_buffer if on_gpu else None)
        log.info("kv host tier: %.1f MiB%s", config.kv_host_bytes / 2**20, " (pinned)" if on_gpu else "")
    return KVTier(store, pool, kv_caches)
