"""Layer kernels vs eager torch at SmolLM2-135M shapes (hidden 576, intermediate 1536, 9 q heads,
3 kv heads, head_dim 64), decode (T=1, 32) and prefill (T=512), fp32 and bf16, 2 threads.

    python -m pytest bench/kernels/bench_layers.py --benchmark-group-by=func,param:tokens,param:dtype \
        --benchmark-columns=min,median,rounds
"""
import pytest
import torch

from pyengine import _C
from pyengine.ops.layers import rms_norm, rotary_embedding, silu_and_mul

HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM = 576, 1536, 9, 3, 64
SHAPES = [1, 32, 512]
DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(autouse=True)
def two_threads():
    old = torch.get_num_threads(), _C.num_threads()
    torch.set_num_threads(2)
    _C.set_num_threads(2)
    yield
    torch.set_num_threads(old[0])
    _C.set_num_threads(old[1])


def torch_rms_norm(x, w, eps):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


@pytest.mark.parametrize("impl", ["pyengine", "torch"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", SHAPES)
def test_rms_norm(benchmark, tokens, dtype, impl):
    x, w = torch.randn(tokens, HIDDEN).to(dtype), torch.rand(HIDDEN).to(dtype)
    benchmark(rms_norm if impl == "pyengine" else torch_rms_norm, x, w, 1e-5)


@pytest.mark.parametrize("impl", ["pyengine", "torch"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", SHAPES)
def test_silu_and_mul(benchmark, tokens, dtype, impl):
    x = torch.randn(tokens, 2 * INTER).to(dtype)
    if impl == "pyengine":
        benchmark(silu_and_mul, x)
    else:
        benchmark(lambda: torch.nn.functional.silu(x[:, :INTER]) * x[:, INTER:])


def torch_rope(positions, q, k, cache):
    half = HEAD_DIM // 2
    cos, sin = cache[positions, :half][:, None, :], cache[positions, half:][:, None, :]
    for t in (q, k):
        x = t.view(t.shape[0], -1, HEAD_DIM)
        x1, x2 = x[..., :half].clone(), x[..., half:].clone()
        x[..., :half] = x1 * cos - x2 * sin
        x[..., half:] = x2 * cos + x1 * sin


@pytest.mark.parametrize("impl", ["pyengine", "torch"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", SHAPES)
def test_rotary_embedding(benchmark, tokens, dtype, impl):
    cache = torch.randn(8192, HEAD_DIM)
    positions = torch.randint(0, 8192, (tokens,))
    q = torch.randn(tokens, HEADS * HEAD_DIM).to(dtype)
    k = torch.randn(tokens, KV_HEADS * HEAD_DIM).to(dtype)
    if impl == "pyengine":
        benchmark(rotary_embedding, positions, q, k, cache, HEAD_DIM)
    else:
        benchmark(torch_rope, positions, q, k, cache)
