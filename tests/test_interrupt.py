"""A lone prompt's chunk stopped for a newcomer (pyengine/interrupt.py): the model stops between layers
(the op-by-op loop and the native decoder_layers), the engine commits nothing and the rerun gives the
same tokens; under AsyncLLM a request arriving during such a chunk waits for about one layer of it."""
from __future__ import annotations

import asyncio
import random
import threading
import time

import pytest

from pyengine.engine.async_engine import AsyncLLM
from pyengine.interrupt import StepInterrupt, StepInterrupted
from pyengine.sampling_params import SamplingParams

from engine_fakes import PagedEchoModel, fake_engine, reference
from model_helpers import real_engine
from test_engine import assert_all_free, prompts_of
from test_isolation import drain, tokens

GREEDY = dict(temperature=0.0)


def test_the_flag_raises_only_once_set():
    interrupt = StepInterrupt()
    interrupt.check()
    interrupt.set()
    with pytest.raises(StepInterrupted):
        interrupt.check()
    interrupt.clear()
    interrupt.check()


@pytest.mark.parametrize("parts_name, native", [("real_parts", False), ("bf16_parts", True)])
def test_a_solo_step_stopped_mid_run_commits_nothing_and_reruns_to_the_same_tokens(request, parts_name, native):
    parts = request.getfixturevalue(parts_name)
    assert (parts[1].native_layer_rows > 0) == native
    dtype = "bfloat16" if native else "float32"
    prompt = [random.Random(3).randrange(100, 40000) for _ in range(600)]
    params = SamplingParams(max_tokens=4, **GREEDY)
    config = dict(dtype=dtype, long_prefill_tokens=64, solo_prefill_tokens=512, enable_prefix_caching=False)
    ref = real_engine(parts, kv_tokens=1024, **config)
    ref.add_request("p", prompt, params)
    t0 = time.perf_counter()
    ref.step()  # the 512-token chunk, uninterrupted
    chunk_seconds = time.perf_counter() - t0
    want = tokens(drain(ref)["p"])

    engine = real_engine(parts, kv_tokens=1024, **config)
    engine.add_request("p", prompt, params)
    req = engine.scheduler.requests["p"]
    timer = threading.Timer(chunk_seconds / 4, engine.interrupt.set)  # about a quarter of the layers in
    timer.start()
    t0 = time.perf_counter()
    assert engine.step() == []
    stopped_after = time.perf_counter() - t0
    timer.join()
    assert engine.num_interrupted_steps == 1 and req.num_computed_tokens == 0 and engine.num_computed_tokens == 0
    engine.interrupt.clear()
    t0 = time.perf_counter()
    assert tokens(drain(engine)["p"]) == want
    assert stopped_after < time.perf_counter() - t0  # it stopped well before a whole chunk
    assert engine.num_interrupted_steps == 1
    assert_all_free(engine)


class SlowSoloModel(PagedEchoModel):
    """PagedEchoModel whose interruptible (solo) steps take LAYERS layers of 10 ms, checking the interrupt
    before each, as the real model does."""

    LAYERS = 50

    def __init__(self) -> None:
        super().__init__()
        self.solo_started = threading.Event()

    def forward(self, input_ids, positions, kv_caches, meta, logits_indices, interrupt=None):
        if interrupt is not None:
            self.solo_started.set()
            for _ in range(self.LAYERS):
                interrupt.check()
                time.sleep(0.01)
        return super().forward(input_ids, positions, kv_caches, meta, logits_indices)


async def collect(llm, prompt, params, rid):
    return [t async for out in llm.generate(prompt, params, rid) for t in out.outputs[0].token_ids]


async def test_a_request_arriving_during_a_lone_prompts_chunk_waits_about_one_layer_of_it():
    engine = fake_engine(max_num_batched_tokens=1024, long_prefill_tokens=64, solo_prefill_tokens=512)
    engine.runner.model = model = SlowSoloModel()
    llm = AsyncLLM(engine=engine)
    await llm.start()
    try:
        big = prompts_of([700], seed=5)[0]
        big_task = asyncio.create_task(collect(llm, big, SamplingParams(max_tokens=2, **GREEDY), "big"))
        assert await asyncio.to_thread(model.solo_started.wait, 10)
        t0 = time.perf_counter()
        short = await collect(llm, [5, 6, 7], SamplingParams(max_tokens=1, **GREEDY), "short")
        waited = time.perf_counter() - t0
        assert short == reference([5, 6, 7], 1)
        assert waited < 0.25, f"waited {waited:.2f} s: the solo chunk (0.5 s) ran on"  # one 10 ms layer, then its step
        assert await big_task == reference(big, 2)
        assert engine.num_interrupted_steps == 1
        assert llm.stats().num_interrupted_steps == 1
        assert_all_free(engine)
    finally:
        await llm.shutdown()
