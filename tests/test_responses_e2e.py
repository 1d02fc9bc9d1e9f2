"""The Responses API end to end: a real `python -m server` with the default model, a store file and a
small context window, driven by the official openai client; then a restart on the same file."""
from __future__ import annotations

import openai
import pytest

from test_server_e2e import ServerProcess

pytestmark = pytest.mark.e2e  # a `python -m server` subprocess (pyproject's markers)
CONTEXT = 320
ARGS = ("--api-key", "k2", "--max-model-len", str(CONTEXT), "--kv-cache-memory", "64MiB", "--max-num-seqs", "8")


@pytest.fixture(scope="module")
def store_path(tmp_path_factory):
    return str(tmp_path_factory.mktemp("store") / "conversations.sqlite3")


@pytest.fixture(scope="module")
def server(store_path):
    s = ServerProcess("k1", "--store", store_path, *ARGS).wait_ready()
    yield s
    s.stop()


def client_for(server: ServerProcess, key: str = "k1") -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)


def create(client: openai.OpenAI, **kw):
    return client.responses.create(**{"model": client.models.list().data[0].id, "temperature": 0,
                                      "max_output_tokens": 24, "instructions": "Answer in one sentence.", **kw})


@pytest.fixture(scope="module")
def chain(server):
    """Three turns chained by previous_response_id: non-streaming, streaming, non-streaming."""
    client = client_for(server)
    r1 = create(client, input="Name a colour.")
    events = list(create(client, input="Name another one.", previous_response_id=r1.id, stream=True))
    assert events[0].type == "response.created" and events[-1].type in ("response.completed", "response.incomplete")
    r2 = events[-1].response
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == r2.output_text
    r3 = create(client, input="And a third?", previous_response_id=r2.id)
    return r1, r2, r3


def test_chained_turns_see_the_history(server, chain):
    r1, r2, r3 = chain
    assert r1.output_text and r2.output_text and r3.output_text
    assert r1.usage.input_tokens < r2.usage.input_tokens < r3.usage.input_tokens
    assert r3.usage.input_tokens_details.cached_tokens >= r1.usage.input_tokens // 16 * 16 > 0
    client = client_for(server)  # greedy: the same answer as chat completions over the same messages
    messages = [{"role": "system", "content": "Answer in one sentence."}]
    for r, q in zip(chain, ["Name a colour.", "Name another one.", "And a third?"]):
        messages.append({"role": "user", "content": q})
        if r is not r3:
            messages.append({"role": "assistant", "content": r.output_text})
    chat = client.chat.completions.create(model=r3.model, messages=messages, max_tokens=24, temperature=0)
    assert chat.choices[0].message.content == r3.output_text
    assert chat.usage.prompt_tokens == r3.usage.input_tokens
    assert chat.usage.prompt_tokens_details.cached_tokens > 0


def test_another_key_cannot_read_it(server, chain):
    theirs = client_for(server, "k2")
    with pytest.raises(openai.NotFoundError):
        theirs.responses.retrieve(chain[0].id)
    with pytest.raises(openai.NotFoundError):
        create(theirs, input="x", previous_response_id=chain[2].id)
    assert client_for(server).responses.retrieve(chain[0].id).output_text == chain[0].output_text


def test_truncation_auto_vs_disabled(server, chain):
    client = client_for(server)
    long_input = "Tell me about the sea. " * 12
    r = chain[2]
    for _ in range(6):  # grow the chain past the context window (320 tokens)
        try:
            r = create(client, input=long_input, previous_response_id=r.id, max_output_tokens=48)
        except openai.BadRequestError as e:
            assert e.body["code"] == "context_length_exceeded"
            assert f"maximum context length is {CONTEXT} tokens" in e.body["message"]
            break
    else:
        pytest.fail("the chain never outgrew the context window")
    t = create(client, input=long_input, previous_response_id=r.id, max_output_tokens=48, truncation="auto")
    assert t.truncation_details["dropped_items"] >= 2 and t.truncation_details["dropped_items"] % 2 == 0
    assert t.usage.input_tokens + 48 <= CONTEXT and t.output_text


def test_survives_a_restart(server, chain, store_path):
    assert server.stop() == 0
    again = ServerProcess("k1", "--store", store_path, *ARGS).wait_ready()
    try:
        client = client_for(again)
        assert client.responses.retrieve(chain[2].id).output_text == chain[2].output_text
        r4 = create(client, input="Which did you name first?", previous_response_id=chain[2].id)
        assert r4.usage.input_tokens > chain[2].usage.input_tokens and r4.output_text
    finally:
        again.stop()
