"""Linear layers on bf16 weights, fast for decode.

At a decode step each weight is used by only a few token rows, and the time is the stream of weight
bytes; torch's bf16 GEMM reaches a fraction of the memory bandwidth there. PackedLinear repacks the
weight once (at load) into 16-output x 2-k tiles for the CPU kernel (native/cpu/linear.cpp), which reads
each weight byte once per call for all rows. Above `max_native_rows` rows (prefill) torch's GEMM wins
and runs on the original weight. On CUDA every call goes to torch.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from pyengine.ops._common import DTYPE_CODES, check_tensor, native

TILE_N, TILE_K = 16, 2
OUT_DTYPES = (torch.bfloat16, torch.float32)
# Rows up to which the native kernel runs. Measured at the SmolLM2-135M shapes on a 2-core Zen 4, 2 threads
# (bench/bench_linear.py): native 1.2-2.6x faster than torch's bf16 GEMM for M <= 64 on every shape; at
# M = 128 equal on down_proj (both at the bf16 dot-product peak, ~225 GFLOP/s a core).
DEFAULT_MAX_NATIVE_ROWS = 64


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [ceil(N/16), ceil(K/2), 16, 2] bf16, zero padded: packed[nb, kp, j, i] = W[16nb + j, 2kp + i]."""
    n, k = weight.shape
    nb, kp = -(-n // TILE_N), -(-k // TILE_K)
    padded = F.pad(weight.to(torch.bfloat16), (0, kp * TILE_K - k, 0, nb * TILE_N - n))
    return padded.view(nb, TILE_N, kp, TILE_K).permute(0, 2, 1, 3).contiguous()


class PackedLinear:
    """y = x @ weight.T + bias for x [M, K] bf16, with the weight repacked once for small M.

    weight [N, K] and bias [N] (or None): bf16, or fp32/fp16 converted to bf16.
    `out_dtype` (bf16 or fp32) is the default result type; a call may override it (fp32 suits the
    lm_head: logits without a bf16 rounding). Rows up to `max_native_rows` run the native kernel.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                 out_dtype: torch.dtype = torch.bfloat16,
                 max_native_rows: int = DEFAULT_MAX_NATIVE_ROWS) -> None:
        check_tensor("weight", weight, dtypes=(torch.bfloat16, torch.float16, torch.float32), ndim=2,
                     contiguous=False)
        if weight.shape[0] == 0 or weight.shape[1] == 0:
            raise ValueError(f"weight must be non-empty, got shape {list(weight.shape)}")
        if bias is not None:
            check_tensor("bias", bias, dtypes=(torch.bfloat16, torch.float16, torch.float32),
                         shape=(weight.shape[0],), device=weight.device, contiguous=False)
        self.out_dtype = _check_out_dtype(out_dtype)
        if isinstance(max_native_rows, bool) or not isinstance(max_native_rows, int) or max_native_rows < 0:
            raise ValueError(f"max_native_rows must be an int >= 0, got {max_native_rows!r}")
        self.max_native_rows = max_native_rows
        self.weight = weight.to(torch.bfloat16).contiguous()
        self.out_features, self.in_features = self.weight.shape
        self.bias = None if bias is None else bias.to(torch.bfloat16).contiguous()
        self.device = self.weight.device
        self.packed = self._bias_f32 = self._kernel = None
        if self.device.type == "cpu":
            self.packed = pack_weight(self.weight)
            if self.packed.data_ptr() % 64:
                raise RuntimeError("packed weight is not 64-byte aligned (unexpected torch allocator alignment)")
            # The kernel adds the same (bf16-rounded) bias as torch's path, in fp32.
            self._bias_f32 = None if self.bias is None else self.bias.float()
            self._kernel = native(self.device).linear_bf16
        self._packed_ptr = 0 if self.packed is None else self.packed.data_ptr()
        self._bias_ptr = 0 if self._bias_f32 is None else self._bias_f32.data_ptr()

    def __call__(self, x: torch.Tensor, *, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """x [M, K] bf16 contiguous -> [M, N] in out_dtype (default: the one given at construction)."""
        # Decode calls this ~120 times a token: test the common case inline (~0.4 us), and let
        # check_tensor (~1 us) find and name the problem otherwise.
        if not (isinstance(x, torch.Tensor) and x.dtype is torch.bfloat16 and x.dim() == 2
                and x.shape[1] == self.in_features and x.device == self.device and x.is_contiguous()):
            check_tensor("x", x, dtypes=(torch.bfloat16,), shape=(None, self.in_features), device=self.device)
        out_dtype = self.out_dtype if out_dtype is None else _check_out_dtype(out_dtype)
        m = x.shape[0]
        if self._kernel is None or m > self.max_native_rows:
            return F.linear(x, self.weight, self.bias).to(out_dtype)
        out = torch.empty(m, self.out_features, dtype=out_dtype)
        self._kernel(x.data_ptr(), self._packed_ptr, self._bias_ptr, out.data_ptr(), m, self.out_features,
                     self.in_features, DTYPE_CODES[out_dtype], 0)
        return out

    def native_pointers(self) -> tuple[int, int]:
        """(packed weight, fp32 bias or 0) addresses for native code that calls the kernel itself
        (decoder_layers); (0, 0) where there is no native kernel (not on the CPU)."""
        return self._packed_ptr, self._bias_ptr

    def __repr__(self) -> str:
        return (f"PackedLinear(in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, max_native_rows={self.max_native_rows})")


def _check_out_dtype(dtype: object) -> torch.dtype:
    if dtype not in OUT_DTYPES:
        raise TypeError(f"out_dtype must be torch.bfloat16 or torch.float32, got {dtype!r}")
    return dtype
