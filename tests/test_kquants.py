"""pyengine.model.kquants' quantizers (requantize's K-quants and IQ4_NL, which the gguf package cannot
write): their blocks, read back by gguf's reference dequantizer, are the input to within the type's
rounding (a bit in the wrong place of the layout costs far more)."""
import numpy as np
import pytest
from gguf import GGMLQuantizationType, quants

from pyengine.model.kquants import quantize_k

# relative RMS error of a plain min/max quantizer on Gaussian rows, with some margin: 2, 3, 4, 5, 6 bits
# (IQ4_NL: 4-bit levels)
MAX_ERROR = {"Q2_K": 0.35, "Q3_K": 0.18, "Q4_K": 0.09, "Q5_K": 0.045, "Q6_K": 0.025, "IQ4_NL": 0.09}


@pytest.mark.parametrize("type_name", list(MAX_ERROR))
def test_blocks_read_back_as_the_values(type_name):
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((64, 512)) * 0.05 + rng.standard_normal((64, 1)) * 0.02).astype(np.float32)
    x[3] = 0  # all-zero blocks: scale 0, no NaN
    blocks = quantize_k(x, type_name)
    qtype = GGMLQuantizationType[type_name]
    per_block, block_bytes = quants.GGML_QUANT_SIZES[qtype]
    assert blocks.shape == (64, 512 // per_block * block_bytes) and blocks.dtype == np.uint8
    y = quants.dequantize(blocks, qtype).reshape(x.shape)
    assert np.all(y[3] == 0)
    assert np.sqrt(((y - x) ** 2).mean() / (x**2).mean()) < MAX_ERROR[type_name]


def test_rows_of_part_of_a_super_block_are_refused():
    with pytest.raises(ValueError, match="Q3_K needs rows of a multiple of 256 values, got 576"):
        quantize_k(np.zeros((2, 576), np.float32), "Q3_K")
