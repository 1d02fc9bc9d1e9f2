"""QuantLinear (native/cpu/qlinear.cpp) against a torch reference on the same numbers: the weight
dequantized by gguf's numpy dequantizer, the activations rounded to int8 per 32-block as the kernel
does; every SIMD path of this build (the VNNI one and the portable one)."""
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from pyengine import _C
from pyengine.ops.qlinear import QUANT_TYPES, QuantLinear

PATHS = ["portable"] + (["avx512_vnni"] if _C.qlinear_isa() == "avx512_vnni" else [])


@pytest.fixture(params=PATHS)
def path(request):
    _C.set_qlinear_portable(request.param == "portable")
    yield request.param
    _C.set_qlinear_portable(False)


def quantized_weight(type_name: str, n: int, k: int, seed: int) -> tuple[np.ndarray, torch.Tensor]:
    """(GGUF blocks [n, row bytes], their fp32 dequantization [n, k])."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((n, k)) * 0.05 + rng.standard_normal((n, 1)) * 0.02).astype(np.float32)
    qtype = GGMLQuantizationType[type_name]
    blocks = quants.quantize(w, qtype)
    return blocks, torch.from_numpy(quants.dequantize(blocks, qtype).astype(np.float32))


def round_activations(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] -> the values the kernel multiplies: per 32-block, d1 q1 + d2 q2 with q = round(v / d),
    d = amax(v) / 127, for v = x and then v = its residual x - d1 q1."""
    v = x.float().view(x.shape[0], -1, 32)
    total = torch.zeros_like(v)
    for _ in range(2):
        d = v.abs().amax(dim=-1, keepdim=True) / 127
        inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
        level = torch.round(v * inv) * d
        total, v = total + level, v - level
    return total.view(x.shape)


# fp32 accumulation, and a rounding tie the kernel breaks the other way than torch in the first level,
# which the second level absorbs to within half its step (amax / 127**2 / 2 = 2**-15 of the block's
# largest value): the kernel agrees with the reference to that, relative to sum |x| |w|.
TOL = 2**-15


def reference(x, w, bias):
    out = round_activations(x).double() @ w.double().T
    return out if bias is None else out + bias.to(torch.bfloat16).double()


@pytest.mark.parametrize("type_name", list(QUANT_TYPES))
@pytest.mark.parametrize("n,k", [(1, 32), (17, 96), (50, 800), (40, 576)])
def test_matches_reference(path, type_name, n, k):
    blocks, w = quantized_weight(type_name, n, k, seed=n * k)
    bias = torch.randn(n) * 0.1 if n % 2 else None
    lin = QuantLinear(blocks, type_name, bias)
    for m in (1, 2, 3, 5, 8, 9, 17, 70):
        x = torch.randn(m, k, dtype=torch.bfloat16)
        x[0, :32] = 0  # an all-zero block: scale 0
        want = reference(x, w, bias)
        scale = (round_activations(x).abs().double() @ w.abs().double().T) + 1e-3
        got32 = lin(x, out_dtype=torch.float32).double()
        assert ((got32 - want).abs() / scale).max() < TOL, (m, path)
        got16 = lin(x.float()).double()  # fp32 activations, bf16 out: one rounding
        assert ((got16 - want).abs() / (scale + want.abs())).max() < 2**-8, (m, path)


@pytest.mark.parametrize("type_name", list(QUANT_TYPES))
def test_prefill_sized_batch(type_name):
    """M large enough for the row panels (and the threaded activation quantization)."""
    blocks, w = quantized_weight(type_name, 70, 256, seed=3)
    x = torch.randn(300, 256, dtype=torch.bfloat16)
    got = QuantLinear(blocks, type_name)(x, out_dtype=torch.float32).double()
    want = reference(x, w, None)
    scale = round_activations(x).abs().double() @ w.abs().double().T
    assert ((got - want).abs() / scale).max() < TOL


@pytest.mark.parametrize("type_name", list(QUANT_TYPES))
def test_embedding_rows_are_the_dequantized_rows(type_name):
    blocks, w = quantized_weight(type_name, 37, 64, seed=5)
    lin = QuantLinear(blocks, type_name)
    ids = torch.tensor([0, 36, 17, 17, 5])
    torch.testing.assert_close(lin.embedding(ids, torch.float32), w[ids], rtol=1e-6, atol=1e-7)
    assert torch.equal(lin.embedding(ids, torch.bfloat16), w[ids].to(torch.bfloat16))
    with pytest.raises(IndexError, match="token id 37"):
        lin.embedding(torch.tensor([37]), torch.float32)


def test_resident_bytes_are_the_file_bytes():
    blocks, _ = quantized_weight("Q4_1", 64, 576, seed=1)
    assert QuantLinear(blocks, "Q4_1").nbytes == blocks.nbytes  # 16-row tiles: no padding here


def test_bad_input_is_named():
    blocks, _ = quantized_weight("Q8_0", 16, 64, seed=2)
    with pytest.raises(ValueError, match="no native kernel for GGML type Q4_K"):
        QuantLinear(blocks, "Q4_K")
    with pytest.raises(ValueError, match="multiple of 20 bytes"):
        QuantLinear(blocks, "Q4_1")  # Q8_0 rows: 68 bytes
    lin = QuantLinear(blocks, "Q8_0")
    with pytest.raises(ValueError, match="x must have shape"):
        lin(torch.zeros(2, 32, dtype=torch.bfloat16))
