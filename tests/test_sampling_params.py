"""SamplingParams validation: bad values raise ValueError naming the field and the range."""
import pytest

from pyengine.sampling_params import SamplingParams


@pytest.mark.parametrize("field,value", [
    ("n", 0), ("temperature", -0.1), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2), ("min_p", 1.1),
    ("seed", -1), ("max_tokens", 0), ("min_tokens", -1), ("presence_penalty", 3.0),
    ("frequency_penalty", -2.5), ("repetition_penalty", 0.0), ("logprobs", 21), ("logprobs", -1),
    ("stop", [""]), ("stop_token_ids", [-3]),
])
def test_invalid_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_min_tokens_above_max_tokens():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)


def test_defaults_and_normalisation():
    p = SamplingParams(stop="###", temperature=0.0)
    assert p.stop_strings == ["###"] and p.stop_token_ids == [] and p.greedy and not p.has_penalties
    assert SamplingParams(stop=["a", "b"]).stop_strings == ["a", "b"]
    assert SamplingParams(repetition_penalty=1.2).has_penalties
    assert SamplingParams(max_tokens=None).max_tokens is None


@pytest.mark.parametrize("bias", [{5: 100.5}, {5: -101}, {-1: 1.0}, {"5": 1.0}, {5: True}, [5]])
def test_logit_bias_range_and_types(bias):
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias=bias)
    assert SamplingParams(logit_bias={5: 100, 7: -100.0}).logit_bias == {5: 100, 7: -100.0}


def test_structured_outputs_sets_exactly_one_constraint():
    from pyengine.sampling_params import StructuredOutputsParams

    for kw in ({}, {"regex": "a", "choice": ["a"]}, {"json": {"type": "object"}, "json_object": True}):
        with pytest.raises(ValueError, match="exactly one"):
            StructuredOutputsParams(**kw)
    with pytest.raises(ValueError, match="choice"):
        StructuredOutputsParams(choice=[])
    p = SamplingParams(structured_outputs=StructuredOutputsParams(json={"b": 1, "a": 2}))
    assert p.structured_outputs.key == ("json", '{"a": 2, "b": 1}')  # the cache key ignores key order
    with pytest.raises(ValueError, match="structured_outputs"):
        SamplingParams(structured_outputs={"json": {}})
