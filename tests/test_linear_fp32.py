"""Fp32Linear (native/cpu/linear/fp32.cpp: fp32 weights in 16-output panels) against torch's fp32
F.linear, and where models use it (fp32 weights on AVX2 builds without AVX-512)."""
import pytest
import torch
import torch.nn.functional as F

from pyengine import _C
from pyengine.model.llama import _holds_weights, make_linear
from pyengine.ops.huge_pages import HugePageArena
from pyengine.ops.linear import Fp32Linear, pack_weight_fp32

pytestmark = pytest.mark.skipif(not _C.linear_fp32_available(), reason="no AVX2 + FMA in this build")

# (N, K): SmolLM2-135M projections, an lm_head stand-in, sizes off the 16-output panel and the 256-deep
# k block (K = 600: blocks of 256, 256, 88).
SHAPES = [(960, 576), (576, 1536), (3072, 576), (4099, 600), (100, 33), (33, 100), (1, 1), (17, 7), (64, 256)]
ROWS = [1, 2, 5, 6, 7, 12, 13, 64, 131]


def make(n, k, m, bias, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    return w, b, torch.randn(m, k, generator=g)


def tol(k):
    """fp32 summation-order noise: grows with the depth of the sums."""
    return dict(atol=1e-5 * k ** 0.5 * 4, rtol=1e-5)


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("bias", [False, True])
def test_matches_torch(n, k, rows, bias):
    w, b, x = make(n, k, rows, bias)
    threads = _C.num_threads()
    _C.set_num_threads(2)  # panel groups run in parallel
    try:
        y = Fp32Linear(w, b)(x)
    finally:
        _C.set_num_threads(threads)
    assert y.dtype == torch.float32 and y.shape == (rows, n)
    torch.testing.assert_close(y, F.linear(x, w, b), **tol(k))


def test_zero_rows():
    assert Fp32Linear(torch.randn(20, 8))(torch.empty(0, 8)).shape == (0, 20)


def test_pack_layout():
    w = torch.arange(20 * 5, dtype=torch.float32).view(20, 5)
    p = pack_weight_fp32(w)
    assert p.shape == (2, 5, 16) and p.dtype == torch.float32
    assert p[1, 4, 3] == w[19, 4] and p[0, 3, 5] == w[5, 3]
    assert (p[1, :, 4:] == 0).all()  # padding outputs


def test_nonfinite_beyond_the_rows_is_not_read():
    """x[:1] is a view whose storage goes on with inf and NaN: the kernel reads only its own rows, and
    the outputs of the last partial panel (N = 17) write only their own columns."""
    x = torch.tensor([[1.0, 2.0, 3.0], [float("inf"), float("nan"), 1.0]])
    out = Fp32Linear(torch.ones(17, 3))(x[:1])
    assert torch.equal(out, torch.full((1, 17), 6.0))


def test_packed_copy_in_an_arena():
    arena = HugePageArena(chunk_bytes=16 << 20)
    w, b, x = make(960, 576, 9, True)
    lin = Fp32Linear(w, b, arena=arena)
    assert torch.equal(lin.packed, pack_weight_fp32(w))
    assert torch.equal(lin(x), Fp32Linear(w, b)(x))
    assert lin.nbytes == 60 * 576 * 16 * 4 + 960 * 4


def test_bad_args():
    lin = Fp32Linear(torch.randn(32, 16))
    with pytest.raises(TypeError, match="x has dtype bfloat16"):
        lin(torch.randn(2, 16).bfloat16())
    with pytest.raises(ValueError, match=r"x must have shape \[\*, 16\]"):
        lin(torch.randn(2, 15))
    with pytest.raises(ValueError, match="x must be contiguous"):
        lin(torch.randn(16, 2).T)
    with pytest.raises(TypeError, match="weight has dtype bfloat16"):
        Fp32Linear(torch.randn(4, 4).bfloat16())
    with pytest.raises(ValueError, match="weight must be non-empty"):
        Fp32Linear(torch.randn(0, 4))
    with pytest.raises(ValueError, match=r"bias must have shape \[32\]"):
        Fp32Linear(torch.randn(32, 16), torch.randn(31))


def test_models_take_it_on_avx2_builds_only():
    """fp32 weights on an AVX2 build without AVX-512 get the native kernel (and no second copy of the
    weight); AVX-512 builds keep torch's GEMM (MKL runs AVX-512 there)."""
    lin = make_linear(torch.randn(48, 32), None)
    if _C.isa() == "avx2":
        assert isinstance(lin, Fp32Linear) and _holds_weights(lin)
    else:
        assert not isinstance(lin, Fp32Linear) and not _holds_weights(lin)
    assert not isinstance(make_linear(torch.randn(48, 32), None, out_dtype=torch.bfloat16), Fp32Linear)
