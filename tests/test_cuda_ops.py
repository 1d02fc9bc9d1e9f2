"""The CUDA kernels on cuda tensors against plain torch references (needs a GPU: `-m cuda`).

Same cases as the CPU tests (tests/test_layer_ops.py, ...), fewer of them; inputs are made on
the CPU with a seeded generator, the references run on the CPU in fp32, results are compared on
the CPU.
"""
from __future__ import annotations

import pytest
import torch

from pyengine.ops.layers import add_rms_norm, rms_norm, rotary_embedding, silu_and_mul

pytestmark = pytest.mark.cuda

DEV = torch.device("cuda")
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
       torch.float16: dict(atol=2e-3, rtol=2e-3)}
DTYPES = list(TOL)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---- layers -------------------------------------------------------------------------------------

def ref_rms_norm(x, w, eps):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(x.dtype)


def cos_sin_cache(max_pos, head_dim, base=10000.0):
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    freqs = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).float()


def ref_rope(positions, x, cache, head_dim):
    half = head_dim // 2
    cos, sin = cache[positions, :half][:, None, :], cache[positions, half:][:, None, :]
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


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
