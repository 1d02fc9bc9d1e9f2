"""One bad request fails alone: validation in native types, blame for a failing step, fairness."""
from __future__ import annotations

import asyncio

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pyengine.engine.async_engine import AsyncLLM, EngineDeadError
from pyengine.engine.engine import MAX_FAILED_STEPS, EngineBrokenError
from pyengine.sampling_params import SamplingParams

from pyengine.ops.attention import from_cache_layout

from engine_fakes import VOCAB, PagedEchoModel, fake_engine, next_token, reference
from test_engine import assert_all_free, prompts_of

GREEDY = dict(temperature=0.0)


def drain(engine, max_steps=10_000):
    outs = {}
    for _ in range(max_steps):
        if not engine.has_unfinished():
            return outs
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
    raise AssertionError("engine did not finish")


def tokens(outs):
    return [t for o in outs for t in o.outputs[0].token_ids]


@pytest.mark.parametrize("params", [
    dict(min_tokens=2, stop_token_ids=[VOCAB]),  # IndexError in _mask_min_tokens before
    dict(stop_token_ids=[VOCAB + 5]),
    dict(logprobs=20, prompt_logprobs=20),  # fine on a real vocabulary; this one has 500 ids
])
def test_engine_refuses_ids_beyond_its_vocabulary(params):
    engine = fake_engine()
    if "logprobs" in params:  # shrink the vocabulary the engine believes in below 20
        engine.model_config.vocab_size = 10
    with pytest.raises(ValueError, match="stop_token_ids|logprobs"):
        engine.add_request("bad", [5, 6, 7], SamplingParams(**params))
    assert not engine.has_unfinished() and engine.pool.num_free == engine.pool.num_blocks


_INT = st.one_of(st.integers(-2, 40), st.sampled_from([2**31 - 1, 2**31, 2**32, 2**63 - 1, 2**63, -(2**31)]))
_FLOAT = st.one_of(st.floats(-3, 3), st.sampled_from([1e-50, 2**-149, 1e-40, 1e-30, float("nan"), float("inf")]))
_FIELDS = {"n": st.integers(1, 3), "temperature": _FLOAT, "top_p": _FLOAT, "top_k": _INT, "min_p": _FLOAT,
           "seed": _INT, "max_tokens": _INT, "min_tokens": _INT, "presence_penalty": _FLOAT,
           "frequency_penalty": _FLOAT, "repetition_penalty": _FLOAT, "logprobs": _INT,
           "stop_token_ids": st.lists(_INT, max_size=3), "ignore_eos": st.booleans()}


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.fixed_dictionaries({}, optional=_FIELDS))
def test_fuzzed_params_are_refused_or_run_beside_others(kwargs):
    """Whatever the values: refused with ValueError up front, or run for several steps beside an
    innocent request that finishes with its exact output (nothing fails inside a step)."""
    engine = fake_engine(kv_tokens=1024)
    prompt = [5, 6, 7, 8]
    try:
        engine.add_request("fuzz", prompt, SamplingParams(**kwargs))
    except ValueError:
        return
    engine.add_request("innocent", prompt, SamplingParams(max_tokens=5, **GREEDY))
    outs = {}
    for _ in range(8):
        for o in engine.step():
            assert o.error is None
            outs.setdefault(o.request_id, []).append(o)
    assert tokens(outs["innocent"]) == reference(prompt, 5)
    engine.abort_request("fuzz")
    assert_all_free(engine)


# ---- a failing model step fails only the request it is blamed on
def poison_sampler(engine, is_poison, calls=None):
    """The runner raises in sampling (after the model wrote the step's KV) whenever a poisoned
    sequence samples in the batch: the step's KV writes already happened when it fails."""
    real = engine.runner.sample

    def sample(logits, reqs, *rest):  # rest: the grammar bitmask
        if calls is not None:
            calls.append(len(reqs))
        if any(is_poison(r) for r in reqs):
            raise RuntimeError("poisoned row")
        return real(logits, reqs, *rest)

    engine.runner.sample = sample


@pytest.mark.parametrize("when", ["admitted", "mid-decode"])
def test_failed_step_fails_only_the_poisoned_request(when):
    """'admitted': it fails in the step that first schedules it (the new requests are tried apart);
    'mid-decode': after 3 good tokens, among long-running requests (found by halving the batch)."""
    engine = fake_engine(max_num_batched_tokens=64)
    prompts = prompts_of([5, 40, 90, 7, 33, 120], seed=3)
    max_tokens = 12
    if when == "admitted":
        poison_sampler(engine, lambda r: r.parent_id == "poison")
    else:
        poison_sampler(engine, lambda r: r.parent_id == "poison" and r.num_output_tokens >= 3)
    for i, p in enumerate(prompts[:3]):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=max_tokens, **GREEDY))
    outs = {}
    for _ in range(2):  # the innocents are running before the poisoned request arrives
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
    engine.add_request("poison", prompts_of([30], seed=9)[0], SamplingParams(max_tokens=max_tokens, n=2, **GREEDY))
    for i, p in enumerate(prompts[3:], 3):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=max_tokens, **GREEDY))
    for rid, os_ in drain(engine).items():
        outs.setdefault(rid, []).extend(os_)
    for i, p in enumerate(prompts):
        got = outs[f"r{i}"]
        assert tokens(got) == reference(p, max_tokens), f"r{i}"
        assert got[-1].finished and all(o.error is None for o in got)
    bad = outs["poison"][-1]
    assert bad.finished and "poisoned row" in bad.error
    assert {c.finish_reason for c in bad.outputs} == {"abort"}
    assert_all_free(engine)


def test_engine_that_always_fails_is_declared_broken():
    engine = fake_engine()
    calls = []
    poison_sampler(engine, lambda r: True, calls)
    for i, p in enumerate(prompts_of([4, 9, 17, 5], seed=2)):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=4, **GREEDY))
    failed = []
    with pytest.raises(EngineBrokenError):
        for _ in range(50):
            failed += [o.request_id for o in engine.step() if o.error]
            engine.add_request(f"late{len(calls)}", [5, 6, 7], SamplingParams(max_tokens=4, **GREEDY))
    assert set(failed) >= {"r0", "r1", "r2", "r3"}
    assert len(calls) < 20  # bounded: each request is retried once per halving, not forever


async def test_async_error_reaches_only_the_poisoned_stream():
    engine = fake_engine(max_num_batched_tokens=64)
    poison_sampler(engine, lambda r: r.parent_id == "poison" and r.num_output_tokens >= 2)
    llm = AsyncLLM(engine=engine)
    await llm.start()
    try:
        prompts = prompts_of([6, 50, 70, 11], seed=4)

        async def run(rid, prompt):
            return [t async for o in llm.generate(prompt, SamplingParams(max_tokens=10, **GREEDY), rid)
                    for t in o.outputs[0].token_ids]

        tasks = [asyncio.create_task(run(f"r{i}", p)) for i, p in enumerate(prompts)]
        tasks.append(asyncio.create_task(run("poison", [7, 8, 9])))
        results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 60)
        for p, got in zip(prompts, results):
            assert got == reference(p, 10)
        assert isinstance(results[-1], RuntimeError) and "poisoned row" in str(results[-1])
        assert llm.is_healthy()
        s = llm.stats()
        assert s.num_free_blocks == s.num_total_blocks
    finally:
        await llm.shutdown()


async def test_async_broken_engine_fails_everyone_and_stops():
    engine = fake_engine()
    poison_sampler(engine, lambda r: True)
    llm = AsyncLLM(engine=engine)
    await llm.start()
    try:
        async def run(rid):
            return [o async for o in llm.generate([5, 6, rid], SamplingParams(max_tokens=5), str(rid))]

        for rid in range(10, 10 + MAX_FAILED_STEPS - 1):  # one at a time: each step fails for all it holds
            with pytest.raises(RuntimeError, match="poisoned row"):
                await asyncio.wait_for(run(rid), 30)
        with pytest.raises(EngineDeadError, match="EngineBrokenError"):  # the last straw
            await asyncio.wait_for(run(10 + MAX_FAILED_STEPS), 30)
        for _ in range(100):
            if not llm.is_healthy():
                break
            await asyncio.sleep(0.05)
        assert not llm.is_healthy()
        with pytest.raises(EngineDeadError):
            await run(99)
    finally:
        await llm.shutdown()


# ---- fairness for expensive requests
class AllRowsEchoModel(PagedEchoModel):
    """PagedEchoModel that also gives logits for prompt rows (prompt logprobs): row i of a sequence
    predicts from the context up to i, read back from the paged KV cache like the last row."""

    def forward(self, input_ids, positions, kv_caches, meta, logits_indices, interrupt=None):
        if logits_indices is None:  # every row (a decode-only step)
            logits_indices = torch.arange(len(input_ids))
        last = super().forward(input_ids, positions, kv_caches, meta, logits_indices[:0], interrupt)  # writes the KV
        k, _ = from_cache_layout(kv_caches[0].k, kv_caches[0].v)
        bs = k.shape[2]
        qsl, seq_lens = meta.query_start_loc.tolist(), meta.seq_lens.tolist()
        rows = []
        for idx in logits_indices.tolist():
            s = next(s for s in range(len(seq_lens)) if qsl[s] <= idx < qsl[s + 1])
            n = seq_lens[s] - (qsl[s + 1] - 1 - idx)  # context length at this row
            blocks = meta.block_tables[s, : -(-n // bs)].long()
            nxt = next_token(k[blocks, 0].reshape(-1, 2)[:n, 0].long().tolist())
            row = -0.5 * (torch.arange(VOCAB) - nxt).abs().float()
            row[nxt] = 5.0
            rows.append(row)
        return torch.stack(rows) if rows else last


def all_rows_engine(**config):
    engine = fake_engine(**config)
    engine.runner.model = AllRowsEchoModel()
    return engine


def test_n_children_compute_the_prompt_and_its_logprobs_once():
    engine = all_rows_engine()
    prompt = prompts_of([200], seed=5)[0]
    params = SamplingParams(n=4, max_tokens=3, prompt_logprobs=2, logprobs=2, **GREEDY)
    engine.add_request("big", prompt, params)
    outs = drain(engine)["big"]
    # child 0: the whole prompt; children 1..3 fork from it: its last prompt token each; 2 decodes each
    assert engine.num_computed_tokens == 200 + 3 * 1 + 4 * 2
    lps = [o.prompt_logprobs for o in outs if o.prompt_logprobs is not None]
    assert len(lps) == 1 and len(lps[0]) == 200 and lps[0][0] is None
    assert [e.token_id for e in lps[0][1:]] == prompt[1:]
    for j in (1, 57, 199):  # the prompt token's logprob is the model's, given the tokens before it
        assert lps[0][j].top[0][0] == next_token(prompt[:j])
    assert_all_free(engine)


def test_children_queue_behind_earlier_arrivals():
    """n > 1: children 1..n-1 are queued when child 0 has its first token, at the back: a request
    that arrived before that goes first (before, they were pushed to the queue front)."""
    engine = fake_engine(max_num_seqs=1)
    engine.add_request("big", prompts_of([40], seed=6)[0], SamplingParams(n=3, max_tokens=3, **GREEDY))
    engine.add_request("other", [5, 6, 7], SamplingParams(max_tokens=2, **GREEDY))
    order = [(o.request_id, c.index) for _ in range(100) for o in engine.step() for c in o.outputs
             if len(c.token_ids) and c.finished]
    assert order == [("big", 0), ("other", 0), ("big", 1), ("big", 2)]
    assert_all_free(engine)


@pytest.mark.parametrize("solo, first_chunk", [(None, 512), (64, 64), (256, 256)])
def test_a_lone_prompt_is_chunked_by_solo_prefill_tokens(solo, first_chunk):
    engine = fake_engine(max_num_batched_tokens=2048, long_prefill_tokens=64, solo_prefill_tokens=solo)
    big = prompts_of([700], seed=7)[0]
    engine.add_request("big", big, SamplingParams(max_tokens=2, **GREEDY))
    engine.step()
    assert engine.num_computed_tokens == first_chunk
    assert tokens(drain(engine)["big"]) == reference(big, 2)
    assert_all_free(engine)


def test_an_interrupted_solo_step_commits_nothing_and_its_rerun_gives_the_same_tokens():
    """The model stops after writing some of the chunk's KV (PagedEchoModel checks the interrupt after
    its cache write): no tokens, no progress, no prefix-cache entry; the blocks stay with the request,
    and the rerun overwrites the slots. A twin prompt admitted meanwhile must not find the chunk's blocks
    cached."""
    engine = fake_engine(max_num_batched_tokens=2048, long_prefill_tokens=64, solo_prefill_tokens=512)
    big = prompts_of([700], seed=7)[0]
    engine.add_request("big", big, SamplingParams(max_tokens=2, **GREEDY))
    req = engine.scheduler.requests["big"]
    engine.interrupt.set()
    assert engine.step() == []
    assert (engine.num_interrupted_steps, engine.num_steps, engine.num_computed_tokens) == (1, 0, 0)
    assert req.num_computed_tokens == 0 and len(req.block_ids) == 512 // 16
    assert engine.metrics.interrupted_steps._value.get() == 1
    engine.add_request("twin", big, SamplingParams(max_tokens=2, **GREEDY))
    outs = drain(engine)  # still set, but no step is solo now: none is interrupted
    assert tokens(outs["big"]) == tokens(outs["twin"]) == reference(big, 2)
    assert engine.num_interrupted_steps == 1
    assert outs["twin"][-1].metrics.num_cached_tokens == 0
    assert_all_free(engine)


def test_a_solo_step_after_an_interrupted_one_runs_to_its_end():
    """Commands that leave the prompt alone again (a request aborted as soon as it came) cannot keep
    stopping its chunks: the step after an interrupted one is not interrupted, the next one may be."""
    engine = fake_engine(max_num_batched_tokens=2048, long_prefill_tokens=64, solo_prefill_tokens=128)
    big = prompts_of([700], seed=7)[0]
    engine.add_request("big", big, SamplingParams(max_tokens=2, **GREEDY))
    engine.interrupt.set()
    computed = []
    for _ in range(4):
        engine.step()
        computed.append(engine.num_computed_tokens)
    assert computed == [0, 128, 128, 256] and engine.num_interrupted_steps == 2
    engine.interrupt.clear()
    assert tokens(drain(engine)["big"]) == reference(big, 2)
    assert_all_free(engine)


def test_one_request_adds_at_most_long_prefill_tokens_per_step():
    engine = fake_engine(max_num_batched_tokens=512, long_prefill_tokens=64, solo_prefill_tokens=64)
    big = prompts_of([400], seed=7)[0]
    engine.add_request("big", big, SamplingParams(max_tokens=2, **GREEDY))
    engine.step()
    assert engine.num_computed_tokens == 64
    engine.add_request("short", [5, 6, 7], SamplingParams(max_tokens=1, **GREEDY))
    outs = engine.step()
    # the short one went first; the long prompt's chunk gave it room: the step is still 64 tokens
    assert engine.num_computed_tokens == 64 + 3 + 61
    assert [o.request_id for o in outs] == ["short"]
    assert tokens(drain(engine)["big"]) == reference(big, 2)
    assert_all_free(engine)


def test_an_n8_echo_logprobs_request_adds_at_most_long_prefill_tokens_of_work_per_step():
    """Its prompt tokens count twice (each also gets a logits row over the vocabulary): 32-token
    chunks under long_prefill_tokens 64. Its 7 other children fork from child 0 in one step of one
    token each (before: the 8 tokens after the cached blocks each, 57 tokens in that step)."""
    engine = all_rows_engine(max_num_batched_tokens=512, long_prefill_tokens=64, solo_prefill_tokens=64)
    prompt = prompts_of([200], seed=9)[0]
    engine.add_request("big", prompt, SamplingParams(n=8, max_tokens=3, prompt_logprobs=2, logprobs=2, **GREEDY))
    per_step = []
    while engine.has_unfinished():
        before = engine.num_computed_tokens
        outs = engine.step()
        per_step.append(engine.num_computed_tokens - before)
    # 6 chunks of 32 and the last 8 prompt tokens; then child 0's decode beside the 7 forks; decodes
    assert per_step == [32] * 6 + [8] + [1 + 7] + [8, 7]
    assert outs[-1].finished and all(c.token_ids for c in outs[-1].outputs)
    assert_all_free(engine)


# ---- small but real
def test_engine_seed_makes_unseeded_requests_reproducible():
    def run(seed):
        engine = fake_engine(seed=seed)
        for i in range(3):
            engine.add_request(f"r{i}", [5, 6, 7 + i], SamplingParams(max_tokens=24, n=2, temperature=1.0))
        return {rid: [c.token_ids for o in outs for c in o.outputs] for rid, outs in drain(engine).items()}

    assert run(7) == run(7)
    assert run(7) != run(8)


def test_prefix_cache_queries_count_each_admission_once():
    """A request blocked for free blocks is looked up every step, but counted once, when admitted."""
    engine = fake_engine(kv_tokens=64)  # 4 blocks: B waits for A's blocks over many steps
    a, b = prompts_of([40, 30], seed=8)
    engine.add_request("a", a, SamplingParams(max_tokens=20, **GREEDY))
    engine.add_request("b", b, SamplingParams(max_tokens=2, **GREEDY))
    drain(engine)
    s = engine.stats()
    assert s.num_steps > 10 and s.prefix_cache_queries == 40 + 30 and s.prefix_cache_hits == 0
