"""CPU memory on 2 MB transparent huge pages, for the buffers the kernels stream: a model's weights,
quantized or packed bf16 (model.llama), and the paged KV cache (model.metadata.allocate_kv_caches).

On 4 KB pages every page a kernel enters costs a TLB miss (in a virtual machine a two-level page walk)
and stops the hardware prefetcher's stream at its edge. Linux's usual THP mode, "madvise", backs
anonymous memory with huge pages only where asked (madvise MADV_HUGEPAGE). Plain reads, decode
attention over shuffled blocks, the M = 1 quantized kernels and batch-1 decode all measured faster on
them (docs/performance.md, "huge pages").
"""
from __future__ import annotations

import math
import mmap

import torch

HUGE_PAGE = 2 << 20
ALIGN = 64  # a piece's alignment: the kernels' lines


def huge_page_buffer(nbytes: int) -> torch.Tensor:
    """uint8 [nbytes rounded up to 2 MB] of zeros, 2 MB aligned, madvised for huge pages where the OS
    has them (4 KB pages where it has not). Anonymous memory: the OS commits a page on its first write,
    so untouched parts cost no resident memory."""
    nbytes = max(1, -(-nbytes // HUGE_PAGE)) * HUGE_PAGE
    # private anonymous memory (a shared map would be shmem, whose huge pages follow other settings);
    # the tensor keeps the map alive
    buf = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE)
    t = torch.frombuffer(buf, dtype=torch.uint8)
    skip = (-t.data_ptr()) % HUGE_PAGE
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            buf.madvise(mmap.MADV_HUGEPAGE, skip, nbytes)
        except OSError:  # THP not configured
            pass
    return t[skip : skip + nbytes]


def commit_pages(t: torch.Tensor) -> None:
    """Commit t's pages now: a zero written to every 4 KB of it (t is zeros already, and stays so)."""
    flat = t.view(-1).view(torch.uint8)
    flat[::4096].zero_()


class HugePageArena:
    """Pieces cut in order (64-byte aligned) from large chunks of huge_page_buffer: many tensors share
    huge pages instead of each rounding up to its own. Pages are committed as pieces are written, so a
    chunk holds at most one partly used huge page beyond what its pieces touch; a chunk is unmapped when
    the last piece in it is freed. Pieces start as zeros (fresh anonymous memory, never reused)."""

    def __init__(self, chunk_bytes: int = 256 << 20) -> None:
        self.chunk_bytes = chunk_bytes
        self._chunk: torch.Tensor | None = None
        self._used = 0

    def take(self, nbytes: int) -> torch.Tensor:
        """uint8 [nbytes], 64-byte aligned."""
        size = -(-nbytes // ALIGN) * ALIGN
        if self._chunk is None or self._used + size > self._chunk.numel():
            self._chunk, self._used = huge_page_buffer(max(self.chunk_bytes, size)), 0
        out = self._chunk[self._used : self._used + nbytes]
        self._used += size
        return out

    def zeros(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A zero tensor of `shape` and `dtype`."""
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        return self.take(nbytes).view(dtype).view(shape)
