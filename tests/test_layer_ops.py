"""rms_norm, add_rms_norm, rotary_embedding, hadamard_heads and silu_and_mul against plain torch references."""
import pytest
import torch

from pyengine.ops.layers import add_rms_norm, hadamard_heads, rms_norm, rotary_embedding, silu_and_mul

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
       torch.float16: dict(atol=2e-3, rtol=2e-3)}
DTYPES = list(TOL)
ROWS = [1, 7, 300]  # 300 rows x 576 is large enough to run on the thread pool


def ref_rms_norm(x, w, eps, dtype=None):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(dtype or x.dtype)


def cos_sin_cache(max_pos, head_dim, base=10000.0):
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    freqs = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).float()


def ref_rope(positions, x, cache, head_dim):
    """x [T, H, D]; neox: rotate the two halves of each head."""
    half = head_dim // 2
    cos, sin = cache[positions, :half][:, None, :], cache[positions, half:][:, None, :]
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("dim", [64, 128, 576, 100])
def test_rms_norm(dtype, rows, dim):
    g = torch.Generator().manual_seed(rows * 1000 + dim)
    x = (torch.randn(rows, dim, generator=g) * 3).to(dtype)
    w = torch.rand(dim, generator=g).to(dtype) + 0.5
    torch.testing.assert_close(rms_norm(x, w, 1e-6), ref_rms_norm(x, w, 1e-6), **TOL[dtype])


def test_rms_norm_out_and_fp32_weight_and_3d():
    x = torch.randn(4, 3, 64).to(torch.bfloat16)
    w = torch.rand(64) + 0.5
    out = torch.empty_like(x)
    assert rms_norm(x, w, 1e-5, out=out) is out
    torch.testing.assert_close(out, ref_rms_norm(x, w, 1e-5), **TOL[torch.bfloat16])
    y = x.clone()
    rms_norm(y, w, 1e-5, out=y)  # in place
    torch.testing.assert_close(y, out, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("dim", [64, 576, 33])
def test_add_rms_norm(dtype, rows, dim):
    g = torch.Generator().manual_seed(rows + dim)
    x = torch.randn(rows, dim, generator=g).to(dtype)
    res = torch.randn(rows, dim, generator=g).to(dtype)
    w = torch.rand(dim, generator=g).to(dtype) + 0.5
    want_res = (x.float() + res.float()).to(dtype)
    want_x = ref_rms_norm(want_res, w, 1e-6)
    add_rms_norm(x, res, w, 1e-6)
    torch.testing.assert_close(res, want_res, atol=0, rtol=0)
    torch.testing.assert_close(x, want_x, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("weight_dtype", ["act", torch.float32])
@pytest.mark.parametrize("rows", ROWS)
def test_norms_of_an_fp32_residual_stream(dtype, weight_dtype, rows):
    """A model's fp32 residual stream beside bf16/fp16 activations: the sum stays fp32 (exactly torch's),
    the normed x is rounded once to the activation dtype."""
    dim = 576
    g = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, dim, generator=g) * 3).to(dtype)
    res = torch.randn(rows, dim, generator=g) * 20
    w = (torch.rand(dim, generator=g) + 0.5).to(dtype if weight_dtype == "act" else weight_dtype)

    normed = rms_norm(res, w, 1e-6, dtype=dtype)
    assert normed.dtype == dtype
    torch.testing.assert_close(normed, ref_rms_norm(res, w, 1e-6, dtype), **TOL[dtype])
    out = torch.empty(rows, dim, dtype=dtype)
    assert rms_norm(res, w, 1e-6, out=out) is out and torch.equal(out, normed)

    want_res = x.float() + res
    want_x = ref_rms_norm(want_res, w, 1e-6, dtype)
    add_rms_norm(x, res, w, 1e-6)
    assert res.dtype == torch.float32
    torch.testing.assert_close(res, want_res, atol=0, rtol=0)
    torch.testing.assert_close(x, want_x, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128, 96])
@pytest.mark.parametrize("tokens", [1, 200])
def test_rotary_embedding(dtype, head_dim, tokens):
    heads, kv_heads, max_pos = 9, 3, 10000
    g = torch.Generator().manual_seed(head_dim + tokens)
    cache = cos_sin_cache(max_pos, head_dim)
    positions = torch.randint(0, max_pos, (tokens,), generator=g)
    q = torch.randn(tokens, heads, head_dim, generator=g).to(dtype)
    k = torch.randn(tokens, kv_heads * head_dim, generator=g).to(dtype)
    want_q = ref_rope(positions, q, cache, head_dim)
    want_k = ref_rope(positions, k.view(tokens, kv_heads, head_dim), cache, head_dim).view(tokens, -1)
    rotary_embedding(positions, q, k, cache, head_dim)
    torch.testing.assert_close(q, want_q, **TOL[dtype])
    torch.testing.assert_close(k, want_k, **TOL[dtype])


def test_rotary_embedding_large_positions_and_fused_qkv_slices():
    """Positions near 128k, on q/k that are column views of one [T, (H + 2KVH) * D] qkv tensor."""
    heads, kv_heads, head_dim, tokens, max_pos = 4, 2, 64, 5, 131072
    cache = cos_sin_cache(max_pos, head_dim, base=500000.0)
    positions = torch.tensor([0, 1, 65535, 131070, 131071])
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    want_q = ref_rope(positions, q.reshape(tokens, heads, head_dim), cache, head_dim).reshape(tokens, -1)
    want_k = ref_rope(positions, k.reshape(tokens, kv_heads, head_dim), cache, head_dim).reshape(tokens, -1)
    want_v = v.clone()
    rotary_embedding(positions, q, k, cache, head_dim)
    torch.testing.assert_close(q, want_q, **TOL[torch.float32])
    torch.testing.assert_close(k, want_k, **TOL[torch.float32])
    torch.testing.assert_close(v, want_v, atol=0, rtol=0)


def test_rotary_embedding_3d_head_views_of_fused_qkv():
    heads, kv_heads, head_dim, tokens = 9, 3, 64, 40
    cache = cos_sin_cache(4096, head_dim)
    positions = torch.randint(0, 4096, (tokens,), generator=torch.Generator().manual_seed(9))
    qkv = torch.randn(tokens, heads + 2 * kv_heads, head_dim).to(torch.bfloat16)
    q, k = qkv[:, :heads], qkv[:, heads:heads + kv_heads]
    want_q, want_k = ref_rope(positions, q, cache, head_dim), ref_rope(positions, k, cache, head_dim)
    want_v = qkv[:, heads + kv_heads:].clone()
    rotary_embedding(positions, q, k, cache, head_dim)
    torch.testing.assert_close(q, want_q, **TOL[torch.bfloat16])
    torch.testing.assert_close(k, want_k, **TOL[torch.bfloat16])
    assert torch.equal(qkv[:, heads + kv_heads:], want_v)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1536), (3, 7), (64, 1536), (2, 5000)])
def test_silu_and_mul(dtype, shape):
    rows, inter = shape
    x = (torch.randn(rows, 2 * inter, generator=torch.Generator().manual_seed(inter)) * 4).to(dtype)
    xf = x.float()
    want = (torch.nn.functional.silu(xf[:, :inter]) * xf[:, inter:]).to(dtype)
    torch.testing.assert_close(silu_and_mul(x), want, **TOL[dtype])


def test_silu_extremes():
    x = torch.tensor([[-200.0, -80.0, 0.0, 80.0, 1.0, 1.0, 1.0, 1.0]])
    want = torch.nn.functional.silu(x[:, :4]) * x[:, 4:]
    torch.testing.assert_close(silu_and_mul(x), want, atol=1e-6, rtol=1e-6)


def test_bad_arguments():
    x = torch.randn(4, 64)
    w = torch.ones(64)
    with pytest.raises(TypeError, match="x"):
        rms_norm(x.double(), w, 1e-6)
    with pytest.raises(TypeError, match="weight"):
        rms_norm(x.bfloat16(), w.half(), 1e-6)
    with pytest.raises(ValueError, match="weight"):
        rms_norm(x, torch.ones(32), 1e-6)
    with pytest.raises(ValueError, match="contiguous"):
        rms_norm(x.t(), w, 1e-6)
    with pytest.raises(ValueError, match="eps"):
        rms_norm(x, w, -1.0)
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        rms_norm([1.0], w, 1e-6)
    with pytest.raises(ValueError, match="out"):
        rms_norm(x, w, 1e-6, out=torch.empty(4, 32))
    with pytest.raises(ValueError, match="residual"):
        add_rms_norm(x, torch.randn(3, 64), w, 1e-6)
    with pytest.raises(TypeError, match="residual"):
        add_rms_norm(x, x.bfloat16(), w, 1e-6)
    with pytest.raises(TypeError, match="residual"):  # fp32 or x's dtype
        add_rms_norm(x.bfloat16(), x.half(), w, 1e-6)
    with pytest.raises(TypeError, match="its own dtype"):  # only an fp32 x may change dtype
        rms_norm(x.bfloat16(), w, 1e-6, dtype=torch.float16)
    with pytest.raises(TypeError, match="weight"):  # the result's dtype or fp32
        rms_norm(x, w.half(), 1e-6, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="even"):
        silu_and_mul(torch.randn(2, 5))
    with pytest.raises(ValueError, match="out"):
        silu_and_mul(torch.randn(2, 8), out=torch.empty(2, 8))

    cache = cos_sin_cache(16, 64)
    q, k = torch.randn(2, 128), torch.randn(2, 64)
    pos = torch.tensor([0, 3])
    with pytest.raises(ValueError, match="head_dim"):
        rotary_embedding(pos, q, k, cache, 63)
    with pytest.raises(TypeError, match="positions"):
        rotary_embedding(pos.int(), q, k, cache, 64)
    with pytest.raises(ValueError, match="q has 3 tokens"):
        rotary_embedding(pos, torch.randn(3, 128), k, cache, 64)
    with pytest.raises(TypeError, match="k"):
        rotary_embedding(pos, q, k.bfloat16(), cache, 64)
    with pytest.raises(ValueError, match="multiple of head_dim"):
        rotary_embedding(pos, torch.randn(2, 100), k, cache, 64)
    with pytest.raises(ValueError, match="contiguous heads"):
        rotary_embedding(pos, torch.randn(128, 2).t(), k, cache, 64)
    with pytest.raises(ValueError, match="cos_sin_cache"):
        rotary_embedding(pos, q, k, cos_sin_cache(16, 32), 64)
    with pytest.raises(ValueError, match=r"positions\[1\] = 16"):
        rotary_embedding(torch.tensor([0, 16]), q, k, cache, 64)
    with pytest.raises(ValueError, match="positions"):
        rotary_embedding(torch.tensor([-1, 0]), q, k, cache, 64)


def ref_hadamard(x: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Each head of x [T, H*D] times H_n / sqrt(n) per block of n (the largest power of two dividing
    head_dim), the matrix written out from its definition: entry (i, j) = (-1)^popcount(i & j)."""
    n = head_dim & -head_dim
    i = torch.arange(n)
    bits = torch.bitwise_and(i[:, None], i[None, :])
    popcount = sum((bits >> b) & 1 for b in range(n.bit_length()))
    h = (1 - 2 * (popcount % 2)).double() / n ** 0.5
    return (x.double().unflatten(-1, (-1, n)) @ h).flatten(-2).to(x.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128, 96, 80])  # 96, 80: blocks of 32, 16
@pytest.mark.parametrize("tokens", [1, 300])
def test_hadamard_heads(dtype, head_dim, tokens):
    """On q and k as column views of one fused qkv tensor (v untouched), against the written-out matrix;
    q.k per head is kept (the reason it is applied)."""
    heads, kv_heads = 9, 3
    g = torch.Generator().manual_seed(head_dim + tokens)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    want_q, want_k, want_v = ref_hadamard(q, head_dim), ref_hadamard(k, head_dim), v.clone()

    def dots():  # q.k of each kv head with the first q head of its group
        return (q.double().view(tokens, heads, head_dim)[:, ::3] * k.double().view(tokens, kv_heads, head_dim)).sum(-1)

    before = dots()
    hadamard_heads(q, head_dim)
    hadamard_heads(k.view(tokens, kv_heads, head_dim), head_dim)
    torch.testing.assert_close(q, want_q, **TOL[dtype])
    torch.testing.assert_close(k, want_k, **TOL[dtype])
    torch.testing.assert_close(v, want_v, atol=0, rtol=0)
    if dtype == torch.float32:
        torch.testing.assert_close(dots(), before, atol=1e-4, rtol=1e-5)


def test_hadamard_heads_spreads_an_outlier_channel():
    """A head whose energy sits in one channel comes out flat: every channel +-|x| / sqrt(64)."""
    x = torch.zeros(2, 64)
    x[0, 5], x[1, 40] = 8.0, -3.0
    hadamard_heads(x, 64)
    torch.testing.assert_close(x.abs(), torch.tensor([[1.0], [3.0 / 8]]).expand(2, 64))


def test_hadamard_heads_refuses_bad_arguments():
    with pytest.raises(ValueError, match="head_dim"):
        hadamard_heads(torch.zeros(2, 64), 0)
    with pytest.raises(ValueError, match="multiple of head_dim"):
        hadamard_heads(torch.zeros(2, 60), 64)
    with pytest.raises(TypeError, match="dtype"):
        hadamard_heads(torch.zeros(2, 64, dtype=torch.int32), 64)
