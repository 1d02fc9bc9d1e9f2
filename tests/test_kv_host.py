"""Host memory as the middle KV tier (pyengine/engine/kv_host.py), in front of the disk tier or alone.

Part 1: the store alone (budget, fall-through to the disk, promotion from it). Part 2: the engine with the
PagedEcho stand-in (its output depends on the whole context as read back from the KV cache, so a block read
back wrong changes the tokens), and the default model against a cold run. Part 3: the GPU path (pinned buffers)."""
import os
import random
import time

import pytest
import torch

from pyengine.engine.kv_disk import DiskKVStore, chain_keys, model_fingerprint
from pyengine.engine.kv_host import HostKVStore
from pyengine.llm import LLM
from pyengine.sampling_params import SamplingParams

from engine_fakes import fake_engine, reference
from kv_tier_helpers import GREEDY, abort_every_other_while_loading, generate, prompts_of
from model_helpers import real_engine

FP = model_fingerprint({"model": "a"})


def block(seed: int, size: int = 1000) -> tuple[bytes, list[int], bytes]:
    rng = random.Random(seed)
    tokens = [rng.randrange(1000) for _ in range(16)]
    return chain_keys(FP, tokens, 16, 1)[0], tokens, bytes(rng.randrange(256) for _ in range(size))


# ---- Part 1: the store ------------------------------------------------------------------------

def test_the_host_budget_holds_under_churn_without_a_disk():
    host = HostKVStore(FP, 10_000)
    rng = random.Random(0)
    for i in range(200):
        assert host.put(*block(i))
        if rng.random() < 0.5:  # reads refresh recency
            host.get(*block(rng.randrange(i + 1))[:2])
        assert host.stats.bytes_used == 1000 * len(host) <= 10_000
    assert host.stats.evicted == 190 and host.stats.spilled == 0
    key, tokens, payload = block(199)
    assert host.get_tiered(key, tokens) == (memoryview(payload), "host")
    assert host.get(*block(0)[:2]) is None and block(0)[0] not in host  # evicted, no disk: gone
    assert not host.put(*block(500, 20_000))  # larger than the whole budget, nowhere to go


def test_host_evictions_fall_through_to_the_disk_and_disk_hits_are_promoted(tmp_path):
    disk = DiskKVStore(str(tmp_path), FP, 100_000)
    host = HostKVStore(FP, 2_000, disk)  # two blocks
    a, b, c = block(1), block(2), block(3)
    for blk in (a, b, c):
        host.put(*blk)
    assert not host.in_memory(a[0]) and a[0] in disk and a[0] in host  # a fell through to the disk
    assert b[0] not in disk and c[0] not in disk  # the others are in host memory only
    assert host.stats.spilled == 1
    payload, tier = host.get_tiered(a[0], a[1])
    assert (bytes(payload), tier) == (a[2], "disk")
    assert host.in_memory(a[0]) and host.stats.promoted == 1  # promoted, and b made room for it: to the disk
    assert not host.in_memory(b[0]) and b[0] in disk
    assert host.get_tiered(a[0], a[1])[1] == "host"
    assert host.get(b[0], b[1]) is not None and disk.stats.hits == 2
    assert host.get(a[0], [0] * 16) is None  # other tokens: a miss in both tiers (the disk removes its file)
    host.flush()  # at close: everything in host memory goes to the disk too
    assert all(k in disk for k in (b[0], c[0]))
    assert host.put(*block(9, 5_000)) and block(9)[0] in disk and not host.in_memory(block(9)[0])  # too big for RAM


# ---- Part 2: the engine -----------------------------------------------------------------------

def assert_consistent(engine):
    """Pool all free, nothing held for loading; host memory and the disk index within budget, the disk's index
    equal to its directory."""
    assert engine.pool.num_free == engine.pool.num_blocks and not engine.groups
    tier = engine.kv_tier
    assert not tier.loading
    host = tier.host
    assert host.stats.bytes_used == sum(len(buf) for _, buf in host._lru.values()) <= host.budget_bytes
    if tier.disk is not None:
        files = sorted(f for f in os.listdir(tier.disk.dir) if f.endswith(".kv"))
        assert [k.hex() + ".kv" for k in sorted(tier.disk._lru)] == files
        assert tier.disk.stats.bytes_used <= tier.disk.budget_bytes


def written(engine):
    """Wait until the tier's writer has stored every block queued so far (it runs on its own thread)."""
    deadline = time.monotonic() + 10
    while engine.kv_tier._pending and time.monotonic() < deadline:
        time.sleep(0.001)
    assert not engine.kv_tier._pending


def test_a_pool_miss_is_served_from_host_memory_without_a_disk():
    """Six prompts of 7 blocks through a pool of 16 blocks: the second pass finds them in host memory only."""
    prompts = prompts_of([120] * 6, seed=2)
    e = fake_engine(kv_tokens=256, kv_host_bytes=2**20)
    assert e.kv_tier.disk is None
    assert generate(e, prompts) == [reference(p, 5) for p in prompts]
    written(e)
    before = e.num_computed_tokens
    outs = LLM.from_engine(e).generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [reference(p, 5) for p in prompts]
    assert e.kv_tier.stats.host_hit_tokens == e.kv_tier.stats.hit_tokens > 0
    assert sum(o.metrics.num_host_cached_tokens for o in outs) == e.kv_tier.stats.hit_tokens
    assert sum(o.metrics.num_disk_cached_tokens for o in outs) == 0
    assert e.num_computed_tokens - before < 6 * 124  # the rest was computed, the host's blocks were not
    e.close()
    assert_consistent(e)


def test_host_evictions_reach_the_disk_and_a_restart_reads_them_back(tmp_path):
    """A host tier of 8 blocks over a disk: the first engine's blocks go to host memory, what it evicts (and all
    of it at close) down to the disk; a restarted engine reads the prompts back from the disk into host memory."""
    prompts = prompts_of([120] * 6, seed=5)
    block_bytes = 16 * 16  # PagedEcho: 16 bytes per token
    config = dict(kv_tokens=256, kv_disk_path=str(tmp_path), kv_host_bytes=8 * block_bytes)
    a = fake_engine(**config)
    assert generate(a, prompts) == [reference(p, 5) for p in prompts]
    a.close()
    assert a.kv_tier.host.stats.spilled == 6 * 7  # every block: evicted early, or flushed at close
    b = fake_engine(**config)
    assert generate(b, prompts) == [reference(p, 5) for p in prompts]
    stats = b.kv_tier.stats
    assert stats.hit_tokens == 6 * 112 and stats.host_hit_tokens == 0  # a fresh process: all from the disk
    assert b.kv_tier.host.stats.promoted == 6 * 7
    b.close()
    assert_consistent(b)


def test_preemption_and_aborts_leave_all_tiers_consistent(tmp_path):
    prompts = prompts_of([30 + 7 * i for i in range(8)], seed=3)
    params = SamplingParams(max_tokens=40, temperature=0.0)
    config = dict(kv_tokens=192, kv_disk_path=str(tmp_path), kv_host_bytes=6 * 256, max_num_seqs=8)
    e = fake_engine(**config)
    assert generate(e, prompts, params) == [reference(p, 40) for p in prompts]
    assert e.scheduler.num_preemptions > 0
    written(e)
    e.pool.reset_prefix_cache()  # the next pass finds nothing in the pool: every hit comes from a tier
    done = abort_every_other_while_loading(e, e.kv_tier.disk, prompts, params)
    assert {f"r{i}": done[f"r{i}"] for i in range(1, 8, 2)} == {f"r{i}": reference(prompts[i], 40)
                                                                 for i in range(1, 8, 2)}
    assert e.kv_tier.stats.hit_tokens > 0
    e.close()
    assert_consistent(e)


def test_metrics_count_hits_per_tier(tmp_path):
    p, = prompts_of([100], seed=7)
    e = fake_engine(kv_disk_path=str(tmp_path), kv_host_bytes=2**20)
    generate(e, [p])
    written(e)
    e.pool.reset_prefix_cache()
    generate(e, [p + [5]])  # from host memory
    e.close()
    b = fake_engine(kv_disk_path=str(tmp_path), kv_host_bytes=2**20)
    out = LLM.from_engine(b).generate([p + [6]], GREEDY, use_tqdm=False)[0]  # from the disk
    assert out.metrics.num_disk_cached_tokens == 96
    written(b)
    b.pool.reset_prefix_cache()
    out = LLM.from_engine(b).generate([p + [7]], GREEDY, use_tqdm=False)[0]  # promoted: from host memory
    assert (out.metrics.num_host_cached_tokens, out.metrics.num_disk_cached_tokens) == (96, 0)
    b.close()

    def value(engine, name):
        return engine.metrics.registry.get_sample_value(name, {"model_name": "paged-echo"})

    assert value(e, "pyengine:kv_host_hit_tokens_total") == 96 and value(e, "pyengine:kv_disk_hit_tokens_total") == 0
    assert value(b, "pyengine:kv_host_hit_tokens_total") == 96 == value(b, "pyengine:kv_disk_hit_tokens_total")
    assert value(b, "pyengine:kv_host_usage_bytes") == b.kv_tier.host.stats.bytes_used > 0
    e.metrics.on_kv_tier(e.kv_tier.stats, e.kv_tier.disk, e.kv_tier.host)  # as a step would after the close's flush
    assert value(e, "pyengine:kv_host_spilled_blocks_total") == e.kv_tier.host.stats.spilled == 6


@pytest.mark.parametrize("kv", ["auto", "int8"])
def test_a_turn_served_from_host_memory_equals_a_cold_run(real_parts, kv):
    tok = real_parts[2]
    turn1 = tok.encode("The history of the printing press begins in the fifteenth century, when Johannes "
                       "Gutenberg combined movable metal type, oil-based ink and a wooden press. " * 6)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    config = dict(kv_cache_dtype=kv)
    e = real_engine(real_parts, 1024, kv_host_bytes=64 * 2**20, **config)
    reply = generate(e, [turn1], params)[0]
    turn2 = turn1 + reply + tok.encode(" Who was Gutenberg?", add_special_tokens=False)
    written(e)
    e.pool.reset_prefix_cache()  # as if evicted: the pool misses, host memory has the blocks
    warm = generate(e, [turn2], params)
    assert e.kv_tier.stats.host_hit_tokens == (len(turn1) + 7) // 16 * 16 > 0
    cold = generate(real_engine(real_parts, 1024, **config), [turn2], params)
    assert warm == cold
    e.close()


def test_usage_and_the_request_log_split_cached_tokens_by_tier(tmp_path):
    from pyengine.output_types import RequestMetrics
    from pyengine.request_log import RequestLog, RequestRecord, read_records
    from server.openai_api import _Job

    def metrics(cached, disk, host):
        return RequestMetrics(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 100, cached, 1, 0, num_disk_cached_tokens=disk,
                              num_host_cached_tokens=host)

    job = _Job("r", "completion", None, [[1] * 100, [2] * 100], [None, None])
    job.metrics = {0: metrics(96, 32, 48), 1: metrics(64, 0, 64)}
    assert job.usage["prompt_tokens_details"] == {"cached_tokens": 160, "disk_cached_tokens": 32,
                                                  "host_cached_tokens": 112}
    log = RequestLog(str(tmp_path / "requests.csv"))
    log.write(RequestRecord("r", 0.0, None, 1.0, 200, 1, None, None, 160, "m", 200, "stop", None, "/v1/completions",
                            None, None, None, None, None, disk_cached_tokens=32, host_cached_tokens=112))
    log.close()
    assert read_records(str(tmp_path / "requests.csv"))[0]["host_cached_tokens"] == 112


def test_the_host_flag_and_its_checks():
    from pyengine.config import EngineConfig
    from server.cli import build_parser, engine_config

    assert engine_config(build_parser().parse_args(["--kv-host-bytes", "3GiB"])).kv_host_bytes == 3 * 2**30
    assert engine_config(build_parser().parse_args([])).kv_host_bytes == 0  # off by default
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        EngineConfig(kv_host_bytes=2**20, enable_prefix_caching=False)
    with pytest.raises(ValueError, match="kv_host_bytes"):
        EngineConfig(kv_host_bytes=0.5)


# ---- Part 3: the GPU path ---------------------------------------------------------------------

@pytest.mark.cuda
def test_blocks_go_through_pinned_host_memory_and_back_on_the_gpu():
    from pyengine.config import ModelConfig
    from pyengine.engine.kv_tiers import BlockCopier, pinned_buffer
    from pyengine.model.metadata import allocate_kv_caches

    cfg = ModelConfig("LlamaForCausalLM", 100, 64, 128, 2, 4, 2, 16)
    caches = allocate_kv_caches(cfg, 8, 16, torch.float8_e4m3fn, "cuda")
    tensors = [t.view(torch.uint8) for c in caches for t in (c.k, c.v, c.k_scales, c.v_scales) if t is not None]
    for t in tensors:
        t.copy_(torch.randint(0, 120, t.shape, dtype=torch.uint8))
    want = [t[[1, 4]].clone() for t in tensors]
    copier = BlockCopier(caches)
    rows = copier.gather([1, 4])
    assert torch.from_numpy(rows).is_pinned()
    host = HostKVStore(FP, 4 * copier.block_bytes, alloc=pinned_buffer)
    keys = chain_keys(FP, list(range(32)), 16, 2)
    for i, key in enumerate(keys):
        host.put(key, list(range(16 * i, 16 * i + 16)), rows[i])
    assert all(torch.from_numpy(buf).is_pinned() for _, buf in host._lru.values())
    for t in tensors:
        t[[1, 4]] = 0  # the sources are gone: only host memory has the blocks now
    copier.scatter([6, 2], [host.get(key, list(range(16 * i, 16 * i + 16))) for i, key in enumerate(keys)])
    torch.cuda.synchronize()
    for t, w in zip(tensors, want):
        assert torch.equal(t[[6, 2]], w)
