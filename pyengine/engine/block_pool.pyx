# cython: language_level=3, boundscheck=False, wraparound=False
"""The KV block pool: ref counts, an LRU free list, and the prefix cache.

Blocks are integers in [0, num_blocks). A block is "free" when its ref count is 0; free blocks sit
in one doubly linked list (arrays prev/next with a sentinel at index num_blocks) so that allocate,
free and "take a cached free block back" are all O(1). Allocation pops from the head. A freed block
that holds a registered prefix-cache entry goes to the tail (evicted last, oldest first); a freed
block without one goes to the head (it is worth nothing, reuse it first).

Prefix cache: a full block is keyed by a chained hash hash((parent_hash, block_tokens)). Hashes
collide, so a hit is verified against the token ids stored with the block. When a cached block is
reallocated for new contents, its hash entry is dropped first (a stale entry would hand out a block
whose contents changed).
"""
from libc.stdlib cimport malloc, free as cfree

_ROOT_HASH = 0x5BD1E995


cdef class BlockPool:

    def __cinit__(self, int num_blocks, int block_size, bint enable_caching=True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks} and {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.ref_cnt = <int*> malloc(num_blocks * sizeof(int))
        self.prev = <int*> malloc((num_blocks + 1) * sizeof(int))
        self.nxt = <int*> malloc((num_blocks + 1) * sizeof(int))
        if not self.ref_cnt or not self.prev or not self.nxt:
            raise MemoryError()
        cdef int i
        for i in range(num_blocks):
            self.ref_cnt[i] = 0
            self.prev[i] = i - 1 if i > 0 else num_blocks
            self.nxt[i] = i + 1
        self.nxt[num_blocks] = 0  # sentinel: nxt = head, prev = tail
        self.prev[num_blocks] = num_blocks - 1
        self.num_free = num_blocks
        self.block_hash = [None] * num_blocks
        self.block_tokens = [None] * num_blocks
        self.hash_to_block = {}

    def __dealloc__(self):
        cfree(self.ref_cnt)
        cfree(self.prev)
        cfree(self.nxt)

    # ---- free list -------------------------------------------------------------------------
    cdef void _unlink(self, int b):
        self.nxt[self.prev[b]] = self.nxt[b]
        self.prev[self.nxt[b]] = self.prev[b]
        self.num_free -= 1

    cdef void _push_tail(self, int b):
        cdef int s = self.num_blocks
        self.prev[b] = self.prev[s]
        self.nxt[b] = s
        self.nxt[self.prev[s]] = b
        self.prev[s] = b
        self.num_free += 1

    cdef void _push_head(self, int b):
        cdef int s = self.num_blocks
        self.nxt[b] = self.nxt[s]
        self.prev[b] = s
        self.prev[self.nxt[s]] = b
        self.nxt[s] = b
        self.num_free += 1

    cpdef list allocate(self, int n):
        """n fresh blocks (ref count 1), evicting the least recently freed cached ones."""
        if n > self.num_free:
            raise RuntimeError(f"block pool exhausted: asked for {n} blocks, {self.num_free} free")
        cdef list out = []
        cdef int b
        cdef int s = self.num_blocks
        for _ in range(n):
            b = self.nxt[s]
            self._unlink(b)
            h = self.block_hash[b]
            if h is not None:
                if self.hash_to_block.get(h) == b:
                    del self.hash_to_block[h]
                self.block_hash[b] = None
                self.block_tokens[b] = None
            self.ref_cnt[b] = 1
            out.append(b)
        return out

    cpdef void free_blocks(self, list blocks):
        """Drop one reference to each block; the last one makes it free. Freed in reverse so a
        sequence's tail blocks are evicted before its head (the head is the likelier shared prefix)."""
        cdef Py_ssize_t i
        cdef int b
        for i in range(len(blocks) - 1, -1, -1):
            b = blocks[i]
            self.ref_cnt[b] -= 1
            if self.ref_cnt[b] == 0:
                if self.block_hash[b] is None:
                    self._push_head(b)
                else:
                    self._push_tail(b)
            elif self.ref_cnt[b] < 0:
                raise RuntimeError(f"block {b} freed more often than allocated")

    cpdef void touch(self, list blocks):
        """Take one more reference to each (cached) block, pulling free ones out of the free list."""
        cdef int b
        for b in blocks:
            if self.ref_cnt[b] == 0:
                self._unlink(b)
            self.ref_cnt[b] += 1

    cpdef int num_evictable(self, list blocks):
        """How many of these blocks are free now (touching them takes them off the free list)."""
        cdef int b, c = 0
        for b in blocks:
            if self.ref_cnt[b] == 0:
                c += 1
        return c

    def ref_count(self, int b) -> int:
        return self.ref_cnt[b]

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by live sequences (cached free blocks count as free)."""
        return 1.0 - self.num_free / self.num_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self.hash_to_block)

    # ---- prefix cache ----------------------------------------------------------------------
    cdef void _extend_hashes(self, list token_ids, list hashes, Py_ssize_t num_full):
        cdef Py_ssize_t i
        cdef int bs = self.block_size
        parent = hashes[len(hashes) - 1] if hashes else _ROOT_HASH
        for i in range(len(hashes), num_full):
            parent = hash((parent, tuple(token_ids[i * bs:(i + 1) * bs])))
            hashes.append(parent)

    cpdef list lookup(self, list token_ids, list hashes):
        """The longest verified run of cached blocks at the start of token_ids, not counting
        the last token (so at least one token is left to compute and produce logits).
        `hashes` is the sequence's chained-hash list, extended in place. Takes no references."""
        cdef list hit = []
        if not self.enable_caching:
            return hit
        cdef int bs = self.block_size
        cdef Py_ssize_t max_blocks = (len(token_ids) - 1) // bs
        cdef Py_ssize_t i
        self._extend_hashes(token_ids, hashes, max_blocks)
        for i in range(max_blocks):
            b = self.hash_to_block.get(hashes[i])
            if b is None or self.block_tokens[b] != tuple(token_ids[i * bs:(i + 1) * bs]):
                break
            hit.append(b)
        return hit

    cpdef Py_ssize_t cache_full_blocks(self, list token_ids, list hashes, list block_ids,
                                       Py_ssize_t num_hashed, Py_ssize_t num_computed):
        """Register the sequence's full, computed blocks [num_hashed, num_computed // bs) in the
        prefix cache. Returns the new number of registered leading blocks."""
        cdef Py_ssize_t num_full = num_computed // self.block_size
        if not self.enable_caching or num_full <= num_hashed:
            return num_hashed
        self._extend_hashes(token_ids, hashes, num_full)
        cdef int bs = self.block_size
        cdef Py_ssize_t i
        cdef int b
        for i in range(num_hashed, num_full):
            b = block_ids[i]
            h = hashes[i]
            if self.block_hash[b] is None and h not in self.hash_to_block:
                self.hash_to_block[h] = b
                self.block_hash[b] = h
                self.block_tokens[b] = tuple(token_ids[i * bs:(i + 1) * bs])
        return num_full

    def reset_prefix_cache(self) -> None:
        """Forget every cached entry (blocks in use keep their contents, just unregistered)."""
        self.hash_to_block.clear()
        self.block_hash = [None] * self.num_blocks
        self.block_tokens = [None] * self.num_blocks
