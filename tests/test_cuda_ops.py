"""The CUDA kernels on cuda tensors against plain torch references (needs a GPU: `-m cuda`).

Same cases as the CPU tests (tests/test_layer_ops.py, ...), fewer of them; inputs are made on
the CPU with a seeded generator, the references run on the CPU in fp32, results are compared on
the CPU.
"""
from __future__ import annotations

import pytest
import torch

from pyengine.ops.layers import add_rms_norm, hadamard_heads, rms_norm, rotary_embedding, silu_and_mul
# the same torch references as the CPU tests
from test_cache_ops import assert_kv_quantized, ref_kv_quantize
from test_layer_ops import cos_sin_cache, ref_hadamard, ref_rms_norm, ref_rope

pytestmark = pytest.mark.cuda

DEV = torch.device("cuda")
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
       torch.float16: dict(atol=2e-3, rtol=2e-3)}
DTYPES = list(TOL)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---- layers -------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,dim", [(1, 64), (7, 576), (300, 100), (3, 4096)])
def test_rms_norm(dtype, rows, dim):
    g = gen(rows * 1000 + dim)
    x = (torch.randn(rows, dim, generator=g) * 3).to(dtype)
    w = torch.rand(dim, generator=g).to(dtype) + 0.5
    got = rms_norm(x.to(DEV), w.to(DEV), 1e-6).cpu()
    torch.testing.assert_close(got, ref_rms_norm(x, w, 1e-6), **TOL[dtype])


def test_rms_norm_out_in_place_and_fp32_weight():
    x = torch.randn(4, 3, 64, generator=gen(1)).to(torch.bfloat16)
    w = torch.rand(64, generator=gen(2)) + 0.5
    xd, wd = x.to(DEV), w.to(DEV)
    out = torch.empty_like(xd)
    assert rms_norm(xd, wd, 1e-5, out=out) is out
    torch.testing.assert_close(out.cpu(), ref_rms_norm(x, w, 1e-5), **TOL[torch.bfloat16])
    y = xd.clone()
    rms_norm(y, wd, 1e-5, out=y)
    torch.testing.assert_close(y, out, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,dim", [(1, 64), (300, 576), (7, 33)])
def test_add_rms_norm(dtype, rows, dim):
    g = gen(rows + dim)
    x = torch.randn(rows, dim, generator=g).to(dtype)
    res = torch.randn(rows, dim, generator=g).to(dtype)
    w = torch.rand(dim, generator=g).to(dtype) + 0.5
    want_res = (x.float() + res.float()).to(dtype)
    want_x = ref_rms_norm(want_res, w, 1e-6)
    xd, rd = x.to(DEV), res.to(DEV)
    add_rms_norm(xd, rd, w.to(DEV), 1e-6)
    torch.testing.assert_close(rd.cpu(), want_res, atol=0, rtol=0)
    torch.testing.assert_close(xd.cpu(), want_x, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("weight_dtype", ["act", torch.float32])
def test_norms_of_an_fp32_residual_stream(dtype, weight_dtype):
    rows, dim = 300, 576
    g = gen(rows)
    x = (torch.randn(rows, dim, generator=g) * 3).to(dtype)
    res = torch.randn(rows, dim, generator=g) * 20
    w = (torch.rand(dim, generator=g) + 0.5).to(dtype if weight_dtype == "act" else weight_dtype)
    xd, rd, wd = x.to(DEV), res.to(DEV), w.to(DEV)
    normed = rms_norm(rd, wd, 1e-6, dtype=dtype)
    assert normed.dtype == dtype
    torch.testing.assert_close(normed.cpu(), ref_rms_norm(res, w, 1e-6, dtype), **TOL[dtype])
    want_res = x.float() + res
    add_rms_norm(xd, rd, wd, 1e-6)
    torch.testing.assert_close(rd.cpu(), want_res, atol=0, rtol=0)
    torch.testing.assert_close(xd.cpu(), ref_rms_norm(want_res, w, 1e-6, dtype), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128, 96])
@pytest.mark.parametrize("tokens", [1, 200])
def test_rotary_embedding(dtype, head_dim, tokens):
    heads, kv_heads, max_pos = 9, 3, 10000
    g = gen(head_dim + tokens)
    cache = cos_sin_cache(max_pos, head_dim)
    positions = torch.randint(0, max_pos, (tokens,), generator=g)
    q = torch.randn(tokens, heads, head_dim, generator=g).to(dtype)
    k = torch.randn(tokens, kv_heads * head_dim, generator=g).to(dtype)
    want_q = ref_rope(positions, q, cache, head_dim)
    want_k = ref_rope(positions, k.view(tokens, kv_heads, head_dim), cache, head_dim).view(tokens, -1)
    qd, kd = q.to(DEV), k.to(DEV)
    rotary_embedding(positions.to(DEV), qd, kd, cache.to(DEV), head_dim)
    torch.testing.assert_close(qd.cpu(), want_q, **TOL[dtype])
    torch.testing.assert_close(kd.cpu(), want_k, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128, 96])
def test_hadamard_heads_on_fused_qkv_slices(dtype, head_dim):
    heads, kv_heads, tokens = 9, 3, 200
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen(head_dim)).to(dtype)
    sizes = [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]
    q, k, v = qkv.split(sizes, dim=-1)
    qd, kd, vd = qkv.to(DEV).split(sizes, dim=-1)
    hadamard_heads(qd, head_dim)
    hadamard_heads(kd.view(tokens, kv_heads, head_dim), head_dim)
    torch.testing.assert_close(qd.cpu(), ref_hadamard(q, head_dim), **TOL[dtype])
    torch.testing.assert_close(kd.cpu(), ref_hadamard(k, head_dim), **TOL[dtype])
    torch.testing.assert_close(vd.cpu(), v, atol=0, rtol=0)


def test_rotary_embedding_fused_qkv_slices():
    """q/k are column views of one [T, (H + 2KVH) * D] qkv tensor; v must stay untouched."""
    heads, kv_heads, head_dim, tokens, max_pos = 4, 2, 64, 5, 131072
    cache = cos_sin_cache(max_pos, head_dim, base=500000.0)
    positions = torch.tensor([0, 1, 65535, 131070, 131071])
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen(3))
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    want_q = ref_rope(positions, q.reshape(tokens, heads, head_dim), cache, head_dim).reshape(tokens, -1)
    want_k = ref_rope(positions, k.reshape(tokens, kv_heads, head_dim), cache, head_dim).reshape(tokens, -1)
    qkv_d = qkv.to(DEV)
    qd, kd, vd = qkv_d.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    rotary_embedding(positions.to(DEV), qd, kd, cache.to(DEV), head_dim)
    torch.testing.assert_close(qd.cpu(), want_q, **TOL[torch.float32])
    torch.testing.assert_close(kd.cpu(), want_k, **TOL[torch.float32])
    torch.testing.assert_close(vd.cpu(), v, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,inter", [(1, 1536), (3, 7), (64, 1536), (2, 5000)])
def test_silu_and_mul(dtype, rows, inter):
    x = (torch.randn(rows, 2 * inter, generator=gen(inter)) * 4).to(dtype)
    xf = x.float()
    want = (torch.nn.functional.silu(xf[:, :inter]) * xf[:, inter:]).to(dtype)
    torch.testing.assert_close(silu_and_mul(x.to(DEV)).cpu(), want, **TOL[dtype])


def test_layers_run_on_the_current_stream():
    """Work queued on a side stream is ordered by that stream (the wrapper passes it)."""
    x = torch.randn(64, 512, generator=gen(4))
    w = torch.rand(512, generator=gen(5)) + 0.5
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        xd = x.to(DEV, non_blocking=False)
        got = rms_norm(xd, w.to(DEV), 1e-6)
    s.synchronize()
    torch.testing.assert_close(got.cpu(), ref_rms_norm(x, w, 1e-6), **TOL[torch.float32])


# ---- paged KV cache -----------------------------------------------------------------------------

def dequant(cache: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
    return cache.float() if scales is None else cache.float() * scales[..., None]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cache_kind", ["same", torch.float8_e4m3fn, torch.int8])
def test_reshape_and_cache(dtype, cache_kind):
    from pyengine.ops.cache import reshape_and_cache

    T, kvh, D, nb, bs = 37, 3, 64, 10, 16
    g = gen(11)
    key = (torch.randn(T, kvh, D, generator=g) * 2).to(dtype)
    value = torch.randn(T, kvh, D, generator=g).to(dtype)
    key[5] = 0  # an all-zero row: scale 0, codes 0
    slots = torch.randperm(nb * bs, generator=g)[:T]
    slots[3] = -1
    cache_dtype = dtype if cache_kind == "same" else cache_kind
    kc = torch.zeros(nb, kvh, bs, D, dtype=cache_dtype, device=DEV)
    vc = torch.zeros_like(kc)
    quant = cache_kind != "same"
    ks = torch.full((nb, kvh, bs), -1.0, device=DEV) if quant else None
    vs = torch.full((nb, kvh, bs), -1.0, device=DEV) if quant else None
    reshape_and_cache(key.to(DEV), value.to(DEV), kc, vc, slots.to(DEV), k_scales=ks, v_scales=vs)
    kc, vc = kc.cpu(), vc.cpu()
    for t in range(T):
        s = int(slots[t])
        if s < 0:
            continue
        blk, off = divmod(s, bs)
        for src, cache, sc in ((key, kc, ks), (value, vc, vs)):
            if quant:
                assert_kv_quantized(src[t], cache[blk, :, off], sc.cpu()[blk, :, off], cache_kind)
            else:
                assert torch.equal(cache[blk, :, off], src[t])
    untouched = torch.ones(nb * bs, dtype=torch.bool)
    untouched[slots[slots >= 0]] = False
    assert torch.all(kc.view(nb, kvh, bs, D).permute(0, 2, 1, 3).reshape(nb * bs, -1)[untouched].float() == 0)


def ref_paged_attention(q, kc, vc, ks, vs, block_tables, seq_lens, qsl, scale):
    """Plain per-sequence causal attention over the gathered (dequantized) cache, fp32."""
    T, H, D = q.shape
    kvh, bs = kc.shape[1], kc.shape[2]
    out = torch.empty(T, H, D)
    kf, vf = dequant(kc, ks), dequant(vc, vs)
    for s in range(len(seq_lens)):
        L, q0, q1 = int(seq_lens[s]), int(qsl[s]), int(qsl[s + 1])
        if q1 == q0:
            continue
        nblk = (L + bs - 1) // bs
        blocks = block_tables[s, :nblk].long()
        bad = ((blocks < 0) | (blocks >= kc.shape[0])).repeat_interleave(bs)[:L]  # masked keys
        blocks = blocks.clamp(0, kc.shape[0] - 1)
        k = kf[blocks].permute(1, 0, 2, 3).reshape(kvh, nblk * bs, D)[:, :L]  # [KVH, L, D]
        v = vf[blocks].permute(1, 0, 2, 3).reshape(kvh, nblk * bs, D)[:, :L]
        k = k.repeat_interleave(H // kvh, 0)
        v = v.repeat_interleave(H // kvh, 0)
        qs = q[q0:q1].float().transpose(0, 1)  # [H, q_len, D]
        scores = qs @ k.transpose(1, 2) * scale  # [H, q_len, L]
        pos = L - (q1 - q0) + torch.arange(q1 - q0)
        mask = (torch.arange(L)[None, :] > pos[:, None]) | bad[None, :]
        scores.masked_fill_(mask[None], float("-inf"))
        out[q0:q1] = (scores.softmax(-1) @ v).transpose(0, 1)
    return out.to(q.dtype)


def make_step(seq_lens, q_lens, H, kvh, D, bs, dtype, cache_kind, seed):
    """A random cache holding every sequence's tokens, and the step's q and metadata."""
    g = gen(seed)
    S = len(seq_lens)
    max_blocks = max((L + bs - 1) // bs for L in seq_lens)
    nb = S * max_blocks + 3
    perm = torch.randperm(nb, generator=g)
    block_tables = perm[: S * max_blocks].view(S, max_blocks).to(torch.int32)
    T = sum(q_lens)
    q = torch.randn(T, H, D, generator=g).to(dtype)
    kf = torch.randn(nb, kvh, bs, D, generator=g)
    vf = torch.randn(nb, kvh, bs, D, generator=g)
    if cache_kind == "same":
        kc, vc, ks, vs = kf.to(dtype), vf.to(dtype), None, None
    else:
        (kc, ks), (vc, vs) = ref_kv_quantize(kf, cache_kind), ref_kv_quantize(vf, cache_kind)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return q, kc, vc, ks, vs, block_tables, torch.tensor(seq_lens, dtype=torch.int32), qsl


ATT_TOL = {torch.float32: dict(atol=2e-4, rtol=2e-4), torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
           torch.float16: dict(atol=3e-3, rtol=3e-3)}


@pytest.mark.parametrize("H,kvh", [(4, 4), (9, 3), (16, 2)])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("bs", [8, 16, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_attention_mixed_step(H, kvh, D, bs, dtype):
    from pyengine.ops.attention import paged_attention

    # decodes (q_len 1), a whole prompt, prompt chunks ending mid-block, a long context
    seq_lens, q_lens = [1, 17, 300, 1000, 33, 2047], [1, 17, 40, 1, 5, 1]
    q, kc, vc, ks, vs, bt, sl, qsl = make_step(seq_lens, q_lens, H, kvh, D, bs, dtype, "same", H * D + bs)
    scale = D ** -0.5
    got = paged_attention(q.to(DEV), kc.to(DEV), vc.to(DEV), bt.to(DEV), sl.to(DEV), qsl.to(DEV), scale)
    torch.testing.assert_close(got.cpu(), ref_paged_attention(q, kc, vc, ks, vs, bt, sl, qsl, scale),
                               **ATT_TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("cache_kind", [torch.float8_e4m3fn, torch.int8])
def test_paged_attention_quantized_cache(dtype, cache_kind):
    from pyengine.ops.attention import paged_attention

    seq_lens, q_lens = [5, 129, 3000], [5, 1, 64]
    q, kc, vc, ks, vs, bt, sl, qsl = make_step(seq_lens, q_lens, 9, 3, 64, 16, dtype, cache_kind, 7)
    got = paged_attention(q.to(DEV), kc.to(DEV), vc.to(DEV), bt.to(DEV), sl.to(DEV), qsl.to(DEV), 0.125,
                          k_scales=ks.to(DEV), v_scales=vs.to(DEV))
    torch.testing.assert_close(got.cpu(), ref_paged_attention(q, kc, vc, ks, vs, bt, sl, qsl, 0.125),
                               **ATT_TOL[dtype])


@pytest.mark.parametrize("option", [dict(window=8), dict(softcap=30.0)])
def test_paged_attention_window_and_softcap_refused(option):
    """The CPU kernel's window and soft-cap are not implemented on CUDA: a clear error, not wrong numbers."""
    from pyengine.ops.attention import paged_attention

    q, kc, vc, ks, vs, bt, sl, qsl = make_step([40], [3], 4, 2, 64, 16, torch.float32, "same", 9)
    with pytest.raises(ValueError, match="not implemented on CUDA"):
        paged_attention(q.to(DEV), kc.to(DEV), vc.to(DEV), bt.to(DEV), sl.to(DEV), qsl.to(DEV), 0.1, **option)


def test_paged_attention_strided_q_and_odd_head_dim():
    """q as a column slice of a fused qkv tensor; head_dim 80 (not a multiple of 32)."""
    from pyengine.ops.attention import paged_attention

    H, kvh, D = 6, 2, 80
    seq_lens, q_lens = [40, 7], [3, 7]
    q, kc, vc, ks, vs, bt, sl, qsl = make_step(seq_lens, q_lens, H, kvh, D, 16, torch.float32, "same", 9)
    qkv = torch.randn(q.shape[0], (H + 2 * kvh) * D)
    qkv[:, : H * D] = q.reshape(q.shape[0], -1)
    q_view = qkv.to(DEV)[:, : H * D].view(-1, H, D)
    got = paged_attention(q_view, kc.to(DEV), vc.to(DEV), bt.to(DEV), sl.to(DEV), qsl.to(DEV), 0.1)
    torch.testing.assert_close(got.cpu(), ref_paged_attention(q, kc, vc, ks, vs, bt, sl, qsl, 0.1),
                               **ATT_TOL[torch.float32])


@pytest.mark.parametrize("dtype,cache_kind", [(torch.bfloat16, "same"), (torch.float32, "same"),
                                              (torch.float16, torch.float8_e4m3fn), (torch.bfloat16, torch.int8)])
def test_paged_attention_split_kv_long_context(dtype, cache_kind):
    """Batch-1 decodes up to 40000 keys: the split-KV path (many splits, merged) at any max_seq_len."""
    from pyengine.ops.attention import paged_attention

    H, kvh, D = 8, 2, 128
    for seq_lens, q_lens in (([40000], [1]), ([9000, 1, 0, 777, 2500], [1, 1, 0, 1, 3])):
        q, kc, vc, ks, vs, bt, sl, qsl = make_step(seq_lens, q_lens, H, kvh, D, 16, dtype, cache_kind, len(seq_lens))
        want = ref_paged_attention(q, kc, vc, ks, vs, bt, sl, qsl, D ** -0.5)
        dev = [x.to(DEV) if x is not None else None for x in (q, kc, vc, ks, vs, bt, sl, qsl)]
        for max_seq_len in (None, 40000, 1000):  # an understated bound is slower, never wrong
            got = paged_attention(dev[0], dev[1], dev[2], dev[5], dev[6], dev[7], D ** -0.5, k_scales=dev[3],
                                  v_scales=dev[4], max_seq_len=max_seq_len)
            torch.testing.assert_close(got.cpu(), want, **ATT_TOL[dtype])


@pytest.mark.parametrize("H,kvh,D", [(10, 2, 64), (20, 1, 128), (4, 4, 64), (6, 2, 256), (12, 4, 96)])
def test_paged_attention_many_decodes_odd_gqa(H, kvh, D):
    """48 decode rows of random lengths (short rows leave splits empty); GQA groups 5, 20 (head
    chunks), 1, 3; head_dim 64..256."""
    from pyengine.ops.attention import paged_attention

    g = gen(H * D)
    seq_lens = torch.randint(1, 1200, (48,), generator=g).tolist()
    seq_lens[:3] = [1, 16, 1199]
    q, kc, vc, ks, vs, bt, sl, qsl = make_step(seq_lens, [1] * 48, H, kvh, D, 16, torch.bfloat16, "same", 5)
    got = paged_attention(q.to(DEV), kc.to(DEV), vc.to(DEV), bt.to(DEV), sl.to(DEV), qsl.to(DEV), D ** -0.5,
                          max_seq_len=1200)
    torch.testing.assert_close(got.cpu(), ref_paged_attention(q, kc, vc, ks, vs, bt, sl, qsl, D ** -0.5),
                               **ATT_TOL[torch.bfloat16])


@pytest.mark.parametrize("dtype,D", [(torch.bfloat16, 36), (torch.float32, 160), (torch.float16, 80)])
def test_paged_attention_masked_blocks_and_fallback_head_dims(dtype, D):
    """Out-of-range block ids are masked; head_dim 36 (bf16) and 160 (fp32) take the generic kernel."""
    from pyengine.ops.attention import paged_attention

    seq_lens, q_lens = [300, 1200, 50], [1, 1, 20]
    q, kc, vc, ks, vs, bt, sl, qsl = make_step(seq_lens, q_lens, 8, 4, D, 16, dtype, "same", 17)
    bt[0, 3] = -1
    bt[1, 10] = kc.shape[0]
    bt[1, 40] = 10**6
    got = paged_attention(q.to(DEV), kc.to(DEV), vc.to(DEV), bt.to(DEV), sl.to(DEV), qsl.to(DEV), 0.1)
    torch.testing.assert_close(got.cpu(), ref_paged_attention(q, kc, vc, ks, vs, bt, sl, qsl, 0.1), **ATT_TOL[dtype])


def test_cache_then_attention_matches_cpu():
    """The same step through both devices: reshape_and_cache + paged_attention, int8 cache."""
    from pyengine.ops.attention import kv_cache_shapes, paged_attention
    from pyengine.ops.cache import reshape_and_cache

    T, H, kvh, D, nb, bs = 20, 8, 2, 64, 4, 8
    g = gen(13)
    key, value = torch.randn(T, kvh, D, generator=g), torch.randn(T, kvh, D, generator=g)
    q = torch.randn(T, H, D, generator=g)
    bt = torch.tensor([[2, 0, 3]], dtype=torch.int32)
    slots = torch.tensor([int(bt[0, t // bs]) * bs + t % bs for t in range(T)])
    sl, qsl = torch.tensor([T], dtype=torch.int32), torch.tensor([0, T], dtype=torch.int32)
    outs = []
    for dev in ("cpu", DEV):
        k_shape, v_shape = kv_cache_shapes(nb, kvh, bs, D, dev, torch.int8)  # each device's own layout
        kc = torch.zeros(k_shape, dtype=torch.int8, device=dev)
        vc = torch.zeros(v_shape, dtype=torch.int8, device=dev)
        ks, vs = torch.zeros(nb, kvh, bs, device=dev), torch.zeros(nb, kvh, bs, device=dev)
        reshape_and_cache(key.to(dev), value.to(dev), kc, vc, slots.to(dev), k_scales=ks, v_scales=vs)
        outs.append(paged_attention(q.to(dev), kc, vc, bt.to(dev), sl.to(dev), qsl.to(dev), 0.125,
                                    k_scales=ks, v_scales=vs).cpu())
    torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-5)


# ---- sampling -----------------------------------------------------------------------------------

def sample_args(B, *, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=0, steps=None, device=DEV):
    full = lambda v, dt: torch.full((B,), v, dtype=dt, device=device)  # noqa: E731
    st = torch.arange(B, dtype=torch.int64) if steps is None else steps
    return (full(temperature, torch.float32), full(top_k, torch.int32), full(top_p, torch.float32),
            full(min_p, torch.float32), full(seed, torch.int64), st.to(device))


def test_greedy_exact_argmax_ties_to_lowest_id():
    from pyengine.ops.sampling import sample

    logits = torch.randn(6, 5000, generator=gen(21))
    logits[1, [7, 300, 4999]] = 50.0
    logits[2] = 0.0
    logits[3, 4999] = 1e30
    logits[4] = float("-inf")
    logits[4, 1234] = -1e30
    res = sample(logits.to(DEV), *sample_args(6, temperature=0.0))
    want = [int(logits[0].argmax()), 7, 0, 4999, 1234, int(logits[5].argmax())]
    assert res.token_ids.cpu().tolist() == want


def test_seeded_tokens_do_not_depend_on_the_batch_and_match_cpu():
    from pyengine.ops.sampling import sample

    B, V = 64, 3000
    logits = torch.randn(B, V, generator=gen(22)) * 3
    params = dict(temperature=0.8, top_k=50, top_p=0.9, min_p=0.01, seed=1234)
    full = sample(logits.to(DEV), *sample_args(B, **params)).token_ids.cpu()
    single = torch.stack([sample(logits[b:b + 1].to(DEV),
                                 *sample_args(1, **params, steps=torch.tensor([b]))).token_ids.cpu()[0]
                          for b in range(0, B, 7)])
    assert torch.equal(full[::7], single)
    cpu = sample(logits, *sample_args(B, **params, device="cpu")).token_ids
    assert torch.equal(full, cpu)


@pytest.mark.parametrize("V", [128256, 3001])
@pytest.mark.parametrize("params", [dict(temperature=0.8, top_k=50, top_p=0.9), dict(temperature=1.0, top_p=0.9),
                                    dict(temperature=0.7, min_p=0.05), dict(temperature=1.2, top_k=2000),
                                    dict(temperature=1.0, top_k=1), dict(temperature=0.5)])
def test_seeded_tokens_match_cpu_large_vocab(V, params):
    """Every filter path (top-k above the 1024 threads too) at a real vocab and at an odd (unaligned) one."""
    from pyengine.ops.sampling import sample

    B = 16
    logits = torch.randn(B, V, generator=gen(V)) * 3
    logits[1, :V // 2] = float("-inf")
    logits[2, 100:110] = 20.0  # ties at the top
    args = dict(**params, seed=7, steps=torch.arange(B) * 1000)
    got = sample(logits.to(DEV), *sample_args(B, **args)).token_ids.cpu()
    cpu = sample(logits, *sample_args(B, **args, device="cpu")).token_ids
    assert torch.equal(got, cpu)
    assert bool(torch.isfinite(logits.gather(1, got[:, None].long())).all())


def test_sampling_rows_with_few_finite_logits():
    """Fewer finite logits than top_k: only finite tokens are drawn, as on the CPU."""
    from pyengine.ops.sampling import sample

    B, V = 64, 5000
    logits = torch.full((B, V), float("-inf"))
    logits[:, [3, 4000, 4999]] = torch.randn(B, 3, generator=gen(31))
    args = dict(temperature=1.0, top_k=50, top_p=0.95, seed=3)
    got = sample(logits.to(DEV), *sample_args(B, **args)).token_ids.cpu()
    assert set(got.tolist()) <= {3, 4000, 4999}
    assert torch.equal(got, sample(logits, *sample_args(B, **args, device="cpu")).token_ids)


def reference_probs(logits, temperature, top_k, top_p, min_p):
    """The filtered, renormalized distribution (sampling.cpp's rules) of one row, in float64."""
    x = logits.double()
    keep = torch.ones_like(x, dtype=torch.bool)
    if 0 < top_k < x.numel():
        keep &= x >= torch.topk(x, top_k).values[-1]
    if min_p > 0:
        keep &= x >= x.max() + temperature * torch.log(torch.tensor(min_p, dtype=torch.float64))
    w = torch.where(keep, torch.exp((x - x.max()) / temperature), torch.zeros_like(x))
    if top_p < 1:
        vals = torch.sort(w, descending=True).values
        cut = vals[int(torch.searchsorted(vals.cumsum(0), top_p * w.sum()))]
        w = torch.where(w >= cut, w, torch.zeros_like(w))
    return w / w.sum()


@pytest.mark.parametrize("params", [dict(temperature=1.0), dict(temperature=0.7, top_k=5),
                                    dict(temperature=1.3, top_p=0.8), dict(temperature=1.0, min_p=0.05),
                                    dict(temperature=0.9, top_k=8, top_p=0.9, min_p=0.02)])
def test_sampling_follows_the_filtered_distribution(params):
    """Chi-square over 20000 seeded draws (steps 0..N-1) of one 16-token row; filtered tokens never drawn."""
    from pyengine.ops.sampling import sample

    N, V = 20000, 16
    row = torch.randn(V, generator=gen(23)) * 1.5
    res = sample(row.expand(N, V).contiguous().to(DEV), *sample_args(N, seed=99, **params))
    counts = torch.bincount(res.token_ids.cpu().long(), minlength=V).double()
    p = reference_probs(row, params.get("temperature"), params.get("top_k", 0), params.get("top_p", 1.0),
                        params.get("min_p", 0.0))
    assert torch.all(counts[p == 0] == 0), "a filtered token was sampled"
    expected = p * N
    live = expected > 0
    chi2 = float(((counts[live] - expected[live]) ** 2 / expected[live]).sum())
    dof = int(live.sum()) - 1
    assert chi2 < dof + 6 * (2 * dof) ** 0.5 + 10, (chi2, dof)


def test_logprobs_and_top_logprobs():
    from pyengine.ops.sampling import sample

    B, V, N = 5, 4000, 7
    logits = torch.randn(B, V, generator=gen(24)) * 4
    res = sample(logits.to(DEV), *sample_args(B, temperature=0.0), num_logprobs=N)
    lsm = torch.log_softmax(logits.double(), -1)
    tok = res.token_ids.cpu().long()
    torch.testing.assert_close(res.logprobs.cpu().double(), lsm.gather(1, tok[:, None])[:, 0], atol=1e-4, rtol=0)
    top = torch.topk(logits, N)
    assert torch.equal(res.top_ids.cpu().long(), top.indices)
    torch.testing.assert_close(res.top_logprobs.cpu().double(), lsm.gather(1, top.indices), atol=1e-4, rtol=0)


def test_apply_penalties():
    from pyengine.ops.sampling import apply_penalties

    B, V = 4, 1000
    g = gen(25)
    logits = torch.randn(B, V, generator=g) * 3
    prompts = [torch.randint(0, V, (n,), generator=g) for n in (0, 5, 300, 40)]
    outputs = [torch.randint(0, 50, (n,), generator=g) for n in (3, 0, 200, 17)]  # repeats
    pres = torch.tensor([0.5, 0.0, 1.0, -0.3])
    freq = torch.tensor([0.2, 0.1, 0.05, 0.0])
    rep = torch.tensor([1.3, 1.0, 0.8, 1.0])
    want = logits.clone()
    for b in range(B):
        counts = torch.bincount(outputs[b], minlength=V)
        seen = torch.zeros(V, dtype=torch.bool)
        seen[prompts[b]] = True
        seen[outputs[b]] = True
        row = want[b]
        r = torch.where(row > 0, row / rep[b], row * rep[b]) if rep[b] != 1 else row.clone()
        row[seen] = r[seen]
        out = counts > 0
        row[out] = row[out] - freq[b] * counts[out].float()
        row[out] = row[out] - pres[b]

    def csr(lists):
        offs = torch.tensor([0, *torch.tensor([len(x) for x in lists]).cumsum(0).tolist()], dtype=torch.int32)
        return torch.cat(lists).to(torch.int32).to(DEV), offs.to(DEV)

    got = logits.to(DEV)
    apply_penalties(got, *csr(prompts), *csr(outputs), pres.to(DEV), freq.to(DEV), rep.to(DEV))
    torch.testing.assert_close(got.cpu(), want, atol=1e-6, rtol=1e-6)


def test_bitmask_matches_cpu():
    """The CUDA sampler under a token bitmask: the tokens and masked logits of the CPU sampler."""
    from pyengine.ops.sampling import sample
    from test_sampling_op import random_bitmask

    B, V = 16, 49155
    logits = torch.randn(B, V, generator=gen(41)) * 3
    mask, allowed = random_bitmask(B, V, 0.03, seed=42)
    for params in (dict(temperature=0.0), dict(temperature=1.0, top_k=40, top_p=0.9, seed=3)):
        dev_logits = logits.to(DEV)
        got = sample(dev_logits, *sample_args(B, **params), bitmask=mask.to(DEV)).token_ids.cpu()
        cpu_logits = logits.clone()
        want = sample(cpu_logits, *sample_args(B, **params, device="cpu"), bitmask=mask).token_ids
        assert torch.equal(got, want)
        assert bool(allowed.gather(1, got[:, None].long()).all())
        assert torch.equal(dev_logits.cpu(), cpu_logits)


# ---- tensor-core prefill attention (prefill_attention.cu) ------------------------------------------

def run_tensor_cores(q, kc, vc, ks, vs, bt, sl, qsl, scale, **kw):
    from pyengine.ops.attention import paged_attention

    dev = [x.to(DEV) if x is not None else None for x in (q, kc, vc, ks, vs, bt, sl, qsl)]
    max_query_len = int((qsl[1:] - qsl[:-1]).max())
    return paged_attention(dev[0], dev[1], dev[2], dev[5], dev[6], dev[7], scale, k_scales=dev[3], v_scales=dev[4],
                           tensor_cores=True, max_query_len=max_query_len, **kw).cpu()


@pytest.mark.parametrize("H,kvh", [(9, 3), (8, 8), (16, 2)])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("bs", [8, 16, 32])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_tensor_core_prefill_ragged_step(H, kvh, D, bs, dtype):
    """Whole prompts, chunks after a cached context (ending mid-block), q_len 1 rows, an empty row and
    chunks longer than one 64-row tile, GQA 3:1 among them: against the fp32 reference."""
    seq_lens = [1, 17, 300, 1000, 33, 200, 5, 129]
    q_lens = [1, 17, 40, 130, 5, 200, 0, 64]
    q, kc, vc, ks, vs, bt, sl, qsl = make_step(seq_lens, q_lens, H, kvh, D, bs, dtype, "same", H * D + bs + 1)
    got = run_tensor_cores(q, kc, vc, ks, vs, bt, sl, qsl, D ** -0.5)
    torch.testing.assert_close(got, ref_paged_attention(q, kc, vc, ks, vs, bt, sl, qsl, D ** -0.5), **ATT_TOL[dtype])


@pytest.mark.parametrize("D", [64, 128])
def test_tensor_core_prefill_matches_sdpa(D):
    """Fresh prompts (no cached context) of ragged lengths against torch SDPA (causal, GQA 3:1) per sequence."""
    import torch.nn.functional as F

    H, kvh, bs, dtype = 9, 3, 16, torch.bfloat16
    q_lens = [1, 63, 64, 65, 700, 128]
    q, kc, vc, ks, vs, bt, sl, qsl = make_step(q_lens, q_lens, H, kvh, D, bs, dtype, "same", D)
    got = run_tensor_cores(q, kc, vc, ks, vs, bt, sl, qsl, D ** -0.5)
    for s, L in enumerate(q_lens):
        nblk = (L + bs - 1) // bs
        blocks = bt[s, :nblk].long()
        k = kc[blocks].permute(1, 0, 2, 3).reshape(kvh, nblk * bs, D)[None, :, :L].float()
        v = vc[blocks].permute(1, 0, 2, 3).reshape(kvh, nblk * bs, D)[None, :, :L].float()
        qs = q[int(qsl[s]):int(qsl[s + 1])].transpose(0, 1)[None].float()
        want = F.scaled_dot_product_attention(qs, k, v, is_causal=True, enable_gqa=True, scale=D ** -0.5)
        torch.testing.assert_close(got[int(qsl[s]):int(qsl[s + 1])], want[0].transpose(0, 1).to(dtype),
                                   **ATT_TOL[dtype])


def test_tensor_core_prefill_masked_blocks_and_strided_q():
    """Out-of-range block ids are masked as by paged_attention; q is a column slice of a fused qkv."""
    from pyengine.ops.attention import paged_attention

    H, kvh, D = 6, 2, 128
    seq_lens, q_lens = [300, 200, 90], [100, 200, 3]
    q, kc, vc, ks, vs, bt, sl, qsl = make_step(seq_lens, q_lens, H, kvh, D, 16, torch.bfloat16, "same", 19)
    bt[0, 2] = -1
    bt[1, 5] = kc.shape[0]
    want = ref_paged_attention(q, kc, vc, ks, vs, bt, sl, qsl, 0.1)
    qkv = torch.randn(q.shape[0], (H + 2 * kvh) * D).to(torch.bfloat16)
    qkv[:, : H * D] = q.reshape(q.shape[0], -1)
    q_view = qkv.to(DEV)[:, : H * D].view(-1, H, D)
    got = paged_attention(q_view, kc.to(DEV), vc.to(DEV), bt.to(DEV), sl.to(DEV), qsl.to(DEV), 0.1,
                          tensor_cores=True, max_query_len=200)
    torch.testing.assert_close(got.cpu(), want, **ATT_TOL[torch.bfloat16])


@pytest.mark.parametrize("dtype,D,cache_kind", [(torch.float32, 64, "same"), (torch.bfloat16, 80, "same"),
                                                (torch.bfloat16, 64, torch.int8), (torch.float16, 128, torch.float8_e4m3fn)])
def test_tensor_core_prefill_falls_back_where_it_does_not_apply(dtype, D, cache_kind):
    """fp32, head_dim 80 and quantized caches run the split-KV kernel: the same bits as without the flag."""
    from pyengine.ops.attention import paged_attention

    seq_lens, q_lens = [70, 300], [70, 20]
    q, kc, vc, ks, vs, bt, sl, qsl = make_step(seq_lens, q_lens, 4, 2, D, 16, dtype, cache_kind, 23)
    got = run_tensor_cores(q, kc, vc, ks, vs, bt, sl, qsl, 0.1)
    dev = [x.to(DEV) if x is not None else None for x in (q, kc, vc, ks, vs, bt, sl, qsl)]
    plain = paged_attention(dev[0], dev[1], dev[2], dev[5], dev[6], dev[7], 0.1, k_scales=dev[3],
                            v_scales=dev[4]).cpu()
    assert torch.equal(got, plain)
