"""paged_attention against a plain torch reference (gather the paged cache, masked softmax)."""
from __future__ import annotations

import math

import pytest
import torch

from pyengine import _C
from pyengine.ops.attention import from_cache_layout, paged_attention, to_cache_layout

TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}


def reference(q, k_cache, v_cache, block_tables, seq_lens, qsl, scale, k_scales=None, v_scales=None, window=0,
              softcap=0.0):
    """Dense causal attention per sequence over the gathered (dequantized) cache, in fp32 (window > 0:
    each query sees its last `window` positions; softcap > 0: scores capped by softcap * tanh(s / softcap))."""
    T, H, D = q.shape
    k_cache, v_cache = from_cache_layout(k_cache, v_cache)
    kvh, bs = k_cache.shape[1], k_cache.shape[2]
    kf, vf = k_cache.float(), v_cache.float()
    if k_scales is not None:
        kf, vf = kf * k_scales[..., None], vf * v_scales[..., None]
    out = torch.zeros(T, H, D)
    for s in range(len(seq_lens)):
        L, q0, q1 = int(seq_lens[s]), int(qsl[s]), int(qsl[s + 1])
        if q1 == q0:
            continue
        blocks = block_tables[s, : (L + bs - 1) // bs].long()
        k = kf[blocks].permute(1, 0, 2, 3).reshape(kvh, -1, D)[:, :L].repeat_interleave(H // kvh, 0)
        v = vf[blocks].permute(1, 0, 2, 3).reshape(kvh, -1, D)[:, :L].repeat_interleave(H // kvh, 0)
        scores = q[q0:q1].float().transpose(0, 1) @ k.transpose(1, 2) * scale  # [H, q_len, L]
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        pos = L - (q1 - q0) + torch.arange(q1 - q0)
        scores.masked_fill_(torch.arange(L)[None, :] > pos[:, None], float("-inf"))
        if window:
            scores.masked_fill_(torch.arange(L)[None, :] <= pos[:, None] - window, float("-inf"))
        out[q0:q1] = (scores.softmax(-1) @ v).transpose(0, 1)
    return out


def make_batch(specs, num_heads, num_kv_heads, head_dim, block_size, dtype, *, cache_dtype=None, seed=0):
    """specs: [(seq_len, q_len)]. Blocks are shuffled; unused block-table entries hold an invalid id."""
    g = torch.Generator().manual_seed(seed)
    nblocks = [(L + block_size - 1) // block_size for L, _ in specs]
    num_blocks = sum(nblocks) + 3
    perm = torch.randperm(num_blocks, generator=g).int()
    block_tables = torch.full((len(specs), max(nblocks) + 1), 10**6, dtype=torch.int32)
    i = 0
    for s, n in enumerate(nblocks):
        block_tables[s, :n] = perm[i : i + n]
        i += n
    shape = (num_blocks, num_kv_heads, block_size, head_dim)
    k_cache = torch.randn(shape, generator=g).to(dtype)
    v_cache = torch.randn(shape, generator=g).to(dtype)
    seq_lens = torch.tensor([L for L, _ in specs], dtype=torch.int32)
    qsl = torch.tensor([0] + [q for _, q in specs], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    q = torch.randn(int(qsl[-1]), num_heads, head_dim, generator=g).to(dtype)
    scales = None
    if cache_dtype is not None:  # quantize the random cache per (block, head, token) row
        qmax = 448.0 if cache_dtype == torch.float8_e4m3fn else 127.0
        scales = []
        caches = []
        for c in (k_cache, v_cache):
            s = c.float().abs().amax(-1) / qmax
            x = c.float() / s[..., None]
            caches.append(x.to(cache_dtype) if cache_dtype == torch.float8_e4m3fn else x.round().to(torch.int8))
            scales.append(s)
        k_cache, v_cache = caches
    k_cache, v_cache = to_cache_layout(k_cache, v_cache, "cpu")
    return q, k_cache, v_cache, block_tables, seq_lens, qsl, scales


def owned_slots(block_tables, specs, num_blocks, block_size):
    """[num_blocks, block_size] bool: the cache slots some sequence of specs [(seq_len, q_len)] owns."""
    owned = torch.zeros(num_blocks, block_size, dtype=torch.bool)
    for s, (L, _) in enumerate(specs):
        for pos in range(L):
            owned[block_tables[s, pos // block_size], pos % block_size] = True
    return owned


def poison_unowned_slots(k_cache, v_cache, block_tables, specs, block_size):
    """The caches with NaN in every slot no sequence of specs [(seq_len, q_len)] owns (partial last
    blocks, spare blocks): kernels that read past a sequence's end would carry it into the output."""
    k, v = from_cache_layout(k_cache, v_cache)
    owned = owned_slots(block_tables, specs, k.shape[0], block_size)
    k[~owned[:, None, :, None].expand_as(k)] = float("nan")
    v[~owned[:, None, :, None].expand_as(v)] = float("nan")
    return to_cache_layout(k, v, "cpu")


# A mixed step: decodes (one at 3000 tokens), a full prompt, prompt chunks with partial last blocks,
# a chunk ending exactly on a block boundary, and a sequence with no query this step.
MIXED = [(1, 1), (17, 17), (50, 1), (3000, 1), (300, 37), (48, 16), (33, 5), (10, 0), (129, 1)]


@pytest.mark.parametrize(
    "gqa,kv_heads,head_dim,block_size,dtype",
    [
        (1, 2, 64, 16, torch.float32),
        (3, 3, 64, 16, torch.bfloat16),  # the default model's shape
        (8, 1, 128, 32, torch.float32),
        (8, 2, 128, 8, torch.bfloat16),
        (3, 1, 80, 8, torch.float32),  # generic head_dim
        (3, 2, 64, 32, torch.float16),
        (4, 2, 64, 32, torch.bfloat16),  # bf16 tiles: half a block each
        (2, 2, 64, 24, torch.bfloat16),  # a block size the bf16 tiles do not fit: the generic path
    ],
)
def test_mixed_step_matches_reference(gqa, kv_heads, head_dim, block_size, dtype):
    q, kc, vc, bt, sl, qsl, _ = make_batch(MIXED, gqa * kv_heads, kv_heads, head_dim, block_size, dtype)
    scale = 1.0 / math.sqrt(head_dim)
    out = paged_attention(q, kc, vc, bt, sl, qsl, scale)
    assert out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(out.float(), reference(q, kc, vc, bt, sl, qsl, scale), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize(
    "specs",
    [
        [(3000, 1)],  # one long decode: split over the kv range
        [(2100, 1), (700, 1)],  # two decodes of different lengths
        [(520, 16), (5, 1)],  # a prompt tile straddling a split boundary (some rows see nothing in a split)
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_long_context_split_path(specs, dtype):
    threads = _C.num_threads()
    _C.set_num_threads(2)  # splits need > 1 thread
    try:
        q, kc, vc, bt, sl, qsl, _ = make_batch(specs, 9, 3, 64, 16, dtype, seed=1)
        out = paged_attention(q, kc, vc, bt, sl, qsl, 0.125, max_seq_len=int(sl.max()))
    finally:
        _C.set_num_threads(threads)
    ref = reference(q, kc, vc, bt, sl, qsl, 0.125)
    torch.testing.assert_close(out.float(), ref, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("window,softcap", [(1, 0.0), (7, 0.0), (64, 0.0), (200, 0.0), (0, 5.0), (33, 2.0)])
@pytest.mark.parametrize("dtype,cache_dtype", [(torch.float32, None), (torch.bfloat16, None),
                                               (torch.bfloat16, torch.int8)])
def test_sliding_window_and_softcap(window, softcap, dtype, cache_dtype):
    """Mistral/Gemma sliding windows (shorter, equal to and longer than the sequences) and Gemma 2's
    score soft-cap, over the mixed step and a long split decode."""
    threads = _C.num_threads()
    _C.set_num_threads(2)  # splits need > 1 thread
    try:
        for specs in (MIXED, [(3000, 1)]):
            q, kc, vc, bt, sl, qsl, scales = make_batch(specs, 6, 2, 64, 16, dtype, cache_dtype=cache_dtype, seed=3)
            ks, vs = scales or (None, None)
            q = q * 3  # large scores, so the cap changes them
            out = paged_attention(q, kc, vc, bt, sl, qsl, 0.125, k_scales=ks, v_scales=vs, window=window,
                                  softcap=softcap)
            ref = reference(q, kc, vc, bt, sl, qsl, 0.125, ks, vs, window=window, softcap=softcap)
            torch.testing.assert_close(out.float(), ref, atol=TOL[dtype], rtol=TOL[dtype])
    finally:
        _C.set_num_threads(threads)


@pytest.mark.parametrize("block_size", [8, 16, 32, 128])
@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.int8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_cache_matches_dequantized_reference(cache_dtype, dtype, block_size, decode_path):
    """fp32 and bf16 q over int8/fp8 caches on every decode path (the AVX2 one takes fp32 q too). Its
    int8 kernel rounds q and the weights to 15-bit codes for vpmaddwd: errors ~1e-4, a hundredth of the
    int8 cache's own rounding, so fp32 q is held to 2e-4 there."""
    specs = [(1, 1), (200, 20), (1000, 1), (64, 3)]
    q, kc, vc, bt, sl, qsl, (ks, vs) = make_batch(specs, 6, 2, 64, block_size, dtype, cache_dtype=cache_dtype,
                                                  seed=2)
    out = paged_attention(q, kc, vc, bt, sl, qsl, 0.125, k_scales=ks, v_scales=vs)
    ref = reference(q, kc, vc, bt, sl, qsl, 0.125, ks, vs)
    tol = TOL[dtype]
    if decode_path == "avx2" and cache_dtype == torch.int8 and dtype == torch.float32:
        tol = 2e-4
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("block_size", [4, 16])  # 16 with bf16 q: the bf16 path's own conversions
@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.int8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_quantized_code_decodes_exactly(cache_dtype, dtype, block_size, decode_path):
    """With one cached token the output is that token's V row: every code (x 0.5) must come back exactly,
    subnormal fp8 codes (which the AVX-512 paths widen on a branch of their own) among them."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    if cache_dtype == torch.float8_e4m3fn:
        codes[(codes & 0x7F) == 0x7F] = 0  # NaN codes are never written
    v_rows = codes.view(cache_dtype).view(2, 1, 1, 128)
    pad = torch.zeros(2, 1, block_size - 1, 128).to(cache_dtype)
    v_logical = torch.cat([v_rows, pad], dim=2)  # the token at offset 0
    k_cache, v_cache = to_cache_layout(torch.zeros_like(v_logical), v_logical, "cpu")
    scales = torch.full((2, 1, block_size), 0.5)
    bt = torch.tensor([[0], [1]], dtype=torch.int32)
    ones = torch.ones(2, dtype=torch.int32)
    q = torch.randn(2, 2, 128).to(dtype)
    out = paged_attention(q, k_cache, v_cache, bt, ones, torch.tensor([0, 1, 2], dtype=torch.int32), 0.1,
                          k_scales=scales, v_scales=scales)
    want = (v_rows.float() * 0.5).view(2, 1, 128).expand(2, 2, 128)
    assert torch.equal(out.float(), want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_strided_q_and_out_buffer(dtype):
    q, kc, vc, bt, sl, qsl, _ = make_batch([(40, 7), (9, 1)], 4, 2, 64, 8, dtype, seed=3)
    qkv = torch.cat([q.reshape(8, -1), torch.randn(8, 2 * 2 * 64).to(dtype)], dim=1)  # a fused QKV output
    q_view = qkv[:, : 4 * 64].view(8, 4, 64)
    out = torch.full_like(q, float("nan"))
    assert paged_attention(q_view, kc, vc, bt, sl, qsl, 0.3, out=out) is out
    ref = reference(q, kc, vc, bt, sl, qsl, 0.3)
    torch.testing.assert_close(out.float(), ref, atol=TOL[dtype], rtol=TOL[dtype])


def good_args():
    q, kc, vc, bt, sl, qsl, _ = make_batch([(20, 4), (7, 1)], 4, 2, 64, 16, torch.float32)
    return dict(q=q, k_cache=kc, v_cache=vc, block_tables=bt, seq_lens=sl, query_start_loc=qsl, scale=0.125)


def _with(**changes):
    args = good_args()
    args.update({k: (v(args) if callable(v) else v) for k, v in changes.items()})
    return args


def int8_caches(args):
    """The good arguments' caches as int8 caches in the int8 layout (no scales)."""
    return to_cache_layout(*(x.to(torch.int8) for x in from_cache_layout(args["k_cache"], args["v_cache"])), "cpu")


@pytest.mark.parametrize(
    "changes,exc,match",
    [
        (dict(q=lambda a: a["q"].double()), TypeError, "q has dtype float64"),
        (dict(q=lambda a: a["q"][:, :, :32].contiguous()), ValueError, "k_cache has head_dim 64; expected 32"),
        (dict(q=lambda a: a["q"][:, :, :32]), ValueError, "q must have contiguous"),
        (dict(q=lambda a: a["q"].transpose(0, 1).contiguous().transpose(0, 1)), ValueError, "q must have contiguous"),
        (dict(q=lambda a: a["q"][:, :3]), ValueError, "not a multiple"),
        (dict(k_cache=lambda a: a["k_cache"].bfloat16()), TypeError, "k_cache has dtype"),
        (dict(v_cache=lambda a: a["v_cache"][:, :, :4]), ValueError, "v_cache must have shape"),
        (dict(k_cache=lambda a: a["k_cache"].transpose(1, 2)), ValueError, "k_cache must"),
        (dict(k_cache=lambda a: a["k_cache"].flatten(2, 3)), ValueError, "k_cache on cpu must be shaped"),
        (dict(k_cache=lambda a: a["k_cache"].to(torch.int8), v_cache=lambda a: a["v_cache"].to(torch.int8)),
         ValueError, r"k_cache on cpu must be shaped \[num_blocks, kv_heads, head_dim/4, block_size, 4\]"),
        (dict(k_cache=lambda a: int8_caches(a)[0], v_cache=lambda a: int8_caches(a)[1]), ValueError,
         "k_scales is required"),
        (dict(block_tables=lambda a: a["block_tables"].long()), TypeError, "block_tables has dtype"),
        (dict(seq_lens=lambda a: a["seq_lens"][:1]), ValueError, "seq_lens must have shape"),
        (dict(query_start_loc=lambda a: a["query_start_loc"][:2]), ValueError, "query_start_loc must have shape"),
        (dict(seq_lens=torch.tensor([2, 7], dtype=torch.int32)), ValueError, "query length"),
        (dict(seq_lens=torch.tensor([20, 99], dtype=torch.int32)), ValueError, "exceeds"),
        (dict(query_start_loc=torch.tensor([0, 4, 6], dtype=torch.int32)), ValueError, "end at num_tokens"),
        (dict(block_tables=lambda a: a["block_tables"].fill_(-1)), ValueError, "block_tables\\[0, 0\\] = -1"),
        (dict(q=lambda a: a["q"].to("meta")), ValueError, "k_cache is on cpu but the other arguments are on meta"),
        (dict(k_cache=lambda a: a["k_cache"].to("meta")), ValueError, "k_cache is on meta"),
        (dict(scale="0.1"), TypeError, "scale must be a float"),
        (dict(q=[1.0]), TypeError, "q must be a torch.Tensor"),
    ],
)
def test_bad_arguments_raise(changes, exc, match):
    with pytest.raises(exc, match=match):
        paged_attention(**_with(**changes))


def test_bad_out_and_scales():
    args = good_args()
    with pytest.raises(TypeError, match="out has dtype"):
        paged_attention(**args, out=torch.empty(args["q"].shape, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="only for fp8_e4m3fn/int8"):
        paged_attention(**args, k_scales=torch.ones(3), v_scales=torch.ones(3))


@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_slots_past_each_sequence_are_never_read(dtype, block_size):
    """NaN in every cache slot no sequence owns (partial last blocks, spare blocks) must not leak."""
    specs = [(1, 1), (37, 5), (130, 1), (61, 61)]
    q, kc, vc, bt, sl, qsl, _ = make_batch(specs, 6, 2, 64, block_size, dtype, seed=5)
    kc, vc = poison_unowned_slots(kc, vc, bt, specs, block_size)
    out = paged_attention(q, kc, vc, bt, sl, qsl, 0.125)
    ref = reference(q, kc.nan_to_num(), vc.nan_to_num(), bt, sl, qsl, 0.125)
    torch.testing.assert_close(out.float(), ref, atol=TOL[dtype], rtol=TOL[dtype])



@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("cache", ["int8", "fp8"])
def test_quantized_slots_past_each_sequence_are_never_read(cache, block_size):
    """The same over quantized caches, bf16 q: NaN scales and NaN (fp8) or extreme codes in every slot no
    sequence owns, the slots after a partial last block among them, must not leak."""
    specs = [(1, 1), (37, 1), (130, 1), (61, 1), (8, 1), (200, 1)]
    cache_dtype = CACHE_DTYPES[cache]
    q, kc, vc, bt, sl, qsl, (ks, vs) = make_batch(specs, 6, 2, 64, block_size, torch.bfloat16,
                                                  cache_dtype=cache_dtype, seed=6)
    k, v = from_cache_layout(kc, vc)
    owned = owned_slots(bt, specs, k.shape[0], block_size)
    for x in (k, v):  # 0x7f: NaN in fp8, the largest code in int8
        x.view(torch.uint8)[~owned[:, None, :, None].expand_as(x)] = 0x7F
    ref = reference(q, *to_cache_layout(k, v, "cpu"), bt, sl, qsl, 0.125, ks, vs)  # reads owned slots only
    for x in (ks, vs):
        x[~owned[:, None, :].expand_as(x)] = float("nan")
    kc, vc = to_cache_layout(k, v, "cpu")
    out = paged_attention(q, kc, vc, bt, sl, qsl, 0.125, k_scales=ks, v_scales=vs)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)

# Decode steps (one query token per sequence) of ragged lengths: shorter than a block, exactly one,
# partial last blocks, a 64-token chunk and one past it, and long ones (split over the threads).
DECODE = [(1, 1), (7, 1), (16, 1), (33, 1), (64, 1), (65, 1), (250, 1), (1000, 1), (2100, 1)]
CACHE_DTYPES = {"bf16": None, "int8": torch.int8, "fp8": torch.float8_e4m3fn, "fp32": None}


def check_decode(specs, num_heads, kv_heads, head_dim, block_size, cache, threads, seed):
    """One decode step over `specs` on `threads` kernel threads, against the dequantized reference: bf16
    q, or for the fp32 cache fp32 q (an fp32 model's decode)."""
    dtype = torch.float32 if cache == "fp32" else torch.bfloat16
    saved = _C.num_threads()
    _C.set_num_threads(threads)
    try:
        q, kc, vc, bt, sl, qsl, scales = make_batch(specs, num_heads, kv_heads, head_dim, block_size, dtype,
                                                    cache_dtype=CACHE_DTYPES[cache], seed=seed)
        ks, vs = scales or (None, None)
        out = paged_attention(q, kc, vc, bt, sl, qsl, head_dim**-0.5, k_scales=ks, v_scales=vs)
    finally:
        _C.set_num_threads(saved)
    ref = reference(q, kc, vc, bt, sl, qsl, head_dim**-0.5, ks, vs)
    tol = 1e-4 if cache == "fp32" else 2e-2
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)


@pytest.fixture(params=["avx512_fp16", "avx512_bf16", "avx2", "fp32"])
def decode_path(request):
    """Each decode kernel path this build has for bf16 q (set_decode_attention_path caps the choice):
    CPUs without AVX512-FP16 compute fp8 caches in bf16, those without AVX512-BF16 run the AVX2 one,
    and every build has the fp32 path."""
    _C.set_decode_attention_path(request.param)
    try:
        if _C.decode_attention_path() != request.param:
            pytest.skip(f"no {request.param} decode path here (the best is {_C.decode_attention_path()})")
        yield request.param
    finally:
        _C.set_decode_attention_path("avx512_fp16")


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("gqa,head_dim,block_size",
                         [(3, 64, 16), (4, 128, 16), (3, 128, 8), (4, 64, 32), (3, 64, 64), (4, 128, 128)])
@pytest.mark.parametrize("cache", list(CACHE_DTYPES))
def test_decode_matches_reference(cache, gqa, head_dim, block_size, threads, decode_path):
    """Every decode path of bf16 q (AVX-512 dot products, AVX2 FMAs and vpmaddwd, fp32; bf16, int8 and
    fp8 caches; GQA 3:1 and 4:1; head_dim 64 and 128; block sizes 8 to 128; one thread and split over two)
    against the dequantized reference."""
    check_decode(DECODE, 2 * gqa, 2, head_dim, block_size, cache, threads, seed=4)


# Speculative decoding's verification steps: sequences of 1 + k query tokens (k = 1..7 drafts; causal among
# them) beside plain decodes and a 20-token prompt chunk (the prefill kernel's); the short ones take the decode
# kernel (step.cpp: fewer than kPrefillMinQueries queries), over block edges and a long context.
VERIFY = [(2, 2), (17, 3), (16, 4), (40, 6), (33, 8), (1000, 5), (130, 1), (300, 20), (64, 7)]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("cache", list(CACHE_DTYPES))
def test_verification_steps_match_reference(cache, threads, decode_path):
    check_decode(VERIFY, 9, 3, 64, 16, cache, threads, seed=5)


# 2 threads, 4 kv heads: items of 1 head (a long sequence among short ones keeps its heads apart), 2
# heads (3 sequences: 6 items) and 4 heads (5 sequences of similar lengths)
@pytest.mark.parametrize("lens", [(250, 1000, 2100), (1000, 997, 601), (1001, 999, 1000, 700, 1001)])
@pytest.mark.parametrize("cache", list(CACHE_DTYPES))
def test_decode_items_over_several_kv_heads(cache, lens, decode_path):
    """A decode item spans as many adjacent kv heads as leave 2 items per thread, none over half a
    thread's share of the work; each head's rows still meet only that head's K/V (4 kv heads, lengths
    ending mid-block, block size 16)."""
    check_decode([(n, 1) for n in lens], 12, 4, 64, 16, cache, threads=2, seed=9)


@pytest.mark.parametrize("specs", [[(3000, 1)], [(2100, 1), (700, 1)], [(1000, 1), (65, 1)]])
@pytest.mark.parametrize("cache", list(CACHE_DTYPES))
def test_decode_split_over_the_kv_range(cache, specs, decode_path):
    """One or two sequences x 3 kv heads cannot feed 2 threads: the kv range is split, each part one
    item over all 3 kv heads, the parts merged after. Ragged lengths end parts and chunks mid-block."""
    check_decode(specs, 9, 3, 64, 16, cache, threads=2, seed=11)


@pytest.mark.parametrize("head_dim,block_size", [(64, 16), (128, 8)])
def test_int8_decode_error_with_sharp_scores(head_dim, block_size, decode_path):
    """The int8 path rounds q to 15-bit codes (two int8 halves) and the weights to u8 per row and
    chunk. With sharp scores (q x 3) its error against the dequantized reference: rms under 3.5e-3
    (measured 2.5e-3; the bf16 path on a bf16 cache 1e-3) and at most 0.025 beyond bf16 output
    rounding (measured 0.014-0.019). q as a single int8 code fails both (rms 5e-3-7e-3, 0.03-0.06);
    it also cost the default model 0.5% of top-1 agreement (native/cpu/attention/paged.cpp)."""
    q, kc, vc, bt, sl, qsl, (ks, vs) = make_batch(DECODE, 6, 2, head_dim, block_size, torch.bfloat16,
                                                  cache_dtype=torch.int8, seed=5)
    q = q * 3
    out = paged_attention(q, kc, vc, bt, sl, qsl, head_dim**-0.5, k_scales=ks, v_scales=vs)
    ref = reference(q, kc, vc, bt, sl, qsl, head_dim**-0.5, ks, vs)
    err = (out.float() - ref).abs() - ref.abs() * 2**-8  # beyond half a bf16 ulp of the output
    rms = (out.float() - ref).pow(2).mean().sqrt().item()
    print(f"int8 decode: rms error {rms:.2e}, max error beyond bf16 rounding {err.max().item():.5f}")
    assert rms < 3.5e-3 and err.max().item() < 0.025


@pytest.mark.parametrize("cache", list(CACHE_DTYPES))
def test_decode_scores_rising_through_the_context(cache, decode_path):
    """Scores that climb by ~5.5 log2 units per 64-token chunk (~170 over the context) and jump by ~40
    once: the decode kernel keeps its running max still until a score passes it by more than its
    slack, so this checks that the max does move (a stuck max overflows exp2 into inf/NaN) and that
    the weights computed against a max a few units low come out right."""
    L, D, gqa = 2000, 64, 3
    dtype = torch.float32 if cache == "fp32" else torch.bfloat16
    q, kc, vc, bt, sl, qsl, scales = make_batch([(L, 1)], gqa, 1, D, 16, dtype, seed=6)
    k, v = from_cache_layout(kc, vc)
    pos = torch.zeros(k.shape[0], 16)
    nblocks = (L + 15) // 16
    pos[bt[0, :nblocks].long()] = torch.arange(nblocks * 16, dtype=torch.float32).view(nblocks, 16)
    ramp = pos * 0.06 + (pos >= 1500) * 28.0  # natural-log units: 0.06 / token, +28 at position 1500
    unit = q[0, 0].float() / q[0, 0].float().norm() ** 2 / D**-0.5  # k = ramp * unit: score = ramp for head 0
    k = (k.float() * 0.05 + ramp[:, None, :, None] * unit).to(dtype)
    ks = vs = None
    if CACHE_DTYPES[cache] is not None:
        qmax = 448.0 if cache == "fp8" else 127.0
        codes = []
        for c in (k, v):
            s = c.float().abs().amax(-1).clamp_min(1e-6) / qmax
            x = c.float() / s[..., None]
            codes.append(x.to(torch.float8_e4m3fn) if cache == "fp8" else x.round().to(torch.int8))
            ks, vs = (s, None) if ks is None else (ks, s)
        k, v = codes
    kc, vc = to_cache_layout(k, v, "cpu")
    saved = _C.num_threads()
    _C.set_num_threads(1)  # one item over the whole context (a split would restart the max per part)
    try:
        out = paged_attention(q, kc, vc, bt, sl, qsl, D**-0.5, k_scales=ks, v_scales=vs)
    finally:
        _C.set_num_threads(saved)
    ref = reference(q, kc, vc, bt, sl, qsl, D**-0.5, ks, vs)
    assert torch.isfinite(out.float()).all()
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("q_gain,v_gain", [(1e-7, 1.0), (1e4, 1.0), (1e12, 1.0), (1.0, 1e-6), (1.0, 1e4), (1.0, 1e6),
                                           (1e-7, 1e-6)])
def test_fp8_decode_at_extreme_magnitudes(q_gain, v_gain, decode_path):
    """q and V scales far from 1: the fp16 path (AVX512-FP16) scales q and the weights by powers of
    two into fp16's range, so its short fp16 sums neither overflow (q x 1e4 is past 65504 with its
    first products) nor sink into subnormals (q x 1e-7, V scales x 1e-6). The AVX2 path multiplies q
    by 2^64 and the weights by 2^104 (its codes are their values times 2^-120): no overflow for q x 1e12
    nor for V scales x 1e6."""
    q, kc, vc, bt, sl, qsl, (ks, vs) = make_batch(DECODE, 6, 2, 64, 16, torch.bfloat16,
                                                  cache_dtype=torch.float8_e4m3fn, seed=7)
    q = (q.float() * q_gain).to(torch.bfloat16)
    vs = vs * v_gain
    scale = 64**-0.5 / q_gain  # the same scores as at gain 1, but q's products far from 1
    out = paged_attention(q, kc, vc, bt, sl, qsl, scale, k_scales=ks, v_scales=vs)
    ref = reference(q, kc, vc, bt, sl, qsl, scale, ks, vs)
    assert torch.isfinite(out.float()).all()
    torch.testing.assert_close(out.float() / v_gain, ref / v_gain, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("threads", [1, 2])
def test_read_probes_sum_what_they_read(threads):
    """bench_attention's baselines: read_bandwidth reads the whole buffer, read_tiles the listed tiles
    (repeats and order as given); each returns the sum of the 64-bit words it read."""
    words = torch.randint(0, 1 << 20, (64 * 40,), generator=torch.Generator().manual_seed(0), dtype=torch.int64)
    tiles = torch.tensor([7, 0, 39, 7, 12], dtype=torch.int64)  # tiles of 512 bytes: 64 words
    before = _C.num_threads()
    _C.set_num_threads(threads)
    try:
        assert _C.read_bandwidth(words.data_ptr(), words.numel() * 8) == int(words.sum())
        expected = int(words.view(40, 64)[tiles].sum())
        assert _C.read_tiles(words.data_ptr(), 512, tiles.data_ptr(), tiles.numel()) == expected
        assert _C.read_tiles(words.data_ptr(), 512, tiles.data_ptr(), 2) == int(words.view(40, 64)[tiles[:2]].sum())
        with pytest.raises(ValueError, match="multiple of 64"):
            _C.read_tiles(words.data_ptr(), 100, tiles.data_ptr(), 1)
    finally:
        _C.set_num_threads(before)
