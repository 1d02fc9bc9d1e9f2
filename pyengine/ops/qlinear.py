"""Linear layers and embeddings on GGUF-quantized weights (Q8_0, Q4_0, Q4_1), kept quantized.

QuantLinear repacks the file's blocks once into 16-row tiles (native/include/pyengine/ggml_blocks.h)
and holds only that copy: the GGUF tensor's bytes plus at most 15 padding rows. Calls quantize the
activations per 32-value block to int8 and run int8 dot products (native/cpu/qlinear.cpp), so a
decode step streams 4.5-8.5 bits per weight instead of bf16's 16. The same copy serves the embedding
lookup (rows dequantized on the fly) and, with tied embeddings, the lm_head. CPU only.
"""
from __future__ import annotations

import numpy as np
import torch

from pyengine.ops._common import DTYPE_CODES, check_tensor, native
from pyengine.ops.linear import _check_out_dtype

# GGML type name -> id, for the types with a native kernel
QUANT_TYPES: dict[str, int] = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 8}
BLOCK_BYTES: dict[str, int] = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}
BLOCK = 32
ALIGN = 64


def _aligned_empty(nbytes: int) -> torch.Tensor:
    """uint8 [nbytes], 64-byte aligned (the kernel's lines)."""
    buf = torch.empty(nbytes + ALIGN, dtype=torch.uint8)
    skip = (-buf.data_ptr()) % ALIGN
    return buf[skip : skip + nbytes]


class QuantLinear:
    """y = x @ W.T + bias for x [M, K] bf16/fp32, W given as GGUF blocks.

    blocks: uint8 [N, K / 32 * block_bytes] (row n's blocks, as in the file); bias [N] or None.
    """

    def __init__(self, blocks: np.ndarray | torch.Tensor, type_name: str, bias: torch.Tensor | None = None, *,
                 out_dtype: torch.dtype = torch.bfloat16) -> None:
        if type_name not in QUANT_TYPES:
            raise ValueError(f"no native kernel for GGML type {type_name}; supported: {', '.join(QUANT_TYPES)}")
        blocks = torch.as_tensor(np.ascontiguousarray(blocks)) if isinstance(blocks, np.ndarray) else blocks
        check_tensor("blocks", blocks, dtypes=(torch.uint8,), ndim=2, device=torch.device("cpu"))
        row_bytes = blocks.shape[1]
        if blocks.shape[0] == 0 or row_bytes == 0 or row_bytes % BLOCK_BYTES[type_name]:
            raise ValueError(f"blocks must be [rows > 0, a multiple of {BLOCK_BYTES[type_name]} bytes] for "
                             f"{type_name}, got {list(blocks.shape)}")
        in_features = row_bytes // BLOCK_BYTES[type_name] * BLOCK
        self.type_name, self.type_id = type_name, QUANT_TYPES[type_name]
        self.out_features, self.in_features = blocks.shape[0], in_features
        self.out_dtype = _check_out_dtype(out_dtype)
        self.device = torch.device("cpu")
        c = native(self.device)
        self.packed = _aligned_empty(c.qpacked_bytes(self.type_id, self.out_features, in_features))
        c.qpack(self.type_id, blocks.data_ptr(), self.out_features, in_features, self.packed.data_ptr())
        if bias is not None:
            check_tensor("bias", bias, dtypes=(torch.bfloat16, torch.float16, torch.float32),
                         shape=(self.out_features,), contiguous=False)
            bias = bias.to(torch.bfloat16).float().contiguous()  # the bf16 path's rounding, added in fp32
        self.bias = bias
        self.has_bias = bias is not None
        self._kernel, self._embed = c.qlinear, c.qembedding
        self._packed_ptr = self.packed.data_ptr()
        self._bias_ptr = 0 if bias is None else bias.data_ptr()

    @property
    def nbytes(self) -> int:
        return self.packed.numel() + (0 if self.bias is None else self.bias.numel() * 4)

    def __call__(self, x: torch.Tensor, *, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """x [M, K] bf16/fp32 contiguous -> [M, N] in out_dtype (default: the one given at construction)."""
        if not (isinstance(x, torch.Tensor) and x.dtype in (torch.bfloat16, torch.float32) and x.dim() == 2
                and x.shape[1] == self.in_features and x.device == self.device and x.is_contiguous()):
            check_tensor("x", x, dtypes=(torch.bfloat16, torch.float32), shape=(None, self.in_features),
                         device=self.device)
        out_dtype = self.out_dtype if out_dtype is None else _check_out_dtype(out_dtype)
        m = x.shape[0]
        out = torch.empty(m, self.out_features, dtype=out_dtype)
        self._kernel(x.data_ptr(), DTYPE_CODES[x.dtype], self._packed_ptr, self.type_id, self._bias_ptr,
                     out.data_ptr(), m, self.out_features, self.in_features, DTYPE_CODES[out_dtype], 0)
        return out

    def embedding(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows `ids` (int64 [T]) of W, dequantized to `dtype` (bf16 or fp32): the embedding lookup."""
        check_tensor("ids", ids, dtypes=(torch.int64,), ndim=1, device=self.device)
        out = torch.empty(ids.shape[0], self.in_features, dtype=dtype)
        self._embed(ids.data_ptr(), ids.shape[0], self._packed_ptr, self.type_id, self.out_features,
                    self.in_features, out.data_ptr(), DTYPE_CODES[dtype], 0)
        return out

    def native_pointers(self) -> tuple[int, int]:
        """(tiled weight, fp32 bias or 0) addresses for decoder_layers."""
        return self._packed_ptr, self._bias_ptr

    def __repr__(self) -> str:
        return (f"QuantLinear({self.type_name}, in_features={self.in_features}, "
                f"out_features={self.out_features}, bias={self.has_bias})")
