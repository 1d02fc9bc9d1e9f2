"""OpenAI's Responses API (POST/GET/DELETE /v1/responses) and conversations (/v1/conversations).

A response turns into a chat request: instructions (a system message) + the history (the chain of
`previous_response_id`, or the items of a `conversation`) + the input items, rendered with the
model's chat template. From there it takes the chat completions path of OpenAIServing (context
check, sampling parameters, rate limits, admission, generation); only the wire format differs
(`ResponsesWire`). Finished responses go to the store, which keeps them per API key.

With `truncation: "auto"`, history that does not fit the context window with max_output_tokens is
dropped oldest turns first (a turn: a user message and what follows it up to the next one), a block
of about half the window at a time, at cut points that stay put as the conversation grows, so the
kept history stays a cached prefix for many turns (ResponsesAPI._fit); system messages and the last
turn are never dropped. Turns of one conversation run one at a time.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import json
import time
import uuid
import weakref
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable, TypeVar

from aiohttp import web
from prometheus_client import CollectorRegistry, Histogram

from pyengine.metrics import LABELS
from server import gateway
from server.openai_api import API_KEY, RATE_KEY, ChatWire, OpenAIServing, _Job, read_json
from server.protocol import APIError, ChatRequest, get_bool, get_int, get_param, get_str, invalid, parse_chat
from server.store import ConversationStore, StoreUnavailable, work_clock

T = TypeVar("T")
# (request, body, rate key) -> the model that serves it: ModelRegistry.choose (by name, or routed)
ChooseModel = Callable[[web.Request, dict, str], Awaitable[OpenAIServing]]
ROLES = {"user", "assistant", "system", "developer"}
TEXT_PARTS = {"input_text", "output_text", "text"}
STORE_BUCKETS = (0.00025, 0.0005, 0.001, 0.0015, 0.002, 0.003, 0.005, 0.01, 0.025, 0.1, 1.0)
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "seed", "stop", "presence_penalty",
                   "frequency_penalty", "repetition_penalty", "min_tokens", "ignore_eos", "priority")
UNSUPPORTED = ("background", "include", "prompt", "reasoning", "top_logprobs")
MAX_ITEMS = 20  # items per conversations create / add-items call, as OpenAI
MAX_METADATA = 16


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


# ---------------------------------------------------------------- parsing (pure)
@dataclass
class ResponseRequest:
    model: str | None
    input: list[dict]  # message items, ids assigned
    instructions: str | None
    previous_response_id: str | None
    conversation_id: str | None
    store: bool
    stream: bool
    truncation: str  # "auto" | "disabled"
    max_output_tokens: int | None
    metadata: dict[str, str]
    user: str | None
    chat: ChatRequest  # sampling fields, validated as a chat request with the input as its messages
    text_format: dict = field(default_factory=lambda: {"type": "text"})


def parse_items(v: Any, param: str, max_items: int | None = None) -> list[dict]:
    """A string (one user message) or a list of message items -> stored item dicts, each with an id;
    at most max_items of them where given (checked before any item is parsed)."""
    if isinstance(v, str):
        v = [{"role": "user", "content": v}]
    if not isinstance(v, list) or not v:
        raise invalid(param, f"'{param}' must be a string or a non-empty list of items")
    if max_items is not None and len(v) > max_items:
        raise invalid(param, f"'{param}' may hold at most {max_items} items, got {len(v)}")
    return [_item(it, f"{param}[{i}]") for i, it in enumerate(v)]


def _item(it: Any, p: str) -> dict:
    if not isinstance(it, dict):
        raise invalid(p, f"'{p}' must be an item object with 'role' and 'content'")
    kind = it.get("type", "message")
    if kind != "message":
        raise APIError(400, f"'{p}' is a {kind!r} item; this server takes message items only",
                       param=p, code="unsupported_parameter")
    role = it.get("role")
    if role not in ROLES:
        raise invalid(f"{p}.role", f"'{p}.role' must be one of {sorted(ROLES)}, got {role!r}")
    content = it.get("content")
    if isinstance(content, str):
        content = [{"type": "input_text", "text": content}]
    if not isinstance(content, list):
        raise invalid(f"{p}.content", f"'{p}.content' must be a string or a list of text parts")
    text_type = "output_text" if role == "assistant" else "input_text"
    parts = []
    for j, part in enumerate(content):
        q = f"{p}.content[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if isinstance(kind, str) and kind not in TEXT_PARTS:
            raise APIError(400, f"'{q}' is a {kind!r} part; this model reads only text parts", param=q,
                           code="unsupported_parameter")
        if kind is None or not isinstance(part.get("text"), str):
            raise invalid(q, f"'{q}' must be a text part {{\"type\": \"{text_type}\", \"text\": ...}}")
        parts.append({"type": text_type, "text": part["text"], **({"annotations": []} if role == "assistant" else {})})
    # a fresh id even when the item has one: a client re-sending a previous output must not clash with it
    return {"id": _new_id("msg"), "type": "message", "role": role, "content": parts, "status": "completed"}


def to_messages(items: list[dict]) -> list[dict]:
    """Stored items -> chat messages for the template (developer is a system message)."""
    return [{"role": "system" if it["role"] == "developer" else it["role"],
             "content": "".join(part["text"] for part in it["content"])} for it in items]


def parse_response(body: dict) -> ResponseRequest:
    for name in UNSUPPORTED:
        if body.get(name):
            raise APIError(400, f"'{name}' is not supported by this server", param=name, code="unsupported_parameter")
    if body.get("tools"):
        raise APIError(400, "'tools' is not supported on /v1/responses; use /v1/chat/completions", param="tools",
                       code="unsupported_parameter")
    if "input" not in body:
        raise invalid("input", "'input' is required: a string or a list of items")
    items = parse_items(body["input"], "input")
    previous = get_str(body, "previous_response_id")
    conversation = body.get("conversation")
    if isinstance(conversation, dict):
        conversation = conversation.get("id")
    if conversation is not None and not isinstance(conversation, str):
        raise invalid("conversation", "'conversation' must be a conversation id or {\"id\": ...}")
    if conversation is not None and previous is not None:
        raise invalid("conversation", "use either 'conversation' or 'previous_response_id', not both")
    store = get_bool(body, "store", True)
    if conversation is not None and not store:
        raise invalid("store", "'store' must be true with 'conversation': its turns are stored in it")
    truncation = get_str(body, "truncation", "disabled")
    if truncation not in ("auto", "disabled"):
        raise invalid("truncation", f"'truncation' must be 'auto' or 'disabled', got {truncation!r}")
    max_output = get_param(body, "max_output_tokens", limit="max_tokens")
    metadata = body.get("metadata") or {}
    if not isinstance(metadata, dict) or len(metadata) > MAX_METADATA or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise invalid("metadata", f"'metadata' must be an object of at most {MAX_METADATA} string values")
    chat_body = {k: body[k] for k in SAMPLING_FIELDS if k in body}
    text_format = _text_format(body.get("text"))
    if text_format["type"] != "text":
        chat_body["response_format"] = (
            {"type": "json_object"} if text_format["type"] == "json_object" else
            {"type": "json_schema", "json_schema": {"name": text_format.get("name"), "schema": text_format.get("schema")}})
    try:
        chat = parse_chat({**chat_body, "messages": to_messages(items), "max_tokens": max_output}, 1)
    except APIError as e:  # the chat request's names for what this request calls otherwise
        e.param = _RESPONSES_PARAMS.get(e.param, e.param)
        raise
    if chat.structured_param == "response_format":  # grammar errors name the field that was sent
        chat = dataclasses.replace(chat, structured_param="text.format")
    return ResponseRequest(
        model=get_str(body, "model"), input=items, instructions=get_str(body, "instructions"),
        previous_response_id=previous, conversation_id=conversation, store=store,
        stream=bool(get_bool(body, "stream", False)), truncation=truncation, max_output_tokens=max_output,
        metadata=metadata, user=get_str(body, "user"), chat=chat, text_format=text_format)


_RESPONSES_PARAMS = {"response_format": "text.format", "max_tokens": "max_output_tokens", "messages": "input"}


def _text_format(text: Any) -> dict:
    fmt = text.get("format") if isinstance(text, dict) else None
    if text is None or fmt is None:
        return {"type": "text"}
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise invalid("text.format", "'text.format' must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
                      "{\"type\": \"json_schema\", \"name\": ..., \"schema\": {...}}")
    return fmt


def turns(messages: list[dict]) -> list[list[int]]:
    """Indices of the non-system messages, grouped in turns: each user message starts one."""
    out: list[list[int]] = []
    for i, m in enumerate(messages):
        if m["role"] == "system":
            continue
        if m["role"] == "user" or not out:
            out.append([])
        out[-1].append(i)
    return out


def cut_points(sizes: list[int], block: int) -> list[int]:
    """Where "auto" truncation may cut a history of turns of these token sizes (the number of turns
    dropped), in order: after each run of turns that adds up to at least `block` tokens, counted
    from the first turn. They depend only on the turns before them, so a growing conversation
    keeps them; the last turn is never cut."""
    cuts, run = [], 0
    for i, size in enumerate(sizes[:-1]):
        run += size
        if run >= max(block, 1):
            cuts.append(i + 1)
            run = 0
    return cuts


def _text(message: dict) -> str:
    content = message.get("content")
    return content if isinstance(content, str) else json.dumps(content) if content else ""


def _turn_sizes(tokenizer: Any, messages: list[dict], groups: list[list[int]]) -> list[int]:
    """Tokens of each turn's text (without the template's markup: an estimate that is the same
    every time the turn is counted)."""
    return [len(tokenizer.encode("\n".join(_text(messages[i]) for i in g), False)) for g in groups]


# ---------------------------------------------------------------- wire format
class ResponsesWire(ChatWire):
    """Writes a generation job as a Response object, or as the Responses API's stream events. Stores
    the finished response when asked to."""

    def __init__(self, serving: OpenAIServing, store: ConversationStore, timer: StoreTimer, owner: str,
                 req: ResponseRequest, response_id: str, dropped: int | None) -> None:
        super().__init__(serving, req.stream)
        self.store, self.timer, self.owner, self.req = store, timer, owner, req
        self.response_id, self.dropped = response_id, dropped
        self.created = int(time.time())
        self.item_id = _new_id("msg")
        self.seq = 0

    def opening(self, job: _Job) -> bytes:
        item = {"id": self.item_id, "type": "message", "role": "assistant", "status": "in_progress", "content": []}
        started = self._response(job, "in_progress", [])
        return (self._event("response.created", response=started)
                + self._event("response.in_progress", response=started)
                + self._event("response.output_item.added", output_index=0, item=item)
                + self._event("response.content_part.added", item_id=self.item_id, output_index=0,
                              content_index=0, part=_text_part("")))

    def events(self, job: _Job, p: int, out: Any) -> bytes:
        self.serving._absorb(job, p, out)  # job.req.stream is False: folds the delta in, makes no chunks
        if not self.stream:
            return b""
        return b"".join(self._event("response.output_text.delta", item_id=self.item_id, output_index=0,
                                    content_index=0, delta=o.text, logprobs=[]) for o in out.outputs if o.text)

    async def closing(self, job: _Job) -> bytes:
        try:
            response = await self.body(job)
        except APIError as e:
            return self.error(e)
        item = response["output"][0]
        part = item["content"][0]
        done = "response.completed" if response["status"] == "completed" else "response.incomplete"
        return (self._event("response.output_text.done", item_id=self.item_id, output_index=0, content_index=0,
                            text=part["text"], logprobs=[])
                + self._event("response.content_part.done", item_id=self.item_id, output_index=0,
                              content_index=0, part=part)
                + self._event("response.output_item.done", output_index=0, item=item)
                + self._event(done, response=response))

    def error(self, err: APIError) -> bytes:
        return self._event("error", code=err.code, message=err.message, param=err.param)

    async def body(self, job: _Job) -> dict:
        """The finished response, stored first when `store` (503 when the store fails)."""
        choice = job.choices.get(0)
        text = "".join(choice.text) if choice else ""
        complete = choice is None or choice.finish_reason != "length"
        item = {"id": self.item_id, "type": "message", "role": "assistant",
                "status": "completed" if complete else "incomplete", "content": [_text_part(text)]}
        response = self._response(job, "completed" if complete else "incomplete", [item])
        if self.req.store:
            await self.timer(self.store.put_response(self.owner, response, self.req.input))
        return response

    def _response(self, job: _Job, status: str, output: list[dict]) -> dict:
        req = self.req
        u = job.usage
        r = {"id": self.response_id, "object": "response", "created_at": self.created, "status": status,
             "error": None,
             "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
             "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
             "metadata": req.metadata, "model": self.serving.model, "output": output,
             "parallel_tool_calls": False, "previous_response_id": req.previous_response_id,
             "conversation": {"id": req.conversation_id} if req.conversation_id else None,
             "store": req.store, "temperature": req.chat.sampling["temperature"],
             "top_p": req.chat.sampling["top_p"], "text": {"format": req.text_format}, "tool_choice": "none",
             "tools": [], "truncation": req.truncation, "user": req.user,
             "usage": None if status == "in_progress" else {
                 "input_tokens": u["prompt_tokens"],
                 "input_tokens_details": {"cached_tokens": u["prompt_tokens_details"]["cached_tokens"]},
                 "output_tokens": u["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
                 "total_tokens": u["total_tokens"]}}
        if self.dropped is not None:  # truncation "auto": how many history items did not fit
            r["truncation_details"] = {"dropped_items": self.dropped}
        return r

    def _event(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(data)}\n\n".encode()


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


async def _stored(call: Awaitable[T]) -> T:
    """Await a store call; a store that cannot serve now is a 503 for this request only."""
    try:
        return await call
    except StoreUnavailable as e:
        raise APIError(503, f"The conversation store is unavailable ({e}); nothing was changed. Retry later.",
                       type="server_error", code="store_unavailable", headers={"Retry-After": "1"}) from None


class StoreTimer:
    """Awaits a generation request's store calls (as _stored) and adds up the time they take: `total`
    as the request waits for them, `work[0]` as the store works on them (no thread hops)."""

    def __init__(self) -> None:
        self.total = 0.0
        self.work = [0.0]

    async def __call__(self, call: Awaitable[T]) -> T:
        start = time.perf_counter()
        token = work_clock.set(self.work)
        try:
            return await _stored(call)
        finally:
            work_clock.reset(token)
            self.total += time.perf_counter() - start


def _not_found(kind: str, ident: str, param: str | None = None) -> APIError:
    return APIError(404, f"{kind} with id '{ident}' not found.", param=param, code="not_found")


# ---------------------------------------------------------------- handlers
class ResponsesAPI:
    """The /v1/responses and /v1/conversations handlers. `choose` picks the model that serves a
    request (the app's model registry: by name, or by the routing rules); `limiter` is the app's
    shared rate limiter."""

    def __init__(self, store: ConversationStore, choose: ChooseModel, limiter: gateway.RateLimiter,
                 registry: CollectorRegistry, *, read_timeout: float = 30.0) -> None:
        self.store = store
        self.choose = choose
        self.limiter = limiter
        self.read_timeout = read_timeout
        self._locks: weakref.WeakValueDictionary[str, asyncio.Lock] = weakref.WeakValueDictionary()
        self.store_wait = Histogram("pyengine_server:response_store_time_seconds",
                                    "Time a /v1/responses request waited for the store (history read + write)",
                                    LABELS, buckets=STORE_BUCKETS, registry=registry)
        self.store_work = Histogram("pyengine_server:response_store_work_seconds",
                                    "Time the store worked for a /v1/responses request (on its thread: SQLite, "
                                    "JSON), without the thread hops", LABELS, buckets=STORE_BUCKETS, registry=registry)

    def add_routes(self, router: web.UrlDispatcher) -> None:
        router.add_post("/v1/responses", self.create)
        router.add_get("/v1/responses/{id}", self.retrieve)
        router.add_delete("/v1/responses/{id}", self.delete)
        router.add_get("/v1/responses/{id}/input_items", self.input_items)
        router.add_post("/v1/conversations", self.create_conversation)
        router.add_get("/v1/conversations/{id}", self.retrieve_conversation)
        router.add_post("/v1/conversations/{id}", self.update_conversation)
        router.add_delete("/v1/conversations/{id}", self.delete_conversation)
        router.add_get("/v1/conversations/{id}/items", self.list_items)
        router.add_post("/v1/conversations/{id}/items", self.add_items)

    # ---- responses ---------------------------------------------------------------------------
    async def create(self, request: web.Request) -> web.StreamResponse:
        key = request[RATE_KEY]
        with self.limiter.charged(key):
            body = await read_json(request, self.read_timeout)
            req = parse_response(body)
            serving = await self.choose(request, body, key)
            timer = StoreTimer()
            owner = _owner(request)
            async with self._turn(req.conversation_id):
                history = await self._history(owner, req, timer)
                messages = to_messages(history + req.input)
                if req.instructions:
                    messages.insert(0, {"role": "system", "content": req.instructions})
                ids, dropped = await self._fit(serving, messages, req)
                chat = dataclasses.replace(req.chat, messages=messages)
                rid = _new_id("resp")
                wire = ResponsesWire(serving, self.store, timer, owner, req, rid,
                                     dropped if req.truncation == "auto" else None)
                try:
                    return await serving._serve(request, key, "chat", chat, [ids], wire, rid, prompt_param="input")
                finally:
                    self.store_wait.labels(serving.model).observe(timer.total)
                    self.store_work.labels(serving.model).observe(timer.work[0])

    async def _history(self, owner: str, req: ResponseRequest, timer: StoreTimer) -> list[dict]:
        if req.previous_response_id is not None:
            items = await timer(self.store.response_history(owner, req.previous_response_id))
            if items is None:
                raise _not_found("Previous response", req.previous_response_id, "previous_response_id")
            return items
        if req.conversation_id is not None:
            items = await timer(self.store.conversation_items(owner, req.conversation_id))
            if items is None:
                raise _not_found("Conversation", req.conversation_id, "conversation")
            return items
        return []

    async def _fit(self, serving: OpenAIServing, messages: list[dict], req: ResponseRequest) -> tuple[list[int], int]:
        """The prompt's token ids and how many items were dropped to fit the context window: none
        under truncation "disabled" (the context check answers 400). Under "auto" the history is
        cut at one of fixed cut points (cut_points: blocks of turns of about half the prompt budget,
        counted from the conversation's start), the first whose rest fits. The cut points do not
        move as the conversation grows, so the kept history, and with it the prefix cache, stays
        the same turn after turn until the rest outgrows the window again; then a whole block goes.
        Instructions (system messages) and the last turn are never dropped."""
        max_len = serving.engine.max_model_len

        def fits(ids: list[int]) -> bool:
            try:
                gateway.check_context(len(ids), req.max_output_tokens, max_len)
                return True
            except APIError:
                return False

        def without(n: int) -> list[dict]:
            gone = {i for turn in groups[:n] for i in turn}
            return [m for i, m in enumerate(messages) if i not in gone]

        ids = await serving._chat_ids(messages, True)
        groups = turns(messages)
        if req.truncation == "disabled" or fits(ids) or len(groups) < 2:
            return ids, 0
        budget = max_len - (req.max_output_tokens or 1)  # prompt tokens that fit
        sizes = await serving._off_loop(sum(len(_text(messages[i])) for g in groups for i in g), _turn_sizes,
                                        serving.tokenizer, messages, groups)
        for cut in cut_points(sizes, budget // 2):
            if sum(sizes[cut:]) > budget:  # (an estimate: the template adds a few tokens per message)
                continue
            cand = await serving._chat_ids(without(cut), True)
            if fits(cand):
                return cand, sum(len(t) for t in groups[:cut])
        # no cut point fits (the last block is most of the window): the fewest oldest turns that do
        lo, hi = 1, len(groups) - 1  # the last turn holds the new input: never dropped
        best = (await serving._chat_ids(without(hi), True), hi)
        while lo < hi:
            mid = (lo + hi) // 2
            cand = await serving._chat_ids(without(mid), True)
            if fits(cand):
                best, hi = (cand, mid), mid
            else:
                lo = mid + 1
        return best[0], sum(len(t) for t in groups[:best[1]])

    @contextlib.asynccontextmanager
    async def _turn(self, conversation_id: str | None) -> AsyncIterator[None]:
        """One turn of a conversation at a time (read history .. store the answer), in this process."""
        if conversation_id is None:
            yield
            return
        lock = self._locks.setdefault(conversation_id, asyncio.Lock())
        async with lock:
            yield

    async def retrieve(self, request: web.Request) -> web.Response:
        rid = request.match_info["id"]
        r = await _stored(self.store.get_response(_owner(request), rid))
        if r is None:
            raise _not_found("Response", rid)
        return web.json_response(r)

    async def delete(self, request: web.Request) -> web.Response:
        rid = request.match_info["id"]
        if not await _stored(self.store.delete_response(_owner(request), rid)):
            raise _not_found("Response", rid)
        return web.json_response({"id": rid, "object": "response.deleted", "deleted": True})

    async def input_items(self, request: web.Request) -> web.Response:
        rid = request.match_info["id"]
        items = await _stored(self.store.response_input_items(_owner(request), rid))
        if items is None:
            raise _not_found("Response", rid)
        after, limit, descending = _page(request)
        if descending:
            items = items[::-1]
        if after is not None:
            ids = [it["id"] for it in items]
            items = items[ids.index(after) + 1:] if after in ids else []
        return _list(items[:limit + 1], limit)

    # ---- conversations -----------------------------------------------------------------------
    async def create_conversation(self, request: web.Request) -> web.Response:
        body = await read_json(request, self.read_timeout)
        raw = body.get("items")
        items = parse_items(raw, "items", MAX_ITEMS) if raw else []
        metadata = _metadata(body.get("metadata"))
        conv = {"id": _new_id("conv"), "object": "conversation", "created_at": int(time.time()), "metadata": metadata}
        await _stored(self.store.create_conversation(_owner(request), conv, items))
        return web.json_response(conv)

    async def update_conversation(self, request: web.Request) -> web.Response:
        """POST /v1/conversations/{id}: replace its metadata (OpenAI's "update a conversation")."""
        cid = request.match_info["id"]
        body = await read_json(request, self.read_timeout)
        if "metadata" not in body:
            raise invalid("metadata", "'metadata' is required: the conversation's new metadata")
        metadata = _metadata(body["metadata"])
        async with self._turn(cid):
            conv = await _stored(self.store.update_conversation(_owner(request), cid, metadata))
        if conv is None:
            raise _not_found("Conversation", cid)
        return web.json_response(conv)

    async def retrieve_conversation(self, request: web.Request) -> web.Response:
        cid = request.match_info["id"]
        conv = await _stored(self.store.get_conversation(_owner(request), cid))
        if conv is None:
            raise _not_found("Conversation", cid)
        return web.json_response(conv)

    async def delete_conversation(self, request: web.Request) -> web.Response:
        cid = request.match_info["id"]
        async with self._turn(cid):
            if not await _stored(self.store.delete_conversation(_owner(request), cid)):
                raise _not_found("Conversation", cid)
        return web.json_response({"id": cid, "object": "conversation.deleted", "deleted": True})

    async def list_items(self, request: web.Request) -> web.Response:
        cid = request.match_info["id"]
        after, limit, descending = _page(request)
        items = await _stored(self.store.conversation_items(_owner(request), cid, after=after, limit=limit + 1,
                                                            descending=descending))
        if items is None:
            raise _not_found("Conversation", cid)
        return _list(items, limit)

    async def add_items(self, request: web.Request) -> web.Response:
        cid = request.match_info["id"]
        body = await read_json(request, self.read_timeout)
        items = parse_items(body.get("items"), "items", MAX_ITEMS)
        async with self._turn(cid):
            if not await _stored(self.store.add_items(_owner(request), cid, items)):
                raise _not_found("Conversation", cid)
        return _list(items, len(items))


def _metadata(value) -> dict[str, str]:
    """A conversation's metadata as OpenAI takes it: an object of at most MAX_METADATA string values
    (null: none); else a 400 naming 'metadata'."""
    metadata = value or {}
    if not isinstance(metadata, dict) or len(metadata) > MAX_METADATA or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise invalid("metadata", f"'metadata' must be an object of at most {MAX_METADATA} string values")
    return metadata


def _owner(request: web.Request) -> str:
    """Who owns what a request stores: a digest of its API key (the key itself is never written).
    Without authentication every caller is the same owner."""
    return hashlib.sha256(request[API_KEY].encode("utf-8", "surrogateescape")).hexdigest()


def _page(request: web.Request) -> tuple[str | None, int, bool]:
    """?after=ID&limit=N&order=asc|desc (OpenAI's defaults: 20, desc)."""
    q = request.query
    try:
        limit = get_int({"limit": int(q["limit"])} if "limit" in q else {}, "limit", 20, lo=1, hi=100)
    except ValueError:
        raise invalid("limit", f"'limit' must be an integer, got {q['limit']!r}") from None
    order = q.get("order", "desc")
    if order not in ("asc", "desc"):
        raise invalid("order", f"'order' must be 'asc' or 'desc', got {order!r}")
    return q.get("after"), limit, order == "desc"


def _list(items: list[dict], limit: int) -> web.Response:
    """An OpenAI list page from up to limit + 1 items (the extra one says there are more)."""
    page = items[:limit]
    return web.json_response({"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                              "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit})
