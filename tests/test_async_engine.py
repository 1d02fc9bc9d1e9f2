"""AsyncLLM: streaming deltas, abort, errors, stats — over the PagedEcho stand-in engine."""
import asyncio

import pytest

from pyengine.engine.async_engine import AsyncLLM
from pyengine.sampling_params import SamplingParams

from engine_fakes import fake_engine, reference
from model_helpers import hf_greedy, real_engine

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
    assert 'pyengine:time_to_first_token_seconds_count{model_name="paged-echo"} 1.0' in text
    assert 'pyengine:generation_tokens_total{model_name="paged-echo"} 4.0' in text
    assert 'pyengine:request_success_total{finished_reason="length",model_name="paged-echo"} 1.0' in text


async def test_real_model_streaming_matches_transformers(real_parts, hf_model):
    """Streamed deltas of the real model against transformers' greedy continuation on the same
    weights, with a stop string that spans several tokens (held back, then cut)."""
    tok = real_parts[2]
    prompt = "1, 2, 3, 4,"
    want_ids, _ = hf_greedy(hf_model, tok.encode(prompt), 20, set(tok.eos_token_ids))
    want = tok.decode(want_ids, skip_special_tokens=True)
    stop = "9, 1"  # " 9", ",", " ", "1": split across tokens
    assert stop in want
    engine = real_engine(real_parts)
    a = AsyncLLM(engine=engine)
    await a.start()
    try:
        deltas = await collect(a, prompt, SamplingParams(max_tokens=20, temperature=0.0), "p")
        assert [t for d in deltas for t in d.outputs[0].token_ids] == want_ids
        assert "".join(d.outputs[0].text for d in deltas) == want
        assert deltas[-1].outputs[0].finish_reason == "length"
        assert deltas[-1].metrics.ttft is not None and deltas[-1].metrics.e2e >= deltas[-1].metrics.ttft
        deltas = await collect(a, prompt, SamplingParams(max_tokens=20, temperature=0.0, stop=stop), "s")
        assert "".join(d.outputs[0].text for d in deltas) == want[: want.index(stop)]
        assert deltas[-1].outputs[0].finish_reason == "stop" and deltas[-1].outputs[0].stop_reason == stop
    finally:
        await a.shutdown()
    assert engine.pool.num_free == engine.pool.num_blocks
