"""reshape_and_cache (plain and quantized) and the fp8/int8 codecs, against torch."""
from __future__ import annotations

import pytest
import torch

from pyengine.ops.attention import from_cache_layout, kv_cache_shapes, paged_attention
from pyengine.ops.cache import reshape_and_cache

QMAX = {torch.float8_e4m3fn: 448.0, torch.int8: 127.0}
FP8_SCALE_STEPS = torch.arange(16, 32) / 16  # kv_quant.h: e4m3 rows try absmax / 448 times each


def ref_kv_quantize(x: torch.Tensor, cache_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (codes [..., D] in cache_dtype, scales [...] fp32) by kv_quant.h's convention, in plain
    torch: int8 scale = absmax / 127; e4m3 the first of the candidates absmax / 448 * (16 + j) / 16 whose
    codes give the least squared error (summed in fp64 here); codes = x / scale rounded to nearest even."""
    xf = x.float()
    amax = xf.abs().amax(-1)
    if cache_dtype == torch.int8:
        scale = amax / QMAX[cache_dtype]
    else:
        scale, least = None, None
        for step in FP8_SCALE_STEPS:
            cand = amax / QMAX[cache_dtype] * step
            y = torch.where(cand[..., None] > 0, xf / cand[..., None], torch.zeros(()))
            err = ((y.to(cache_dtype).float() * cand[..., None] - xf).double() ** 2).sum(-1)
            better = err < least if least is not None else torch.ones_like(err, dtype=torch.bool)
            scale = torch.where(better, cand, scale) if scale is not None else cand
            least = torch.where(better, err, least) if least is not None else err
    y = torch.where(scale[..., None] > 0, xf / scale[..., None], torch.zeros_like(xf))
    if cache_dtype == torch.int8:
        return y.round().clamp(-127, 127).to(torch.int8), scale
    return y.clamp(-448, 448).to(cache_dtype), scale


def assert_kv_quantized(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, cache_dtype: torch.dtype) -> None:
    """Stored codes [..., D] and scales [...] of rows x follow kv_quant.h: int8 exactly ref_kv_quantize's;
    e4m3 a candidate scale whose squared error is within 1e-3 of the least (the AVX-512 search estimates
    errors; near-ties may go either way), and codes = torch's rounding of x / scale."""
    x = x.float()
    want_codes, want_scale = ref_kv_quantize(x, cache_dtype)
    if cache_dtype == torch.int8:
        assert torch.equal(scale, want_scale) and torch.equal(codes.view(torch.int8), want_codes.view(torch.int8))
        return
    cands = (x.abs().amax(-1) / QMAX[cache_dtype])[..., None] * FP8_SCALE_STEPS
    assert (cands == scale[..., None]).any(-1).all()
    y = torch.where(scale[..., None] > 0, x / scale[..., None], torch.zeros_like(x))
    assert torch.equal(codes.view(torch.int8), y.clamp(-448, 448).to(cache_dtype).view(torch.int8))
    err = ((codes.float() * scale[..., None] - x).double() ** 2).sum(-1)
    least = ((want_codes.float() * want_scale[..., None] - x).double() ** 2).sum(-1)
    assert (err <= least * (1 + 1e-3) + 1e-30).all()


def make_cache(num_blocks, kv_heads, block_size, head_dim, dtype, quant=False):
    k_shape, v_shape = kv_cache_shapes(num_blocks, kv_heads, block_size, head_dim, "cpu", dtype)
    k, v = torch.zeros(k_shape, dtype=dtype), torch.zeros(v_shape, dtype=dtype)
    if not quant:
        return k, v, None, None
    s = torch.full((num_blocks, kv_heads, block_size), -1.0)
    return k, v, s, s.clone()


def cache_rows(cache, slots, block_size):
    """[T, KVH, D] rows of a logical [NB, KVH, BS, D] cache (from_cache_layout) at the given slots."""
    return cache[slots // block_size, :, slots % block_size]


def assert_writes_exactly(key, value, slots, nb, bs):
    """reshape_and_cache of rows key, value [T, KVH, D] at slots (-1: skipped) into a zero cache of nb
    blocks: each row is at its slot, and nothing else was written."""
    kvh, D = key.shape[1:]
    kc, vc, _, _ = make_cache(nb, kvh, bs, D, key.dtype)
    reshape_and_cache(key, value, kc, vc, slots)
    keep = slots >= 0
    k, v = from_cache_layout(kc, vc)
    assert torch.equal(cache_rows(k, slots[keep], bs), key[keep])
    assert torch.equal(cache_rows(v, slots[keep], bs), value[keep])
    assert int((k != 0).any(-1).sum()) == int(keep.sum()) * kvh
    assert int((v != 0).any(-1).sum()) == int(keep.sum()) * kvh


@pytest.mark.parametrize("bs", [16, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_writes_rows_and_skips_minus_one(dtype, bs):
    T, kvh, D, nb = 12, 3, 64, 5
    key, value = torch.randn(T, kvh, D).to(dtype), torch.randn(T, kvh, D).to(dtype)
    slots = torch.randperm(nb * bs)[:T]
    slots[[2, 7]] = -1
    assert_writes_exactly(key, value, slots, nb, bs)


@pytest.mark.parametrize("cache_dtype,lane", [(torch.bfloat16, 2), (torch.float32, 2), (torch.int8, 4),
                                              (torch.float8_e4m3fn, 4)])
def test_cpu_tiles_hold_lanes_of_dims_in_k_and_of_tokens_in_v(cache_dtype, lane):
    """The CPU layout (kv_layout.h), element by element: K [NB, KVH, D/L, BS, L] holds dims L j .. L j + L - 1
    of a token in one lane, V [NB, KVH, BS/L, D, L] tokens L p .. L p + L - 1 of a dim; L = 4 for
    one-byte caches (the int8/fp8 decode kernel's quads), 2 otherwise (bf16 pairs)."""
    nb, kvh, bs, D, T = 3, 2, 8, 16, 11
    k_shape, v_shape = kv_cache_shapes(nb, kvh, bs, D, "cpu", cache_dtype)
    assert k_shape == (nb, kvh, D // lane, bs, lane) and v_shape == (nb, kvh, bs // lane, D, lane)
    # values each cache holds exactly, with scale 1 for int8 (absmax 127) and fp8 (absmax 448)
    top = QMAX.get(cache_dtype, 127.0)
    key = torch.randint(-15, 16, (T, kvh, D), generator=torch.Generator().manual_seed(3)).float()
    key[:, :, 0] = top
    value = key.flip(-1)
    quant = cache_dtype in QMAX
    kc, vc, ks, vs = make_cache(nb, kvh, bs, D, cache_dtype, quant=quant)
    slots = torch.arange(T) + bs  # block 1 from offset 0, then block 2
    src = torch.float32 if quant else cache_dtype
    reshape_and_cache(key.to(src), value.to(src), kc, vc, slots, k_scales=ks, v_scales=vs)
    if quant:
        assert (ks[slots // bs, :, slots % bs] == 1).all() and (vs[slots // bs, :, slots % bs] == 1).all()
    for t in range(T):
        blk, off = (bs + t) // bs, (bs + t) % bs
        for d in range(D):
            assert torch.equal(kc[blk, :, d // lane, off, d % lane].float(), key[t, :, d])
            assert torch.equal(vc[blk, :, off // lane, d, off % lane].float(), value[t, :, d])


@pytest.mark.parametrize("start", [0, 5])
@pytest.mark.parametrize("bs,D", [(16, 64), (32, 128), (48, 64)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_prompt_chunk_writes_whole_block_groups(dtype, bs, D, start):
    """A prompt chunk's consecutive slots (64 tokens or more: a block's 16 tokens are written at once) from
    strided q|k|v rows: from a block's start or mid-block, crossing blocks, a -1 inside one group, and a
    group whose slots are not in order; everything else in the cache stays zero."""
    T, kvh, nb = 100, 3, 12
    g = torch.Generator().manual_seed(bs + D)
    qkv = torch.randn(T, (4 + 2 * kvh) * D, generator=g).to(dtype)
    key = qkv[:, 4 * D : (4 + kvh) * D].view(T, kvh, D)
    value = qkv[:, (4 + kvh) * D :].view(T, kvh, D)
    slots = torch.arange(T, dtype=torch.int64) + bs + start  # block 1 from offset `start`
    slots[40] = -1
    slots[[70, 71]] = slots[[71, 70]]
    assert_writes_exactly(key, value, slots, nb, bs)


def test_strided_key_value_views():
    T, kvh, D, bs = 6, 2, 32, 8
    qkv = torch.randn(T, (4 + 2 * kvh) * D)
    key = qkv[:, 4 * D : (4 + kvh) * D].view(T, kvh, D)
    value = qkv[:, (4 + kvh) * D :].view(T, kvh, D)
    slots = torch.arange(T, dtype=torch.int64) + 3
    kc, vc, _, _ = make_cache(2, kvh, bs, D, torch.float32)
    reshape_and_cache(key, value, kc, vc, slots)
    k, v = from_cache_layout(kc, vc)
    assert torch.equal(cache_rows(k, slots, bs), key) and torch.equal(cache_rows(v, slots, bs), value)


@pytest.mark.parametrize("D", [128, 20])  # 20: a row of one 16-lane vector and a part one
@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.int8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_write_scales_and_error_bound(cache_dtype, dtype, D):
    torch.manual_seed(0)
    T, kvh, bs, nb = 40, 2, 16, 4
    key = (torch.randn(T, kvh, D) * torch.logspace(-3, 3, T)[:, None, None]).to(dtype)  # wide dynamic range
    key[5] = 0  # all-zero rows: scale 0, values 0
    value = torch.randn(T, kvh, D).to(dtype)
    slots = torch.randperm(nb * bs)[:T]
    slots[9] = -1
    kc, vc, ks, vs = make_cache(nb, kvh, bs, D, cache_dtype, quant=True)
    reshape_and_cache(key, value, kc, vc, slots, k_scales=ks, v_scales=vs)
    keep = slots >= 0
    for x, c, s in zip((key, value), from_cache_layout(kc, vc), (ks, vs)):
        x = x[keep].float()
        stored, scale = cache_rows(c, slots[keep], bs), s[slots[keep] // bs, :, slots[keep] % bs]
        assert_kv_quantized(x, stored, scale, cache_dtype)
        deq = stored.float() * scale[..., None]
        if cache_dtype == torch.int8:
            bound = scale[..., None] / 2  # half a step
        else:  # half an ulp: relative 2^-4 for normals, 2^-10 (x scale) in the subnormal range
            bound = torch.maximum(x.abs() * 2.0**-4, scale[..., None] * 2.0**-10)
        assert ((deq - x).abs() <= bound * (1 + 1e-4)).all()  # slack: fp32 rounding of q * scale
    assert (ks[slots[9] // bs, :, slots[9] % bs] == -1).all() if slots[9] >= 0 else True
    assert int((ks != -1).sum()) == int(keep.sum()) * kvh  # only written rows got scales


def test_fp8_scale_is_the_candidate_of_least_error():
    """An e4m3 row takes the scale, of absmax / 448 * (16 + j) / 16, that reconstructs it best: for
    Gaussian rows (K and V after the Hadamard rotation look like this) about a quarter less squared error
    than absmax / 448 alone, and never more."""
    T, kvh, D, bs = 512, 3, 64, 16
    x = torch.randn(T, kvh, D, generator=torch.Generator().manual_seed(0)) * torch.logspace(-2, 2, T)[:, None, None]
    kc, vc, ks, vs = make_cache(T // bs, kvh, bs, D, torch.float8_e4m3fn, quant=True)
    reshape_and_cache(x, x, kc, vc, torch.arange(T), k_scales=ks, v_scales=vs)
    stored = from_cache_layout(kc, vc)[0].permute(0, 2, 1, 3).reshape(T, kvh, D).float()
    scale = ks.permute(0, 2, 1).reshape(T, kvh)
    err = ((stored * scale[..., None] - x) ** 2).sum(-1)
    plain = x.abs().amax(-1) / 448
    plain_err = (((x / plain[..., None]).to(torch.float8_e4m3fn).float() * plain[..., None] - x) ** 2).sum(-1)
    assert (scale >= plain).all() and (scale <= plain * 31 / 16).all()
    assert (err <= plain_err * (1 + 1e-3)).all()
    assert float(err.sum() / plain_err.sum()) < 0.8  # measured 0.73


def test_quantized_codes_round_ties_to_even():
    """Values exactly between two codes go to the even one, as torch rounds: int8 half-integers, and for
    e4m3 the midpoint of every pair of neighbouring codes, subnormal ones included. Each e4m3 row holds
    every code's value at scale 1 (absmax 448), so that scale reconstructs it best, and three midpoints."""
    ints = torch.arange(-127, 127) + 0.5
    x8 = torch.cat([torch.tensor([127.0, 0.0]), ints]).view(1, 1, 256)
    codes = torch.arange(1, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # 2^-9 .. 448
    mids = (torch.cat([torch.zeros(1), codes[:-1]]) + codes) / 2
    rows = []
    for k in range(0, len(mids), 3):
        ties = mids[k : k + 3] * torch.tensor([1.0, -1.0, 1.0])[: len(mids[k : k + 3])]
        rows.append(torch.cat([torch.zeros(1), codes, -codes, ties, torch.zeros(3 - len(ties))]))
    xf = torch.stack(rows)[:, None]
    for x, cache_dtype in ((x8, torch.int8), (xf, torch.float8_e4m3fn)):
        T = x.shape[0]
        kc, vc, ks, vs = make_cache(T, 1, 4, 256, cache_dtype, quant=True)
        slots = torch.arange(T) * 4
        reshape_and_cache(x, x, kc, vc, slots, k_scales=ks, v_scales=vs)
        k, v = from_cache_layout(kc, vc)
        for c, s in ((k, ks), (v, vs)):
            scale = s[slots // 4, :, 0]
            assert (scale == 1).all()
            assert_kv_quantized(x, cache_rows(c, slots, 4), scale, cache_dtype)


def k_rows(k, ks, T):
    """[T, KVH, D] dequantized K of slots 0..T-1 and the raw codes, of a logical [NB, KVH, BS, D] cache."""
    codes = k.permute(0, 2, 1, 3).reshape(T, k.shape[1], -1)
    return codes.float() * ks.permute(0, 2, 1).reshape(T, -1)[..., None], codes


@pytest.mark.parametrize("device,D", [("cpu", 64), ("cpu", 20), pytest.param("cuda", 64, marks=pytest.mark.cuda)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.int8])
def test_k_is_rounded_for_the_steps_queries(cache_dtype, dtype, device, D):
    """Given the step's q, each fp8 or int8 K value takes the nearest code or the other one next to it,
    chosen so that J = sum_g (u_g . e)^2 + |e|^2 / D (u_g the token's q of head g, unit length; e the
    rounding error) never rises, and the error along the token's own q heads mostly goes; the scales and
    V do not change. Queries that share a direction with q (as a model's do) gain too."""
    T, kvh, G, bs = 128, 3, 3, 16
    g = torch.Generator().manual_seed(0)
    key = torch.randn(T, kvh, D, generator=g).to(dtype)
    value = torch.randn(T, kvh, D, generator=g).to(dtype)
    common = torch.randn(kvh * G, D, generator=g) * 2  # a direction every token's q shares
    q = (common + torch.randn(T, kvh * G, D, generator=g)).to(dtype)
    later = common + torch.randn(T, kvh * G, D, generator=g)  # other queries with the same direction
    written = {}
    for name, query in (("nearest", None), ("for q", q)):
        kc, vc, ks, vs = (t.to(device) for t in make_cache(T // bs, kvh, bs, D, cache_dtype, quant=True))
        if device == "cuda":  # the CUDA cache layout: [NB, KVH, BS, D] for both
            kc, vc = kc.view(T // bs, kvh, bs, D), vc.view(T // bs, kvh, bs, D)
        reshape_and_cache(key.to(device), value.to(device), kc, vc, torch.arange(T, device=device), k_scales=ks,
                          v_scales=vs, query=None if query is None else query.to(device))
        written[name] = tuple(t.cpu() for t in (*from_cache_layout(kc, vc), ks, vs))
    (kc0, vc0, ks0, vs0), (kc1, vc1, ks1, vs1) = written["nearest"], written["for q"]
    assert torch.equal(ks0, ks1) and torch.equal(vs0, vs1) and torch.equal(vc0.view(torch.uint8), vc1.view(torch.uint8))
    if cache_dtype == torch.int8:
        assert torch.equal(k_rows(kc0, ks0, T)[1], ref_kv_quantize(key, torch.int8)[0])  # nearest without q
    (k0, c0), (k1, c1) = k_rows(kc0, ks0, T), k_rows(kc1, ks1, T)
    x = key.float()
    moved = c0.view(torch.uint8) != c1.view(torch.uint8)
    assert 0 < int(moved.sum()) <= 16 * T * kvh
    assert ((k0 - x) * (k1 - x) <= 0)[moved].all()  # the other neighbour: on the far side of x
    # one code away: fp8 codes are sign and magnitude, int8 two's complement
    as_int = (lambda c: c.view(torch.uint8).int()) if cache_dtype == torch.float8_e4m3fn else (lambda c: c.int())
    assert ((as_int(c0) - as_int(c1)).abs() <= 1).all()

    u = q.float().view(T, kvh, G, D)
    u = u / u.norm(dim=-1, keepdim=True)
    def J(k):
        e = k - x
        return ((u * e[:, :, None]).sum(-1) ** 2).sum(-1) + (e ** 2).sum(-1) / D
    assert (J(k1) <= J(k0) * (1 + 1e-5) + 1e-12).all()
    own = lambda k: float((((u * (k - x)[:, :, None]).sum(-1)) ** 2).mean())
    assert own(k1) < 0.25 * own(k0)
    score = lambda k: float(((later.view(T, kvh, G, D) * (k - x)[:, :, None]).sum(-1) ** 2).mean())
    assert score(k1) < 0.7 * score(k0)


def test_query_of_the_wrong_shape_is_refused():
    kc, vc, ks, vs = make_cache(2, 2, 8, 16, torch.float8_e4m3fn, quant=True)
    key = torch.randn(3, 2, 16)
    for bad in (torch.randn(3, 3, 16), torch.randn(2, 4, 16), torch.randn(3, 4, 8)):
        with pytest.raises(ValueError, match="query"):
            reshape_and_cache(key, key, kc, vc, torch.tensor([0, 1, 2]), k_scales=ks, v_scales=vs, query=bad)
    with pytest.raises(TypeError, match="query has dtype"):
        reshape_and_cache(key, key, kc, vc, torch.tensor([0, 1, 2]), k_scales=ks, v_scales=vs,
                          query=torch.randn(3, 4, 16).half())
    assert (ks == -1).all()  # nothing written


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.int8])
def test_quantized_cache_end_to_end(cache_dtype):
    """reshape_and_cache then paged_attention stays close to attention over the unquantized K/V."""
    kvh, H, D, bs, L = 2, 6, 64, 16, 100
    key, value, q = torch.randn(L, kvh, D), torch.randn(L, kvh, D), torch.randn(1, H, D)
    kc, vc, ks, vs = make_cache(8, kvh, bs, D, cache_dtype, quant=True)
    reshape_and_cache(key, value, kc, vc, torch.arange(L), k_scales=ks, v_scales=vs)
    bt = torch.arange(8, dtype=torch.int32)[None]
    out = paged_attention(q, kc, vc, bt, torch.tensor([L], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32),
                          0.125, k_scales=ks, v_scales=vs)
    k, v = key.repeat_interleave(H // kvh, 1).transpose(0, 1), value.repeat_interleave(H // kvh, 1).transpose(0, 1)
    ref = ((q.transpose(0, 1) @ k.transpose(1, 2) * 0.125).softmax(-1) @ v).transpose(0, 1)
    torch.testing.assert_close(out, ref, atol=0.05, rtol=0.05)


def test_fp8_codec_matches_torch_on_every_code():
    """Decoding all 254 finite e4m3 codes through the cache path reproduces torch's fp8 values."""
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F].view(torch.float8_e4m3fn)  # drop the NaN codes
    values = torch.cat([codes.float(), torch.zeros(2)])  # exact in fp32; 256: a head_dim the layout takes
    # a row of exactly representable values quantizes to itself when its absmax is 448
    n = values.numel()
    key = values.view(1, 1, n)
    kc, vc, ks, vs = make_cache(1, 1, 4, n, torch.float8_e4m3fn, quant=True)
    reshape_and_cache(key, key, kc, vc, torch.zeros(1, dtype=torch.int64), k_scales=ks, v_scales=vs)
    assert float(ks[0, 0, 0]) == 1.0
    k, v = from_cache_layout(kc, vc)
    assert torch.equal(k[0, 0, 0].float(), values) and torch.equal(v[0, 0, 0].float(), values)


def good_args():
    kc, vc, _, _ = make_cache(2, 2, 8, 16, torch.float32)
    return dict(key=torch.randn(3, 2, 16), value=torch.randn(3, 2, 16), k_cache=kc, v_cache=vc,
                slot_mapping=torch.tensor([0, -1, 15]))


@pytest.mark.parametrize(
    "changes,exc,match",
    [
        (dict(slot_mapping=torch.tensor([0, 1, 16])), ValueError, r"slot_mapping\[2\] = 16 is outside \[-1, 16\)"),
        (dict(slot_mapping=torch.tensor([0, -2, 1])), ValueError, "is outside"),
        (dict(slot_mapping=torch.tensor([0, 1, 2], dtype=torch.int32)), TypeError, "slot_mapping has dtype"),
        (dict(slot_mapping=torch.tensor([0, 1])), ValueError, "slot_mapping must have shape"),
        (dict(key=torch.randn(3, 2, 16).double()), TypeError, "key has dtype"),
        (dict(value=torch.randn(3, 2, 16).bfloat16()), TypeError, "value has dtype"),
        (dict(key=torch.randn(3, 3, 16)), ValueError, "value must have shape"),
        (dict(key=torch.randn(3, 16, 2).transpose(1, 2)), ValueError, "key must have contiguous"),
        (dict(k_cache=torch.zeros(2, 2, 8, 8, 2, dtype=torch.bfloat16)), TypeError, "k_cache has dtype"),
        (dict(v_cache=torch.zeros(2, 2, 4, 8, 2)), ValueError, "v_cache must have shape"),
        (dict(k_cache=torch.zeros(2, 2, 8, 16)), ValueError, "k_cache on cpu must be shaped"),
        (dict(k_cache=torch.zeros(2, 2, 8, 8, 2, dtype=torch.int8), v_cache=torch.zeros(2, 2, 4, 16, 2, dtype=torch.int8)),
         ValueError, r"k_cache on cpu must be shaped \[num_blocks, kv_heads, head_dim/4, block_size, 4\]"),
        (dict(k_cache=torch.zeros(2, 2, 4, 8, 4, dtype=torch.int8), v_cache=torch.zeros(2, 2, 2, 16, 4, dtype=torch.int8)),
         ValueError, "k_scales is required"),
        (dict(k_cache=torch.zeros(2, 2, 8, 8, 2, device="meta")), ValueError, "k_cache is on meta"),
    ],
)
def test_bad_arguments_raise(changes, exc, match):
    args = good_args()
    args.update(changes)
    with pytest.raises(exc, match=match):
        reshape_and_cache(**args)


def test_bad_slot_writes_nothing():
    args = good_args()
    args["slot_mapping"] = torch.tensor([0, 1, 99])
    with pytest.raises(ValueError):
        reshape_and_cache(**args)
    assert not args["k_cache"].any()


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.int8])
def test_copy_blocks_copies_whole_blocks_with_their_scales(cache_dtype):
    """copy_blocks (a forked sequence's own copy of a block), checked in the logical [NB, KVH, BS, D]
    view: each destination block equals its source, values and scales, in every layer; nothing else
    changes."""
    from pyengine.model.metadata import KVCache, copy_blocks

    kvh, D, bs, nb = 3, 64, 16, 6
    quant = cache_dtype != torch.bfloat16
    rows = torch.float32 if quant else torch.bfloat16
    caches = []
    for _ in range(2):  # layers
        kc, vc, ks, vs = make_cache(nb, kvh, bs, D, cache_dtype, quant=quant)
        key, value = torch.randn(nb * bs, kvh, D).to(rows), torch.randn(nb * bs, kvh, D).to(rows)
        reshape_and_cache(key, value, kc, vc, torch.arange(nb * bs), k_scales=ks, v_scales=vs)
        caches.append(KVCache(kc, vc, ks, vs))

    def logical(c: KVCache) -> list[torch.Tensor]:  # as bytes: torch.equal has no fp8
        k, v = from_cache_layout(c.k, c.v)
        return [x.contiguous().view(torch.uint8) for x in (k, v)] + ([c.k_scales.clone(), c.v_scales.clone()]
                                                                    if quant else [])

    before = [logical(c) for c in caches]
    copy_blocks(caches, [(1, 4), (2, 0)])
    for c, old in zip(caches, before):
        for new, ref in zip(logical(c), old):
            want = ref.clone()
            want[4], want[0] = ref[1], ref[2]
            assert torch.equal(new, want)
