"""PackedLinear (the native bf16 linear on the CPU, every M) against fp32 torch on the same bf16 weights."""
import pytest
import torch

from pyengine import _C
from pyengine.ops.huge_pages import HugePageArena
from pyengine.ops.linear import PackedLinear, pack_weight
from tests.model_helpers import huge_page_eligible

BF16_DOT = _C.isa() == "avx512_bf16"  # builds without it run torch's F.linear


def best_avx512_path() -> str:
    """The AVX-512 kernel linear_bf16 picks where AMX does not run, by the rule the code uses
    (kPreferFp32Fma, bf16_widen.h): the fp32 kernel on builds whose -march has AVX512-FP16 (the CPUs
    where vdpbf16ps issues at a quarter of the FMA rate), else vdpbf16ps. The decode attention's best
    path (at its default cap) is avx512_fp16 on exactly those builds."""
    return "avx512_fp32" if _C.decode_attention_path() == "avx512_fp16" else "avx512_bf16"

# (N, K): SmolLM2-135M projections, a 49152-like lm_head stand-in, and sizes off the 16 x 2 tile.
SHAPES = [(960, 576), (576, 1536), (3072, 576), (4099, 576), (100, 33), (33, 100), (1, 1), (17, 7)]
ROWS = [1, 2, 3, 4, 5, 8, 9, 16, 17]


def reference(x, w, bias):
    """fp32 math on the bf16 operands (and the bf16-rounded bias, which both paths use)."""
    y = x.float() @ w.to(torch.bfloat16).float().T
    return y if bias is None else y + bias.to(torch.bfloat16).float()


def bf16_tol(ref):
    """One bf16 rounding of the output (rel 2^-8) plus fp32 summation-order noise."""
    return dict(atol=1e-3 * ref.abs().max().item() + 1e-4, rtol=2 ** -8)


def fp32_tol(ref):
    """fp32 output: the native kernel accumulates and returns fp32; torch's bf16 GEMM (builds without
    bf16 dot products) rounds to bf16 first, as on CUDA."""
    return dict(atol=1e-4 * ref.abs().max().item() + 1e-5, rtol=1e-4) if BF16_DOT else bf16_tol(ref)


@pytest.fixture(params=["amx", "avx512_fp32", "avx512_bf16"])
def path(request):
    """Each kernel path of linear_bf16: AMX tiles (where the build and CPU have them, K % 32 == 0), the
    bf16 weights widened to fp32 FMAs, and the vdpbf16ps kernel."""
    if not BF16_DOT:
        pytest.skip("no native bf16 linear in this build")
    _C.set_linear_path(request.param)
    try:
        if request.param == "amx" and _C.linear_path(64) != "amx":
            pytest.skip("no AMX on this build/CPU")
        yield request.param
    finally:
        _C.set_linear_path("amx")


def make(n, k, rows, seed, with_bias=False, wdtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(wdtype)
    b = torch.randn(n, generator=g) if with_bias else None
    x = torch.randn(rows, k, generator=g).bfloat16()
    return w, b, x


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("rows", ROWS)
def test_native_rows(n, k, rows, path):
    w, _, x = make(n, k, rows, seed=n * 7919 + k * 31 + rows)
    lin = PackedLinear(w)
    ref = reference(x, w, None)
    y = lin(x)
    assert y.dtype == torch.bfloat16 and y.shape == (rows, n)
    torch.testing.assert_close(y.float(), ref, **bf16_tol(ref))
    y32 = lin(x, out_dtype=torch.float32)
    assert y32.dtype == torch.float32
    torch.testing.assert_close(y32, ref, **fp32_tol(ref))


@pytest.mark.parametrize("n,k", [(576, 576), (100, 33), (33, 577)])
@pytest.mark.parametrize("rows", [1, 7, 16, 40])
def test_bias_and_fp32_out(n, k, rows, path):
    w, b, x = make(n, k, rows, seed=rows + n, with_bias=True)
    lin = PackedLinear(w, b, out_dtype=torch.float32)  # 40 rows: 16-row chunks + 8
    ref = reference(x, w, b)
    y = lin(x)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y, ref, **fp32_tol(ref))
    torch.testing.assert_close(lin(x, out_dtype=torch.bfloat16).float(), ref, **bf16_tol(ref))


@pytest.mark.parametrize("wdtype", [torch.float32, torch.float16])
def test_weight_converted_to_bf16(wdtype):
    w, b, x = make(64, 96, 3, seed=5, with_bias=True, wdtype=wdtype)
    lin = PackedLinear(w, b.to(wdtype))
    held = lin.packed if BF16_DOT else lin.weight  # with the native kernel, only the packed copy is kept
    assert held.dtype == torch.bfloat16 and (lin.weight is None) == BF16_DOT
    ref = reference(x, w, b.to(wdtype))
    torch.testing.assert_close(lin(x).float(), ref, **bf16_tol(ref))


@pytest.mark.parametrize("n,k", [(576, 576), (100, 1537), (4099, 64)])
@pytest.mark.parametrize("rows", [64, 257, 700])
def test_prefill_rows_in_panels(n, k, rows, path):
    """Above 256 rows x is repacked in parallel and run in L2-sized panels of rows (vdpbf16ps), or in
    32-row blocks and a zero-padded last partial 16 rows (AMX)."""
    w, b, x = make(n, k, rows, seed=rows + k, with_bias=True)
    lin = PackedLinear(w, b)
    ref = reference(x, w, b)
    torch.testing.assert_close(lin(x).float(), ref, **bf16_tol(ref))
    y32 = lin(x, out_dtype=torch.float32)
    torch.testing.assert_close(y32, ref, **fp32_tol(ref))
    if BF16_DOT:  # the native kernel: a row's result does not depend on the batch it came in
        torch.testing.assert_close(lin(x[rows // 2 : rows // 2 + 1], out_dtype=torch.float32),
                                   y32[rows // 2 :][:1], atol=0, rtol=0)


def test_amx_path_is_chosen_by_the_weight_shape_alone():
    """Where AMX runs, it runs for every row count of a weight whose K is a multiple of 32, so a row's
    result never depends on how many rows came with it (the two paths round differently)."""
    if _C.isa() != "avx512_bf16" or _C.linear_path(576) != "amx":
        pytest.skip("no AMX on this build/CPU")
    assert _C.linear_path(577) == _C.linear_path(100) == best_avx512_path()  # K not a multiple of 32
    w, b, x = make(3072, 576, 70, seed=5, with_bias=True)
    lin = PackedLinear(w, b, out_dtype=torch.float32)
    whole = lin(x)
    for r in (0, 17, 69):  # alone, and in a batch whose last 16-row block is partial
        assert torch.equal(lin(x[r : r + 1]), whole[r : r + 1])
        assert torch.equal(lin(x[: r + 5])[r], whole[r])


@pytest.mark.parametrize("n,k", [(3072, 576), (100, 33), (33, 577)])
@pytest.mark.parametrize("rows", [1, 3, 5, 9, 16, 40])
def test_fp32_kernel_gives_the_bits_of_vdpbf16ps(n, k, rows):
    """The widened kernel adds each k pair's products odd k first, as vdpbf16ps does, and bf16 x bf16
    products are exact in fp32: the two kernels agree to the bit (operands without subnormals), so the
    path a host takes does not change a token."""
    if not BF16_DOT:
        pytest.skip("no native bf16 linear in this build")
    w, b, x = make(n, k, rows, seed=rows * 13 + n, with_bias=True)
    lin = PackedLinear(w, b, out_dtype=torch.float32)
    try:
        outs = []
        for p in ("avx512_fp32", "avx512_bf16"):
            _C.set_linear_path(p)
            assert _C.linear_path(k) == p
            outs.append(lin(x))
    finally:
        _C.set_linear_path("amx")
    assert torch.equal(outs[0], outs[1])


def test_best_path_without_amx():
    """Where AMX does not run, the default is the fp32 kernel on builds for AVX512-FP16 CPUs (Intel
    Sapphire Rapids and later, where vdpbf16ps runs at a quarter of the FMA rate), else vdpbf16ps."""
    if not BF16_DOT:
        pytest.skip("no native bf16 linear in this build")
    assert _C.linear_path(100) == best_avx512_path()


def test_zero_rows():
    lin = PackedLinear(torch.randn(20, 8).bfloat16())
    assert lin(torch.empty(0, 8, dtype=torch.bfloat16)).shape == (0, 20)


@pytest.mark.skipif(not BF16_DOT, reason="no native bf16 linear in this build (no packed copy)")
def test_packed_copy_in_an_arena():
    """A model's packed weights go to its HugePageArena (huge pages: a decode step streams them), one
    after the other, computing the same bits as a standalone packed copy."""
    arena = HugePageArena(chunk_bytes=16 << 20)  # all three in one chunk
    lins = [PackedLinear(w, b, arena=arena) for w, b, _ in (make(n, k, 1, n, True) for n, k in SHAPES[:3])]
    ptrs = [lin.packed.data_ptr() for lin in lins]
    assert ptrs == sorted(ptrs) and all(huge_page_eligible(p) for p in ptrs)
    for lin, (w, b, x) in zip(lins, (make(n, k, 5, n, True) for n, k in SHAPES[:3])):
        assert torch.equal(lin.packed, pack_weight(w))
        assert torch.equal(lin(x), PackedLinear(w, b)(x))


def test_pack_layout():
    w = torch.arange(20 * 5, dtype=torch.float32).view(20, 5)
    p = pack_weight(w)
    assert p.shape == (2, 3, 16, 2) and p.dtype == torch.bfloat16
    assert p[1, 2, 3, 0] == w[19, 4] and p[0, 1, 5, 1] == w[5, 3]
    assert (p[1, :, 4:] == 0).all() and (p[:, 2, :, 1] == 0).all()  # padding rows / k column


def test_nonfinite_x_beyond_odd_k_is_not_read():
    """With K odd, the last k pair has one real element: what follows the row in memory must not leak in."""
    w = torch.ones(16, 3).bfloat16()
    x = torch.tensor([[1.0, 2.0, 3.0], [float("inf"), float("nan"), 1.0]]).bfloat16()
    lin = PackedLinear(w)
    assert torch.equal(lin(x[:1]), torch.full((1, 16), 6.0).bfloat16())  # x[:1] shares x's storage
    y = lin(torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]).bfloat16())
    assert torch.equal(y.float(), torch.tensor([[6.0] * 16, [15.0] * 16]))


def test_bad_args():
    w = torch.randn(32, 16).bfloat16()
    lin = PackedLinear(w)
    with pytest.raises(TypeError, match="x has dtype float32"):
        lin(torch.randn(2, 16))
    with pytest.raises(ValueError, match=r"x must have shape \[\*, 16\]"):
        lin(torch.randn(2, 15).bfloat16())
    with pytest.raises(ValueError, match="x must have shape"):
        lin(torch.randn(16).bfloat16())
    with pytest.raises(ValueError, match="x must be contiguous"):
        lin(torch.randn(16, 2).bfloat16().T)
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        lin([[0.0] * 16])
    with pytest.raises(TypeError, match="out_dtype"):
        lin(torch.randn(2, 16).bfloat16(), out_dtype=torch.float16)
    with pytest.raises(TypeError, match="weight has dtype int64"):
        PackedLinear(torch.ones(4, 4, dtype=torch.int64))
    with pytest.raises(ValueError, match="weight must have 2 dimensions"):
        PackedLinear(torch.randn(4).bfloat16())
    with pytest.raises(ValueError, match="weight must be non-empty"):
        PackedLinear(torch.randn(0, 4).bfloat16())
    with pytest.raises(ValueError, match=r"bias must have shape \[32\]"):
        PackedLinear(w, torch.randn(31))


def test_non_cpu_weight_uses_torch():
    """Off the CPU (CUDA; here the meta device stands in) nothing is packed and torch runs."""
    lin = PackedLinear(torch.empty(48, 32, dtype=torch.bfloat16, device="meta"))
    assert lin.packed is None
    y = lin(torch.empty(3, 32, dtype=torch.bfloat16, device="meta"), out_dtype=torch.float32)
    assert y.shape == (3, 48) and y.dtype == torch.float32 and y.device.type == "meta"
