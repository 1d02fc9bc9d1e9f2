"""qlinear's AMX-INT8 GEMM (native/cpu/linear/quant_amx.cpp) against a torch reference on the same numbers:
the weight dequantized by gguf's numpy dequantizer, the activations rounded as the kernel rounds them (one int8
code per value, per 32-block scale amax / 127); every type, odd shapes (partial tiles, K not a multiple of 256
where the type allows, M not a multiple of 16, panels of many rows), fused weights of several types; and which
path qlinear takes for how many rows, on each SIMD path of this build."""
import pytest
import torch

from pyengine import _C
from pyengine.ops.qlinear import QUANT_TYPES, QuantLinear
from test_qlinear_op import quantized_weight

AMX = "amx" in _C.qlinear_isas().split(",")
needs_amx = pytest.mark.skipif(not AMX, reason="no AMX-INT8 in this build or process: the GEMM is not built")


@pytest.fixture
def gemm_rows():
    """Sets qlinear_gemm_rows for one test (the SIMD path at amx, the strips off), restored after."""
    defaults = _C.qlinear_gemm_rows(), _C.qlinear_strip_rows(), _C.qlinear_isa()
    _C.set_qlinear_strip_rows(0)
    _C.set_qlinear_isa("amx")
    yield _C.set_qlinear_gemm_rows
    _C.set_qlinear_gemm_rows(defaults[0])
    _C.set_qlinear_strip_rows(defaults[1])
    _C.set_qlinear_isa(defaults[2])


def round_activations(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] -> the values the GEMM multiplies: per 32-block, d q with d = amax / 127 (fp32) and
    q = nearbyint(v * (1 / d)) (0 for an all-zero block), as the kernel computes them."""
    v = x.float().view(x.shape[0], -1, 32)
    d = v.abs().amax(dim=-1, keepdim=True) / 127
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    return (torch.round(v * inv).clamp(-127, 127) * d).view(x.shape)


def reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out = round_activations(x).double() @ w.double().T
    return out if bias is None else out + bias.to(torch.bfloat16).double()


# int32 sums are exact; what is left is fp32 accumulation across the blocks, relative to sum |x| |w|
TOL = 2**-16


def check(lin: QuantLinear, w: torch.Tensor, bias: torch.Tensor | None, rows=(16, 17, 31, 64, 130)) -> None:
    n, k = w.shape
    for m in rows:
        x = torch.randn(m, k, dtype=torch.bfloat16)
        x[0, :32] = 0  # an all-zero block: scale 0
        x[m - 1, -32:] *= 1000  # a block far larger than the rest of its row
        assert _C.qlinear_path(m, k) == "amx_gemm"
        want = reference(x, w, bias)
        scale = round_activations(x).abs().double() @ w.abs().double().T + 1e-6
        got = lin(x, out_dtype=torch.float32).double()
        assert ((got - want).abs() / scale).max() < TOL, m
        got = lin(x.float(), out_dtype=torch.float32).double()  # fp32 activations: the same codes
        assert ((got - want).abs() / scale).max() < TOL, m
        got16 = lin(x).double()  # bf16 out: one rounding more
        assert ((got16 - want).abs() / (scale + want.abs())).max() < 2**-8, m


def shapes(type_name: str) -> list[tuple[int, int]]:
    """(N, K): one row, partial tiles; K of one block and of many, not a multiple of 256 where the type allows."""
    if QUANT_TYPES[type_name][1] == 256:
        return [(1, 256), (17, 768), (50, 512)]
    return [(1, 32), (17, 96), (50, 800)]


@needs_amx
@pytest.mark.parametrize("type_name", list(QUANT_TYPES))
def test_matches_reference(gemm_rows, type_name):
    gemm_rows(16)
    for n, k in shapes(type_name):
        blocks, w = quantized_weight(type_name, n, k, seed=n * k)
        bias = torch.randn(n) * 0.1 if n % 2 else None
        check(QuantLinear(blocks, type_name, bias), w, bias)


@needs_amx
def test_row_panels(gemm_rows):
    """More rows than one panel (the activations' L2 share): each panel on every tile."""
    gemm_rows(16)
    blocks, w = quantized_weight("Q4_K", 40, 512, seed=3)
    check(QuantLinear(blocks, "Q4_K"), w, None, rows=(300, 515))


@needs_amx
def test_row_ranges_of_different_types(gemm_rows):
    """A fused projection whose parts differ in type (Q4_K_M's qkv): the activations quantized once for all."""
    gemm_rows(16)
    parts = [quantized_weight(t, n, 512, seed=n) for t, n in (("Q5_0", 24), ("Q8_0", 7), ("Q6_K", 17), ("Q4_1", 3))]
    bias = torch.randn(51) * 0.1
    lin = QuantLinear([b for b, _ in parts], ["Q5_0", "Q8_0", "Q6_K", "Q4_1"], bias)
    check(lin, torch.cat([w for _, w in parts]), bias, rows=(16, 45))


@needs_amx
def test_path_by_rows(gemm_rows):
    """From qlinear_gemm_rows rows on the amx path; below, and on every other SIMD path, the int8 kernels."""
    gemm_rows(16)
    assert _C.qlinear_gemm_rows() == 16
    assert [_C.qlinear_path(m, 512) for m in (1, 15, 16, 500)] == ["amx", "amx", "amx_gemm", "amx_gemm"]
    blocks, w = quantized_weight("Q8_0", 40, 512, seed=1)
    lin = QuantLinear(blocks, "Q8_0")
    x = torch.randn(20, 512, dtype=torch.bfloat16)
    gemm = lin(x, out_dtype=torch.float32)
    for isa in _C.qlinear_isas().split(","):
        if isa != "amx":
            _C.set_qlinear_isa(isa)
            assert _C.qlinear_path(20, 512) == isa
            assert not torch.equal(lin(x, out_dtype=torch.float32), gemm)  # the int8 kernels' value and residual
    _C.set_qlinear_isa("amx")
    gemm_rows(0)
    assert _C.qlinear_path(500, 512) == "amx"
    assert not torch.equal(lin(x, out_dtype=torch.float32), gemm)


def test_server_flag_reaches_the_engine_config():
    from server.cli import build_parser, engine_config

    assert engine_config(build_parser().parse_args(["--qlinear-gemm-rows", "16"])).qlinear_gemm_rows == 16
    assert engine_config(build_parser().parse_args([])).qlinear_gemm_rows == 0
