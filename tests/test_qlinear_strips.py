"""qlinear's many-row path (native/cpu/linear/quant_strips.cpp): from qlinear_strip_rows() rows of bf16
activations the weight is dequantized a strip at a time for linear_bf16's kernel (on AMX, up to 32 rows, a
group at a time into L1 tiles multiplied at once; the 4-bit types with one scale a group through per-row
lookup tables, the weight as the A tile). Its result is, bit for bit, what PackedLinear gives on the weight
dequantized at load (weights="dequantize"): per type, on odd shapes, on every bf16 kernel path of this
build, and through the model."""
import pytest
import torch

from model_helpers import SequenceRunner, default_model_path
from pyengine import _C
from pyengine.model.gguf import dequantize
from pyengine.model.loader import load_model
from pyengine.ops.linear import PackedLinear
from pyengine.ops.qlinear import QUANT_TYPES, QuantLinear
from test_qlinear_op import quantized_weight
from test_linear_op import path  # noqa: F401  (each linear_bf16 path the strips feed: AMX, AVX-512)

STRIPS = _C.isa() == "avx512_bf16"  # qlinear_strips needs linear_bf16's SIMD kernels
pytestmark = pytest.mark.skipif(not STRIPS, reason="no AVX512-BF16 linear in this build: int8 kernels only")


@pytest.fixture
def strip_rows():
    """Sets qlinear_strip_rows for one test, restored after."""
    default = _C.qlinear_strip_rows()
    yield _C.set_qlinear_strip_rows
    _C.set_qlinear_strip_rows(default)


def load_time_bf16(blocks, type_name: str, n: int, k: int) -> torch.Tensor:
    """The weight as weights="dequantize" holds it: gguf.py's load-time dequantization, rounded to bf16."""
    return dequantize(blocks, type_name, (n, k)).to(torch.bfloat16)


def assert_bit_identical(q: QuantLinear, bf16: PackedLinear, rows):
    for m in rows:
        x = torch.randn(m, q.in_features, dtype=torch.bfloat16)
        for out_dtype in (torch.float32, torch.bfloat16):
            assert torch.equal(q(x, out_dtype=out_dtype), bf16(x, out_dtype=out_dtype)), (m, out_dtype)


def shapes(type_name: str) -> list[tuple[int, int]]:
    """(N, K): one row, odd tile counts (partial last tile, odd strips), K of one block and of many."""
    if QUANT_TYPES[type_name][1] == 256:
        return [(1, 256), (17, 768), (50, 512)]
    return [(1, 32), (17, 96), (50, 800), (40, 576)]


@pytest.mark.parametrize("type_name", list(QUANT_TYPES))
def test_bit_identical_to_the_dequantized_weight(path, strip_rows, type_name):
    strip_rows(1)  # every M, down to one row
    for n, k in shapes(type_name):
        blocks, _ = quantized_weight(type_name, n, k, seed=n * k)
        bias = torch.randn(n) * 0.1 if n % 2 else None
        assert_bit_identical(QuantLinear(blocks, type_name, bias),
                             PackedLinear(load_time_bf16(blocks, type_name, n, k), bias),
                             rows=(1, 8, 16, 17, 24, 32, 33, 70, 130))


def test_row_ranges_of_different_types(path, strip_rows):
    """A fused projection whose parts differ in type (Q4_K_M's qkv): strips never straddle two of them."""
    strip_rows(1)
    parts = [(t, n, quantized_weight(t, n, 512, seed=n)[0]) for t, n in (("Q5_0", 24), ("Q8_0", 7), ("Q6_K", 17),
                                                                        ("Q4_K", 3))]
    bias = torch.randn(51) * 0.1
    q = QuantLinear([b for _, _, b in parts], [t for t, _, _ in parts], bias)
    w = torch.cat([load_time_bf16(b, t, n, 512) for t, n, b in parts])
    assert_bit_identical(q, PackedLinear(w, bias), rows=(3, 16, 45))


def test_prefill_sized_batch(path, strip_rows):
    """Many rows at the AMX hosts' threshold: x in panels (AVX-512), many 32-row blocks (AMX), and a weight
    of many strips."""
    strip_rows(16)
    blocks, _ = quantized_weight("Q4_1", 2000, 576, seed=4)
    assert_bit_identical(QuantLinear(blocks, "Q4_1"), PackedLinear(load_time_bf16(blocks, "Q4_1", 2000, 576)),
                         rows=(300,))


def test_threshold_and_activation_dtype_choose_the_path(strip_rows):
    """From qlinear_strip_rows() rows of bf16 x the strips run; below it, or for fp32 x, the int8 kernels."""
    blocks, _ = quantized_weight("Q8_0", 40, 576, seed=6)
    q, bf16 = QuantLinear(blocks, "Q8_0"), PackedLinear(load_time_bf16(blocks, "Q8_0", 40, 576))
    x = torch.randn(20, 576, dtype=torch.bfloat16)
    strip_rows(0)
    int8 = q(x, out_dtype=torch.float32)
    assert not torch.equal(int8, bf16(x, out_dtype=torch.float32))  # the two paths are told apart
    strip_rows(20)
    assert torch.equal(q(x, out_dtype=torch.float32), bf16(x, out_dtype=torch.float32))
    strip_rows(21)
    assert torch.equal(q(x, out_dtype=torch.float32), int8)
    strip_rows(1)
    strips_off = q(x.float(), out_dtype=torch.float32)
    strip_rows(0)
    assert torch.equal(strips_off, q(x.float(), out_dtype=torch.float32))


def test_default_threshold_is_eight_rows_on_amx_else_never():
    """Beside vdpbf16ps (no AMX) the int8 kernels are faster at every M (bench/engine/bench_quant_steps.py)."""
    assert _C.qlinear_strip_rows() == (8 if _C.linear_path(576) == "amx" else 0)


def test_model_prompt_bit_identical_to_dequantize(strip_rows):
    """The default model (Q4_1 projections, a tied Q8_0 embedding and lm_head), bf16: a prompt step of >= 16
    tokens gives the logits weights="dequantize" gives, bit for bit (native decoder layers and the
    op-by-op path)."""
    strip_rows(16)
    cfg, auto = load_model(default_model_path(), torch.bfloat16, "cpu")
    _, ref = load_model(default_model_path(), torch.bfloat16, "cpu", weights="dequantize")
    assert isinstance(auto.lm_head_linear, QuantLinear) and not isinstance(ref.lm_head_linear, QuantLinear)
    ids = torch.randint(100, 40000, (37,), generator=torch.Generator().manual_seed(0)).tolist()
    native_rows = auto.native_layer_rows
    for rows in (native_rows, 0):  # decoder_layers, then the op-by-op path
        auto.native_layer_rows = ref.native_layer_rows = rows
        for n in (16, 37):
            a, b = SequenceRunner(auto, cfg, n), SequenceRunner(ref, cfg, n)
            assert torch.equal(a.step(ids[:n], all_logits=True), b.step(ids[:n], all_logits=True)), (rows, n)
