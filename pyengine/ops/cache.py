"""reshape_and_cache: write this step's K/V rows into the paged KV cache."""
from __future__ import annotations

import torch

from pyengine.ops._common import check_tensor, cuda_stream, dtype_code, native
from pyengine.ops.attention import ACT_DTYPES, check_kv_cache, check_token_rows


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
    query: torch.Tensor | None = None,
) -> None:
    """key/value [T, KVH, D] -> cache rows at slot_mapping [T] int64 (block * block_size + offset; -1 = skip).

    key/value may be token-strided views (e.g. slices of a fused QKV output). For fp8_e4m3fn/int8 caches
    each (token, kv head) row is quantized with one scale, stored in k_scales/v_scales: int8 absmax / 127,
    fp8 the one of 16 candidates absmax / 448 * (16 + j) / 16 that reconstructs the row best (kv_quant.h).
    query [T, H, D] (key's dtype, H a multiple of KVH; token-strided views too): this step's q, in K's
    basis. fp8 and int8 caches then round each K value to one of its two nearest codes so that the error
    points away from the token's own q heads, which share the direction later queries mostly take
    (native/cpu/kv_cache.cpp: round_k_for_queries); unquantized caches ignore it.
    """
    check_tensor("key", key, dtypes=ACT_DTYPES, ndim=3, contiguous=False)
    device = key.device
    T, kvh, D = key.shape
    check_tensor("value", value, dtypes=(key.dtype,), shape=(T, kvh, D), device=device, contiguous=False)
    check_token_rows("key", key, kvh, D)
    check_token_rows("value", value, kvh, D)
    nb, _, bs, _ = check_kv_cache(k_cache, v_cache, k_scales, v_scales, key.dtype, device, kvh, D)
    check_tensor("slot_mapping", slot_mapping, dtypes=(torch.int64,), shape=(T,), device=device)
    heads = 0
    if query is not None:
        check_tensor("query", query, dtypes=(key.dtype,), ndim=3, device=device, contiguous=False)
        heads = query.shape[1]
        if query.shape[0] != T or query.shape[2] != D or heads % kvh:
            raise ValueError(f"query must be [{T}, a multiple of {kvh}, {D}], got {list(query.shape)}")
        check_token_rows("query", query, heads, D)
    if T == 0:
        return
    native(device).reshape_and_cache(
        key.data_ptr(), value.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
        k_scales.data_ptr() if k_scales is not None else 0, v_scales.data_ptr() if v_scales is not None else 0,
        slot_mapping.data_ptr(), T, kvh, D, key.stride(0), value.stride(0), nb, bs,
        dtype_code(key), dtype_code(k_cache), cuda_stream(device),
        query.data_ptr() if query is not None else 0, query.stride(0) if query is not None else 0, heads,
    )
