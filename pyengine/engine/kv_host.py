"""The host-memory tier of the KV cache: block payloads in RAM under a byte budget, evicted LRU, in front of an
optional disk store (kv_disk.DiskKVStore).

The same interface as the disk store (get / put / __contains__ / fingerprint / stats), keyed by the same chain
keys, so the engine's KVTier does not know which it talks to. A lookup tries host memory first, then the disk; a
disk hit is promoted into host memory. A block that host memory evicts falls through to the disk (written there
if it is not already) or, without a disk, is dropped. Host memory saves the disk's read and checksum on the CPU;
on a GPU it holds the blocks in pinned buffers (the allocator BlockCopier.host_buffer), the middle tier between
the device pool and the disk.

Puts and gets come from the tier's writer and reader threads; a fall-through write to the disk runs on the thread
that caused the eviction, outside the lock, so the other thread only waits for the index, never for the disk.
While a block is between the two it is in neither index: a lookup then misses and the block is recomputed.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

import numpy as np

from pyengine.engine.kv_disk import DiskKVStore


@dataclass
class HostStats:
    """Counters of one host store since it opened (plain ints, read by the metrics)."""

    blocks: int = 0
    bytes_used: int = 0
    hits: int = 0  # blocks served from host memory
    misses: int = 0  # lookups host memory could not serve (the disk may have)
    promoted: int = 0  # disk hits copied into host memory
    evicted: int = 0  # blocks host memory let go to stay within its budget
    spilled: int = 0  # of those, written down to the disk (the rest were there already, or there is no disk)


def _numpy_buffer(nbytes: int) -> np.ndarray:
    return np.empty(nbytes, dtype=np.uint8)


class HostKVStore:
    """Blocks in host memory, at most budget_bytes of payload, in front of `disk` (None: host memory only).

    alloc(nbytes) makes the uint8 buffer one block is copied into (pinned memory on a GPU; None: plain memory).
    Thread-safe."""

    def __init__(self, fingerprint: bytes, budget_bytes: int, disk: DiskKVStore | None = None,
                 alloc: Callable[[int], np.ndarray] | None = None) -> None:
        if budget_bytes < 0:
            raise ValueError(f"the host budget must be >= 0 bytes, got {budget_bytes}")
        if disk is not None and disk.fingerprint != fingerprint:
            raise ValueError("the host and disk stores must key blocks by the same model fingerprint")
        self.fingerprint = fingerprint
        self.budget_bytes = budget_bytes
        self.disk = disk
        self.stats = HostStats()
        self._alloc = alloc or _numpy_buffer
        self._lock = threading.Lock()
        # key -> (the block's tokens, its payload), least recent first
        self._lru: OrderedDict[bytes, tuple[list[int], np.ndarray]] = OrderedDict()

    def __contains__(self, key: bytes) -> bool:
        with self._lock:
            if key in self._lru:
                return True
        return self.disk is not None and key in self.disk

    def __len__(self) -> int:
        return len(self._lru)

    def in_memory(self, key: bytes) -> bool:
        """Whether host memory itself holds the block (not counting the disk)."""
        with self._lock:
            return key in self._lru

    # ---- blocks ----------------------------------------------------------------------------
    def put(self, key: bytes, tokens: list[int], payload: bytes | memoryview | np.ndarray) -> bool:
        """Keep a copy of one block in host memory; a block larger than the whole budget goes to the disk
        directly. True when some tier holds it afterwards."""
        with self._lock:
            if key in self._lru:
                self._lru.move_to_end(key)
                return True
        if len(payload) > self.budget_bytes:
            return self.disk is not None and self.disk.put(key, tokens, payload)
        self._insert(key, tokens, payload)
        return True

    def get(self, key: bytes, tokens: list[int]):
        """The block's K/V bytes (host memory first, then the disk), or None."""
        return self.get_tiered(key, tokens)[0]

    def get_tiered(self, key: bytes, tokens: list[int]) -> tuple[object, str | None]:
        """(payload, "host" or "disk"), or (None, None) on a miss. A disk hit is promoted into host memory."""
        with self._lock:
            entry = self._lru.get(key)
            if entry is not None and entry[0] == list(tokens):
                self._lru.move_to_end(key)
                self.stats.hits += 1
                return memoryview(entry[1]), "host"
            self.stats.misses += 1
        if self.disk is None:
            return None, None
        payload = self.disk.get(key, tokens)
        if payload is None:
            return None, None
        if len(payload) <= self.budget_bytes:
            self._insert(key, tokens, payload)
            with self._lock:
                self.stats.promoted += 1
        return payload, "disk"

    def _insert(self, key: bytes, tokens: list[int], payload) -> None:
        """Copy payload into a buffer of its own, make room (LRU) and spill what was evicted to the disk."""
        buf = self._alloc(len(payload))
        buf[:] = np.frombuffer(payload, dtype=np.uint8)
        with self._lock:
            if key in self._lru:  # the other thread stored it meanwhile
                self._lru.move_to_end(key)
                return
            evicted = []
            while self._lru and self.stats.bytes_used + len(buf) > self.budget_bytes:
                old_key, (old_tokens, old_buf) = self._lru.popitem(last=False)
                self.stats.bytes_used -= len(old_buf)
                evicted.append((old_key, old_tokens, old_buf))
            self._lru[key] = (list(tokens), buf)
            self.stats.bytes_used += len(buf)
            self.stats.blocks = len(self._lru)
            self.stats.evicted += len(evicted)
        self._spill(evicted)

    def _spill(self, evicted: list) -> None:
        """Write evicted blocks down to the disk, unless it holds them already (lock not held)."""
        if self.disk is None:
            return
        for key, tokens, buf in evicted:
            if key not in self.disk and self.disk.put(key, tokens, memoryview(buf)):
                with self._lock:
                    self.stats.spilled += 1

    def flush(self) -> None:
        """Write every block host memory holds down to the disk (at close: a restart finds them there)."""
        with self._lock:
            entries = [(k, t, b) for k, (t, b) in self._lru.items()]
        self._spill(entries)

    def clear(self) -> None:
        """Drop every block from host memory (the disk keeps its own)."""
        with self._lock:
            self._lru.clear()
            self.stats.bytes_used = 0
            self.stats.blocks = 0
