"""Decode steps as CUDA graphs (pyengine/model/cuda_graphs.py).

On the CPU: the bucket choice, the static batch's padding, and that a padded step through the model gives
the unpadded step's logits and writes only the real rows' K/V (what every graph replays relies on). On a
GPU (`-m cuda`): graph replays against eager steps, and the engine with graphs against the engine without.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from model_helpers import write_tiny_checkpoint
from pyengine.config import EngineConfig
from pyengine.model.cuda_graphs import DecodeBatch, DecodeGraphs, batch_buckets, bucket_for
from pyengine.model.loader import load_model
from pyengine.model.metadata import AttentionMetadata, allocate_kv_caches


@pytest.mark.parametrize("max_num_seqs,want", [
    (1, [1]), (3, [1, 2, 3]), (8, [1, 2, 4, 8]), (16, [1, 2, 4, 8, 16]), (40, [1, 2, 4, 8, 16, 32, 40]),
    (256, [1, 2, 4, 8, *range(16, 257, 16)])])
def test_batch_buckets(max_num_seqs, want):
    assert batch_buckets(max_num_seqs) == want


def test_bucket_for_is_the_smallest_that_fits():
    buckets = batch_buckets(40)
    assert [bucket_for(n, buckets) for n in (1, 2, 3, 5, 8, 9, 16, 17, 33, 40)] == [1, 2, 4, 8, 8, 16, 16, 32, 40, 40]
    assert bucket_for(41, buckets) is None
    with pytest.raises(ValueError):
        batch_buckets(0)


def test_cuda_options_need_a_cuda_device():
    for name in ("cuda_graphs", "tensor_core_prefill"):
        with pytest.raises(ValueError, match=f"{name} needs device='cuda'"):
            EngineConfig(device="cpu", **{name: True})


def test_server_flags_reach_the_engine_config():
    from server.cli import build_parser, engine_config

    cfg = engine_config(build_parser().parse_args(["--device", "cuda", "--cuda-graphs", "--tensor-core-prefill"]))
    assert cfg.cuda_graphs and cfg.tensor_core_prefill
    cfg = engine_config(build_parser().parse_args(["--device", "cuda"]))
    assert not cfg.cuda_graphs and not cfg.tensor_core_prefill


def test_decode_batch_pads_and_keeps_static_views():
    batch = DecodeBatch(8, max_model_len=100, block_size=16, device=torch.device("cpu"))
    assert batch.max_blocks == 7
    ids0, _, meta0, _ = batch.inputs(8)
    bt = np.array([[3, 4], [5, 6], [7, 8]], np.int32)
    batch.fill(3, 4, np.array([10, 11, 12]), np.array([20, 30, 40]), np.array([50, 70, 130]),
               np.array([21, 31, 41], np.int32), bt)
    ids, pos, meta, rows = batch.inputs(4)
    assert ids.data_ptr() == ids0.data_ptr() and meta.block_tables.data_ptr() == meta0.block_tables.data_ptr()
    assert ids[:3].tolist() == [10, 11, 12] and pos[:3].tolist() == [20, 30, 40]
    assert meta.slot_mapping.tolist() == [50, 70, 130, -1]
    assert meta.seq_lens.tolist() == [21, 31, 41, 1]
    assert meta.block_tables[3, 0] == 0
    assert meta.query_start_loc.tolist() == [0, 1, 2, 3, 4] and rows.tolist() == [0, 1, 2, 3]
    assert meta.block_tables.shape == (4, 7) and meta.block_tables[:3, :2].tolist() == bt.tolist()
    assert meta.max_seq_len == 100 and meta.max_query_len == 1
    # a smaller step after a larger one: the rows it leaves become padding again
    batch.fill(1, 2, np.array([9]), np.array([1]), np.array([5]), np.array([2], np.int32), bt[:1])
    assert batch.inputs(2)[2].slot_mapping.tolist() == [5, -1] and batch.inputs(2)[2].seq_lens.tolist() == [2, 1]
    with pytest.raises(ValueError):
        batch.fill(5, 4, *([np.zeros(5, np.int64)] * 4), np.zeros((5, 1), np.int32))
    with pytest.raises(ValueError):
        batch.fill(1, 1, *([np.zeros(1, np.int64)] * 4), np.zeros((1, 8), np.int32))


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return write_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny")), "llama")


def prefill_three(model, cfg, device, bs=16):
    """Caches holding three prompts (lengths 5, 40, 17) over shuffled blocks; returns (caches, tables, lens)."""
    lens = [5, 40, 17]
    nb = 20
    caches = allocate_kv_caches(cfg, nb, bs, model.dtype, device)
    perm = torch.randperm(nb, generator=torch.Generator().manual_seed(1)).to(torch.int32)
    tables = [perm[0:2], perm[2:6], perm[6:9]]
    g = torch.Generator().manual_seed(2)
    for table, n in zip(tables, lens):
        ids = torch.randint(3, cfg.vocab_size, (n,), generator=g)
        pos = torch.arange(n)
        meta = AttentionMetadata(
            slot_mapping=(table.long()[pos // bs] * bs + pos % bs).to(device), block_tables=table[None].to(device),
            seq_lens=torch.tensor([n], dtype=torch.int32, device=device),
            query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=device), max_seq_len=n)
        model(ids.to(device), pos.to(device), caches, meta, torch.tensor([n - 1], device=device))
    return caches, tables, lens


def decode_arrays(cfg, tables, lens, bs=16):
    """One decode token per sequence: numpy arrays as the runner's prepare_batch leaves them."""
    n = len(lens)
    ids = np.arange(7, 7 + n, dtype=np.int64)
    pos = np.array(lens, np.int64)
    slots = np.array([int(t[p // bs]) * bs + p % bs for t, p in zip(tables, pos)], np.int64)
    seq_lens = np.array([p + 1 for p in lens], np.int32)
    width = max((int(s) + bs - 1) // bs for s in seq_lens)
    bt = np.zeros((n, width), np.int32)
    for i, t in enumerate(tables):
        bt[i, : len(t)] = t.numpy()[:width]
    return ids, pos, slots, seq_lens, bt


def eager_decode(model, caches, arrays, device):
    ids, pos, slots, seq_lens, bt = arrays
    n = len(ids)
    meta = AttentionMetadata(
        slot_mapping=torch.from_numpy(slots).to(device), block_tables=torch.from_numpy(bt).to(device),
        seq_lens=torch.from_numpy(seq_lens).to(device),
        query_start_loc=torch.arange(n + 1, dtype=torch.int32, device=device), max_seq_len=int(seq_lens.max()))
    return model(torch.from_numpy(ids).to(device), torch.from_numpy(pos).to(device), caches, meta,
                 torch.arange(n, device=device))


def clone_caches(caches):
    return [type(c)(c.k.clone(), c.v.clone()) for c in caches]


@torch.inference_mode()
def test_padded_decode_step_equals_the_unpadded_one_on_cpu(tiny_folder):
    """The static batch padded to a bucket of 8 through the model: the 3 real rows' logits of the plain step,
    and only their 3 K/V slots written (padding rows write nothing)."""
    cfg, model = load_model(tiny_folder, torch.float32, "cpu")
    caches, tables, lens = prefill_three(model, cfg, torch.device("cpu"))
    before = clone_caches(caches)
    arrays = decode_arrays(cfg, tables, lens)
    want = eager_decode(model, clone_caches(before), arrays, torch.device("cpu"))

    batch = DecodeBatch(16, max_model_len=512, block_size=16, device=torch.device("cpu"))
    batch.fill(3, 8, *arrays)
    ids, pos, meta, rows = batch.inputs(8)
    got = model(ids, pos, caches, meta, rows)
    torch.testing.assert_close(got[:3], want, atol=1e-5, rtol=1e-5)
    slots = set(arrays[2].tolist())
    for new, old in zip(caches, before):
        # logical [blocks, kvh, bs, d] -> [slot, kvh, d]
        for a, b in ((new.k, old.k), (new.v, old.v)):
            changed = (a != b).reshape(a.shape[0], a.shape[1], -1).any(1).any(1)  # per block
            assert set(torch.nonzero(changed).flatten().tolist()) <= {s // 16 for s in slots}
            assert changed.any()


class EagerGraphs(DecodeGraphs):
    """DecodeGraphs whose 'replay' runs the captured function eagerly: the whole decode path of the runner
    (dispatch, static batch, padding to buckets, logits rows) minus the capture, so it runs on the CPU."""

    def _replay(self, bucket: int) -> None:
        self._forward(bucket)


def test_engine_through_the_graph_path_on_cpu_matches_eager(tiny_folder):
    """Ragged prompts with prefix hits and preemption (a tight pool), batches of 1 to 16 crossing buckets:
    the runner's decode-only steps through the static padded batch give the eager engine's tokens."""
    from test_cuda_model import GREEDY, SEEDED, mixed_prompts, tiny_llm, tokens
    from test_engine import assert_all_free

    prompts = mixed_prompts(256, n=24)
    config = dict(max_num_seqs=16, max_num_batched_tokens=256, kv_tokens=2048)
    eager = tiny_llm(tiny_folder, "cpu", **config)
    graphed = tiny_llm(tiny_folder, "cpu", **config)
    runner = graphed.engine.runner
    runner.graphs = EagerGraphs(runner.model, runner.kv_caches, max_num_seqs=16,
                                max_model_len=graphed.engine.max_model_len, block_size=16,
                                vocab_size=runner.vocab_size, device=torch.device("cpu"))
    buckets = []
    fill = runner.graphs.batch.fill
    runner.graphs.batch.fill = lambda n, bucket, *a: buckets.append(bucket) or fill(n, bucket, *a)
    for params in (GREEDY, SEEDED):
        got, want = tokens(graphed, prompts, params), tokens(eager, prompts, params)
        assert sum(g == w for g, w in zip(got, want)) >= len(prompts) - 1
    assert len(set(buckets)) >= 3, sorted(set(buckets))  # several buckets, padding rows among them
    assert graphed.engine.stats().num_preemptions > 0
    assert_all_free(graphed.engine)


# ---- on a GPU ------------------------------------------------------------------------------------

@pytest.mark.cuda
@torch.inference_mode()
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_graph_replay_equals_eager_step(tiny_folder, dtype):

    dev = torch.device("cuda")
    cfg, model = load_model(tiny_folder, dtype, "cuda")
    caches, tables, lens = prefill_three(model, cfg, dev)
    graphs = DecodeGraphs(model, caches, max_num_seqs=20, max_model_len=512, block_size=16,
                          vocab_size=cfg.vocab_size, device=dev)
    graphs.capture()
    assert sorted(graphs.graphs) == [1, 2, 4, 8, 16, 20]
    arrays = decode_arrays(cfg, tables, lens)
    for n in (1, 2, 3):  # buckets 1, 2 and 4 (one padding row)
        part = tuple(a[:n] for a in arrays)
        want = eager_decode(model, caches, part, dev).clone()
        got = graphs.run(n, *part)
        # the graph's attention splits its keys for max_model_len, the eager step for the longest row
        tol = dict(atol=1e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=5e-2, rtol=2e-2)
        torch.testing.assert_close(got, want, **tol)
    assert graphs.run(21, *arrays) is None  # beyond the largest bucket: the runner runs it eagerly


@pytest.mark.cuda
@pytest.mark.parametrize("kv", ["auto", "int8"])
def test_engine_with_cuda_graphs_matches_eager_token_for_token(tiny_folder, kv):
    """Greedy and seeded runs over ragged prompts with prefix hits and preemption (a tight pool), batches
    from 1 to 16 sequences crossing buckets: the same tokens with and without graphs, and graphs used."""
    from test_cuda_model import GREEDY, SEEDED, mixed_prompts, tiny_llm, tokens
    from test_engine import assert_all_free

    prompts = mixed_prompts(256, n=24)
    config = dict(max_num_seqs=16, max_num_batched_tokens=256, kv_tokens=2048, kv_cache_dtype=kv)
    eager = tiny_llm(tiny_folder, "cuda", **config)
    graphed = tiny_llm(tiny_folder, "cuda", cuda_graphs=True, **config)
    graphs = graphed.engine.runner.graphs
    replays = []
    run = graphs.run
    graphs.run = lambda n, *a: replays.append(n) or run(n, *a)
    for params in (GREEDY, SEEDED):  # split-KV partitions differ (max_seq_len): allow one near-tie to flip
        got, want = tokens(graphed, prompts, params), tokens(eager, prompts, params)
        assert sum(g == w for g, w in zip(got, want)) >= len(prompts) - 1
    assert len(set(replays)) > 3, replays
    assert graphed.engine.stats().num_preemptions > 0
    assert_all_free(graphed.engine)


@pytest.fixture(scope="module")
def d64_folder(tmp_path_factory):
    return write_tiny_checkpoint(str(tmp_path_factory.mktemp("d64")), "llama_d64")


@pytest.mark.cuda
@torch.inference_mode()
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_model_with_tensor_core_prefill_matches_split_kernel(d64_folder, dtype):
    """A 700-token prompt in chunks of 256 (cached context, a partial last block) through the model (head_dim
    64, GQA 9:3 like the default model): the tensor-core kernel's logits are as close to the fp32 model's as
    the split-KV kernel's are (both in `dtype`)."""
    from model_helpers import step_metadata

    dev = torch.device("cuda")
    prompt = torch.randint(3, 256, (700,), generator=torch.Generator().manual_seed(4))
    table = torch.randperm(50, generator=torch.Generator().manual_seed(5)).to(torch.int32)

    def logits(run_dtype: torch.dtype, tc: bool) -> torch.Tensor:
        cfg, model = load_model(d64_folder, run_dtype, "cuda")
        caches = allocate_kv_caches(cfg, 50, 16, run_dtype, dev)
        rows = []
        for start in range(0, 700, 256):
            n = min(256, 700 - start)
            m = step_metadata(table, 16, start, n)
            meta = AttentionMetadata(m.slot_mapping.to(dev), m.block_tables.to(dev), m.seq_lens.to(dev),
                                     m.query_start_loc.to(dev), m.max_seq_len, max_query_len=n, tensor_cores=tc)
            rows.append(model(prompt[start:start + n].to(dev), torch.arange(start, start + n, device=dev), caches,
                              meta, torch.arange(n, device=dev)).cpu())
        return torch.cat(rows)

    ref, split, tc = logits(torch.float32, False), logits(dtype, False), logits(dtype, True)
    span = float(ref.max() - ref.min())
    err_split, err_tc = (ref - split).abs(), (ref - tc).abs()
    assert float(err_tc.max()) <= 1.5 * float(err_split.max()) + 1e-3 * span
    assert float(err_tc.mean()) <= 1.5 * float(err_split.mean()) + 1e-4 * span


@pytest.mark.cuda
def test_engine_with_tensor_core_prefill_matches_split_kernel(d64_folder):
    """The engine end to end (bf16): ragged prompts with prefix hits, the first greedy tokens mostly equal."""
    from test_cuda_model import GREEDY, mixed_prompts, tiny_llm, tokens
    from test_engine import assert_all_free

    prompts = mixed_prompts(256, n=12)
    base = tiny_llm(d64_folder, "cuda", dtype="bfloat16", max_num_batched_tokens=512)
    fast = tiny_llm(d64_folder, "cuda", dtype="bfloat16", max_num_batched_tokens=512, tensor_core_prefill=True)
    want, got = tokens(base, prompts, GREEDY), tokens(fast, prompts, GREEDY)
    assert sum(w[0] == g[0] for w, g in zip(want, got)) >= len(prompts) * 3 // 4  # bf16 may flip near-ties
    assert_all_free(fast.engine)
