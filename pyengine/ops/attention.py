"""paged_attention: causal attention of a whole mixed step over the paged KV cache."""
from __future__ import annotations

import torch

from pyengine.ops._common import check_tensor, cuda_stream, dtype_code, native

ACT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
QUANT_DTYPES = (torch.float8_e4m3fn, torch.int8)


def cpu_cache_lane(dtype: torch.dtype) -> int:
    """Values per 32-bit lane of the CPU cache layout: 4 for one-byte caches (fp8, int8), else 2."""
    return 4 if dtype.itemsize == 1 else 2


def kv_cache_shapes(num_blocks: int, num_kv_heads: int, block_size: int, head_dim: int,
                    device: torch.device | str, dtype: torch.dtype) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Shapes of one layer's K and V cache of `dtype` on `device`.

    cuda: both [num_blocks, KVH, block_size, head_dim]. cpu: K [num_blocks, KVH, head_dim/L, block_size, L]
    and V [num_blocks, KVH, block_size/L, head_dim, L], L = cpu_cache_lane(dtype) values per 32-bit lane:
    per (block, kv head) tile, K as groups of L dims of each token and V as groups of L tokens of each dim,
    the operand layouts of the CPU decode kernel's dot products (native/include/pyengine/kv_layout.h), so
    attention reads the tiles without shuffles. On the CPU block_size and head_dim must be multiples of L.
    """
    nb, kvh, bs, d = num_blocks, num_kv_heads, block_size, head_dim
    if (device if isinstance(device, torch.device) else torch.device(device)).type != "cpu":
        return (nb, kvh, bs, d), (nb, kvh, bs, d)
    lane = cpu_cache_lane(dtype)
    if bs % lane or d % lane:
        raise ValueError(f"the CPU {str(dtype).removeprefix('torch.')} KV cache needs a block_size and head_dim "
                         f"that are multiples of {lane}, got {bs} and {d}")
    return (nb, kvh, d // lane, bs, lane), (nb, kvh, bs // lane, d, lane)


def kv_cache_geometry(k_cache: torch.Tensor) -> tuple[int, int, int, int]:
    """(num_blocks, num_kv_heads, block_size, head_dim) of a K cache in its device's layout."""
    cpu = k_cache.device.type == "cpu"
    if k_cache.dim() != (5 if cpu else 4) or (cpu and k_cache.shape[4] != cpu_cache_lane(k_cache.dtype)):
        lane = cpu_cache_lane(k_cache.dtype)
        want = (f"[num_blocks, kv_heads, head_dim/{lane}, block_size, {lane}]" if cpu
                else "[num_blocks, kv_heads, block_size, head_dim]")
        raise ValueError(f"k_cache on {k_cache.device.type} must be shaped {want}, got {list(k_cache.shape)}")
    if cpu:
        nb, kvh, groups, bs, lane = k_cache.shape
        return nb, kvh, bs, groups * lane
    return tuple(k_cache.shape)


def to_cache_layout(k: torch.Tensor, v: torch.Tensor, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """Logical [num_blocks, KVH, block_size, head_dim] K/V (any device) -> new caches in `device`'s layout."""
    k, v = k.to(device), v.to(device)
    if k.device.type != "cpu":
        return k.contiguous(), v.contiguous()
    nb, kvh, bs, d = k.shape
    lane = cpu_cache_lane(k.dtype)
    return (k.reshape(nb, kvh, bs, d // lane, lane).permute(0, 1, 3, 2, 4).contiguous(),
            v.reshape(nb, kvh, bs // lane, lane, d).permute(0, 1, 2, 4, 3).contiguous())


def from_cache_layout(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Caches in their device's layout -> logical [num_blocks, KVH, block_size, head_dim] copies."""
    if k_cache.device.type != "cpu":
        return k_cache.clone(), v_cache.clone()
    nb, kvh, bs, d = kv_cache_geometry(k_cache)
    return (k_cache.permute(0, 1, 3, 2, 4).reshape(nb, kvh, bs, d),
            v_cache.permute(0, 1, 2, 4, 3).reshape(nb, kvh, bs, d))


def check_kv_cache(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scales: torch.Tensor | None,
    v_scales: torch.Tensor | None,
    act_dtype: torch.dtype,
    device: torch.device,
    num_kv_heads: int | None = None,
    head_dim: int | None = None,
) -> tuple[int, int, int, int]:
    """Validate a layer's cache (and scales); returns (num_blocks, num_kv_heads, block_size, head_dim)."""
    check_tensor("k_cache", k_cache, dtypes=(act_dtype, *QUANT_DTYPES), device=device)
    nb, kvh, bs, d = kv_cache_geometry(k_cache)
    if num_kv_heads is not None and kvh != num_kv_heads:
        raise ValueError(f"k_cache has {kvh} kv heads; expected {num_kv_heads}")
    if head_dim is not None and d != head_dim:
        raise ValueError(f"k_cache has head_dim {d}; expected {head_dim}")
    v_shape = kv_cache_shapes(nb, kvh, bs, d, device, k_cache.dtype)[1]
    check_tensor("v_cache", v_cache, dtypes=(k_cache.dtype,), shape=v_shape, device=device)
    if k_cache.dtype in QUANT_DTYPES:
        for name, s in (("k_scales", k_scales), ("v_scales", v_scales)):
            if s is None:
                raise ValueError(f"{name} is required for a {str(k_cache.dtype).removeprefix('torch.')} cache")
            check_tensor(name, s, dtypes=(torch.float32,), shape=(nb, kvh, bs), device=device)
    elif k_scales is not None or v_scales is not None:
        raise ValueError("k_scales/v_scales are only for fp8_e4m3fn/int8 caches")
    return nb, kvh, bs, d


def check_token_rows(name: str, t: torch.Tensor, heads: int, head_dim: int) -> None:
    """[T, heads, head_dim] with heads and head_dim contiguous (any token stride)."""
    if t.stride(2) != 1 or t.stride(1) != head_dim or (t.shape[0] > 1 and t.stride(0) < heads * head_dim):
        raise ValueError(f"{name} must have contiguous [heads, head_dim] rows (call .contiguous() first)")


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    *,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
    max_seq_len: int | None = None,
    out: torch.Tensor | None = None,
    window: int = 0,
    softcap: float = 0.0,
    tensor_cores: bool = False,
    max_query_len: int | None = None,
) -> torch.Tensor:
    """Causal attention for a mixed step of prompt chunks and decodes.

    q [T, H, D] (fp32/bf16/fp16; a token-strided view such as a slice of a fused QKV output is fine);
    k_cache/v_cache in the device's cache layout (kv_cache_shapes), in q's dtype, or fp8_e4m3fn/int8 with
    k_scales/v_scales [num_blocks, KVH, block_size] fp32; block_tables [S, max_blocks] int32;
    seq_lens [S] int32 (cache tokens including this step's); query_start_loc [S+1] int32.
    Query token j of sequence s sits at position seq_lens[s] - q_len + j and sees positions <= its own.
    max_seq_len: an upper bound on seq_lens (defaults to the block table's capacity).
    window > 0: sliding-window attention, each query sees only the `window` positions ending at its
    own (Mistral, Gemma's local layers). softcap > 0: scores s (scale applied) become
    softcap * tanh(s / softcap) before the softmax (Gemma 2). Both are CPU only for now (CUDA: ValueError).
    tensor_cores (CUDA): the prompt chunks of a step run FlashAttention-2 on tensor cores where it applies
    (bf16/fp16 with an unquantized cache, head_dim 64 or 128; native/cuda/prefill_attention.cu); decode rows
    (sequences with one query token) and other cases keep the split-KV kernel. max_query_len: the step's longest query length (defaults to
    T; must not be understated: rows past it would be left unwritten). The CPU ignores both.
    Returns out [T, H, D] in q's dtype.
    """
    check_tensor("q", q, dtypes=ACT_DTYPES, ndim=3, contiguous=False)
    device = q.device
    T, H, D = q.shape
    check_token_rows("q", q, H, D)
    nb, kvh, bs, _ = check_kv_cache(k_cache, v_cache, k_scales, v_scales, q.dtype, device, head_dim=D)
    if H % kvh != 0:
        raise ValueError(f"q has {H} heads, which is not a multiple of the cache's {kvh} kv heads")
    check_tensor("block_tables", block_tables, dtypes=(torch.int32,), ndim=2, device=device)
    S, max_blocks = block_tables.shape
    check_tensor("seq_lens", seq_lens, dtypes=(torch.int32,), shape=(S,), device=device)
    check_tensor("query_start_loc", query_start_loc, dtypes=(torch.int32,), shape=(S + 1,), device=device)
    if not isinstance(scale, (float, int)):
        raise TypeError(f"scale must be a float, got {type(scale).__name__}")
    if isinstance(window, bool) or not isinstance(window, int) or window < 0:
        raise ValueError(f"window must be an int >= 0 (0: no window), got {window!r}")
    if not isinstance(softcap, (float, int)) or not 0 <= softcap < float("inf"):
        raise ValueError(f"softcap must be a finite float >= 0 (0: none), got {softcap!r}")
    if max_seq_len is None:
        max_seq_len = max_blocks * bs
    if max_query_len is None:
        max_query_len = T
    elif isinstance(max_query_len, bool) or not isinstance(max_query_len, int) or max_query_len < 1:
        raise ValueError(f"max_query_len must be an int >= 1, got {max_query_len!r}")
    if out is None:
        out = torch.empty((T, H, D), dtype=q.dtype, device=device)
    else:
        check_tensor("out", out, dtypes=(q.dtype,), shape=(T, H, D), device=device)
    if T == 0:
        return out
    args = (
        out.data_ptr(), q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
        k_scales.data_ptr() if k_scales is not None else 0, v_scales.data_ptr() if v_scales is not None else 0,
        block_tables.data_ptr(), seq_lens.data_ptr(), query_start_loc.data_ptr(),
        T, H, kvh, D, q.stride(0), nb, bs, S, max_blocks, int(max_seq_len), float(scale),
        dtype_code(q), dtype_code(k_cache), cuda_stream(device), window, float(softcap),
    )
    if tensor_cores and device.type == "cuda" and max_query_len > 1:
        native(device).prefill_attention(*args, int(max_query_len))
    else:
        native(device).paged_attention(*args)
    return out
