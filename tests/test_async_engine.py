"""AsyncLLM: streaming deltas, abort, errors, stats — over the PagedEcho stand-in engine."""
import asyncio

import pytest

from pyengine.engine.async_engine import AsyncLLM
from pyengine.sampling_params import SamplingParams

from engine_fakes import fake_engine, reference

GREEDY = dict(temperature=0.0)


@pytest.fixture
async def llm():
    a = AsyncLLM(engine=fake_engine(max_num_batched_tokens=64))
    await a.start()
    yield a
    await a.shutdown()


async def collect(llm, prompt, params, rid):
    deltas = []
    async for out in llm.generate(prompt, params, rid):
        deltas.append(out)
    return deltas


async def test_streaming_deltas_concurrent(llm):
    prompts = [[5 + i, 9, 33, 7 * i + 3] for i in range(8)]
    params = SamplingParams(max_tokens=10, **GREEDY)
    results = await asyncio.gather(*(collect(llm, p, params, f"r{i}") for i, p in enumerate(prompts)))
    for p, deltas in zip(prompts, results):
        assert len(deltas) == 10  # one delta per token
        assert [t for d in deltas for t in d.outputs[0].token_ids] == reference(p, 10)
        assert deltas[-1].finished and deltas[-1].outputs[0].finish_reason == "length"
        assert not any(d.finished for d in deltas[:-1])
        assert "".join(d.outputs[0].text for d in deltas) == llm.tokenizer.decode(reference(p, 10), skip_special_tokens=True)
    assert llm.stats().num_free_blocks == llm.stats().num_total_blocks
    assert llm.is_healthy()


async def test_abort_and_disconnect_free_blocks(llm):
    params = SamplingParams(max_tokens=2000, **GREEDY)
    gen = llm.generate([3, 4, 5], params, "long")
    first = await gen.__anext__()
    assert not first.finished
    await llm.abort("long")
    rest = [o async for o in gen]
    assert rest[-1].finished and rest[-1].outputs[0].finish_reason == "abort"

    async def consume_two():
        n = 0
        async for _ in llm.generate([7, 8], params, "gone"):
            n += 1
            if n == 2:
                break  # client disconnects: the generator is closed, the request aborted

    await consume_two()
    for _ in range(100):
        s = llm.stats()
        if s.num_running == 0 and s.num_waiting == 0:
            break
        await asyncio.sleep(0.01)
    assert s.num_free_blocks == s.num_total_blocks and s.num_running == 0


async def test_prompt_too_long_raises_before_queueing(llm):
    with pytest.raises(ValueError, match="maximum context length"):
        async for _ in llm.generate([5] * 9000, SamplingParams(), "big"):
            pass
    assert llm.stats().num_waiting == 0


async def test_step_error_fails_requests_not_hangs(llm):
    model = llm.engine.runner.model
    orig = model.forward

    def boom(*a, **k):
        raise RuntimeError("kernel exploded")

    model.forward = boom
    with pytest.raises(RuntimeError, match="kernel exploded"):
        await asyncio.wait_for(collect(llm, [3, 4], SamplingParams(max_tokens=5), "x"), 10)
    model.forward = orig
    assert llm.is_healthy()
    s = llm.stats()
    assert s.num_free_blocks == s.num_total_blocks
    out = await collect(llm, [3, 4], SamplingParams(max_tokens=3, **GREEDY), "y")
    assert [t for d in out for t in d.outputs[0].token_ids] == reference([3, 4], 3)


async def test_metrics_registry(llm):
    from prometheus_client import generate_latest

    await collect(llm, [3, 4, 5], SamplingParams(max_tokens=4, **GREEDY), "m")
    text = generate_latest(llm.metrics.registry).decode()
    assert "pyengine:time_to_first_token_seconds_count 1.0" in text
    assert "pyengine:generation_tokens_total 4.0" in text
    assert 'pyengine:request_success_total{finished_reason="length"} 1.0' in text


async def test_real_model_streaming_matches_offline():
    from pyengine.config import EngineConfig
    from pyengine.engine.engine import Engine
    from pyengine.llm import LLM

    engine = Engine(EngineConfig(dtype="float32", kv_cache_memory=64 << 20, max_model_len=1024))
    params = SamplingParams(max_tokens=16, temperature=0.0)
    want = LLM.from_engine(engine).generate(["The capital of France is"], params, use_tqdm=False)[0].outputs[0]
    a = AsyncLLM(engine=engine)
    await a.start()
    try:
        deltas = await collect(a, "The capital of France is", params, "p")
        assert "".join(d.outputs[0].text for d in deltas) == want.text
        assert [t for d in deltas for t in d.outputs[0].token_ids] == want.token_ids
        assert deltas[-1].outputs[0].finish_reason == want.finish_reason
        assert deltas[-1].metrics.ttft is not None and deltas[-1].metrics.e2e >= deltas[-1].metrics.ttft
    finally:
        await a.shutdown()
    assert engine.pool.num_free == engine.pool.num_blocks
