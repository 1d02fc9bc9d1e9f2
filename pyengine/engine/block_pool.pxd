# cython: language_level=3
"""C-level declaration of BlockPool so the scheduler calls it without Python dispatch."""

cdef class BlockPool:
    cdef readonly int num_blocks
    cdef readonly int block_size
    cdef readonly bint enable_caching
    cdef readonly int num_free
    cdef int* ref_cnt
    cdef int* prev
    cdef int* nxt
    cdef list block_hash  # per block: its registered hash, or None
    cdef list block_tokens  # per block: the token tuple behind block_hash
    cdef dict hash_to_block

    cdef void _unlink(self, int b)
    cdef void _push_tail(self, int b)
    cdef void _push_head(self, int b)
    cpdef list allocate(self, int n)
    cpdef void free_blocks(self, list blocks)
    cpdef void touch(self, list blocks)
    cpdef int num_evictable(self, list blocks)
    cdef void _extend_hashes(self, list token_ids, list hashes, Py_ssize_t num_full)
    cpdef list lookup(self, list token_ids, list hashes)
    cpdef Py_ssize_t cache_full_blocks(self, list token_ids, list hashes, list block_ids,
                                       Py_ssize_t num_hashed, Py_ssize_t num_computed)
