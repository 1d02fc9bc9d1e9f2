"""The disk tier of the KV cache: one file per KV block, under a byte budget, evicted LRU.

A block's file is named by its key: a chained digest of every token up to the block's end, seeded
with the model's fingerprint (model_fingerprint), so a key says "this model, this exact prefix".
Files live in DIR/<fingerprint>/, so servers of different models (or KV dtypes, block sizes...)
sharing DIR never see each other's blocks. Each file holds a header, the block's own tokens and
the K/V bytes, and a crc32 over tokens and bytes. Anything that does not check out (a foreign
version or fingerprint, a truncated file, a bad checksum, other tokens) is a miss and the file is
removed: the disk can cost a recompute, never a wrong answer.

Writes go to a temporary file that is renamed into place, so a crash leaves either the whole file
or none. Recency is kept in memory (an ordered dict) and in the files' mtimes (touched on a hit), so
a restart rebuilds the same LRU order from the directory.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
import threading
import time
import zlib
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

log = logging.getLogger("pyengine.kv_disk")

MAGIC = b"PEKV"
VERSION = 1
KEY_BYTES = 16
# magic, version, fingerprint, key, number of tokens, payload bytes, crc32 of tokens + payload
_HEADER = struct.Struct(f"<4sI{KEY_BYTES}s{KEY_BYTES}sIQI")
SUFFIX = ".kv"
# Temporary files older than this at start-up were left by a crash (a live writer renames within seconds).
STALE_TMP_SECONDS = 600.0


def model_fingerprint(identity: dict) -> bytes:
    """A digest of everything that makes stored K/V bytes valid for this engine: weights identity,
    dtypes, block size, cache layout, architecture and RoPE settings (the caller's dict, JSON-able)."""
    text = json.dumps({"format": VERSION, **identity}, sort_keys=True, default=str)
    return hashlib.blake2b(text.encode(), digest_size=KEY_BYTES).digest()


def weights_identity(path: str) -> list:
    """(path, size, mtime) of a weights file, or of every file in a model folder: a changed file is another model."""
    path = os.path.realpath(path)
    files = [path] if os.path.isfile(path) else sorted(
        os.path.join(path, f) for f in os.listdir(path) if os.path.isfile(os.path.join(path, f)))
    out = []
    for f in files:
        st = os.stat(f)
        out.append((f, st.st_size, st.st_mtime_ns))
    return out


def _token_bytes(tokens) -> bytes:
    return np.asarray(tokens, dtype="<i4").tobytes()


def chain_keys(fingerprint: bytes, token_ids: list[int], block_size: int, num_blocks: int,
               keys: list[bytes] | None = None) -> list[bytes]:
    """Keys of the first num_blocks full blocks of token_ids; `keys` (a prefix already computed) is extended."""
    keys = [] if keys is None else keys
    parent = keys[-1] if keys else fingerprint
    for i in range(len(keys), num_blocks):
        parent = hashlib.blake2b(parent + _token_bytes(token_ids[i * block_size:(i + 1) * block_size]),
                                 digest_size=KEY_BYTES).digest()
        keys.append(parent)
    return keys


@dataclass
class DiskStats:
    """Counters of one store since it opened (plain ints, read by the metrics)."""

    files: int = 0
    bytes_used: int = 0
    hits: int = 0  # blocks read back intact
    misses: int = 0  # lookups of blocks that were not there
    bad_files: int = 0  # entries found corrupt, truncated or foreign (removed, counted as misses)
    bytes_read: int = 0
    bytes_written: int = 0
    blocks_written: int = 0
    write_errors: int = 0  # writes that raised (a full disk, permissions): the block is simply not stored
    evicted: int = 0  # files removed to stay within the budget


class DiskKVStore:
    """Blocks on disk under DIR/<fingerprint hex>/<key hex>.kv, at most budget_bytes of them.

    Thread-safe: the engine's writer and reader threads share one store. Two stores of the same
    model on one directory (two servers) each keep their own budget over the files they know of."""

    def __init__(self, root: str, fingerprint: bytes, budget_bytes: int) -> None:
        if budget_bytes < 0:
            raise ValueError(f"the disk budget must be >= 0 bytes, got {budget_bytes}")
        self.fingerprint = fingerprint
        self.budget_bytes = budget_bytes
        self.dir = os.path.join(root, fingerprint.hex())
        os.makedirs(self.dir, exist_ok=True)
        self.stats = DiskStats()
        self._lock = threading.Lock()
        self._lru: OrderedDict[bytes, int] = OrderedDict()  # key -> file size, least recent first
        self._scan()

    # ---- index -----------------------------------------------------------------------------
    def _scan(self) -> None:
        """Rebuild the LRU index from the directory (oldest mtime first); remove stale temporaries."""
        entries = []
        now = time.time()
        for e in os.scandir(self.dir):
            try:
                st = e.stat()
                if e.name.endswith(SUFFIX) and len(e.name) == 2 * KEY_BYTES + len(SUFFIX):
                    entries.append((st.st_mtime_ns, bytes.fromhex(e.name[:-len(SUFFIX)]), st.st_size))
                elif e.name.endswith(".tmp") and now - st.st_mtime > STALE_TMP_SECONDS:
                    os.unlink(e.path)
            except (OSError, ValueError):
                continue
        for _, key, size in sorted(entries):
            self._lru[key] = size
            self.stats.bytes_used += size
        self.stats.files = len(self._lru)
        self._evict_to(self.budget_bytes)

    def _path(self, key: bytes) -> str:
        return os.path.join(self.dir, key.hex() + SUFFIX)

    def __contains__(self, key: bytes) -> bool:
        with self._lock:
            return key in self._lru

    def __len__(self) -> int:
        return len(self._lru)

    def _forget(self, key: bytes) -> None:
        """Drop key from the index (lock held)."""
        size = self._lru.pop(key, None)
        if size is not None:
            self.stats.bytes_used -= size
            self.stats.files -= 1

    def _evict_to(self, limit: int) -> None:
        """Remove least recently used files until at most `limit` bytes are used (lock held)."""
        while self._lru and self.stats.bytes_used > limit:
            key = next(iter(self._lru))
            self._forget(key)
            self.stats.evicted += 1
            try:
                os.unlink(self._path(key))
            except OSError:
                pass

    # ---- blocks ----------------------------------------------------------------------------
    def put(self, key: bytes, tokens: list[int], payload: bytes | memoryview) -> bool:
        """Store one block (atomically: temp file + rename). False when it does not fit the budget or
        the write failed (counted in stats.write_errors; the disk keeps what it had)."""
        tok = _token_bytes(tokens)
        crc = zlib.crc32(payload, zlib.crc32(tok))
        header = _HEADER.pack(MAGIC, VERSION, self.fingerprint, key, len(tokens), len(payload), crc)
        size = len(header) + len(tok) + len(payload)
        if size > self.budget_bytes:
            return False
        with self._lock:
            if key in self._lru:
                self._lru.move_to_end(key)
                return True
            self._evict_to(self.budget_bytes - size)
        path = self._path(key)
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
        try:
            with open(tmp, "wb") as f:
                f.write(header)
                f.write(tok)
                f.write(payload)
            os.replace(tmp, path)
        except OSError as exc:
            log.warning("kv disk: writing a block failed (%r); it is not stored", exc)
            with self._lock:
                self.stats.write_errors += 1
            try:
                os.unlink(tmp)
            except OSError:
                pass
            return False
        with self._lock:
            if key not in self._lru:
                self._lru[key] = size
                self.stats.bytes_used += size
                self.stats.files += 1
            self.stats.bytes_written += size
            self.stats.blocks_written += 1
            self._evict_to(self.budget_bytes)
        return True

    def get(self, key: bytes, tokens: list[int]) -> memoryview | None:
        """The block's K/V bytes, or None: absent, or any check failed (the file is then removed)."""
        with self._lock:
            if key not in self._lru:
                self.stats.misses += 1
                return None
        path = self._path(key)
        data = None
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError:
            pass
        payload = self._check(data, key, tokens)
        with self._lock:
            if payload is None:
                self.stats.misses += 1
                if data is not None:
                    self.stats.bad_files += 1
                    log.warning("kv disk: %s is corrupt, truncated or foreign; removed", path)
                    self._remove(key)
                else:
                    self._forget(key)
                return None
            self.stats.hits += 1
            self.stats.bytes_read += len(data)
            if key in self._lru:
                self._lru.move_to_end(key)
        try:
            os.utime(path)  # recency survives a restart
        except OSError:
            pass
        return payload

    def get_tiered(self, key: bytes, tokens: list[int]) -> tuple[memoryview | None, str | None]:
        """(get's payload, "disk"), or (None, None): the host store's interface, which also names the tier."""
        payload = self.get(key, tokens)
        return (payload, "disk") if payload is not None else (None, None)

    def _remove(self, key: bytes) -> None:
        """Forget and delete one entry (lock held)."""
        self._forget(key)
        try:
            os.unlink(self._path(key))
        except OSError:
            pass

    def _check(self, data: bytes | None, key: bytes, tokens: list[int]) -> memoryview | None:
        if data is None or len(data) < _HEADER.size:
            return None
        magic, version, fp, k, ntok, nbytes, crc = _HEADER.unpack_from(data)
        tok = _token_bytes(tokens)
        start = _HEADER.size + 4 * ntok
        if (magic != MAGIC or version != VERSION or fp != self.fingerprint or k != key or ntok != len(tokens)
                or len(data) != start + nbytes or data[_HEADER.size:start] != tok):
            return None
        payload = memoryview(data)[start:]
        if zlib.crc32(payload, zlib.crc32(tok)) != crc:
            return None
        return payload

    def clear(self) -> None:
        """Remove every block of this fingerprint."""
        with self._lock:
            self._evict_to(0)
