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
