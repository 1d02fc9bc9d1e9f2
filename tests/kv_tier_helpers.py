"""What the KV-tier tests (test_kv_disk.py, test_kv_host.py) share: prompts, a greedy generate through
LLM, and aborts that land while a tier reads blocks back."""
from __future__ import annotations

import random
import time

from pyengine.llm import LLM
from pyengine.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=5, temperature=0.0)


def prompts_of(lengths, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(n)] for n in lengths]


def generate(engine, prompts, params=GREEDY):
    return [o.outputs[0].token_ids for o in LLM.from_engine(engine).generate(prompts, params, use_tqdm=False)]


def abort_every_other_while_loading(engine, store, prompts, params) -> dict[str, list[int]]:
    """Adds prompts as r0, r1, ... with `store`'s reads slowed so the tier is still loading them, aborts the
    even ones, runs the engine dry and returns each request's output tokens."""
    slow_get = store.get

    def get(key, tokens):  # reads slow enough that the aborts land while they load
        time.sleep(0.01)
        return slow_get(key, tokens)

    store.get = get
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    assert len(engine.kv_tier.loading) > 0
    for i in range(0, len(prompts), 2):
        engine.abort_request(f"r{i}")
    done: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            done.setdefault(o.request_id, []).extend(o.outputs[0].token_ids if o.outputs else [])
    return done
