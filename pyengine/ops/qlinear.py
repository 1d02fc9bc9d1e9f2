"""Linear layers and embeddings on GGUF-quantized weights, kept quantized.

Types with a native kernel: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL (32-value blocks) and Q2_K, Q3_K, Q4_K,
Q5_K, Q6_K, IQ4_XS (256-value super-blocks). QuantLinear repacks the file's blocks once into 16-row tiles
(native/include/pyengine/ggml_blocks.h) and holds only that copy: the GGUF tensor's bytes (1.01-1.04x
for Q4_K/Q5_K/IQ4_XS/Q3_K, whose 6-bit scales are spread to bytes) plus at most 15 padding rows. Calls quantize
the activations per 32-value block to int8 and run int8 dot products (native/cpu/linear/quant.cpp), so a decode
step streams 2.6-8.5 bits per weight instead of bf16's 16. Steps of many rows may take other kernels
(_C.qlinear_path names them): on AMX hosts, from 8 rows, the weight dequantized to bf16 for the AMX
bf16 kernel, a group or a strip at a time (native/cpu/linear/quant_strips.cpp). A weight may be row ranges of different types (a fused qkv whose v is Q8_0
and q/k Q5_0, as llama.cpp's Q4_K_M mixes them). The same copy serves the embedding lookup (rows
dequantized on the fly) and, with tied embeddings, the lm_head. CPU only.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from pyengine.ops._common import DTYPE_CODES, check_tensor, native
from pyengine.ops.huge_pages import ALIGN, HugePageArena
from pyengine.ops.linear import _check_out_dtype

# GGML type name -> (id, values per block, bytes per block), for the types with a native kernel
QUANT_TYPES: dict[str, tuple[int, int, int]] = {
    "Q4_0": (2, 32, 18), "Q4_1": (3, 32, 20), "Q5_0": (6, 32, 22), "Q5_1": (7, 32, 24), "Q8_0": (8, 32, 34),
    "Q2_K": (10, 256, 84), "Q3_K": (11, 256, 110), "Q4_K": (12, 256, 144), "Q5_K": (13, 256, 176),
    "Q6_K": (14, 256, 210), "IQ4_NL": (20, 32, 18), "IQ4_XS": (23, 256, 136),
}

Blocks = np.ndarray | torch.Tensor


def _aligned_empty(nbytes: int) -> torch.Tensor:
    """uint8 [nbytes], 64-byte aligned (the kernel's lines)."""
    buf = torch.empty(nbytes + ALIGN, dtype=torch.uint8)
    skip = (-buf.data_ptr()) % ALIGN
    return buf[skip : skip + nbytes]


def _in_features(blocks: torch.Tensor, type_name: str) -> int:
    """K of a [rows, row bytes] tensor of `type_name` blocks (a clear error for unsupported or malformed)."""
    if type_name not in QUANT_TYPES:
        raise ValueError(f"no native kernel for GGML type {type_name}; supported: {', '.join(QUANT_TYPES)}")
    check_tensor("blocks", blocks, dtypes=(torch.uint8,), ndim=2, device=torch.device("cpu"))
    _, values, block_bytes = QUANT_TYPES[type_name]
    row_bytes = blocks.shape[1]
    if blocks.shape[0] == 0 or row_bytes == 0 or row_bytes % block_bytes:
        raise ValueError(f"blocks must be [rows > 0, a multiple of {block_bytes} bytes] for {type_name}, "
                         f"got {list(blocks.shape)}")
    return row_bytes // block_bytes * values


class QuantLinear:
    """y = x @ W.T + bias for x [M, K] bf16/fp32, W given as GGUF blocks.

    blocks: uint8 [N, K / values per block * block bytes] (row n's blocks, as in the file) of GGML type
    `type_name`; or lists of both, W's row ranges in order (one type each, the same K). bias [N] or None.
    arena: where the tiled copy goes (a model's weights: on huge pages), else its own buffer.
    """

    def __init__(self, blocks: Blocks | Sequence[Blocks], type_name: str | Sequence[str],
                 bias: torch.Tensor | None = None, *, out_dtype: torch.dtype = torch.bfloat16,
                 arena: HugePageArena | None = None) -> None:
        parts = list(zip(blocks, type_name)) if isinstance(type_name, (list, tuple)) else [(blocks, type_name)]
        parts = [(torch.as_tensor(np.ascontiguousarray(b)) if isinstance(b, np.ndarray) else b, t) for b, t in parts]
        ks = {_in_features(b, t) for b, t in parts}
        if len(ks) != 1:
            raise ValueError(f"row ranges of different in_features {sorted(ks)}")
        self.in_features = ks.pop()
        self.out_features = sum(b.shape[0] for b, _ in parts)
        self.type_name = "+".join(dict.fromkeys(t for _, t in parts))  # e.g. "Q5_0+Q8_0" for a mixed qkv
        self.type_id = QUANT_TYPES[parts[0][1]][0]  # of the first range: the embedding's (one range)
        self.out_dtype = _check_out_dtype(out_dtype)
        self.device = torch.device("cpu")
        c = native(self.device)
        self.tiles: list[torch.Tensor] = []  # per row range: the tiled copy
        table = [len(parts)]
        for b, t in parts:
            type_id, rows = QUANT_TYPES[t][0], b.shape[0]
            packed = (arena.take if arena else _aligned_empty)(c.qpacked_bytes(type_id, rows, self.in_features))
            c.qpack(type_id, b.data_ptr(), rows, self.in_features, packed.data_ptr())
            self.tiles.append(packed)
            table += [type_id, rows, packed.data_ptr()]
        self.segments = torch.tensor(table, dtype=torch.int64)  # qlinear's segment table
        if bias is not None:
            check_tensor("bias", bias, dtypes=(torch.bfloat16, torch.float16, torch.float32),
                         shape=(self.out_features,), contiguous=False)
            bias = bias.to(torch.bfloat16).float().contiguous()  # the bf16 path's rounding, added in fp32
        self.bias = bias
        self.has_bias = bias is not None
        self._kernel, self._embed = c.qlinear, c.qembedding
        self._segments_ptr = self.segments.data_ptr()
        self._bias_ptr = 0 if bias is None else bias.data_ptr()

    @property
    def nbytes(self) -> int:
        return sum(t.numel() for t in self.tiles) + (0 if self.bias is None else self.bias.numel() * 4)

    def __call__(self, x: torch.Tensor, *, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """x [M, K] bf16/fp32 contiguous -> [M, N] in out_dtype (default: the one given at construction)."""
        if not (isinstance(x, torch.Tensor) and x.dtype in (torch.bfloat16, torch.float32) and x.dim() == 2
                and x.shape[1] == self.in_features and x.device == self.device and x.is_contiguous()):
            check_tensor("x", x, dtypes=(torch.bfloat16, torch.float32), shape=(None, self.in_features),
                         device=self.device)
        out_dtype = self.out_dtype if out_dtype is None else _check_out_dtype(out_dtype)
        m = x.shape[0]
        out = torch.empty(m, self.out_features, dtype=out_dtype)
        self._kernel(x.data_ptr(), DTYPE_CODES[x.dtype], self._segments_ptr, self._bias_ptr, out.data_ptr(), m,
                     self.out_features, self.in_features, DTYPE_CODES[out_dtype], 0)
        return out

    def embedding(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows `ids` (int64 [T]) of W, dequantized to `dtype` (bf16 or fp32): the embedding lookup."""
        if len(self.tiles) != 1:
            raise ValueError(f"embedding lookup on a weight of several row ranges ({self.type_name})")
        check_tensor("ids", ids, dtypes=(torch.int64,), ndim=1, device=self.device)
        out = torch.empty(ids.shape[0], self.in_features, dtype=dtype)
        self._embed(ids.data_ptr(), ids.shape[0], self.tiles[0].data_ptr(), self.type_id, self.out_features,
                    self.in_features, out.data_ptr(), DTYPE_CODES[dtype], 0)
        return out

    def native_pointers(self) -> tuple[int, int]:
        """(segment table, fp32 bias or 0) addresses for decoder_layers."""
        return self._segments_ptr, self._bias_ptr

    def __repr__(self) -> str:
        return (f"QuantLinear({self.type_name}, in_features={self.in_features}, "
                f"out_features={self.out_features}, bias={self.has_bias})")
