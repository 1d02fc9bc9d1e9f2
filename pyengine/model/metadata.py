"""Attention metadata of one forward step, and the paged KV cache it indexes (layouts: docs/architecture.md,
"KV cache")."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pyengine.config import ModelConfig
from pyengine.ops.attention import kv_cache_shapes
from pyengine.ops.huge_pages import HugePageArena, commit_pages

QUANTIZED_CACHE_DTYPES = (torch.float8_e4m3fn, torch.int8)


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: block_id * block_size + offset of each new token (-1 = skip)
    block_tables: torch.Tensor  # [S, max_blocks] int32
    seq_lens: torch.Tensor  # [S] int32: cache tokens per sequence, this step's included
    query_start_loc: torch.Tensor  # [S+1] int32
    max_seq_len: int
    max_query_len: int | None = None  # the longest query_start_loc span (None: up to T)
    tensor_cores: bool = False  # CUDA: steps with prompt chunks use the tensor-core kernel (ops.paged_attention)


@dataclass
class KVCache:
    """One layer's cache. k, v: shaped by the device's layout (ops.attention.kv_cache_shapes); scales
    only for fp8/int8 caches."""

    k: torch.Tensor
    v: torch.Tensor
    k_scales: torch.Tensor | None = None  # [num_blocks, KVH, block_size] fp32
    v_scales: torch.Tensor | None = None


def allocate_kv_caches(
    cfg: ModelConfig, num_blocks: int, block_size: int, cache_dtype: torch.dtype, device: torch.device | str,
    prefault: bool = False,
) -> list[KVCache]:
    """Every layer's cache, zeroed. On the CPU all of them are cut from one HugePageArena (decode
    attention streams the cache: huge pages spare it a TLB miss per 4 KB), anonymous memory the OS
    commits on first write: a pool sized for the whole configuration costs resident memory only for
    the 2 MB pages that the blocks in use touch. prefault commits it all now instead (the
    kv_cache_prefault setting)."""
    k_shape, v_shape = kv_cache_shapes(num_blocks, cfg.num_key_value_heads, block_size, cfg.head_dim, device,
                                       cache_dtype)
    shapes = [(k_shape, cache_dtype), (v_shape, cache_dtype)]
    if cache_dtype in QUANTIZED_CACHE_DTYPES:  # k_scales, v_scales
        shapes += [((num_blocks, cfg.num_key_value_heads, block_size), torch.float32)] * 2
    if torch.device(device).type == "cpu":
        arena = HugePageArena()

        def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
            t = arena.zeros(shape, dtype)
            if prefault:
                commit_pages(t)
            return t
    else:
        def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)
    return [KVCache(*(zeros(s, d) for s, d in shapes)) for _ in range(cfg.num_hidden_layers)]


def copy_blocks(kv_caches: list[KVCache], pairs: list[tuple[int, int]]) -> None:
    """Copy whole KV blocks, (source, destination) pairs, in every layer: values and scales (a forked
    sequence's own copy of the block its prompt ends in). The block is the leading dim of every layout."""
    device = kv_caches[0].k.device
    src = torch.tensor([s for s, _ in pairs], dtype=torch.int64, device=device)
    dst = torch.tensor([d for _, d in pairs], dtype=torch.int64, device=device)
    for cache in kv_caches:
        for t in (cache.k, cache.v, cache.k_scales, cache.v_scales):
            if t is not None:  # as bytes: torch has no index_copy_ for fp8 on the CPU
                b = t.view(torch.uint8)
                b.index_copy_(0, dst, b.index_select(0, src))


def kv_bytes_per_token(cfg: ModelConfig, cache_dtype: torch.dtype) -> int:
    """K and V bytes per token over all layers, scales (one fp32 per token per kv head) included."""
    per_head = cfg.head_dim * torch.empty((), dtype=cache_dtype).element_size()
    if cache_dtype in QUANTIZED_CACHE_DTYPES:
        per_head += 4
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * per_head
