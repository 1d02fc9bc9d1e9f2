"""Structured output and tool calls end to end: a real `python -m server` with the default model,
driven by the official openai client (response_format, tools, logit_bias, the 400s)."""
from __future__ import annotations

import concurrent.futures
import json
import re

import jsonschema
import openai
import pytest
import xgrammar as xgr
from pydantic import BaseModel, Field

from pyengine.model.loader import resolve_model_path
from pyengine.structured import StructuredOutputs
from pyengine.sampling_params import StructuredOutputsParams
from pyengine.tokenizer import Tokenizer
from test_server_e2e import ServerProcess

pytestmark = pytest.mark.e2e  # a `python -m server` subprocess (pyproject's markers)
KEY = "structured-key"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Get the local time in a timezone",
    "parameters": {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 20}},
                   "required": ["timezone"]}}}
SCHEMAS = {
    "nested objects": {"type": "object", "properties": {"person": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 12},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                     "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"]}}, "required": ["name", "address"]}}, "required": ["person"]},
    "arrays with min/max items": {"type": "object", "properties": {"tags": {
        "type": "array", "items": {"type": "string", "maxLength": 8}, "minItems": 2, "maxItems": 4}},
        "required": ["tags"]},
    "enums": {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                               "size": {"type": "string", "enum": ["S", "M", "L"]}},
              "required": ["color", "size"]},
    "integers and numbers": {"type": "object", "properties": {
        "count": {"type": "integer", "minimum": 0, "maximum": 1000},
        "ratio": {"type": "number", "minimum": 0, "maximum": 1}}, "required": ["count", "ratio"]},
    "strings with patterns": {"type": "object", "properties": {
        "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
        "email": {"type": "string", "pattern": "^[a-z]{1,10}@[a-z]{1,8}\\.com$"}}, "required": ["code", "email"]},
}


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess(KEY, "--max-n", "100").wait_ready()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=600)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_model_path(resolve_model_path(None))


def chat(client, model, content, **kw):
    return client.chat.completions.create(model=model, messages=[{"role": "user", "content": content}], **kw)


class City(BaseModel):
    name: str = Field(max_length=30)
    population: int


def test_parse_with_a_pydantic_model(client, model):
    r = client.chat.completions.parse(
        model=model, messages=[{"role": "user", "content": "Paris has 2100000 inhabitants. Answer in JSON "
                                                            "with the city's name and population."}],
        response_format=City, max_tokens=100, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, City)
    assert City.model_validate_json(choice.message.content) == choice.message.parsed


def test_json_object_mode(client, model):
    """Any JSON object (no schema): the ones that finish parse; an open-ended object may run to max_tokens."""
    r = chat(client, model, "Describe a cat as JSON.", response_format={"type": "json_object"}, max_tokens=150,
             temperature=0.7, seed=1, n=4)
    done = [c for c in r.choices if c.finish_reason == "stop"]
    assert done
    for c in done:
        assert isinstance(json.loads(c.message.content), dict)


def test_sampled_outputs_all_valid_for_five_schemas(client, model):
    """temperature 1.0, 100 samples per schema (one n=100 request each, the five at once)."""
    def run(name):
        schema = SCHEMAS[name]
        r = chat(client, model, f"Reply with JSON for: {name}.", n=100, temperature=1.0, seed=11, max_tokens=120,
                 response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
        return name, r

    with concurrent.futures.ThreadPoolExecutor(len(SCHEMAS)) as pool:
        results = list(pool.map(run, SCHEMAS))
    for name, r in results:
        assert len(r.choices) == 100
        texts = [c.message.content for c in r.choices]
        bad = [(c.finish_reason, c.message.content) for c in r.choices if c.finish_reason != "stop"]
        assert not bad, f"{name}: {len(bad)} of 100 did not finish: {bad[:3]}"
        for t in texts:
            jsonschema.validate(json.loads(t), SCHEMAS[name])
        assert len(set(texts)) >= 5, f"{name}: samples barely differ at temperature 1"


def test_regex_choice_and_grammar(client, model):
    r = chat(client, model, "Pick a code.", extra_body={"structured_outputs": {"regex": "[A-Z]{2}[0-9]{4}"}},
             max_tokens=20, temperature=1.0, n=8, seed=2)
    assert all(re.fullmatch(r"[A-Z]{2}[0-9]{4}", c.message.content) for c in r.choices)
    r = chat(client, model, "Is the sky blue?", extra_body={"structured_outputs": {"choice": ["yes", "no", "maybe"]}},
             max_tokens=10, temperature=1.0, n=8, seed=3)
    assert all(c.message.content in ("yes", "no", "maybe") and c.finish_reason == "stop" for c in r.choices)
    grammar = 'root ::= "The answer is " digit digit "."\ndigit ::= [0-9]'
    r = chat(client, model, "Answer.", extra_body={"structured_outputs": {"grammar": grammar}}, max_tokens=20)
    assert re.fullmatch(r"The answer is [0-9]{2}\.", r.choices[0].message.content)


def test_max_tokens_cut_gives_length_and_a_valid_prefix(client, model, tokenizer):
    schema = SCHEMAS["nested objects"]
    r = chat(client, model, "A person as JSON.", max_tokens=6, temperature=1.0, seed=5,
             response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": schema}})
    c = r.choices[0]
    assert c.finish_reason == "length" and r.usage.completion_tokens == 6
    so = StructuredOutputs(tokenizer, 49152, tokenizer.eos_token_ids)
    matcher = xgr.GrammarMatcher(so.compile(StructuredOutputsParams(json=schema)))
    assert matcher.accept_string(c.message.content) and not matcher.is_terminated()


def valid_call(call, tools):
    spec = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    assert call.type == "function" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), spec[call.function.name])


def test_tool_choice_required(client, model):
    tools = [WEATHER, TIME]
    r = chat(client, model, "What is the weather in Paris?", tools=tools, tool_choice="required", max_tokens=100,
             temperature=1.0, seed=7, n=4, parallel_tool_calls=False)
    for c in r.choices:
        assert c.finish_reason == "tool_calls" and c.message.content is None
        assert len(c.message.tool_calls) == 1
        valid_call(c.message.tool_calls[0], tools)
    # parallel calls: the model may chain calls until max_tokens; every complete one is valid
    r = chat(client, model, "Weather in Oslo and time in Tokyo?", tools=tools, tool_choice="required",
             max_tokens=100, temperature=1.0, seed=8, n=4)
    for c in r.choices:
        assert c.finish_reason in ("tool_calls", "length") and c.message.tool_calls
        assert (c.message.content is None) == (c.finish_reason == "tool_calls")  # a cut call is content
        for call in c.message.tool_calls:  # every call handed out is complete
            valid_call(call, tools)


@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_call_cut_by_max_tokens_is_content_with_finish_reason_length(client, model, stream):
    kw = dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=3,
              temperature=0)
    if not stream:
        c = chat(client, model, "Weather in Paris?", **kw).choices[0]
        assert c.finish_reason == "length" and not c.message.tool_calls and c.message.content.startswith("{")
        return
    deltas, finish = [], None
    for chunk in chat(client, model, "Weather in Paris?", stream=True, **kw):
        for ch in chunk.choices:
            deltas += ch.delta.tool_calls or []
            finish = ch.finish_reason or finish
    assert finish == "length" and deltas == []


def test_tool_choice_named_function(client, model):
    r = chat(client, model, "Tell me something.", tools=[WEATHER, TIME], max_tokens=80, temperature=1.0, seed=9,
             tool_choice={"type": "function", "function": {"name": "get_time"}})
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    assert [t.function.name for t in c.message.tool_calls] == ["get_time"]
    valid_call(c.message.tool_calls[0], [TIME])


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_streamed_tool_call_deltas_concatenate_to_the_non_streaming_result(client, model, tool_choice):
    # one call (parallel calls may chain until max_tokens, and a call cut short ends with "length")
    kw = dict(tools=[WEATHER, TIME], tool_choice=tool_choice, max_tokens=100, temperature=1.0, seed=21,
              parallel_tool_calls=False)
    full = chat(client, model, "Weather in Rome?", **kw).choices[0]
    calls, finish, headers = {}, None, []
    for chunk in chat(client, model, "Weather in Rome?", stream=True, **kw):
        if not chunk.choices:
            continue
        ch = chunk.choices[0]
        finish = ch.finish_reason or finish
        assert not ch.delta.content
        for d in ch.delta.tool_calls or []:
            if d.index not in calls:  # the header comes first: id, type and name, then arguments in pieces
                assert d.id and d.type == "function" and d.function.name
                headers.append(d.index)
                calls[d.index] = [d.function.name, d.function.arguments or ""]
            else:
                assert d.id is None and d.function.name is None
                calls[d.index][1] += d.function.arguments
    assert finish == full.finish_reason == "tool_calls"
    assert [tuple(calls[k]) for k in sorted(calls)] == \
        [(t.function.name, t.function.arguments) for t in full.message.tool_calls]
    assert sum(len(a) > 0 for _, a in calls.values()) == len(calls) and len(headers) == len(calls)


class Address(BaseModel):
    city: str = Field(max_length=20)
    zip_code: str = Field(pattern=r"^[0-9]{5}$")


class Shipment(BaseModel):
    """Ship a parcel (pydantic writes the nested model under $defs and refers to it with $ref)."""

    weight_kg: int = Field(ge=1, le=50)
    to: Address


@pytest.mark.parametrize("tool_choice", ["required", "auto", {"type": "function", "function": {"name": "Shipment"}}])
def test_a_pydantic_tool_with_a_nested_model_works_under_every_tool_choice(client, model, tool_choice):
    tool = openai.pydantic_function_tool(Shipment)
    assert "$defs" in json.dumps(tool)  # what the test is about
    r = chat(client, model, "Ship 3 kg to Paris, zip 75001.", tools=[tool, WEATHER], tool_choice=tool_choice,
             max_tokens=120, temperature=0)
    c = r.choices[0]
    if tool_choice == "auto" and not c.message.tool_calls:  # the model may answer in words
        assert c.finish_reason in ("stop", "length")
        return
    call = c.message.tool_calls[0]
    if call.function.name == "Shipment":
        Shipment.model_validate_json(call.function.arguments)
    else:
        valid_call(call, [WEATHER])


def test_multi_turn_tool_conversation_renders(client, model):
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                    "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'}]
    r = client.chat.completions.create(model=model, messages=messages, tools=[WEATHER], max_tokens=20, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert r.usage.prompt_tokens > 100  # the tool listing and the tool result are in the prompt


def test_logit_bias_plus_100_forces_the_token(client, model, tokenizer):
    tok = tokenizer.encode(" banana", add_special_tokens=False)[0]
    r = client.completions.create(model=model, prompt="My favourite colour is", max_tokens=5, temperature=1.0,
                                  logit_bias={str(tok): 100}, seed=4, logprobs=0)
    lp = r.choices[0].logprobs
    assert r.choices[0].text == tokenizer.decode([tok]) * 5
    assert len(lp.tokens) == 5
    r = chat(client, model, "Say hi.", logit_bias={str(tok): 100}, max_tokens=3, temperature=0)
    assert r.choices[0].message.content == tokenizer.decode([tok]) * 3


@pytest.mark.parametrize("kw,param,words", [
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "frobnicate"}}}}}), "response_format", "frobnicate"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "integer", "multipleOf": 3}}}}}), "response_format",
     "multipleOf"),
    (dict(extra_body={"structured_outputs": {"regex": "("}}), "structured_outputs", "regex"),
    (dict(extra_body={"structured_outputs": {"grammar": "root ::= undefined_rule"}}), "structured_outputs",
     "undefined_rule"),
    (dict(response_format={"type": "yaml"}), "response_format", "response_format"),
    (dict(logit_bias={"49152": 1}), "logit_bias", "49152"),
    (dict(logit_bias={"5": 101}), "logit_bias", "[-100, 100]"),
    (dict(extra_body={"best_of": 3}), "best_of", "best_of"),
    (dict(extra_body={"functions": [{"name": "f"}]}), "functions", "tools"),
    (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice", "nope"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "$ref": "http://example.com/schema.json"}}}), "response_format", "http://example.com/schema.json"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"$ref": "#/$defs/Missing"}}}}}), "response_format",
     "names nothing"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"$ref": "other.json#/A"}}}}}], tool_choice="required"), "tools",
     "other.json"),
])
def test_bad_structured_requests_get_a_400_naming_the_field(client, model, kw, param, words):
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, model, "hi", max_tokens=5, **kw)
    err = e.value.body
    assert err["param"] == param and words in err["message"], err


def test_unsupported_completion_and_content_fields_and_the_server_keeps_serving(client, model):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model, prompt="a", suffix="b", max_tokens=3)
    assert e.value.body["param"] == "suffix"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, max_tokens=3, messages=[{"role": "user", "content": [
            {"type": "text", "text": "what is this?"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}])
    assert e.value.body["param"] == "messages[0].content[1]" and "image_url" in e.value.body["message"]
    assert chat(client, model, "hi", max_tokens=3).choices[0].finish_reason in ("stop", "length")


def test_langchain_with_structured_output_and_bind_tools(server, model):
    """LangChain (optional test dependency: pip install -e '.[langchain]')."""
    langchain_openai = pytest.importorskip("langchain_openai")
    llm = langchain_openai.ChatOpenAI(base_url=server.url + "/v1", api_key=KEY, model=model, temperature=0,
                                      max_tokens=100, max_retries=0)
    city = llm.with_structured_output(City).invoke(
        "Paris has 2100000 inhabitants. Answer in JSON with the city's name and population.")
    assert isinstance(city, City)
    msg = llm.bind_tools([WEATHER], tool_choice="get_weather").invoke("What is the weather in Paris?")
    assert [c["name"] for c in msg.tool_calls] == ["get_weather"]
    jsonschema.validate(msg.tool_calls[0]["args"], WEATHER["function"]["parameters"])
