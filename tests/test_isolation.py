"""One bad request fails alone: validation in native types, blame for a failing step, fairness."""
from __future__ import annotations

import pytest

from pyengine.sampling_params import SamplingParams
from tests.engine_fakes import VOCAB, fake_engine, reference
from tests.test_engine import assert_all_free, prompts_of


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
