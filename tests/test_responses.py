"""/v1/responses and /v1/conversations through the official openai client, over the real AsyncLLM
driving the PagedEcho stand-in model (tests/engine_fakes.py): the real scheduler and prefix cache,
no weights. PagedEcho's tokens are a function of the whole context, so an answer equal to the
reference for a given message list proves the server rendered exactly that history."""
from __future__ import annotations

import asyncio
import os
import sqlite3
import subprocess
import sys

import openai
import pytest
from aiohttp.test_utils import TestClient, TestServer

from engine_fakes import FakeTokenizer, fake_engine, reference
from pyengine.engine.async_engine import AsyncLLM
from server import gateway
from server.app import ServerConfig, create_app
from server.gateway import GatewayConfig
from server.protocol import APIError
from server.responses import MAX_ITEMS, turns
from server.store import MIGRATIONS, SQLiteStore, StoreOpenError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = "paged-echo"


class RoleTokenizer(FakeTokenizer):
    """A template that keeps roles and makes each turn's prompt a prefix of the next one's."""

    def apply_chat_template(self, messages, add_generation_prompt: bool = True) -> str:
        return "".join(f"<{m['role']}>{m['content']}\n" for m in messages) + ("<assistant>" if add_generation_prompt else "")


TOK = RoleTokenizer()


def answer(messages: list[dict], n: int) -> str:
    """What PagedEcho answers (greedy, n tokens) to these chat messages."""
    return TOK.decode(reference(TOK.encode(TOK.apply_chat_template(messages), False), n))


class Served:
    def __init__(self, store: SQLiteStore | None = None, keys: tuple[str, ...] = ("k1", "k2"),
                 max_model_len: int = 4096) -> None:
        engine = fake_engine(max_num_batched_tokens=256, max_model_len=max_model_len)
        engine.tokenizer = TOK
        self.llm = AsyncLLM(engine=engine)
        self.store = store
        self.app = create_app(self.llm, ServerConfig(store=store, gateway=GatewayConfig(api_keys=list(keys))))
        self.http = TestClient(TestServer(self.app, handler_cancellation=True))
        self.clients: list[openai.AsyncOpenAI] = []

    async def __aenter__(self) -> "Served":
        await self.http.start_server()
        return self

    async def __aexit__(self, *exc) -> None:
        for c in self.clients:
            await c.close()
        await self.http.close()

    def client(self, key: str = "k1") -> openai.AsyncOpenAI:
        self.clients.append(openai.AsyncOpenAI(base_url=str(self.http.make_url("/v1")), api_key=key, max_retries=0))
        return self.clients[-1]


@pytest.fixture
async def served():
    async with Served() as s:
        yield s


def create(client: openai.AsyncOpenAI, **kw):
    return client.responses.create(**{"model": MODEL, "max_output_tokens": 6, "temperature": 0, **kw})


async def test_three_turns_chained_non_streaming_and_streaming(served):
    client = served.client()
    history = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    r1 = await create(client, input="hello", instructions="be brief")
    assert r1.output_text == answer(history, 6)
    assert r1.status == "incomplete" and r1.incomplete_details.reason == "max_output_tokens"
    assert r1.usage.input_tokens_details.cached_tokens == 0

    history += [{"role": "assistant", "content": r1.output_text}, {"role": "user", "content": "more"}]
    r2 = await create(client, input=[{"role": "user", "content": [{"type": "input_text", "text": "more"}]}],
                      previous_response_id=r1.id, instructions="be brief")
    assert r2.output_text == answer(history, 6)
    assert r2.previous_response_id == r1.id
    assert r2.usage.input_tokens == len(TOK.encode(TOK.apply_chat_template(history), False))
    assert r2.usage.input_tokens_details.cached_tokens >= 16  # turn 1's prompt, from the prefix cache

    history += [{"role": "assistant", "content": r2.output_text}, {"role": "user", "content": "last"}]
    stream = await create(client, input="last", previous_response_id=r2.id, instructions="be brief", stream=True)
    events = [e async for e in stream]
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == answer(history, 6) == events[-1].response.output_text
    r3 = events[-1].response
    assert events[0].response.id == r3.id and events[0].response.status == "in_progress"
    assert r3.usage.output_tokens == 6 and r3.usage.input_tokens_details.cached_tokens >= 32

    got = await client.responses.retrieve(r3.id)
    assert got.output_text == text and got.previous_response_id == r2.id
    items = await client.responses.input_items.list(r2.id)
    assert [i.content[0].text for i in items.data] == ["more"]


async def test_instructions_are_not_carried_over(served):
    client = served.client()
    r1 = await create(client, input="hello", instructions="be brief")
    r2 = await create(client, input="more", previous_response_id=r1.id)
    assert r2.instructions is None
    assert r2.output_text == answer([{"role": "user", "content": "hello"}, {"role": "assistant", "content": r1.output_text},
                                     {"role": "user", "content": "more"}], 6)


async def test_store_false_and_delete(served):
    client = served.client()
    r = await create(client, input="hi", store=False)
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(r.id)
    kept = await create(client, input="hi")
    await client.responses.delete(kept.id)
    for call in (client.responses.retrieve(kept.id), client.responses.delete(kept.id),
                 create(client, input="x", previous_response_id=kept.id)):
        with pytest.raises(openai.NotFoundError):
            await call


async def test_another_key_gets_404(served):
    mine, theirs = served.client("k1"), served.client("k2")
    r = await create(mine, input="secret")
    conv = await mine.conversations.create(items=[{"role": "user", "content": "mine"}])
    for call in (theirs.responses.retrieve(r.id), theirs.responses.delete(r.id),
                 theirs.responses.input_items.list(r.id),
                 create(theirs, input="x", previous_response_id=r.id),
                 create(theirs, input="x", conversation=conv.id),
                 theirs.conversations.retrieve(conv.id), theirs.conversations.items.list(conv.id),
                 theirs.conversations.items.create(conv.id, items=[{"role": "user", "content": "x"}]),
                 theirs.conversations.delete(conv.id)):
        with pytest.raises(openai.NotFoundError) as e:
            await call
        assert e.value.body["code"] == "not_found"
    assert (await mine.responses.retrieve(r.id)).output_text == r.output_text  # nothing deleted
    assert len((await mine.conversations.items.list(conv.id)).data) == 1
    with pytest.raises(openai.NotFoundError) as e:
        await create(mine, input="x", previous_response_id="resp_unknown")
    assert e.value.body["param"] == "previous_response_id"


async def test_survives_a_restart_on_the_same_file(tmp_path):
    path = str(tmp_path / "store.sqlite3")
    async with Served(SQLiteStore(path)) as s:
        r1 = await create(s.client(), input="remember me")
    async with Served(SQLiteStore(path)) as s:  # a new engine and app; the same file
        client = s.client()
        assert (await client.responses.retrieve(r1.id)).output_text == r1.output_text
        r2 = await create(client, input="and now?", previous_response_id=r1.id)
    history = [{"role": "user", "content": "remember me"}, {"role": "assistant", "content": r1.output_text},
               {"role": "user", "content": "and now?"}]
    assert r2.output_text == answer(history, 6)


def test_turns_never_split_and_skip_system():
    msgs = [{"role": r, "content": ""} for r in ["system", "assistant", "user", "assistant", "user", "system", "user"]]
    assert turns(msgs) == [[1], [2, 3], [4], [6]]


async def test_truncation_auto_drops_oldest_turns_disabled_is_400():
    async with Served(max_model_len=160) as s:
        client = s.client()
        r, history = None, []
        for q in ["first question", "second question", "third question"]:
            r = await create(client, input=q, instructions="sys", truncation="auto", max_output_tokens=10,
                             previous_response_id=r.id if r else None)
            assert r.truncation_details == {"dropped_items": 0}
            history += [{"role": "user", "content": q}, {"role": "assistant", "content": r.output_text}]
        ask = {"role": "user", "content": "fourth question"}
        full = [{"role": "system", "content": "sys"}, *history, ask]
        n_full = len(TOK.encode(TOK.apply_chat_template(full), False))
        assert n_full + 10 > 160  # the whole history no longer fits

        with pytest.raises(openai.BadRequestError) as e:
            await create(client, input="fourth question", instructions="sys", max_output_tokens=10,
                         previous_response_id=r.id)  # truncation defaults to "disabled", as OpenAI's
        with pytest.raises(APIError) as want:
            gateway.check_context(n_full, 10, 160)
        assert e.value.body["message"] == want.value.message and e.value.body["code"] == "context_length_exceeded"

        t = await create(client, input="fourth question", instructions="sys", truncation="auto", max_output_tokens=10,
                         previous_response_id=r.id)
        dropped = t.truncation_details["dropped_items"]
        assert dropped in (2, 4, 6) and dropped % 2 == 0  # whole turns (user + assistant), oldest first
        kept = [full[0], *history[dropped:], ask]  # the instructions stay
        assert t.output_text == answer(kept, 10)
        assert t.usage.input_tokens + 10 <= 160

        with pytest.raises(openai.BadRequestError) as e:  # the new input alone is too long: nothing to drop
            await create(client, input="x" * 200, truncation="auto", max_output_tokens=10)
        assert e.value.body["code"] == "context_length_exceeded"


async def test_truncation_auto_keeps_the_cached_prefix_for_many_turns():
    async with Served(max_model_len=600) as s:
        client = s.client()
        r, rows = None, []
        for t in range(30):
            r = await create(client, input=f"question {t} " + "about the sea " * 2, instructions="Be brief.",
                             truncation="auto", max_output_tokens=12, previous_response_id=r.id if r else None)
            rows.append((r.truncation_details["dropped_items"], r.usage.input_tokens,
                         r.usage.input_tokens_details.cached_tokens))
            assert r.usage.input_tokens + 12 <= 600
        after = [row for row in rows[next(i for i, row in enumerate(rows) if row[0]):]]
        assert len(after) >= 10  # the conversation went well past the window
        # the history is cut in blocks: the same turns are kept for several turns in a row
        assert len({d for d, _, _ in after}) <= len(after) // 3
        ratios = sorted(c / n for _, n, c in after)
        assert ratios[len(ratios) // 2] >= 0.5  # the median turn is served mostly from the prefix cache


def test_cut_points_stay_put_as_the_history_grows():
    from server.responses import cut_points

    sizes = [30, 50, 20, 70, 10, 10, 60, 40]
    assert cut_points(sizes, 100) == [3, 7]  # 30+50+20, then 70+10+10+60 ... the last turn never counts
    for n in range(2, len(sizes)):  # a longer history only adds cut points after the old ones
        assert cut_points(sizes[:n], 100) == [c for c in cut_points(sizes, 100) if c < n]


async def test_conversations_items_and_serialised_turns(served):
    client = served.client()
    conv = await client.conversations.create(items=[{"role": "system", "content": "sys"}], metadata={"a": "b"})
    assert conv.metadata == {"a": "b"} and (await client.conversations.retrieve(conv.id)).id == conv.id
    with pytest.raises(openai.BadRequestError) as e:  # values are strings, at creation as at update
        await client.conversations.create(metadata={"n": 1})
    assert e.value.body["param"] == "metadata"
    updated = await client.conversations.update(conv.id, metadata={"topic": "sea"})  # POST /v1/conversations/{id}
    assert updated.metadata == {"topic": "sea"} and updated.created_at == conv.created_at
    assert (await client.conversations.retrieve(conv.id)).metadata == {"topic": "sea"}
    with pytest.raises(openai.BadRequestError) as e:
        await client.conversations.update(conv.id, metadata={"n": 1})
    assert e.value.body["param"] == "metadata"
    assert (await client.conversations.retrieve(conv.id)).metadata == {"topic": "sea"}  # a bad update changes nothing
    with pytest.raises(openai.NotFoundError):
        await served.client("k2").conversations.update(conv.id, metadata={})  # another key's conversation
    added = await client.conversations.items.create(conv.id, items=[{"role": "user", "content": "hi"},
                                                                    {"role": "assistant", "content": "yo"}])
    assert [i.role for i in added.data] == ["user", "assistant"]

    # two turns at once: the second waits for the first and sees its answer
    a, b = await asyncio.gather(create(client, input="one", conversation=conv.id),
                                create(client, input="two", conversation=conv.id))
    first, second = sorted([a, b], key=lambda r: r.usage.input_tokens)
    page = await client.conversations.items.list(conv.id, order="asc", limit=100)
    texts = [(i.role, i.content[0].text) for i in page.data]
    q1, q2 = ("one", "two") if first is a else ("two", "one")
    assert texts == [("system", "sys"), ("user", "hi"), ("assistant", "yo"), ("user", q1),
                     ("assistant", first.output_text), ("user", q2), ("assistant", second.output_text)]
    msgs = [{"role": r, "content": t} for r, t in texts]
    assert second.output_text == answer(msgs[:-1], 6) and second.conversation.id == conv.id

    newest = await client.conversations.items.list(conv.id, limit=2)  # default order: newest first
    assert [i.content[0].text for i in newest.data] == [second.output_text, q2] and newest.has_more
    rest = await client.conversations.items.list(conv.id, limit=10, after=newest.last_id)
    assert len(rest.data) == 5 and not rest.has_more

    await client.conversations.delete(conv.id)
    with pytest.raises(openai.NotFoundError):
        await client.conversations.items.list(conv.id)


@pytest.mark.parametrize("path", ["/v1/conversations", "/v1/conversations/conv_x/items"])
async def test_conversation_items_are_capped_before_any_is_parsed(served, path):
    """Both conversation endpoints take at most MAX_ITEMS items, refused on the count alone: the
    21st item is not even read (here it is malformed, and the error names the cap, not it)."""
    items = [{"role": "user", "content": "hi"}] * MAX_ITEMS + [{"role": "robot"}]
    r = await served.http.post(path, json={"items": items}, headers={"Authorization": "Bearer k1"})
    assert r.status == 400
    err = (await r.json())["error"]
    assert err["param"] == "items" and f"at most {MAX_ITEMS} items, got {MAX_ITEMS + 1}" in err["message"]


@pytest.mark.parametrize("body, param", [
    ({}, "input"),
    ({"input": []}, "input"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0]"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0]"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
    ({"input": "x", "truncation": "sometimes"}, "truncation"),
    ({"input": "x", "tools": [{"type": "function", "name": "f"}]}, "tools"),
    ({"input": "x", "conversation": "conv_1", "previous_response_id": "resp_1"}, "conversation"),
    ({"input": "x", "temperature": -1}, "temperature"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
])
async def test_bad_requests_are_400_naming_the_field(served, body, param):
    r = await served.http.post("/v1/responses", json={"model": MODEL, **body},
                               headers={"Authorization": "Bearer k1"})
    assert r.status == 400
    err = (await r.json())["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error"
    assert (await create(served.client(), input="ok")).status == "incomplete"  # still serving


async def test_locked_or_full_store_is_503_for_that_request_only(tmp_path):
    path = str(tmp_path / "store.sqlite3")
    async with Served(SQLiteStore(path, busy_timeout=0.1)) as s:
        client = s.client()
        before = await create(client, input="kept")
        other = sqlite3.connect(path, isolation_level=None)
        other.execute("BEGIN EXCLUSIVE")  # another process holds the write lock
        try:
            with pytest.raises(openai.APIStatusError) as e:
                await create(client, input="blocked")
            assert e.value.status_code == 503 and e.value.body["code"] == "store_unavailable"
            stream = await create(client, input="blocked", stream=True)
            events = [ev async for ev in stream]
            assert events[-1].type == "error" and events[-1].code == "store_unavailable"
            assert (await client.responses.retrieve(before.id)).output_text == before.output_text  # reads go on
            chat = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                        max_tokens=2)
            assert chat.choices[0].message.content  # stateless: unaffected
        finally:
            other.execute("ROLLBACK")
            other.close()
        after = await create(client, input="works again", previous_response_id=before.id)
        assert (await client.responses.retrieve(after.id)).previous_response_id == before.id

        s.store.db.execute("PRAGMA max_page_count = 1")  # no page beyond those in use: the disk is full
        with pytest.raises(openai.APIStatusError) as e:
            await create(client, input="y" * 3000, max_output_tokens=1)
        assert e.value.status_code == 503
        s.store.db.execute("PRAGMA max_page_count = 1073741823")
        assert (await client.responses.retrieve(after.id)).id == after.id
    assert s.llm.stats().num_free_blocks == s.llm.stats().num_total_blocks


async def test_chat_completions_report_cached_tokens(served):
    http = served.http
    body = {"model": MODEL, "messages": [{"role": "user", "content": "a long enough question " * 3}], "max_tokens": 2}
    headers = {"Authorization": "Bearer k1"}
    first = await (await http.post("/v1/chat/completions", json=body, headers=headers)).json()
    again = await (await http.post("/v1/chat/completions", json=body, headers=headers)).json()
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    prompt = again["usage"]["prompt_tokens"]
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == prompt // 16 * 16 > 0


# ---------------------------------------------------------------- the store file
@pytest.mark.e2e
def test_corrupt_file_fails_at_start_up_naming_it(tmp_path):
    bad = tmp_path / "bad.sqlite3"
    bad.write_bytes(b"this is not a database" * 100)
    with pytest.raises(StoreOpenError, match=str(bad)):
        SQLiteStore(str(bad))
    with pytest.raises(StoreOpenError, match=str(tmp_path)):  # unreadable as a database: a directory
        SQLiteStore(str(tmp_path))
    proc = subprocess.run([sys.executable, "-m", "server", "--store", str(bad), "--port", "0"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and str(bad) in proc.stderr and "Traceback" not in proc.stderr


def test_schema_version_and_migrations(tmp_path):
    path = str(tmp_path / "s.sqlite3")
    SQLiteStore(path).db.close()
    db = sqlite3.connect(path)
    assert db.execute("SELECT version FROM schema_version").fetchall() == [(len(MIGRATIONS),)]
    SQLiteStore(path).db.close()  # reopening runs nothing again
    assert db.execute("SELECT version FROM schema_version").fetchall() == [(len(MIGRATIONS),)]
    db.execute("UPDATE schema_version SET version = 99")
    db.commit()
    with pytest.raises(StoreOpenError, match="schema version 99 is newer"):
        SQLiteStore(path)


async def test_history_cache_agrees_with_the_database(tmp_path):
    path = str(tmp_path / "s.sqlite3")
    async with Served(SQLiteStore(path)) as s:
        client = s.client()
        r = None
        for q in ["one", "two", "three"]:
            r = await create(client, input=q, previous_response_id=r.id if r else None)
        owner = next(iter(s.store._histories))[0]
        cached = await s.store.response_history(owner, r.id)
        fresh = SQLiteStore(path, history_cache=0)  # reads the chain from the file
        assert await fresh.response_history(owner, r.id) == cached
        assert [i["role"] for i in cached] == ["user", "assistant"] * 3
        await fresh.close()
        metrics = await (await s.http.get("/metrics", headers={"Authorization": "Bearer k1"})).text()
        for name in ("response_store_time_seconds", "response_store_work_seconds"):
            assert f'pyengine_server:{name}_count{{model_name="{MODEL}"}} 3.0' in metrics
