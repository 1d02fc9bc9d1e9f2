"""The disk tier under the prefix cache (pyengine/engine/kv_disk.py, kv_tiers.py).

Part 1: the store alone (keys, checks, budget, failing writes). Part 2: the engine with the PagedEcho stand-in,
whose output depends on the whole context as read back from the KV cache, so a block read back wrong changes
the tokens. Part 3: the default model after a restart, fp32 and bf16, against a cold run."""
import errno
import os
import random
import threading
import time

import pytest
import torch

from pyengine.engine.kv_disk import DiskKVStore, chain_keys, model_fingerprint
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


def files_of(store: DiskKVStore) -> list[str]:
    return sorted(f for f in os.listdir(store.dir) if f.endswith(".kv"))


# ---- Part 1: the store ------------------------------------------------------------------------

def test_keys_chain_the_whole_prefix_and_the_model():
    a = chain_keys(FP, list(range(48)), 16, 3)
    b = chain_keys(FP, [99] + list(range(1, 48)), 16, 3)
    assert len(set(a)) == 3 and all(x != y for x, y in zip(a, b))  # one token early changes every later key
    assert chain_keys(model_fingerprint({"model": "b"}), list(range(48)), 16, 3)[2] != a[2]
    assert chain_keys(FP, list(range(48)), 16, 3, a[:1]) == a  # extends a computed prefix


def test_blocks_survive_a_reopen_in_lru_order(tmp_path):
    store = DiskKVStore(str(tmp_path), FP, 1 << 20)
    blocks = [block(i) for i in range(3)]
    for key, tokens, payload in blocks:
        assert store.put(key, tokens, payload)
    time.sleep(0.01)
    assert bytes(store.get(blocks[0][0], blocks[0][1])) == blocks[0][2]  # the most recent now
    again = DiskKVStore(str(tmp_path), FP, 1 << 20)
    assert len(again) == 3 and again.stats.bytes_used == store.stats.bytes_used
    assert list(again._lru) == [blocks[1][0], blocks[2][0], blocks[0][0]]
    for key, tokens, payload in blocks:
        assert bytes(again.get(key, tokens)) == payload


@pytest.mark.parametrize("damage", ["flip", "truncate", "foreign", "tokens", "empty"])
def test_a_damaged_or_foreign_entry_is_a_miss_and_is_removed(tmp_path, damage):
    store = DiskKVStore(str(tmp_path), FP, 1 << 20)
    key, tokens, payload = block(0)
    store.put(key, tokens, payload)
    path = os.path.join(store.dir, key.hex() + ".kv")
    data = bytearray(open(path, "rb").read())
    if damage == "flip":
        data[-10] ^= 1
    elif damage == "truncate":
        data = data[:-1]
    elif damage == "empty":
        data = bytearray()
    elif damage == "foreign":  # another model's file under this model's name
        other = DiskKVStore(str(tmp_path / "other"), model_fingerprint({"model": "b"}), 1 << 20)
        other.put(key, tokens, payload)
        data = bytearray(open(os.path.join(other.dir, key.hex() + ".kv"), "rb").read())
    open(path, "wb").write(data)
    asked = tokens if damage != "tokens" else [t + 1 for t in tokens]  # same key, other tokens
    assert store.get(key, asked) is None
    assert store.stats.bad_files == 1 and not os.path.exists(path) and key not in store
    assert store.stats.bytes_used == 0 and store.stats.files == 0


def test_the_budget_holds_under_churn(tmp_path):
    store = DiskKVStore(str(tmp_path), FP, 20_000)
    rng = random.Random(1)
    for i in range(200):
        key, tokens, payload = block(i, rng.randrange(500, 4000))
        store.put(key, tokens, payload)
        if i % 7 == 0:
            store.get(*block(rng.randrange(i + 1))[:2])
        on_disk = sum(os.path.getsize(os.path.join(store.dir, f)) for f in files_of(store))
        assert on_disk == store.stats.bytes_used <= 20_000
    assert store.stats.evicted > 0 and len(files_of(store)) == len(store)
    assert not store.put(*block(999, 30_000))  # larger than the whole budget: not stored
    smaller = DiskKVStore(str(tmp_path), FP, 5_000)  # a restart with a smaller budget trims at once
    assert smaller.stats.bytes_used <= 5_000 and len(files_of(smaller)) == len(smaller)


def test_a_full_disk_fails_the_write_only(tmp_path, monkeypatch):
    store = DiskKVStore(str(tmp_path), FP, 1 << 20)
    kept = block(0)
    store.put(*kept)
    real_replace = os.replace

    def enospc(src, dst):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "replace", enospc)
    assert not store.put(*block(1))
    assert store.stats.write_errors == 1 and len(store) == 1
    assert os.listdir(store.dir) == [kept[0].hex() + ".kv"]  # no temporary left behind
    monkeypatch.setattr(os, "replace", real_replace)
    assert bytes(store.get(kept[0], kept[1])) == kept[2] and store.put(*block(1))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_block_copier_moves_whole_blocks_of_every_layer(device, dtype):
    from pyengine.config import ModelConfig
    from pyengine.engine.kv_tiers import BlockCopier
    from pyengine.model.metadata import allocate_kv_caches

    cfg = ModelConfig("LlamaForCausalLM", 100, 64, 128, 2, 4, 2, 16)
    caches = allocate_kv_caches(cfg, 8, 16, dtype, device)
    tensors = [t for c in caches for t in (c.k, c.v, c.k_scales, c.v_scales) if t is not None]
    assert len(tensors) == (8 if dtype == torch.float8_e4m3fn else 4)
    for t in tensors:
        u = t.view(torch.uint8)
        u.copy_(torch.randint(0, 120, u.shape, dtype=torch.uint8))
    want = [t.view(torch.uint8)[[1, 4]].clone() for t in tensors]
    copier = BlockCopier(caches)
    rows = copier.gather([1, 4])
    assert rows.shape == (2, copier.block_bytes)
    copier.scatter([6, 2], list(rows))
    for t, w in zip(tensors, want):
        assert torch.equal(t.view(torch.uint8)[[6, 2]], w)
        assert torch.equal(t.view(torch.uint8)[[1, 4]], w)  # the sources are untouched


# ---- Part 2: the engine, PagedEcho ------------------------------------------------------------

def assert_consistent(engine):
    """Pool all free, nothing held for loading, the store's index equal to its directory and within budget."""
    assert engine.pool.num_free == engine.pool.num_blocks and not engine.groups
    tier = engine.kv_tier
    assert not tier.loading
    store = tier.store
    assert [k.hex() + ".kv" for k in sorted(store._lru)] == files_of(store)
    assert store.stats.bytes_used <= store.budget_bytes


def test_a_restarted_engine_reads_the_prefix_back_and_computes_only_the_rest(tmp_path):
    first, = prompts_of([200])
    a = fake_engine(kv_disk_path=str(tmp_path))
    assert generate(a, [first]) == [reference(first, 5)]
    a.close()
    b = fake_engine(kv_disk_path=str(tmp_path))  # a new process: an empty pool, the same directory
    nxt = first + prompts_of([50], seed=1)[0]
    out = LLM.from_engine(b).generate([nxt], GREEDY, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == reference(nxt, 5)
    assert b.kv_tier.stats.hit_tokens == 192 == out.metrics.num_cached_tokens  # 200 + 4 decoded: 12 full blocks
    assert out.metrics.num_disk_cached_tokens == 192
    assert b.num_computed_tokens == len(nxt) - 192 + 4
    assert b.kv_tier.store.stats.hits == 12
    b.close()
    assert_consistent(b)


@pytest.mark.parametrize("max_num_seqs", [1, 8])
def test_blocks_evicted_from_a_small_pool_come_back_from_disk(tmp_path, max_num_seqs):
    """Six prompts of 7 blocks each through a pool of 16 blocks, all at once: each request's blocks are read
    back and stay pinned until it is admitted, so none is evicted by the others' before it runs."""
    prompts = prompts_of([120] * 6, seed=2)
    e = fake_engine(kv_tokens=256, kv_disk_path=str(tmp_path), max_num_seqs=max_num_seqs)
    assert generate(e, prompts) == [reference(p, 5) for p in prompts]
    e.close()
    e2 = fake_engine(kv_tokens=256, kv_disk_path=str(tmp_path), max_num_seqs=max_num_seqs)
    before = e2.num_computed_tokens
    assert generate(e2, prompts) == [reference(p, 5) for p in prompts]
    assert e2.kv_tier.stats.hit_tokens == 6 * 112
    assert e2.num_computed_tokens - before == 6 * (8 + 4)
    e2.close()
    assert_consistent(e2)


def test_many_users_through_a_pool_a_tenth_of_their_prompts_read_their_prefixes_back(tmp_path):
    """16 users' 512-token system prompts, a pool of 832 tokens (52 blocks), all users at once, one sequence at
    a time: each loaded request joins the queue only when it is next, so its blocks are not evicted (or held
    pinned while others need the pool) before it runs."""
    rng = random.Random(8)
    systems = prompts_of([512] * 16, seed=8)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)

    def turn(engine):
        prompts = [s + [rng.randrange(3, 500) for _ in range(32)] for s in systems]
        outs = LLM.from_engine(engine).generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == [reference(p, 8) for p in prompts]
        engine.close()
        return outs

    def engine():
        return fake_engine(kv_tokens=832, max_model_len=832, max_num_seqs=1, kv_disk_path=str(tmp_path))

    first = engine()
    first.kv_tier._writes.maxsize = 1024  # room for the whole turn: the fake model outruns the writer
    turn(first)
    assert first.kv_tier.stats.dropped_writes == 0
    second = engine()
    outs = turn(second)
    assert [o.metrics.num_disk_cached_tokens for o in outs] == [512] * 16
    assert second.kv_tier.stats.gave_up == 0 and second.scheduler.num_preemptions == 0
    assert_consistent(second)


def test_preemption_and_aborts_leave_both_tiers_consistent(tmp_path):
    prompts = prompts_of([30 + 7 * i for i in range(8)], seed=3)
    params = SamplingParams(max_tokens=40, temperature=0.0)
    e = fake_engine(kv_tokens=192, kv_disk_path=str(tmp_path), max_num_seqs=8)
    assert generate(e, prompts, params) == [reference(p, 40) for p in prompts]
    assert e.scheduler.num_preemptions > 0
    e.kv_tier.close()
    e2 = fake_engine(kv_tokens=192, kv_disk_path=str(tmp_path), max_num_seqs=8)
    done = abort_every_other_while_loading(e2, e2.kv_tier.store, prompts, params)
    assert {f"r{i}": done[f"r{i}"] for i in range(1, 8, 2)} == {f"r{i}": reference(prompts[i], 40)
                                                                   for i in range(1, 8, 2)}
    assert e2.kv_tier.stats.hit_tokens > 0
    e2.close()
    assert_consistent(e2)


def test_a_read_slower_than_the_timeout_is_recomputed(tmp_path):
    p, = prompts_of([100], seed=4)
    a = fake_engine(kv_disk_path=str(tmp_path))
    generate(a, [p])
    a.close()
    b = fake_engine(kv_disk_path=str(tmp_path))
    b.kv_tier.read_timeout = 0.05
    gate = threading.Event()
    get = b.kv_tier.store.get
    b.kv_tier.store.get = lambda key, tokens: gate.wait(5) and get(key, tokens)
    other, = prompts_of([40], seed=5)
    assert generate(b, [p + [7, 8, 9], other]) == [reference(p + [7, 8, 9], 5), reference(other, 5)]
    gate.set()
    assert b.kv_tier.stats.read_timeouts == 1 and b.kv_tier.stats.hit_tokens == 0
    b.close()
    assert_consistent(b)


def test_a_full_disk_or_a_full_queue_costs_recompute_only(tmp_path, monkeypatch):
    prompts = prompts_of([100, 90, 80], seed=6)
    tiny = fake_engine(kv_disk_path=str(tmp_path / "tiny"), kv_disk_bytes=100)  # smaller than one block file
    assert generate(tiny, prompts) == [reference(p, 5) for p in prompts]
    tiny.close()
    assert len(tiny.kv_tier.store) == 0

    e = fake_engine(kv_disk_path=str(tmp_path / "full"))

    def enospc(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(e.kv_tier.store, "put", lambda key, tokens, payload: e.kv_tier.store.stats.__setattr__(
        "write_errors", e.kv_tier.store.stats.write_errors + 1) or enospc())
    assert generate(e, prompts) == [reference(p, 5) for p in prompts]
    e.close()
    assert e.kv_tier.store.stats.write_errors > 0 and len(e.kv_tier.store) == 0

    q = fake_engine(kv_disk_path=str(tmp_path / "queue"))
    gate = threading.Event()
    put = q.kv_tier.store.put
    monkeypatch.setattr(q.kv_tier.store, "put", lambda *args: gate.wait(5) and put(*args))  # a stuck disk
    q.kv_tier._writes.maxsize = 2
    assert generate(q, prompts) == [reference(p, 5) for p in prompts]
    gate.set()
    q.close()
    assert q.kv_tier.stats.dropped_writes > 0 and 0 < len(q.kv_tier.store) <= 3  # the queue + the one in hand


def test_metrics_count_the_disk_tier(tmp_path):
    p, = prompts_of([100], seed=7)
    a = fake_engine(kv_disk_path=str(tmp_path))
    generate(a, [p])
    a.close()
    b = fake_engine(kv_disk_path=str(tmp_path))
    generate(b, [p + [5]])
    b.close()
    reg = b.metrics.registry

    def value(name, **labels):
        return reg.get_sample_value(name, {"model_name": "paged-echo", **labels})

    assert value("pyengine:kv_disk_hit_tokens_total") == 96
    assert value("pyengine:kv_disk_read_bytes_total") == b.kv_tier.store.stats.bytes_read > 0
    assert value("pyengine:kv_disk_usage_bytes") == b.kv_tier.store.stats.bytes_used > 0
    assert value("pyengine:prefix_cache_hits_total") == 96


# ---- Part 3: the default model after a restart ------------------------------------------------

@pytest.fixture(scope="module")
def bf16_parts(real_parts):
    from pyengine.model.loader import load_model, resolve_model_path

    cfg, model = load_model(resolve_model_path(None), torch.bfloat16, torch.device("cpu"))
    return cfg, model, real_parts[2], real_parts[3]


@pytest.mark.parametrize("parts_name, dtype, kv", [("real_parts", "float32", "auto"),
                                                   ("bf16_parts", "bfloat16", "auto"), ("bf16_parts", "bfloat16", "int8")])
def test_a_turn_after_a_restart_hits_the_disk_and_equals_a_cold_run(request, tmp_path, parts_name, dtype, kv):
    parts = request.getfixturevalue(parts_name)
    tok = parts[2]
    turn1 = tok.encode("The history of the printing press begins in the fifteenth century, when Johannes "
                       "Gutenberg combined movable metal type, oil-based ink and a wooden press. " * 6)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    config = dict(dtype=dtype, kv_cache_dtype=kv)
    a = real_engine(parts, 1024, kv_disk_path=str(tmp_path), **config)
    reply = generate(a, [turn1], params)[0]
    a.close()
    turn2 = turn1 + reply + tok.encode(" Who was Gutenberg?", add_special_tokens=False)
    b = real_engine(parts, 1024, kv_disk_path=str(tmp_path), **config)
    warm = generate(b, [turn2], params)
    assert b.kv_tier.stats.hit_tokens == (len(turn1) + 7) // 16 * 16 > 0
    cold = generate(real_engine(parts, 1024, **config), [turn2], params)
    assert warm == cold
    b.close()


# ---- Part 4: a stored conversation's next turn after a server restart --------------------------

async def test_a_restarted_server_serves_the_next_turn_of_a_stored_conversation_from_disk(tmp_path):
    import openai
    from aiohttp.test_utils import TestClient, TestServer

    from pyengine.engine.async_engine import AsyncLLM
    from server.app import ServerConfig, create_app
    from server.store import SQLiteStore
    from test_responses import TOK, answer

    async def serve_once(turn):
        engine = fake_engine(max_num_batched_tokens=256, kv_disk_path=str(tmp_path / "kv"))
        engine.tokenizer = TOK
        app = create_app(AsyncLLM(engine=engine), ServerConfig(store=SQLiteStore(str(tmp_path / "store.db"))))
        http = TestClient(TestServer(app))
        await http.start_server()
        client = openai.AsyncOpenAI(base_url=str(http.make_url("/v1")), api_key="-", max_retries=0)
        try:
            return await turn(client), engine
        finally:
            await client.close()
            await http.close()  # stops the engine: its write queue is flushed

    def create(client, **kw):
        return client.responses.create(model="paged-echo", max_output_tokens=6, temperature=0, **kw)

    system = "You are a careful assistant that answers in one short line. " * 2
    r1, _ = await serve_once(lambda c: create(c, input="Where is the printing press from?", instructions=system))
    r2, engine = await serve_once(lambda c: create(c, input="And when?", previous_response_id=r1.id,
                                                   instructions=system))
    history = [{"role": "system", "content": system}, {"role": "user", "content": "Where is the printing press from?"},
               {"role": "assistant", "content": r1.output_text}, {"role": "user", "content": "And when?"}]
    assert r2.output_text == answer(history, 6)
    cached = r2.usage.input_tokens_details.cached_tokens
    assert cached == engine.kv_tier.stats.hit_tokens >= 7 * 16  # a fresh pool: every cached token came from disk


# ---- Part 5: settings ---------------------------------------------------------------------------

def test_the_flags_the_toml_keys_and_their_checks(tmp_path):
    from pyengine.config import EngineConfig
    from server import config_file
    from server.cli import build_parser, engine_config
    from server.models import ConfigError

    args = build_parser().parse_args(["--kv-disk-path", str(tmp_path), "--kv-disk-bytes", "3GiB"])
    config = engine_config(args)
    assert config.kv_disk_path == str(tmp_path) and config.kv_disk_bytes == 3 * 2**30
    assert engine_config(build_parser().parse_args([])).kv_disk_path is None  # off by default

    toml = tmp_path / "serve.toml"
    toml.write_text(f'[[models]]\nname = "m"\nkv_disk_path = "{tmp_path}"\nkv_disk_bytes = "512MiB"\n')
    assert config_file.load(str(toml)).models[0].engine == {"kv_disk_path": str(tmp_path), "kv_disk_bytes": 2**29}
    toml.write_text('[[models]]\nname = "m"\nkv_disk_bytes = "lots"\n')
    with pytest.raises(ConfigError, match="kv_disk_bytes"):
        config_file.load(str(toml))

    with pytest.raises(ValueError, match="enable_prefix_caching"):
        EngineConfig(kv_disk_path=str(tmp_path), enable_prefix_caching=False)
    with pytest.raises(ValueError, match="kv_disk_bytes"):
        EngineConfig(kv_disk_path=str(tmp_path), kv_disk_bytes=0.5)
    with pytest.raises(ValueError, match="kv_disk_bytes must be a number of bytes"):  # not a fraction of a byte
        EngineConfig(kv_disk_path=str(tmp_path), kv_disk_bytes=2.5)
