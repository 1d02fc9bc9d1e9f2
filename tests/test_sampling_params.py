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


# ---- native types: every value that passes fits the int32/int64/float32 the step converts it to
@pytest.mark.parametrize("field,value", [
    ("top_k", 2**31), ("max_tokens", 2**31), ("stop_token_ids", [2**31]),
    ("n", 129), ("n", True), ("logprobs", True), ("temperature", 2.5),
    ("top_p", 1e-50), ("repetition_penalty", 1e-46),  # positive, but 0 in float32
    ("repetition_penalty", 1e-38), ("repetition_penalty", 0.0099),  # a logit divided by it can overflow
    ("top_p", "0.5"), ("stop_token_ids", 3), ("ignore_eos", 1), ("stop", 7),
])
def test_native_type_bounds_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_min_tokens_is_int32_without_max_tokens():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=None, min_tokens=2**31)


def test_float32_underflow_to_zero_is_documented_clamp():
    """temperature / min_p too small for float32 become 0 (greedy / off), as the native step sees them;
    the int32/int64 edges themselves are accepted."""
    p = SamplingParams(temperature=1e-50, min_p=1e-60, presence_penalty=-1e-50)
    assert p.temperature == 0.0 and p.greedy and p.min_p == 0.0 and p.presence_penalty == 0.0
    # a float32 subnormal is still positive: kept as given
    assert SamplingParams(top_p=1e-40).top_p == 1e-40
    assert SamplingParams(repetition_penalty=0.01).repetition_penalty == 0.01  # MIN_REPETITION_PENALTY
    p = SamplingParams(top_k=2**31 - 1, seed=2**63 - 1, max_tokens=2**31 - 1, min_tokens=5, n=128,
                       temperature=2.0, logprobs=20, prompt_logprobs=0, stop_token_ids=[2**31 - 1])
    assert p.top_k == 2**31 - 1 and p.n == 128


def test_server_reads_the_same_limits():
    """server/protocol.py has no second copy of the ranges: its 400 comes from LIMITS."""
    from pyengine.sampling_params import LIMITS
    from server.protocol import APIError, get_param

    for name, rng in LIMITS.items():
        if name == "stop_token_ids":
            continue
        with pytest.raises(APIError) as e:
            get_param({name: rng.hi + 1}, name)
        assert e.value.status == 400 and e.value.param == name and rng.describe() in e.value.message
    with pytest.raises(APIError, match="float32"):
        get_param({"top_p": 1e-50}, "top_p")


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
    # the key keeps the schema's order: the grammar writes properties in it
    assert p.structured_outputs.key == ("json", '{"b": 1, "a": 2}')
    with pytest.raises(ValueError, match="structured_outputs"):
        SamplingParams(structured_outputs={"json": {}})
