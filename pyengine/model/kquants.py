"""Quantizers for the K-quant GGUF types (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K), IQ4_NL (llama.cpp's fallback for
Q2_K/Q3_K rows) and llama.cpp's Q4_K_M / Q5_K_M type mixes, for `requantize` (benchmarks and accuracy tests
of the native kernels without llama.cpp).

The `gguf` package dequantizes these types but does not quantize them. These are the plain min/max
quantizers (one pass, no search for the best scales as llama.cpp's make_qkx2 / make_q3_quants do), so
their files are a little less accurate than llama-quantize's; the block layouts are the ones in gguf.py's
docstring and native/include/pyengine/ggml_blocks.h.
"""
from __future__ import annotations

import numpy as np

# type -> the type llama.cpp writes instead when a row is not a whole number of 256-value super-blocks
K_FALLBACK = {"Q2_K": "IQ4_NL", "Q3_K": "IQ4_NL", "Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}
# llama.cpp's kvalues_iq4nl: IQ4_NL's 16 levels
IQ4_NL_LEVELS = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.float32)
_IQ4_NL_MIDPOINTS = (IQ4_NL_LEVELS[1:] + IQ4_NL_LEVELS[:-1]) / 2


def _f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16)


def _div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a / b, 0 where b is 0."""
    return np.divide(a, b, out=np.zeros(np.broadcast(a, b).shape, np.float32), where=b != 0)


def _scales_and_mins(xs: np.ndarray, top: int, scale_top: int) -> tuple[np.ndarray, ...]:
    """The plain min/max quantizer of the types with value = d sc q - dmin m (Q2_K, Q4_K, Q5_K): xs [nb,
    sub-blocks, values] -> d, dmin [nb, 1] fp16; sc, m [nb, sub-blocks] uint8 in [0, scale_top]; q uint8
    in [0, top], xs's shape."""
    low = np.minimum(xs.min(-1), 0)
    scale, minv = (xs.max(-1) - low) / top, -low
    d = _f16(scale.max(-1, keepdims=True) / scale_top)
    dmin = _f16(minv.max(-1, keepdims=True) / scale_top)
    sc = np.clip(np.rint(_div(scale, d.astype(np.float32))), 0, scale_top).astype(np.uint8)
    m = np.clip(np.rint(_div(minv, dmin.astype(np.float32))), 0, scale_top).astype(np.uint8)
    eff_d = (d.astype(np.float32) * sc)[..., None]
    eff_m = (dmin.astype(np.float32) * m)[..., None]
    q = np.clip(np.rint(_div(xs + eff_m, eff_d)), 0, top).astype(np.uint8)
    return d, dmin, sc, m, q


def _q45_k(x: np.ndarray, bits: int) -> np.ndarray:
    """[nb, 256] fp32 -> [nb, 144 (Q4_K) or 176 (Q5_K)] uint8 blocks."""
    nb = x.shape[0]
    d, dmin, sc, m, q = _scales_and_mins(x.reshape(nb, 8, 32), 2**bits - 1, 63)  # q [nb, 8, 32]
    scales = np.concatenate([sc[:, :4] | (sc[:, 4:] >> 4) << 6, m[:, :4] | (m[:, 4:] >> 4) << 6,
                             (sc[:, 4:] & 15) | (m[:, 4:] & 15) << 4], axis=1)
    nib = q & 15
    qs = (nib[:, 0::2] | nib[:, 1::2] << 4).reshape(nb, 128)  # bytes 32i + l: sub-blocks 2i, 2i + 1
    parts = [d.view(np.uint8), dmin.view(np.uint8), scales]
    if bits == 5:
        parts.append(np.bitwise_or.reduce((q >> 4) << np.arange(8, dtype=np.uint8)[None, :, None], axis=1))
    return np.concatenate(parts + [qs], axis=1)


def _q6_k(x: np.ndarray) -> np.ndarray:
    """[nb, 256] fp32 -> [nb, 210] uint8 Q6_K blocks."""
    nb = x.shape[0]
    xs = x.reshape(nb, 16, 16)
    scale = np.abs(xs).max(-1) / 31                        # [nb, 16]: q - 32 in [-31, 31]
    d = _f16(scale.max(-1, keepdims=True) / 127)
    sc = np.clip(np.rint(_div(scale, d.astype(np.float32))), -128, 127).astype(np.int8)
    eff = (d.astype(np.float32) * sc)[..., None]
    q = (np.clip(np.rint(_div(xs, eff)), -32, 31) + 32).astype(np.uint8).reshape(nb, 2, 4, 32)  # [n, quarter, l]
    ql = np.concatenate([(q[:, :, 0] & 15) | (q[:, :, 2] & 15) << 4, (q[:, :, 1] & 15) | (q[:, :, 3] & 15) << 4],
                        axis=2)                            # [nb, 2, 64]
    qh = (q[:, :, 0] >> 4) | (q[:, :, 1] >> 4) << 2 | (q[:, :, 2] >> 4) << 4 | (q[:, :, 3] >> 4) << 6
    return np.concatenate([ql.reshape(nb, 128), qh.reshape(nb, 64), sc.view(np.uint8), d.view(np.uint8)], axis=1)


def _crumbs(q: np.ndarray) -> np.ndarray:
    """[nb, 256] values 0..3 -> [nb, 64] bytes: value 128 n + 32 i + l in bits 2i, 2i + 1 of byte 32 n + l."""
    q = q.reshape(-1, 2, 4, 32)
    return (q[:, :, 0] | q[:, :, 1] << 2 | q[:, :, 2] << 4 | q[:, :, 3] << 6).reshape(-1, 64)


def _q2_k(x: np.ndarray) -> np.ndarray:
    """[nb, 256] fp32 -> [nb, 84] uint8 Q2_K blocks: 16 sub-blocks of 16, value = d sc q - dmin m."""
    d, dmin, sc, m, q = _scales_and_mins(x.reshape(x.shape[0], 16, 16), 3, 15)
    return np.concatenate([sc | m << 4, _crumbs(q), d.view(np.uint8), dmin.view(np.uint8)], axis=1)


def _q3_k(x: np.ndarray) -> np.ndarray:
    """[nb, 256] fp32 -> [nb, 110] uint8 Q3_K blocks: 16 sub-blocks of 16, value = d (sc - 32) (q - 4).
    As llama.cpp, each sub-block's largest |x| maps to q - 4 = -4 (the range is [-4, 3])."""
    nb = x.shape[0]
    xs = x.reshape(nb, 16, 16)
    peak = np.take_along_axis(xs, np.abs(xs).argmax(-1)[..., None], -1)[..., 0]  # [nb, 16], signed
    scale = -peak / 4
    big = np.take_along_axis(scale, np.abs(scale).argmax(-1)[:, None], -1)     # [nb, 1], signed
    d = _f16(-big / 32)
    sc = np.clip(np.rint(_div(scale, d.astype(np.float32))), -32, 31).astype(np.int16)
    eff = (d.astype(np.float32) * sc)[..., None]
    q = (np.clip(np.rint(_div(xs, eff)), -4, 3) + 4).astype(np.uint8).reshape(nb, 256)
    hmask = np.bitwise_or.reduce((q >> 2).reshape(nb, 8, 32) << np.arange(8, dtype=np.uint8)[None, :, None], axis=1)
    ls = (sc + 32).astype(np.uint8)                                             # [nb, 16], 6 bits
    top = ls >> 4
    scales = np.concatenate([(ls[:, :8] & 15) | (ls[:, 8:] & 15) << 4,
                             top[:, 0:4] | top[:, 4:8] << 2 | top[:, 8:12] << 4 | top[:, 12:16] << 6], axis=1)
    return np.concatenate([hmask, _crumbs(q & 3), scales, d.view(np.uint8)], axis=1)


def _iq4_nl(x: np.ndarray) -> np.ndarray:
    """[nb, 32] fp32 -> [nb, 18] uint8 IQ4_NL blocks: fp16 d, 16 bytes of nibbles (as Q4_0) indexing
    IQ4_NL_LEVELS, value = d * level; the block's largest |x| maps to the level -127."""
    peak = np.take_along_axis(x, np.abs(x).argmax(-1)[:, None], -1)            # [nb, 1], signed
    d = _f16(-peak / 127)
    idx = np.searchsorted(_IQ4_NL_MIDPOINTS, _div(x, d.astype(np.float32))).astype(np.uint8)  # the nearest level
    return np.concatenate([d.view(np.uint8), idx[:, :16] | idx[:, 16:] << 4], axis=1)


_QUANTIZERS = {"Q2_K": (256, _q2_k), "Q3_K": (256, _q3_k), "Q4_K": (256, lambda x: _q45_k(x, 4)),
               "Q5_K": (256, lambda x: _q45_k(x, 5)), "Q6_K": (256, _q6_k), "IQ4_NL": (32, _iq4_nl)}


def quantize_k(values: np.ndarray, type_name: str) -> np.ndarray:
    """fp32 [..., K] -> uint8 [..., K / block values * block bytes] of `type_name` blocks: a K-quant (K a
    multiple of 256) or IQ4_NL (of 32)."""
    *lead, k = values.shape
    per_block, quantize = _QUANTIZERS[type_name]
    if k % per_block:
        raise ValueError(f"{type_name} needs rows of a multiple of {per_block} values, got {k}")
    x = np.ascontiguousarray(values, dtype=np.float32).reshape(-1, per_block)
    return quantize(x).reshape(*lead, -1)


def _more_bits(i: int, n: int) -> bool:
    """llama.cpp's use_more_bits: the first and last eighth of the layers, and every third between."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def mix_type(recipe: str, name: str, row_values: int, n_layers: int, tied: bool) -> str:
    """The type llama-quantize gives tensor `name` (GGUF naming) in a Q4_K_M / Q5_K_M file (row length
    `row_values`), with its fallback for rows that are not whole super-blocks."""
    base = "Q4_K" if recipe == "Q4_K_M" else "Q5_K"
    parts = name.split(".")
    if name == "output.weight" or (tied and name == "token_embd.weight"):
        type_name = "Q6_K"
    elif parts[0] == "blk" and parts[2] in ("attn_v", "ffn_down") and _more_bits(int(parts[1]), n_layers):
        type_name = "Q6_K"
    else:
        type_name = base
    return K_FALLBACK[type_name] if row_values % 256 else type_name
