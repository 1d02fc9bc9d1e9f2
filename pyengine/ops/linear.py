"""Linear layers on bf16 weights, fast for decode; and on fp32 weights for CPUs with AVX2 but no AVX-512.

At a decode step each weight is used by only a few token rows, and the time is the stream of weight
bytes; torch's bf16 GEMM reaches a fraction of the memory bandwidth there. PackedLinear repacks the
weight once (at load) into 16-output x 2-k tiles for the CPU kernel (native/cpu/linear/bf16.cpp), which reads
each weight byte once per call for all rows, and serves prefill rows too (at the bf16 dot-product peak,
close to torch's GEMM), so the original weight is not kept: one copy of the weights in memory.
On CUDA, and on CPUs without bf16 dot products, every call goes to torch.
Fp32Linear (at the end) packs an fp32 weight in 16-output panels for native/cpu/linear/fp32.cpp, where
torch's fp32 GEMM lags the FMA peak (AVX2 CPUs without AVX-512, which run fp32 models by default).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from pyengine.ops._common import DTYPE_CODES, check_tensor, native
from pyengine.ops.huge_pages import HugePageArena

TILE_N, TILE_K = 16, 2
OUT_DTYPES = (torch.bfloat16, torch.float32)


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [ceil(N/16), ceil(K/2), 16, 2] bf16, zero padded: packed[nb, kp, j, i] = W[16nb + j, 2kp + i]."""
    n, k = weight.shape
    nb, kp = -(-n // TILE_N), -(-k // TILE_K)
    padded = F.pad(weight.to(torch.bfloat16), (0, kp * TILE_K - k, 0, nb * TILE_N - n))
    return padded.view(nb, TILE_N, kp, TILE_K).permute(0, 2, 1, 3).contiguous()


class PackedLinear:
    """y = x @ weight.T + bias for x [M, K] bf16.

    weight [N, K] and bias [N] (or None): bf16, or fp32/fp16 converted to bf16. On a CPU build with bf16
    dot products (AVX512-BF16) the weight is held only as its packed copy (`packed`; `weight` is None)
    and every call runs the native kernel; elsewhere (CUDA, CPUs without them) `weight` is kept and
    calls go to torch. `out_dtype` (bf16 or fp32) is the default
    result type; a call may override it (fp32 suits the lm_head: logits without a bf16 rounding).
    arena: where the packed copy goes (a model's weights: on huge pages, which a decode step's stream of
    them prefers), else its own buffer.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                 out_dtype: torch.dtype = torch.bfloat16, arena: HugePageArena | None = None) -> None:
        check_tensor("weight", weight, dtypes=(torch.bfloat16, torch.float16, torch.float32), ndim=2,
                     contiguous=False)
        if weight.shape[0] == 0 or weight.shape[1] == 0:
            raise ValueError(f"weight must be non-empty, got shape {list(weight.shape)}")
        if bias is not None:
            check_tensor("bias", bias, dtypes=(torch.bfloat16, torch.float16, torch.float32),
                         shape=(weight.shape[0],), device=weight.device, contiguous=False)
        self.out_dtype = _check_out_dtype(out_dtype)
        self.out_features, self.in_features = weight.shape
        self.device = weight.device
        bias = None if bias is None else bias.to(torch.bfloat16).contiguous()
        self.has_bias = bias is not None
        self.weight = self.bias = self.packed = self._bias_f32 = self._kernel = None
        if self.device.type == "cpu" and native(self.device).isa() == "avx512_bf16":
            packed = pack_weight(weight)
            if arena is not None:
                packed = arena.zeros(tuple(packed.shape), torch.bfloat16).copy_(packed)
            self.packed = packed
            if self.packed.data_ptr() % 64:
                raise RuntimeError("packed weight is not 64-byte aligned (unexpected torch allocator alignment)")
            # The kernel adds the bf16-rounded bias (as torch's bf16 path would), in fp32.
            self._bias_f32 = None if bias is None else bias.float()
            self._kernel = native(self.device).linear_bf16
        else:
            self.weight, self.bias = weight.to(torch.bfloat16).contiguous(), bias
        self._packed_ptr = 0 if self.packed is None else self.packed.data_ptr()
        self._bias_ptr = 0 if self._bias_f32 is None else self._bias_f32.data_ptr()

    @property
    def nbytes(self) -> int:
        """Bytes of weight (and bias) this layer holds."""
        held = [self.packed, self._bias_f32] if self.packed is not None else [self.weight, self.bias]
        return sum(t.numel() * t.element_size() for t in held if t is not None)

    def __call__(self, x: torch.Tensor, *, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """x [M, K] bf16 contiguous -> [M, N] in out_dtype (default: the one given at construction)."""
        # Decode calls this ~120 times a token: test the common case inline (~0.4 us), and let
        # check_tensor (~1 us) find and name the problem otherwise.
        if not (isinstance(x, torch.Tensor) and x.dtype is torch.bfloat16 and x.dim() == 2
                and x.shape[1] == self.in_features and x.device == self.device and x.is_contiguous()):
            check_tensor("x", x, dtypes=(torch.bfloat16,), shape=(None, self.in_features), device=self.device)
        out_dtype = self.out_dtype if out_dtype is None else _check_out_dtype(out_dtype)
        if self._kernel is None:
            return F.linear(x, self.weight, self.bias).to(out_dtype)
        m = x.shape[0]
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
                f"bias={self.has_bias}, device={self.device.type})")


def _check_out_dtype(dtype: object) -> torch.dtype:
    if dtype not in OUT_DTYPES:
        raise TypeError(f"out_dtype must be torch.bfloat16 or torch.float32, got {dtype!r}")
    return dtype


def pack_weight_fp32(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [ceil(N/16), K, 16] fp32, zero padded: packed[p, k, j] = W[16p + j, k] (linear_fp32's panels)."""
    n, k = weight.shape
    nb = -(-n // TILE_N)
    padded = F.pad(weight.float(), (0, 0, 0, nb * TILE_N - n))
    return padded.view(nb, TILE_N, k).transpose(1, 2).contiguous()


class Fp32Linear:
    """y = x @ weight.T + bias in fp32 on CPUs with AVX2 but no AVX-512, through the native kernel
    (native/cpu/linear/fp32.cpp): there torch's fp32 GEMM (MKL) lags the FMA peak, and this one is ahead of
    it from decode to prefill sizes (docs/performance.md, "fp32 linear").
    Holds only the packed copy of the weight. `runs_here()` says whether a CPU build should use it."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                 arena: HugePageArena | None = None) -> None:
        check_tensor("weight", weight, dtypes=(torch.float32,), ndim=2, device=torch.device("cpu"), contiguous=False)
        if weight.shape[0] == 0 or weight.shape[1] == 0:
            raise ValueError(f"weight must be non-empty, got shape {list(weight.shape)}")
        if bias is not None:
            check_tensor("bias", bias, dtypes=(torch.float32,), shape=(weight.shape[0],), device=weight.device,
                         contiguous=False)
        self.out_features, self.in_features = weight.shape
        self.device = weight.device
        packed = pack_weight_fp32(weight)
        self.packed = arena.zeros(tuple(packed.shape), torch.float32).copy_(packed) if arena is not None else packed
        if self.packed.data_ptr() % 64:
            # torch's CPU allocator aligns to 64 bytes; an arena hands out page-aligned runs
            raise RuntimeError("packed weight is not 64-byte aligned (unexpected allocator alignment)")
        self.bias = None if bias is None else bias.contiguous()
        self._bias_ptr = 0 if self.bias is None else self.bias.data_ptr()
        self._kernel = native(self.device).linear_fp32

    @staticmethod
    def runs_here() -> bool:
        """An AVX2 build without AVX-512 (where MKL's sgemm lags; on AVX-512 it is left to torch)."""
        _C = native(torch.device("cpu"))
        return _C.isa() == "avx2" and _C.linear_fp32_available()

    @property
    def nbytes(self) -> int:
        """Bytes of weight (and bias) this layer holds."""
        return sum(t.numel() * t.element_size() for t in (self.packed, self.bias) if t is not None)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] fp32 contiguous -> [M, N] fp32."""
        if not (isinstance(x, torch.Tensor) and x.dtype is torch.float32 and x.dim() == 2
                and x.shape[1] == self.in_features and x.device == self.device and x.is_contiguous()):
            check_tensor("x", x, dtypes=(torch.float32,), shape=(None, self.in_features), device=self.device)
        m = x.shape[0]
        out = torch.empty(m, self.out_features, dtype=torch.float32)
        self._kernel(x.data_ptr(), self.packed.data_ptr(), self._bias_ptr, out.data_ptr(), m, self.out_features,
                     self.in_features)
        return out

    def __repr__(self) -> str:
        return (f"Fp32Linear(in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None})")
