"""Scheduler with fake requests and a fake deterministic "model" (next token = f(all tokens so far))."""
import pytest
from pyengine.engine.block_pool import BlockPool
from pyengine.engine.request import Request, RequestStatus
from pyengine.engine.scheduler import Scheduler
from pyengine.sampling_params import SamplingParams

BS = 4


def fake_next(tokens):
    return (sum(tokens[-3:]) * 7 + len(tokens)) % 1000


def make(rid, n_prompt, max_tokens, *, start=0, priority=0):
    return Request(rid, None, [(start + 13 * i) % 1000 for i in range(n_prompt)],
                   SamplingParams(max_tokens=max_tokens, temperature=0.0), priority=priority)


def step(sched, log=None):
    out = sched.schedule()
    if log is not None:
        log.append(out)
    sampled = [fake_next(r.all_token_ids) for r, s in zip(out.reqs, out.sampling) if s]
    for r, n in zip(out.reqs, out.num_new):  # the token budget and block coverage hold every step
        assert r.num_computed_tokens + n <= len(r.block_ids) * BS
    assert out.num_tokens == sum(out.num_new) <= sched.max_num_batched_tokens
    assert len(sched.running) <= sched.max_num_seqs
    for r in sched.update_from_output(out, sampled):
        if r.num_tokens >= r.max_total_tokens:
            sched.finish(r, RequestStatus.FINISHED_LENGTH)
    return out


def run_all(sched, reqs, log=None):
    for r in reqs:
        sched.add_request(r)
    steps = 0
    while sched.has_unfinished():
        step(sched, log)
        steps += 1
        assert steps < 10000
    return {r.request_id: r.output_token_ids for r in reqs}


def reference(n_prompt, max_tokens, start=0):
    toks = [(start + 13 * i) % 1000 for i in range(n_prompt)]
    for _ in range(max_tokens):
        toks.append(fake_next(toks))
    return toks[n_prompt:]


def test_continuous_batching_outputs_and_budget():
    pool = BlockPool(64, BS)
    sched = Scheduler(pool, max_num_seqs=4, max_num_batched_tokens=16)
    specs = [(3, 5), (30, 4), (9, 12), (1, 3), (17, 7), (5, 1)]
    reqs = [make(f"r{i}", p, m, start=i) for i, (p, m) in enumerate(specs)]
    out = run_all(sched, reqs)
    for i, (p, m) in enumerate(specs):
        assert out[f"r{i}"] == reference(p, m, start=i)
    assert pool.num_free == pool.num_blocks and sched.num_waiting == 0 and not sched.running


def test_decodes_first_and_chunked_prefill_never_stalls_decodes():
    pool = BlockPool(64, BS)
    sched = Scheduler(pool, max_num_seqs=8, max_num_batched_tokens=8)
    short = [make(f"s{i}", 2, 12, start=i) for i in range(3)]
    for r in short:
        sched.add_request(r)
    step(sched)  # all three prefill (6 tokens)
    long = make("long", 50, 2)
    sched.add_request(long)
    log = []
    while any(not r.finished for r in short):
        out = step(sched, log)
        # every short request still unfinished before this step decoded exactly one token in it
        for r in short:
            if not r.finished or r.num_output_tokens == 12 and r in out.reqs:
                assert out.num_new[out.reqs.index(r)] == 1
    chunks = [o.num_new[o.reqs.index(long)] for o in log if long in o.reqs]
    assert len(chunks) > 1 and max(chunks) <= 8  # the long prompt was spread over several steps


def test_a_newcomer_goes_ahead_of_a_running_prompt_chunk_in_at_most_every_other_step():
    """long_prefill_tokens 16: a running long prompt's chunk shrinks by the first chunk of a request
    that arrives (the step stays 16 tokens, so the newcomer's first token comes after one chunk's
    time, not two), but only in every other step, so a newcomer every step cannot starve it."""
    pool = BlockPool(256, BS)
    sched = Scheduler(pool, max_num_seqs=64, max_num_batched_tokens=256, long_prefill_tokens=16)
    long = make("long", 300, 2)
    sched.add_request(long)
    assert step(sched).num_new == [16]
    short = make("short", 5, 1, start=1)
    sched.add_request(short)
    out = step(sched)
    assert list(zip(out.reqs, out.num_new)) == [(long, 11), (short, 5)]
    log, newcomers = [], []
    for i in range(12):  # a 16-token newcomer every step
        newcomers.append(make(f"n{i}", 16, 1, start=10 + i))
        sched.add_request(newcomers[-1])
        log.append(step(sched))
    chunks = [o.num_new[o.reqs.index(long)] if long in o.reqs else 0 for o in log]
    assert chunks == [16, 0] * 6  # yields fully, but only every other step
    assert all(o.reqs[-1] is r and o.num_new[-1] == 16 for o, r in zip(log, newcomers))  # all start at once
    out = run_all(sched, [])
    assert long.output_token_ids == reference(300, 2)
    assert all(r.output_token_ids == reference(16, 1, start=10 + i) for i, r in enumerate(newcomers))
    assert pool.num_free == pool.num_blocks


def test_a_prompt_alone_takes_solo_chunks_and_shrinks_to_long_prefill_tokens_once_others_come():
    """solo_prefill_tokens 64 over long_prefill_tokens 16: alone (nothing else running or waiting),
    a long prompt computes 64 tokens a step, from its admission on; once another request waits or
    runs, 16 (less the newcomer's first chunk); alone again, 64 again."""
    pool = BlockPool(256, BS)
    sched = Scheduler(pool, max_num_seqs=8, max_num_batched_tokens=256, long_prefill_tokens=16,
                      solo_prefill_tokens=64)
    long = make("long", 300, 2)
    sched.add_request(long)
    assert step(sched).num_new == [64]
    assert step(sched).num_new == [64]
    short = make("short", 5, 3, start=1)
    sched.add_request(short)
    out = step(sched)
    assert list(zip(out.reqs, out.num_new)) == [(long, 11), (short, 5)]
    out = step(sched)  # the short one decodes beside the long prompt: the cap stays 16
    assert list(zip(out.reqs, out.num_new)) == [(long, 16), (short, 1)]
    step(sched)
    assert short.finished
    assert step(sched).num_new == [64]
    run_all(sched, [])
    assert long.output_token_ids == reference(300, 2)
    assert pool.num_free == pool.num_blocks


def test_only_a_chunk_of_the_one_request_running_or_waiting_is_marked_solo():
    """solo marks the steps a newcomer may interrupt (pyengine/interrupt.py): a prompt chunk of the only
    request; not its decode steps, and nothing once a second request waits or runs."""
    pool = BlockPool(256, BS)
    sched = Scheduler(pool, max_num_seqs=8, max_num_batched_tokens=256, long_prefill_tokens=16,
                      solo_prefill_tokens=64)
    long = make("long", 100, 3)
    sched.add_request(long)
    assert [step(sched).solo for _ in range(2)] == [True, True]  # chunks of 64 and 36
    assert step(sched).solo is False  # its decode
    sched.add_request(make("short", 5, 3, start=1))
    assert step(sched).solo is False
    lone = Scheduler(BlockPool(256, BS), max_num_seqs=8, max_num_batched_tokens=256, long_prefill_tokens=16,
                     solo_prefill_tokens=64)
    for r in (make("a", 40, 1), make("b", 40, 1, start=3)):  # two prompts waiting: neither is alone
        lone.add_request(r)
    assert step(lone).solo is False


def test_solo_prefill_tokens_is_never_below_long_prefill_tokens_and_off_without_a_cap():
    assert Scheduler(BlockPool(8, BS), 8, 64, long_prefill_tokens=16, solo_prefill_tokens=4).solo_prefill_tokens == 16
    assert Scheduler(BlockPool(8, BS), 8, 64, long_prefill_tokens=0, solo_prefill_tokens=32).solo_prefill_tokens == 0
    with pytest.raises(ValueError, match="solo_prefill_tokens"):
        Scheduler(BlockPool(8, BS), 8, 64, solo_prefill_tokens=-1)


def test_prompt_logprob_tokens_count_twice_against_the_chunk_cap_and_budget():
    """A request owing prompt logprobs computes a logits row over the whole vocabulary for each
    prompt token too: each of its tokens counts twice against long_prefill_tokens and the step's
    budget, so a step holding its chunk costs less than a plain chunk's."""
    pool = BlockPool(256, BS)
    sched = Scheduler(pool, max_num_seqs=8, max_num_batched_tokens=40, long_prefill_tokens=16)
    echo = Request("echo", None, [13 * i % 1000 for i in range(100)],
                   SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1))
    plain = [make(f"p{i}", 100, 1, start=i + 1) for i in range(2)]
    for r in [echo, *plain]:
        sched.add_request(r)
    out = step(sched)
    assert out.num_new == [8, 16, 8] and out.num_tokens == 32  # 8 x 2 + 16 + 8 = the budget of 40


def test_preemption_recompute_same_outputs_and_counted():
    specs = [(10, 20), (7, 25), (12, 18), (5, 30)]
    big = Scheduler(BlockPool(256, BS), 8, 64)
    ref = run_all(big, [make(f"r{i}", p, m, start=i) for i, (p, m) in enumerate(specs)])
    pool = BlockPool(14, BS)  # 56 tokens: not enough for all four at once
    small = Scheduler(pool, 8, 64)
    got = run_all(small, [make(f"r{i}", p, m, start=i) for i, (p, m) in enumerate(specs)])
    assert got == ref
    assert small.num_preemptions > 0
    assert pool.num_free == pool.num_blocks


def test_preemption_victim_is_lowest_priority_latest():
    pool = BlockPool(6, BS)
    sched = Scheduler(pool, 8, 64, policy="priority")
    a, b, c = make("a", 7, 30, priority=0), make("b", 7, 30, priority=5), make("c", 7, 30, priority=1)
    for r in (a, b, c):
        sched.add_request(r)
    step(sched)
    assert [r.request_id for r in sched.running] == ["a", "c", "b"]  # sorted by priority
    for _ in range(10):
        out = step(sched)
        if out.preempted:
            assert out.preempted[0] is b
            break
    else:
        raise AssertionError("no preemption happened")


def test_priority_admission_order():
    pool = BlockPool(64, BS)
    sched = Scheduler(pool, max_num_seqs=1, max_num_batched_tokens=64, policy="priority")
    for rid, prio in [("low", 9), ("high", -1), ("mid", 3)]:
        sched.add_request(make(rid, 3, 1, priority=prio))
    order = []
    while sched.has_unfinished():
        out = step(sched)
        order += [r.request_id for r in out.reqs]
    assert order == ["high", "mid", "low"]


def test_waiting_higher_priority_preempts_running_lower_priority():
    # one sequence slot: a later, more urgent request takes it from the running one at once
    sched = Scheduler(BlockPool(64, BS), max_num_seqs=1, max_num_batched_tokens=64, policy="priority")
    low = make("low", 5, 20, priority=5)
    sched.add_request(low)
    step(sched)
    step(sched)
    high = make("high", 6, 3, priority=1)
    sched.add_request(high)
    out = step(sched)
    assert out.preempted == [low] and out.reqs == [high] and low.num_preemptions == 1
    while sched.has_unfinished():
        step(sched)
    assert low.num_output_tokens == 20 and high.num_output_tokens == 3
    # blocks, not slots: the running low-priority request is preempted to make room
    pool = BlockPool(6, BS)
    sched = Scheduler(pool, max_num_seqs=8, max_num_batched_tokens=64, policy="priority")
    low = make("low", 16, 4, priority=3)
    sched.add_request(low)
    step(sched)
    high = make("high", 12, 2, priority=0, start=500)
    sched.add_request(high)
    out = step(sched)
    assert out.preempted == [low] and high in out.reqs
    while sched.has_unfinished():
        step(sched)
    assert pool.num_free == pool.num_blocks


def test_equal_priority_does_not_preempt():
    sched = Scheduler(BlockPool(64, BS), max_num_seqs=1, max_num_batched_tokens=64, policy="priority")
    first = make("first", 5, 6, priority=2)
    sched.add_request(first)
    step(sched)
    sched.add_request(make("second", 5, 2, priority=2))
    out = step(sched)
    assert not out.preempted and out.reqs == [first]


def test_max_num_seqs_and_fcfs_order():
    sched = Scheduler(BlockPool(64, BS), max_num_seqs=2, max_num_batched_tokens=100)
    reqs = [make(f"r{i}", 3, 2) for i in range(4)]
    for r in reqs:
        sched.add_request(r)
    out = step(sched)
    assert out.reqs == reqs[:2] and sched.num_waiting == 2


def test_abort_any_state_frees_blocks():
    pool = BlockPool(32, BS)
    sched = Scheduler(pool, max_num_seqs=2, max_num_batched_tokens=8)
    reqs = [make(f"r{i}", 10, 20, start=i) for i in range(3)]
    for r in reqs:
        sched.add_request(r)
    step(sched)  # r0 prefilling (chunk of 8), r1/r2 waiting
    assert reqs[0].status == RequestStatus.RUNNING and pool.num_free < 32
    sched.abort("r0")  # running mid-prefill
    sched.abort("r2")  # waiting
    assert reqs[0].finish_reason == "abort" and reqs[2].finish_reason == "abort"
    assert pool.num_free == 32 and sched.num_waiting == 1
    assert sched.abort("nope") is None
    while sched.has_unfinished():
        step(sched)
    assert reqs[1].output_token_ids == reference(10, 20, start=1)
    assert pool.num_free == 32


def test_prefix_cache_computes_only_suffix():
    pool = BlockPool(64, BS)
    sched = Scheduler(pool, 4, 64)
    shared = [(13 * i) % 1000 for i in range(21)]
    a = Request("a", None, shared + [1, 2, 3], SamplingParams(max_tokens=3))
    run_all(sched, [a])
    b = Request("b", None, shared + [4, 5], SamplingParams(max_tokens=3))
    run_all(sched, [b])
    assert b.num_cached_tokens == 20  # five full blocks of the shared 21 tokens
    assert b.num_computed_prompt_tokens == 3
    # the cache never covers the whole prompt
    c = Request("c", None, list(a.prompt_token_ids[:20]), SamplingParams(max_tokens=2))
    run_all(sched, [c])
    assert c.num_cached_tokens == 16 and c.num_computed_prompt_tokens == 4
    assert pool.num_free == pool.num_blocks


def test_prefill_chunk_flags_reach_the_engine_config():
    from server.cli import build_parser, engine_config

    cfg = engine_config(build_parser().parse_args(["--long-prefill-tokens", "32", "--solo-prefill-tokens", "256"]))
    assert (cfg.long_prefill_tokens, cfg.solo_prefill_tokens) == (32, 256)
    cfg = engine_config(build_parser().parse_args([]))
    assert (cfg.long_prefill_tokens, cfg.solo_prefill_tokens) == (None, None)  # the engine's defaults


@pytest.mark.parametrize("block_size", [8, 16, 32, 64, 128])
def test_block_size_flag_reaches_the_engine_config(block_size):
    from server.cli import build_parser, engine_config

    assert engine_config(build_parser().parse_args(["--block-size", str(block_size)])).block_size == block_size


def test_block_size_outside_the_supported_sizes_is_refused():
    from pyengine.config import EngineConfig

    with pytest.raises(ValueError, match="block_size must be 8, 16, 32, 64 or 128, got 48"):
        EngineConfig(block_size=48)
