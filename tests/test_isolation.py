"""One bad request fails alone: validation in native types, blame for a failing step, fairness."""
from __future__ import annotations

import asyncio

import pytest

from pyengine.engine.async_engine import AsyncLLM, EngineDeadError
from pyengine.engine.engine import MAX_FAILED_STEPS, EngineBrokenError
from pyengine.sampling_params import SamplingParams

from engine_fakes import VOCAB, fake_engine, reference
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


def test_extreme_but_valid_params_run_beside_others():
    """Every field at its accepted extreme runs in the same steps as a plain greedy request."""
    engine = fake_engine()
    prompt = prompts_of([20], seed=1)[0]
    extreme = SamplingParams(top_k=2**31 - 1, top_p=1e-40, min_p=1e-60, temperature=2.0, seed=2**63 - 1,
                             repetition_penalty=1e-30, presence_penalty=-2.0, frequency_penalty=2.0,
                             min_tokens=3, max_tokens=6, stop_token_ids=[VOCAB - 1, 0], logprobs=20,
                             n=3)
    engine.add_request("x", prompt, extreme)
    engine.add_request("y", prompt, SamplingParams(temperature=0.0, max_tokens=6, top_k=-1))
    outs = drain(engine)
    assert tokens(outs["y"]) == reference(prompt, 6)
    assert outs["x"][-1].finished
    assert_all_free(engine)


# ---- a failing model step fails only the request it is blamed on
def poison_sampler(engine, is_poison, calls=None):
    """The runner raises in sampling (after the model wrote the step's KV) whenever a poisoned
    sequence samples in the batch: the step's KV writes already happened when it fails."""
    real = engine.runner.sample

    def sample(logits, reqs):
        if calls is not None:
            calls.append(len(reqs))
        if any(is_poison(r) for r in reqs):
            raise RuntimeError("poisoned row")
        return real(logits, reqs)

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
