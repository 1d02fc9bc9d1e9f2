"""server/tools.py: tool-call parsing (Hermes, Llama-3 JSON, constrained modes), streaming deltas, rendering."""
from __future__ import annotations

import json

import pytest

from server.protocol import APIError, invalid
from server.tools import CallScanner, ToolSpec, ToolStream, parse_tools, render_default

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}


def stream(spec: ToolSpec, parser: str, text: str, step: int = 3):
    """Feed text in pieces; return (streamed content, {call index: (id, name, streamed arguments)}, final message)."""
    ts = ToolStream(CallScanner(spec, parser))
    content, calls = "", {}
    for i in range(0, len(text), step):
        piece, deltas = ts.feed(text[i:i + step], i + step >= len(text))
        content += piece
        for d in deltas:
            if "id" in d:
                assert d["index"] not in calls and d["function"]["arguments"] == ""  # header first, once
                calls[d["index"]] = [d["id"], d["function"]["name"], ""]
            else:
                calls[d["index"]][2] += d["function"]["arguments"]
    return content, calls, ts.message()


def check_stream_matches_message(content, calls, message):
    final_content, final_calls = message
    assert (final_content or "") == content
    assert [(c["id"], c["function"]["name"], c["function"]["arguments"]) for c in final_calls] == \
        [tuple(calls[k]) for k in sorted(calls)]


@pytest.mark.parametrize("step", [1, 3, 7])
def test_hermes_calls_with_leading_text(step):
    spec = ToolSpec([WEATHER, TIME], "auto")
    text = ('Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris \\"}<x>\\"", '
            '"n": {"name": "inner"}}}\n</tool_call>\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')
    content, calls, message = stream(spec, "hermes", text, step)
    check_stream_matches_message(content, calls, message)
    assert content == "Let me check."
    args = [json.loads(c["function"]["arguments"]) for c in message[1]]
    assert [c["function"]["name"] for c in message[1]] == ["get_weather", "get_time"]
    assert args == [{"city": 'Paris "}<x>"', "n": {"name": "inner"}}, {}]


def test_hermes_plain_text_is_content_and_partial_tag_is_held_back():
    spec = ToolSpec([WEATHER], "auto")
    ts = ToolStream(CallScanner(spec, "hermes"))
    assert ts.feed("a < b <tool", False) == ("a < b ", [])
    assert ts.feed("s", True) == ("<tools", [])
    assert ts.message() == ("a < b <tools", [])


@pytest.mark.parametrize("prefix", ["", "<|python_tag|>", "  "])
def test_llama3_json_calls(prefix):
    spec = ToolSpec([WEATHER, TIME], "auto")
    text = prefix + '{"name": "get_weather", "parameters": {"city": "Oslo"}}; {"name": "get_time", "parameters": {}}'
    content, calls, message = stream(spec, "llama3_json", text, 2)
    check_stream_matches_message(content, calls, message)
    assert message[0] is None
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message[1]] == \
        [("get_weather", {"city": "Oslo"}), ("get_time", {})]
    content, calls, message = stream(spec, "llama3_json", "The weather is fine.", 2)
    assert content == "The weather is fine." and message == ("The weather is fine.", [])


def test_required_and_named_modes_read_the_constrained_output():
    spec = ToolSpec([WEATHER, TIME], "required", parallel=False)
    assert spec.schema()["maxItems"] == 1
    text = '[{"name": "get_weather", "arguments": {"city": "Rome"}}]'
    content, calls, message = stream(spec, "hermes", text, 4)
    check_stream_matches_message(content, calls, message)
    assert message[1][0]["function"]["arguments"] == '{"city": "Rome"}'
    named = ToolSpec([WEATHER, TIME], "named", "get_weather")
    assert named.schema() == WEATHER["function"]["parameters"]
    content, calls, message = stream(named, "hermes", '{"city": "Rome"}', 2)
    check_stream_matches_message(content, calls, message)
    assert message == (None, [{"id": message[1][0]["id"], "type": "function",
                               "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}])


@pytest.mark.parametrize("spec,parser,text,calls", [
    (ToolSpec([WEATHER, TIME], "required"), "hermes",
     '[{"name": "get_time", "arguments": {}}, {"name": "get_weather", "arguments": {"ci', 1),
    (ToolSpec([WEATHER, TIME], "required"), "hermes", '[{"name": "get_weather", "arguments": ', 0),
    (ToolSpec([WEATHER, TIME], "named", "get_weather"), "hermes", '{"', 0),
    (ToolSpec([WEATHER, TIME], "named", "get_weather"), "hermes", "", 0),
    (ToolSpec([WEATHER], "auto"), "hermes", 'Sure.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Ro', 0),
    (ToolSpec([WEATHER], "auto"), "llama3_json", '{"name": "get_weather", "parameters": {"city": "Ro', 0),
])
@pytest.mark.parametrize("step", [1, 5])
def test_a_call_cut_short_is_content_and_never_announced(spec, parser, text, calls, step):
    content, streamed, message = stream(spec, parser, text, step)
    check_stream_matches_message(content, streamed, message)
    assert len(message[1]) == calls and len(streamed) == calls
    for c in message[1]:
        json.loads(c["function"]["arguments"])  # what a client will do with it
    assert (message[0] or "").rstrip().endswith(text.rstrip()[-5:])  # the cut call's text is there, as content


def test_a_call_to_an_unknown_function_or_with_invalid_arguments_is_content():
    spec = ToolSpec([WEATHER], "auto")
    text = '<tool_call>{"name": "get_weather", "arguments": {"city": 1,}}</tool_call>'
    assert stream(spec, "hermes", text)[2] == (text, [])
    text = '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>'
    assert stream(spec, "hermes", text)[2] == (text, [])


@pytest.mark.parametrize("body,param", [
    ({"tools": {"a": 1}}, "tools"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0]"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
])
def test_parse_tools_rejects_bad_fields(body, param):
    with pytest.raises(APIError) as e:
        parse_tools(body, invalid)
    assert e.value.status == 400 and e.value.param == param


def test_default_rendering_round_trips_a_tool_conversation():
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "content": '{"temp": 21}', "tool_call_id": "call_1"}]
    out = render_default(msgs, [WEATHER["function"]])
    assert out[0]["role"] == "system" and out[0]["content"].startswith("Be brief.") and "<tools>" in out[0]["content"]
    assert '"name": "get_weather"' in out[0]["content"]
    assert out[2] == {"role": "assistant",
                      "content": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'}
    assert out[3] == {"role": "user", "content": '<tool_response>\n{"temp": 21}\n</tool_response>'}
    # what the model would write back in that format parses to the same call
    _, calls, message = stream(ToolSpec([WEATHER], "auto"), "hermes", out[2]["content"])
    assert (message[1][0]["function"]["name"], json.loads(message[1][0]["function"]["arguments"])) == \
        ("get_weather", {"city": "Paris"})
