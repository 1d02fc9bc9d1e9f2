"""Decode steps replayed as CUDA graphs.

A decode step of the default model launches about ten kernels per layer, ~300 in all, each tens of
microseconds from Python: at small batches the GPU waits on the host. A CUDA graph records one step's
launches once and replays them with one call. A graph is fixed in its shapes, its addresses and its
host-side arguments, so:

- one graph per batch-size bucket (`batch_buckets`); a step of n sequences replays the smallest bucket
  >= n, whose extra rows are padding: slot -1 (writes no K/V), one key in block 0 (seq_len 1: a row that
  reads no more than the cache's first row; its output is dropped);
- the step's inputs are copied into static buffers (`DecodeBatch`) that every graph reads; block tables
  are [bucket, blocks of max_model_len], query_start_loc is 0..bucket (one token per row, padding too);
- attention is told max_seq_len = max_model_len (the split-KV kernel sizes its splits from it; shorter
  rows leave their last splits empty) and max_query_len = 1;
- every graph writes its logits into one static [max bucket, vocab] buffer; the graphs share one memory
  pool, since only one runs at a time.

Only decode-only steps (every sequence computes one token and samples) replay a graph; prefill and mixed
steps, and steps that want prompt logprobs, run eagerly (model/runner.py decides).
"""
from __future__ import annotations

import numpy as np
import torch

from pyengine.model.metadata import AttentionMetadata, KVCache


def batch_buckets(max_num_seqs: int) -> list[int]:
    """Batch sizes that get a graph: 1, 2, 4, 8, then every multiple of 16, up to max_num_seqs (included).

    Padding costs at most 15 rows of a bucket above 16 (a decode row is cheap next to the weights every
    step reads); finer buckets would cost capture time and pool memory."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    sizes = [b for b in (1, 2, 4, 8) if b < max_num_seqs] + list(range(16, max_num_seqs, 16))
    return sizes + [max_num_seqs]


def bucket_for(n: int, buckets: list[int]) -> int | None:
    """The smallest bucket >= n (None when n exceeds the largest)."""
    for b in buckets:
        if b >= n:
            return b
    return None


class DecodeBatch:
    """The static inputs of a decode step for up to `max_rows` sequences, on `device`.

    fill() writes a step's arrays into host staging buffers (pinned on CUDA) and copies the first
    `bucket` rows to the device buffers on the current stream; the host buffers are reused by the next
    fill, which the runner calls only after the previous step's tokens reached the host (a sync)."""

    def __init__(self, max_rows: int, max_model_len: int, block_size: int, device: torch.device) -> None:
        self.max_rows, self.max_seq_len, self.device = max_rows, max_model_len, device
        self.max_blocks = max_blocks = -(-max_model_len // block_size)
        shapes = {"input_ids": ((max_rows,), torch.int64), "positions": ((max_rows,), torch.int64),
                  "slot_mapping": ((max_rows,), torch.int64), "seq_lens": ((max_rows,), torch.int32),
                  "block_tables": ((max_rows, max_blocks), torch.int32)}
        cuda = device.type == "cuda"
        self.host = {k: torch.zeros(shape, dtype=dt, pin_memory=cuda) for k, (shape, dt) in shapes.items()}
        self.dev = {k: v.to(device) if cuda else v for k, v in self.host.items()}
        self.query_start_loc = torch.arange(max_rows + 1, dtype=torch.int32).to(device)
        self.logits_indices = torch.arange(max_rows, dtype=torch.int64).to(device)
        self._np = {k: v.numpy() for k, v in self.host.items()}
        self.host["slot_mapping"].fill_(-1)  # rows never filled are padding (as fill() leaves them)
        self.host["seq_lens"].fill_(1)
        if cuda:
            self.dev["slot_mapping"].fill_(-1)
            self.dev["seq_lens"].fill_(1)

    def fill(self, n: int, bucket: int, input_ids: np.ndarray, positions: np.ndarray, slot_mapping: np.ndarray,
             seq_lens: np.ndarray, block_tables: np.ndarray) -> None:
        """A step of n sequences (one token each) in rows [0, n); rows [n, bucket) become padding.
        block_tables: [n, blocks] with blocks <= max_blocks (the columns past it are never read)."""
        if not 0 < n <= bucket <= self.max_rows:
            raise ValueError(f"a decode step of {n} rows does not fit bucket {bucket} (max {self.max_rows})")
        blocks = block_tables.shape[1]
        if block_tables.shape[0] != n or blocks > self.max_blocks:
            raise ValueError(f"block_tables {block_tables.shape} for {n} rows of at most {self.max_blocks} blocks")
        h = self._np
        h["input_ids"][:n] = input_ids[:n]
        h["positions"][:n] = positions[:n]
        h["slot_mapping"][:n] = slot_mapping[:n]
        h["slot_mapping"][n:bucket] = -1
        h["seq_lens"][:n] = seq_lens[:n]
        h["seq_lens"][n:bucket] = 1
        h["block_tables"][:n, :blocks] = block_tables
        h["block_tables"][n:bucket, 0] = 0
        if self.device.type == "cuda":
            for k, src in self.host.items():
                self.dev[k][:bucket].copy_(src[:bucket], non_blocking=True)

    def inputs(self, bucket: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """(input_ids, positions, metadata, logits_indices) of the first `bucket` rows: views of the static
        buffers, the same tensors every call (what a graph captures)."""
        d = self.dev
        meta = AttentionMetadata(
            slot_mapping=d["slot_mapping"][:bucket], block_tables=d["block_tables"][:bucket],
            seq_lens=d["seq_lens"][:bucket], query_start_loc=self.query_start_loc[: bucket + 1],
            max_seq_len=self.max_seq_len, max_query_len=1)
        return d["input_ids"][:bucket], d["positions"][:bucket], meta, self.logits_indices[:bucket]


class DecodeGraphs:
    """One captured CUDA graph per bucket of `batch_buckets(max_num_seqs)`, over `kv_caches`."""

    def __init__(self, model: torch.nn.Module, kv_caches: list[KVCache], *, max_num_seqs: int, max_model_len: int,
                 block_size: int, vocab_size: int, device: torch.device) -> None:
        self.model, self.kv_caches = model, kv_caches
        self.buckets = batch_buckets(max_num_seqs)
        self.batch = DecodeBatch(max_num_seqs, max_model_len, block_size, device)
        self.logits = torch.empty(max_num_seqs, vocab_size, dtype=torch.float32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}

    def _forward(self, bucket: int) -> None:
        ids, pos, meta, rows = self.batch.inputs(bucket)
        self.logits[:bucket].copy_(self.model(ids, pos, self.kv_caches, meta, rows))

    @torch.inference_mode()
    def capture(self) -> None:
        """Warm each bucket up eagerly (lazy initializations must not happen inside a capture), then capture
        it, largest first so that the smaller graphs reuse the shared pool's blocks. The static inputs hold
        padding meanwhile: no cache row is read or written."""
        side = torch.cuda.Stream(self.batch.device)
        side.wait_stream(torch.cuda.current_stream(self.batch.device))
        with torch.cuda.stream(side):
            for bucket in self.buckets:
                self._forward(bucket)
        torch.cuda.current_stream(self.batch.device).wait_stream(side)
        pool = torch.cuda.graph_pool_handle()
        for bucket in reversed(self.buckets):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._forward(bucket)
            self.graphs[bucket] = graph
        torch.cuda.synchronize(self.batch.device)

    def run(self, n: int, input_ids: np.ndarray, positions: np.ndarray, slot_mapping: np.ndarray,
            seq_lens: np.ndarray, block_tables: np.ndarray) -> torch.Tensor | None:
        """Replay the graph of n sequences' decode step: logits [n, vocab] (a view of the static buffer,
        valid until the next replay), or None when n exceeds every bucket."""
        bucket = bucket_for(n, self.buckets)
        if bucket is None:
            return None
        self.batch.fill(n, bucket, input_ids, positions, slot_mapping, seq_lens, block_tables)
        self._replay(bucket)
        return self.logits[:n]

    def _replay(self, bucket: int) -> None:
        self.graphs[bucket].replay()
