"""QuantLinear's int8 kernels (native/cpu/linear/quant.cpp) against a torch reference on the same numbers: the
weight dequantized by gguf's numpy dequantizer, the activations rounded to int8 per 32-block as the kernel
does; every SIMD path of this build (scalar, AVX2, AVX512-VNNI, AMX: M >= 8 rows, 16 at a time, the rest
on VNNI). The many-row path that runs instead on AMX hosts (linear/quant_strips.cpp) is off here; it has its own
tests (test_qlinear_strips.py)."""
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from pyengine import _C
from pyengine.model.kquants import quantize_k
from pyengine.ops.huge_pages import HugePageArena
from pyengine.ops.qlinear import QUANT_TYPES, QuantLinear
from tests.model_helpers import huge_page_eligible

PATHS = _C.qlinear_isas().split(",")
K_QUANTS = ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]
# the types made of random bits, and their blocks' fp16 fields: (d, dmin) at bytes 0, 2 (Q4_K, Q5_K), 80, 82
# (Q2_K); d at byte 108 (Q3_K), 208 (Q6_K), 0 (IQ4_NL, IQ4_XS)
FP16_FIELDS = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "IQ4_NL": (0,),
               "IQ4_XS": (0,)}


@pytest.fixture(autouse=True)
def int8_kernels_at_every_m():
    rows = _C.qlinear_strip_rows()
    _C.set_qlinear_strip_rows(0)
    yield
    _C.set_qlinear_strip_rows(rows)


@pytest.fixture(params=PATHS)
def path(request):
    best = _C.qlinear_isa()
    _C.set_qlinear_isa(request.param)
    yield request.param
    _C.set_qlinear_isa(best)


def quantized_weight(type_name: str, n: int, k: int, seed: int) -> tuple[np.ndarray, torch.Tensor]:
    """(GGUF blocks [n, row bytes], their fp32 dequantization [n, k]). K-quants and IQ4 types: random
    bits (every pattern of the packed 6-bit scales and high bits) with finite scales; K-quants: half the
    rows written by kquants' quantizer."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((n, k)) * 0.05 + rng.standard_normal((n, 1)) * 0.02).astype(np.float32)
    qtype = GGMLQuantizationType[type_name]
    if type_name in FP16_FIELDS:
        _, values, block_bytes = QUANT_TYPES[type_name]
        blocks = rng.integers(0, 256, size=(n, k // values, block_bytes), dtype=np.uint8)
        for off in FP16_FIELDS[type_name]:
            blocks[..., off : off + 2] = (rng.random((n, k // values, 1)) * 1e-3).astype(np.float16).view(np.uint8)
        blocks = blocks.reshape(n, -1)
        if type_name in K_QUANTS:
            blocks[::2] = quantize_k(w[::2], type_name)
    else:
        blocks = quants.quantize(w, qtype)
    return blocks, torch.from_numpy(quants.dequantize(blocks, qtype).astype(np.float32).reshape(n, k))


def shapes(type_name: str) -> list[tuple[int, int]]:
    """(N, K) cases: odd row counts (partial tiles), K of one and of many blocks."""
    if QUANT_TYPES[type_name][1] == 256:
        return [(1, 256), (17, 512), (50, 768)]
    return [(1, 32), (17, 96), (50, 800), (40, 576)]


def round_activations(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] -> the values the kernel multiplies: per 32-block, d1 q1 + d2 q2 with q = round(v / d),
    clamped to +-127: v = x with d1 = amax(x) / 127, then v = its residual x - d1 q1 with d2 = d1 / 256."""
    v = x.float().view(x.shape[0], -1, 32)
    d = v.abs().amax(dim=-1, keepdim=True) / 127
    total = torch.zeros_like(v)
    for _ in range(2):
        inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
        level = torch.round(v * inv).clamp(-127, 127) * d
        total, v, d = total + level, v - level, d / 256
    return total.view(x.shape)


# fp32 accumulation, and a rounding tie the kernel breaks the other way than torch in the first level,
# which the second level absorbs to within its step (amax / 127 / 256 < 2**-15 of the block's largest
# value): the kernel agrees with the reference to that, relative to sum |x| |w|.
TOL = 2**-15


def reference(x, w, bias):
    out = round_activations(x).double() @ w.double().T
    return out if bias is None else out + bias.to(torch.bfloat16).double()


def check_against_reference(lin, w, bias, path):
    n, k = w.shape
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
def test_matches_reference(path, type_name):
    for n, k in shapes(type_name):
        blocks, w = quantized_weight(type_name, n, k, seed=n * k)
        bias = torch.randn(n) * 0.1 if n % 2 else None
        check_against_reference(QuantLinear(blocks, type_name, bias), w, bias, path)


def test_row_ranges_of_different_types(path):
    """A fused projection whose parts differ in type (Q4_K_M's qkv: Q5_0 q/k, a Q8_0 or Q6_K v)."""
    parts = [quantized_weight(t, n, 512, seed=n) for t, n in (("Q5_0", 24), ("Q8_0", 7), ("Q6_K", 17), ("Q4_K", 3))]
    bias = torch.randn(51) * 0.1
    lin = QuantLinear([b for b, _ in parts], ["Q5_0", "Q8_0", "Q6_K", "Q4_K"], bias)
    assert lin.type_name == "Q5_0+Q8_0+Q6_K+Q4_K" and lin.out_features == 51
    check_against_reference(lin, torch.cat([w for _, w in parts]), bias, path)


@pytest.mark.parametrize("type_name", list(QUANT_TYPES))
def test_prefill_sized_batch(type_name):
    """M large enough for the row panels (and the threaded activation quantization)."""
    blocks, w = quantized_weight(type_name, 70, 512, seed=3)
    x = torch.randn(300, 512, dtype=torch.bfloat16)
    got = QuantLinear(blocks, type_name)(x, out_dtype=torch.float32).double()
    want = reference(x, w, None)
    scale = round_activations(x).abs().double() @ w.abs().double().T
    assert ((got - want).abs() / scale).max() < TOL


@pytest.mark.parametrize("type_name", list(QUANT_TYPES))
def test_a_rows_result_does_not_depend_on_its_batch(path, type_name):
    """Row i of a 70-row call (on AMX: 64 rows on tiles, 6 on VNNI) equals row i alone (a decode step:
    VNNI), to the bit: a request's tokens do not change with the batch it is scheduled in."""
    blocks, _ = quantized_weight(type_name, 40, 512, seed=7)
    lin = QuantLinear(blocks, type_name, torch.randn(40) * 0.1)
    x = torch.randn(70, 512, dtype=torch.bfloat16)
    for out_dtype in (torch.float32, torch.bfloat16):
        batch = lin(x, out_dtype=out_dtype)
        alone = torch.cat([lin(x[i : i + 1], out_dtype=out_dtype) for i in range(70)])
        assert torch.equal(batch, alone), (path, out_dtype)


@pytest.mark.parametrize("type_name", list(QUANT_TYPES))
def test_embedding_rows_are_the_dequantized_rows(type_name):
    blocks, w = quantized_weight(type_name, 37, 256, seed=5)
    lin = QuantLinear(blocks, type_name)
    ids = torch.tensor([0, 36, 17, 17, 5])
    torch.testing.assert_close(lin.embedding(ids, torch.float32), w[ids], rtol=1e-6, atol=1e-7)
    assert torch.equal(lin.embedding(ids, torch.bfloat16), w[ids].to(torch.bfloat16))
    with pytest.raises(IndexError, match="token id 37"):
        lin.embedding(torch.tensor([37]), torch.float32)


@pytest.mark.parametrize("type_name", list(QUANT_TYPES))
def test_resident_bytes_are_the_file_bytes(type_name):
    blocks, _ = quantized_weight(type_name, 64, 512, seed=1)
    ratio = QuantLinear(blocks, type_name).nbytes / blocks.nbytes  # 16-row tiles: no padding here
    # the K-quants' packed 6-bit scales take a byte each (Q4_K, Q5_K: 12 bytes -> 16; Q3_K 12 -> 16)
    assert ratio == {"Q4_K": 148 / 144, "Q5_K": 180 / 176, "IQ4_XS": 138 / 136, "Q3_K": 114 / 110}.get(type_name, 1.0)


def test_weights_from_an_arena():
    """A model's weights (HugePageArena): 64-byte aligned, one after the other in memory madvised for huge pages
    (the M = 1 kernels stream them faster), computing the same bits as standalone weights."""
    arena = HugePageArena(chunk_bytes=4 << 20)
    parts = [quantized_weight("Q4_1", n, 512, seed=n) for n in (16, 40, 7)] + [quantized_weight("Q8_0", 600, 2048, 1)]
    lins = [QuantLinear(b, t, arena=arena) for (b, _), t in zip(parts, ["Q4_1"] * 3 + ["Q8_0"])]
    ptrs = [lin.tiles[0].data_ptr() for lin in lins]
    assert all(p % 64 == 0 for p in ptrs) and ptrs[:3] == sorted(ptrs[:3])  # the Q8_0 one: a new chunk
    assert all(huge_page_eligible(p) for p in ptrs)
    for lin, (b, t) in zip(lins, [(b, t) for (b, _), t in zip(parts, ["Q4_1"] * 3 + ["Q8_0"])]):
        x = torch.randn(3, lin.in_features, dtype=torch.bfloat16)
        assert torch.equal(lin(x), QuantLinear(b, t)(x))


def test_bad_input_is_named():
    blocks, _ = quantized_weight("Q8_0", 16, 64, seed=2)
    with pytest.raises(ValueError, match="no native kernel for GGML type IQ2_XS"):
        QuantLinear(blocks, "IQ2_XS")
    with pytest.raises(ValueError, match="multiple of 144 bytes"):
        QuantLinear(blocks, "Q4_K")
    with pytest.raises(ValueError, match="multiple of 20 bytes"):
        QuantLinear(blocks, "Q4_1")  # Q8_0 rows: 68 bytes
    lin = QuantLinear(blocks, "Q8_0")
    with pytest.raises(ValueError, match="x must have shape"):
        lin(torch.zeros(2, 32, dtype=torch.bfloat16))


def test_unknown_simd_path_is_named():
    with pytest.raises(ValueError, match="SIMD path 'neon' is not in this build"):
        _C.set_qlinear_isa("neon")


def test_amx_path_where_the_host_has_it():
    """A build for an AMX host (-march=native there) runs steps of 8+ rows on AMX tiles by default."""
    with open("/proc/cpuinfo") as f:
        flags = f.read().split()
    if "amx_int8" not in flags:
        pytest.skip("this CPU has no AMX-INT8")
    if _C.isa() != "avx512_bf16":  # PYENGINE_CPU_ARCH=x86-64-v3 and the like: the build has no AMX code
        pytest.skip(f"a build for an older -march than this CPU's (isa {_C.isa()})")
    assert "amx" in PATHS and _C.qlinear_isa() == "amx"
