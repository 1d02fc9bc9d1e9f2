"""Quantizers for the K-quant GGUF types (Q4_K, Q5_K, Q6_K) and llama.cpp's Q4_K_M / Q5_K_M type mixes,
for `requantize` (benchmarks and accuracy tests of the native K-quant kernels without llama.cpp).

The `gguf` package dequantizes K-quants but does not quantize them. These are the plain min/max
quantizers (one pass, no search for the best scales as llama.cpp's make_qkx2 does), so their files
are a little less accurate than llama-quantize's; the block layouts are the ones in gguf.py's docstring.
"""
from __future__ import annotations

import numpy as np

# type -> the type llama.cpp writes instead when a row is not a whole number of 256-value super-blocks
K_FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}


def _f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16)


def _div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a / b, 0 where b is 0."""
    return np.divide(a, b, out=np.zeros(np.broadcast(a, b).shape, np.float32), where=b != 0)


def _q45_k(x: np.ndarray, bits: int) -> np.ndarray:
    """[nb, 256] fp32 -> [nb, 144 (Q4_K) or 176 (Q5_K)] uint8 blocks."""
    nb, top = x.shape[0], 2**bits - 1
    xs = x.reshape(nb, 8, 32)
    low = np.minimum(xs.min(-1), 0)                     # [nb, 8]: value = d sc q - dmin m
    scale, minv = (xs.max(-1) - low) / top, -low
    d = _f16(scale.max(-1, keepdims=True) / 63)
    dmin = _f16(minv.max(-1, keepdims=True) / 63)
    sc = np.clip(np.rint(_div(scale, d.astype(np.float32))), 0, 63).astype(np.uint8)
    m = np.clip(np.rint(_div(minv, dmin.astype(np.float32))), 0, 63).astype(np.uint8)
    eff_d = (d.astype(np.float32) * sc)[..., None]
    eff_m = (dmin.astype(np.float32) * m)[..., None]
    q = np.clip(np.rint(_div(xs + eff_m, eff_d)), 0, top).astype(np.uint8)  # [nb, 8, 32]
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


def quantize_k(values: np.ndarray, type_name: str) -> np.ndarray:
    """fp32 [..., K] (K a multiple of 256) -> uint8 [..., K / 256 * block bytes] of `type_name` blocks."""
    *lead, k = values.shape
    if k % 256:
        raise ValueError(f"{type_name} needs rows of a multiple of 256 values, got {k}")
    x = np.ascontiguousarray(values, dtype=np.float32).reshape(-1, 256)
    blocks = _q6_k(x) if type_name == "Q6_K" else _q45_k(x, 5 if type_name == "Q5_K" else 4)
    return blocks.reshape(*lead, -1)


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
