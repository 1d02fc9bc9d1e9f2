"""Per-token layer ops: RMSNorm (plain and fused with the residual add), neox rotary embedding, the
Walsh-Hadamard rotation of attention heads, SiLU-and-multiply. CPU or CUDA tensors; activations fp32,
bf16 or fp16, arithmetic in fp32. The norms also take a model's residual stream in fp32 beside bf16/fp16
activations (the stream is never rounded).
"""
from __future__ import annotations

import functools
import math

import torch

from pyengine.ops._common import check_tensor, cuda_stream, dtype_code, native

ACT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check_eps(eps: float) -> float:
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps < 0:
        raise ValueError(f"eps must be a finite float >= 0, got {eps!r}")
    return float(eps)


def _act_or_fp32(dtype: torch.dtype) -> tuple[torch.dtype, ...]:
    """The dtypes of a weight or a residual stream beside activations of `dtype`: theirs or fp32."""
    return (dtype,) if dtype == torch.float32 else (dtype, torch.float32)


def _check_weight(weight: object, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """weight [D]: the activations' `dtype` or fp32."""
    return check_tensor("weight", weight, dtypes=_act_or_fp32(dtype), shape=(x.shape[-1],), device=x.device)


def _check_rows(name: str, x: object) -> torch.Tensor:
    check_tensor(name, x, dtypes=ACT_DTYPES)
    if x.dim() < 1 or x.shape[-1] == 0:
        raise ValueError(f"{name} must have a non-empty last dimension, got shape {list(x.shape)}")
    return x


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, out: torch.Tensor | None = None,
             dtype: torch.dtype | None = None) -> torch.Tensor:
    """x / sqrt(mean(x**2, -1) + eps) * weight over the last dimension of x ([T, D] or [..., D]).

    The result has `dtype` (default: out's, else x's): x's, or any where x is fp32 (a residual stream
    normed into bf16 activations); weight has the result's dtype or fp32. `out` (x's shape; may be x
    itself) receives the result, else a new tensor.
    """
    _check_rows("x", x)
    dtype = dtype or (x.dtype if out is None else out.dtype)
    if dtype != x.dtype and x.dtype != torch.float32:
        raise TypeError(f"rms_norm: x of dtype {x.dtype} can only be normed into its own dtype, not {dtype}")
    _check_weight(weight, x, dtype)
    eps = _check_eps(eps)
    if out is None:
        out = torch.empty(x.shape, dtype=dtype, device=x.device)
    else:
        check_tensor("out", out, dtypes=(dtype,), shape=tuple(x.shape), device=x.device)
    dim = x.shape[-1]
    native(x.device).rms_norm(x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.numel() // dim, dim, eps,
                              dtype_code(x), dtype_code(weight), dtype_code(out), cuda_stream(x.device))
    return out


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """In place: residual += x, then x = rms_norm(residual) * weight (of the stored, rounded residual).

    residual has x's dtype or fp32 (then the sum is kept in fp32 and only x is rounded to its dtype);
    weight has x's dtype or fp32.
    """
    _check_rows("x", x)
    check_tensor("residual", residual, dtypes=_act_or_fp32(x.dtype), shape=tuple(x.shape), device=x.device)
    _check_weight(weight, x, x.dtype)
    eps = _check_eps(eps)
    dim = x.shape[-1]
    native(x.device).add_rms_norm(x.data_ptr(), residual.data_ptr(), weight.data_ptr(), x.numel() // dim, dim, eps,
                                  dtype_code(x), dtype_code(weight), dtype_code(residual), cuda_stream(x.device))


def _rope_rows(name: str, t: object, tokens: int | None, head_dim: int, dtype: torch.dtype | None,
               device: torch.device | None) -> tuple[int, int]:
    """Check a q/k operand; return (num_heads, row_stride). Rows may be strided (a column slice of a
    fused qkv output), but each row's heads must be contiguous."""
    check_tensor(name, t, dtypes=ACT_DTYPES if dtype is None else (dtype,), device=device, contiguous=False)
    if t.dim() == 2:
        if t.shape[1] % head_dim:
            raise ValueError(f"{name} has {t.shape[1]} columns, not a multiple of head_dim={head_dim}")
        heads = t.shape[1] // head_dim
        inner_ok = t.stride(1) == 1 or t.shape[1] == 1
    elif t.dim() == 3:
        if t.shape[2] != head_dim:
            raise ValueError(f"{name} has head size {t.shape[2]}; expected head_dim={head_dim}")
        heads = t.shape[1]
        inner_ok = (t.stride(2) == 1 or head_dim == 1) and (t.stride(1) == head_dim or heads == 1)
    else:
        raise ValueError(f"{name} must be [T, H*D] or [T, H, D], got shape {list(t.shape)}")
    if not inner_ok:
        raise ValueError(f"{name} must have contiguous heads within a row (only the row stride may differ)")
    if tokens is not None and t.shape[0] != tokens:
        raise ValueError(f"{name} has {t.shape[0]} tokens but positions has {tokens}")
    if t.shape[0] > 1 and t.stride(0) < heads * head_dim:
        raise ValueError(f"{name} rows overlap (row stride {t.stride(0)} < {heads * head_dim})")
    return heads, t.stride(0)


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor,
                     head_dim: int) -> None:
    """Neox-style rotary embedding, in place on q and k, by token position.

    positions [T] int64; q [T, H*D] or [T, H, D]; k [T, KVH*D] or [T, KVH, D] (same dtype as q). q and k
    may have any row stride (e.g. column slices of a fused qkv projection) as long as each row's heads are
    contiguous. cos_sin_cache [max_pos, head_dim] fp32: [:, :head_dim//2] = cos, [:, head_dim//2:] = sin.
    A position outside [0, max_pos) raises ValueError (checked on CPU; on CUDA it is the caller's duty).
    """
    if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim <= 0 or head_dim % 2:
        raise ValueError(f"head_dim must be a positive even int, got {head_dim!r}")
    check_tensor("positions", positions, dtypes=(torch.int64,), ndim=1)
    device = positions.device
    tokens = positions.shape[0]
    q_heads, q_stride = _rope_rows("q", q, tokens, head_dim, None, device)
    kv_heads, k_stride = _rope_rows("k", k, tokens, head_dim, q.dtype, device)
    check_tensor("cos_sin_cache", cos_sin_cache, dtypes=(torch.float32,), shape=(None, head_dim), device=device)
    native(device).rotary_embedding(positions.data_ptr(), q.data_ptr(), k.data_ptr(), cos_sin_cache.data_ptr(),
                                    tokens, q_heads, kv_heads, head_dim, q_stride, k_stride,
                                    cos_sin_cache.shape[0], dtype_code(q), cuda_stream(device))


def hadamard_heads(x: torch.Tensor, head_dim: int) -> None:
    """In place: each head of x ([T, H*D] or [T, H, D]; any row stride, heads contiguous within a row)
    becomes H_n v / sqrt(n) over blocks of n = the largest power of two dividing head_dim (all of it for
    64, 128, 256), H_n the Sylvester Hadamard matrix.

    An orthogonal, symmetric map: applied to both q and k it leaves q.k as it was (up to rounding). The
    model applies it after RoPE when the KV cache is fp8/int8: K has a few large channels, which a
    per-(token, head) scale has to cover, leaving the other channels few levels (int8) or making the
    dot product's error that of one or two coarsely rounded terms (fp8); rotated, every channel carries
    a share of each, and the rounding errors average over the dot product.
    """
    if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim <= 0:
        raise ValueError(f"head_dim must be a positive int, got {head_dim!r}")
    heads, row_stride = _rope_rows("x", x, None, head_dim, None, None)
    if x.device.type == "cuda":  # a batched [n, n] matmul: no kernel of its own on the GPU
        n = head_dim & -head_dim
        blocks = x.unflatten(-1, (-1, n))
        x.copy_((blocks.float() @ _hadamard_matrix(n, x.device)).to(x.dtype).flatten(-2))
        return
    native(x.device).hadamard_heads(x.data_ptr(), x.shape[0], heads, head_dim, row_stride, dtype_code(x),
                                    cuda_stream(x.device))


@functools.lru_cache(maxsize=None)
def _hadamard_matrix(n: int, device: torch.device) -> torch.Tensor:
    """[n, n] fp32 H_n / sqrt(n) (Sylvester order, as native/cpu/layers.cpp's fwht), n a power of two."""
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    return (h / math.sqrt(n)).to(device)


def silu_and_mul(x: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., 2I] -> silu(x[..., :I]) * x[..., I:] of shape [..., I] (into `out` when given)."""
    _check_rows("x", x)
    if x.shape[-1] % 2:
        raise ValueError(f"x must have an even last dimension (gate | up), got shape {list(x.shape)}")
    inter = x.shape[-1] // 2
    out_shape = (*x.shape[:-1], inter)
    if out is None:
        out = torch.empty(out_shape, dtype=x.dtype, device=x.device)
    else:
        check_tensor("out", out, dtypes=(x.dtype,), shape=out_shape, device=x.device)
    native(x.device).silu_and_mul(x.data_ptr(), out.data_ptr(), x.numel() // x.shape[-1], inter, dtype_code(x),
                                  cuda_stream(x.device))
    return out
