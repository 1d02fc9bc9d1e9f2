# cython: language_level=3, boundscheck=False, wraparound=False
"""Batch preparation for the model runner: a step's schedule (a SchedulerOutput: reqs, num_new, sampling)
written into the flat step arrays and the per-row sampling arrays, in place, in buffers the runner allocates
once. Compiled, as these loops run every step over every scheduled token and sampling row."""


def prepare_batch(object out, int block_size,
                  long long[::1] input_ids, long long[::1] positions, long long[::1] slot_mapping,
                  int[::1] seq_lens, int[::1] query_start_loc, int[::1] block_tables,
                  long long[::1] logits_indices):
    """Fill the flat step arrays from a SchedulerOutput, in place (buffers sized by the caller).

    block_tables is a flat buffer used as a C-contiguous [S, max_blocks] array, max_blocks being the
    longest block list of the step. A sequence with drafts (spec_token_ids) computes them after its last
    token and gets a logits row for each of its 1 + k query tokens (so logits_indices needs up to
    max_num_batched_tokens entries).
    Returns (num_tokens, max_blocks, max_seq_len, num_logits)."""
    cdef list reqs = out.reqs
    cdef list num_new = out.num_new
    cdef list sampling = out.sampling
    cdef Py_ssize_t S = len(reqs)
    cdef Py_ssize_t s, j, k, t = 0, n, start, nb, max_blocks = 0, max_seq_len = 0, nl = 0, ntok
    cdef long long blk
    cdef list toks, blocks, drafts
    for s in range(S):
        nb = len(reqs[s].block_ids)
        if nb > max_blocks:
            max_blocks = nb
    query_start_loc[0] = 0
    for s in range(S):
        req = reqs[s]
        toks = req.all_token_ids
        drafts = req.spec_token_ids
        ntok = len(toks)
        blocks = req.block_ids
        n = num_new[s]
        start = req.num_computed_tokens
        nb = len(blocks)
        for k in range(nb):
            block_tables[s * max_blocks + k] = blocks[k]
        for k in range(nb, max_blocks):
            block_tables[s * max_blocks + k] = 0
        blk = -1
        for j in range(start, start + n):
            input_ids[t] = toks[j] if j < ntok else drafts[j - ntok]
            positions[t] = j
            if blk < 0 or j % block_size == 0:
                blk = blocks[j // block_size]
            slot_mapping[t] = blk * block_size + j % block_size
            t += 1
        seq_lens[s] = start + n
        if start + n > max_seq_len:
            max_seq_len = start + n
        query_start_loc[s + 1] = t
        if sampling[s]:  # the last row, and before it one per draft (it verifies the draft after it)
            for j in range(t - 1 - len(drafts), t):
                logits_indices[nl] = j
                nl += 1
    return t, max_blocks, max_seq_len, nl


def prepare_sampling(list reqs, float[::1] temperature, int[::1] top_k, float[::1] top_p,
                     float[::1] min_p, long long[::1] seeds, long long[::1] steps):
    """Per-row sampling arrays for the sampling requests. Returns (all_greedy, any_penalties,
    max_logprobs) where max_logprobs is -1 when no request wants logprobs."""
    cdef Py_ssize_t i
    cdef bint all_greedy = True, any_pen = False
    cdef int max_lp = -1, lp
    cdef tuple row
    for i in range(len(reqs)):
        req = reqs[i]
        row = req.sampling_row
        temperature[i] = row[0]
        top_k[i] = row[1]
        top_p[i] = row[2]
        min_p[i] = row[3]
        seeds[i] = row[4]
        steps[i] = len(req.all_token_ids) - req.num_prompt_tokens
        if row[0] != 0.0:
            all_greedy = False
        if row[5]:
            any_pen = True
        lp = row[6]
        if lp > max_lp:
            max_lp = lp
    return all_greedy, any_pen, max_lp
