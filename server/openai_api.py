"""OpenAI-compatible endpoints over an AsyncLLM-like engine, with SSE streaming.

Request path: auth (middleware) -> request rate limit -> read (408 when too slow) -> the model (by
name, or routed: server/models.py) -> parse + validate -> chat template + tokenize (off the event loop when long) -> context budget -> SamplingParams ->
token rate limit -> admission (bounded queue) -> engine.generate(). Every exit before the request
finished (client gone, timeout, error) aborts it in the engine so its KV blocks return to the pool.
A request refused on the way (an error response other than a timeout) is not charged to the key's
rate limits.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from aiohttp import web

from pyengine.sampling_params import SamplingParams
from server import gateway, tools
from server.connections import read_timeout_error
from server.protocol import (APIError, ChatRequest, CompletionRequest, GenerationRequest, get_bool, get_str,
                             parse_chat, parse_completion, parse_detokenize, parse_json)

log = logging.getLogger("server")
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
               "X-Accel-Buffering": "no"}
RATE_KEY = web.RequestKey("rate_key", str)  # the caller's API key, or its address without auth
API_KEY = web.RequestKey("api_key", str)  # the caller's API key; "" without auth
JOB_KEY = web.RequestKey("job", object)  # the generation request's _Job, for the access / request log


@dataclass
class _Choice:
    """Accumulated state of one output choice."""

    text: list[str] = field(default_factory=list)
    num_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[Any] = field(default_factory=list)
    logprob_chars: int = 0  # text length the streamed logprob tokens covered so far (text_offset)
    role_sent: bool = False
    tools: tools.ToolStream | None = None  # chat with tools: reads calls out of the text

    def finish(self) -> str | None:
        """OpenAI's finish_reason: "tool_calls" when the choice ended normally with calls."""
        if self.finish_reason == "stop" and self.tools is not None and self.tools.message()[1]:
            return "tool_calls"
        return self.finish_reason


@dataclass
class _Job:
    """One HTTP generation request after the gateway: one engine request per prompt."""

    request_id: str
    kind: str  # "chat" | "completion"
    req: GenerationRequest
    prompt_ids: list[list[int]]
    params: list[Any]
    created: int = field(default_factory=lambda: int(time.time()))
    choices: dict[int, _Choice] = field(default_factory=dict)
    prompt_logprobs: dict[int, list[dict]] = field(default_factory=dict)  # echo + logprobs, per prompt
    metrics: dict[int, Any] = field(default_factory=dict)  # the engine's latest RequestMetrics, per prompt
    # perf_counter when the first output text reached the server: what a streaming client sees as
    # its first token (the detokenizer may hold a token back, e.g. an incomplete UTF-8 sequence)
    first_token_time: float | None = None

    @property
    def usage(self) -> dict:
        p = sum(len(x) for x in self.prompt_ids)
        c = sum(ch.num_tokens for ch in self.choices.values())
        cached = sum(m.num_cached_tokens for m in self.metrics.values())
        details = {"cached_tokens": cached}
        disk = sum(m.num_disk_cached_tokens for m in self.metrics.values())
        if disk:  # of cached_tokens, those the KV disk tier served (the rest came from the pool)
            details["disk_cached_tokens"] = disk
        host = sum(m.num_host_cached_tokens for m in self.metrics.values())
        if host:  # of cached_tokens, those the KV host-memory tier served
            details["host_cached_tokens"] = host
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c, "prompt_tokens_details": details}


class ChatWire:
    """How a job's output is written to the client: chat.completion / text_completion objects, or their
    chunks ending in `data: [DONE]`. `_respond` only calls these methods; the Responses API overrides
    them with its own objects and events (server/responses.py's ResponsesWire)."""

    def __init__(self, serving: "OpenAIServing", stream: bool) -> None:
        self.serving, self.stream = serving, stream

    def opening(self, job: _Job) -> bytes:
        """Written right after the stream's headers."""
        return b""

    def events(self, job: _Job, p: int, out: Any) -> bytes:
        """Fold one engine delta into the job; return what goes on the stream for it."""
        return b"".join(_sse(e) for e in self.serving._absorb(job, p, out))

    async def closing(self, job: _Job) -> bytes:
        """The end of a stream that finished."""
        tail = _sse(self.serving._chunk(job, [], usage=job.usage)) if job.req.include_usage else b""
        return tail + b"data: [DONE]\n\n"

    def error(self, err: APIError) -> bytes:
        """The end of a stream that failed after its headers were sent."""
        return _sse(err.body()) + b"data: [DONE]\n\n"

    async def body(self, job: _Job) -> dict:
        """The whole answer, when not streaming."""
        return self.serving._final_body(job)


class OpenAIServing:
    def __init__(self, engine: Any, served_model_name: str, gw: gateway.GatewayConfig, *,
                 limiter: gateway.RateLimiter, max_n: int, long_prompt_chars: int = 4096,
                 tool_call_parser: str | None = None) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.model = served_model_name
        self.gw = gw
        self.max_n = max_n
        self.long_prompt_chars = long_prompt_chars
        self.limiter = limiter  # the app's, shared by all models: a key's limits hold across them
        self.admission = gateway.AdmissionControl(gw.max_queue)
        self.created = int(time.time())
        self.tasks: set[asyncio.Task] = set()  # handlers of admitted generation requests
        self.tool_parser = tools.choose_parser(tool_call_parser, getattr(self.tokenizer, "chat_template", None))

    async def drain(self, grace: float) -> None:
        """Refuse new requests; give in-flight ones `grace` seconds, then end them cleanly."""
        self.admission.draining = True
        deadline = time.monotonic() + grace
        while self.tasks and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for t in list(self.tasks):
            t.cancel()  # _respond answers 503 / ends the stream with an error event
        while self.tasks and time.monotonic() < deadline + 5:
            await asyncio.sleep(0.01)

    # ------------------------------------------------------------ endpoints
    # Each takes the caller's key and the request's JSON body: the app reads it, charges the key and
    # picks the model (server/models.py) first.
    def model_card(self) -> dict:
        """This model's /v1/models entry."""
        return {"id": self.model, "object": "model", "created": self.created, "owned_by": "pyengine",
                "root": self.engine.model_name, "max_model_len": self.engine.max_model_len}

    async def tokenize(self, request: web.Request, key: str, body: dict) -> web.Response:
        if "messages" in body:
            chat = parse_chat({"messages": body["messages"]}, 1)
            ids = await self._chat_ids(chat.messages, get_bool(body, "add_generation_prompt", True))
        else:
            prompt = get_str(body, "prompt") if "prompt" in body else get_str(body, "content")  # vLLM / llama.cpp
            if prompt is None:
                raise APIError(400, "'prompt' (a string) or 'messages' is required", param="prompt")
            add = get_bool(body, "add_special_tokens", True)
            ids = await self._off_loop(len(prompt), self.tokenizer.encode, prompt, add)
        return web.json_response({"tokens": ids, "count": len(ids),
                                  "max_model_len": self.engine.max_model_len})

    def tokenizer_info(self) -> dict:
        """The tokenizer's settings (tokenizer_config.json's names; pyengine.tokenizer.Tokenizer.info)."""
        info = getattr(self.tokenizer, "info", None)
        base = info(self.engine.max_model_len) if info is not None else {
            "chat_template": getattr(self.tokenizer, "chat_template", None)}
        return {**base, "model": self.model}

    async def detokenize(self, request: web.Request, key: str, body: dict) -> web.Response:
        ids = parse_detokenize(body, self.tokenizer.vocab_size)
        text = await self._off_loop(len(ids), self.tokenizer.decode, ids)
        return web.json_response({"prompt": text, "content": text})  # vLLM's and llama.cpp's names

    async def chat(self, request: web.Request, key: str, body: dict) -> web.StreamResponse:
        req = parse_chat(body, self.max_n)
        ids = await self._chat_ids(req.messages, True, req.tools)
        return await self._serve(request, key, "chat", req, [ids])

    async def completions(self, request: web.Request, key: str, body: dict) -> web.StreamResponse:
        req = parse_completion(body, self.max_n, self.tokenizer.vocab_size)
        return await self._serve(request, key, "completion", req, await self._prompt_ids(req))

    async def prompt_tokens(self, body: dict) -> int:
        """Tokens of a request's prompt under this model (the longest, for several prompts): what
        routing thresholds compare. Chat `messages`, completion `prompt`, or Responses `input` text."""
        if "messages" in body:
            req = parse_chat(body, self.max_n)
            return len(await self._chat_ids(req.messages, True, req.tools))
        if "prompt" in body:
            req = parse_completion(body, self.max_n, self.tokenizer.vocab_size)
            return max(map(len, await self._prompt_ids(req)))
        text = _input_text(body.get("input"))
        return len(await self._off_loop(len(text), self.tokenizer.encode, text, True))

    async def _prompt_ids(self, req: CompletionRequest) -> list[list[int]]:
        prompt_ids = []
        for p in req.prompts:
            ids = p if isinstance(p, list) else await self._off_loop(len(p), self.tokenizer.encode, p, True)
            prompt_ids.append(list(ids))
        return prompt_ids

    async def _serve(self, request: web.Request, key: str, kind: str, req: GenerationRequest,
                     prompt_ids: list[list[int]], wire: ChatWire | None = None,
                     request_id: str | None = None, prompt_param: str | None = None) -> web.StreamResponse:
        """Context budget, sampling parameters, token rate limit, admission, then generation written
        out by `wire` (default: chat / completions objects) under `request_id` (default: a new id).
        prompt_param: the field that held the prompt, for the context error (default: messages or prompt)."""
        max_len = self.engine.max_model_len
        prompt_param = prompt_param or ("messages" if kind == "chat" else "prompt")
        params, cost = [], 0
        for ids in prompt_ids:
            if not ids:
                raise APIError(400, "The prompt is empty (0 tokens).", param="prompt")
            max_tokens = gateway.check_context(len(ids), req.max_tokens, max_len, prompt_param)
            try:
                echo_lps = isinstance(req, CompletionRequest) and req.echo and req.num_logprobs is not None
                params.append(SamplingParams(**req.sampling, max_tokens=max_tokens, logprobs=req.num_logprobs,
                                              prompt_logprobs=req.num_logprobs if echo_lps else None))
            except (ValueError, TypeError) as e:  # SamplingParams names the field first
                field_name = str(e).split(" ", 1)[0]
                raise APIError(400, str(e), param=field_name if field_name in req.sampling else None,
                               code="invalid_value") from None
            try:  # the vocabulary and the grammar: the engine compiles it now (cached for the request)
                await self.engine.check_params(params[-1])
            except ValueError as e:
                first = str(e).split(" ", 1)[0]
                param = first if first in req.sampling and first != "structured_outputs" else req.structured_param
                raise APIError(400, str(e), param=param, code="invalid_value") from None
            cost += len(ids) + max_tokens * req.n
        self.limiter.check_tokens(key, cost)
        prefix = "chatcmpl" if kind == "chat" else "cmpl"
        job = _Job(request_id or f"{prefix}-{uuid.uuid4().hex}", kind, req, prompt_ids, params)
        request[JOB_KEY] = job
        refused = False
        try:
            self.admission.admit()
            task = asyncio.current_task()
            self.tasks.add(task)
            try:
                return await self._respond(request, job, wire or ChatWire(self, req.stream))
            finally:
                self.tasks.discard(task)
                self.admission.finished()
        except APIError as e:
            refused = gateway.refused(e)
            raise
        finally:  # tokens not spent go back: the unused part of max_tokens, or all of a refused request
            spent = 0 if refused else job.usage["prompt_tokens"] + job.usage["completion_tokens"]
            self.limiter.refund_tokens(key, cost - spent)

    async def _respond(self, request: web.Request, job: _Job, wire: ChatWire) -> web.StreamResponse:
        stream = _merged(self.engine, job)
        timeout = self.gw.request_timeout
        resp: web.StreamResponse | None = None
        waiting = True
        try:
            async with asyncio.timeout(timeout):
                async for p, out in stream:
                    head = b""
                    if waiting:
                        waiting = False
                        self.admission.started()
                        if wire.stream:
                            resp = web.StreamResponse(headers=SSE_HEADERS)
                            await resp.prepare(request)
                            head = wire.opening(job)
                    data = head + wire.events(job, p, out)
                    if resp is not None and data:
                        await resp.write(data)
        except TimeoutError:
            if resp is None:
                raise gateway.timeout_error(timeout) from None
            await resp.write(wire.error(gateway.timeout_error(timeout)))
            return resp
        except ValueError as e:  # the engine refuses before queueing (e.g. prompt beyond the KV pool)
            if resp is None:
                raise APIError(400, str(e)) from None
            await self._stream_error(resp, e, wire)
            return resp
        except ConnectionResetError:  # the client left: the finally below aborts
            raise
        except asyncio.CancelledError:
            if not self.admission.draining:  # the client left
                raise
            # drain(): the shutdown grace period is over. Tell the client instead of cutting the stream.
            asyncio.current_task().uncancel()
            err = APIError(503, "The server shut down before the request finished.", type="server_error",
                           code="server_shutting_down")
            if resp is None:
                raise err from None
            await resp.write(wire.error(err))
            await resp.write_eof()
            return resp
        except Exception as e:
            if resp is None:
                raise
            await self._stream_error(resp, e, wire)
            return resp
        finally:
            if waiting:
                self.admission.started()
            await stream.aclose()
        if resp is None:
            return web.json_response(await wire.body(job))
        await resp.write(await wire.closing(job))
        await resp.write_eof()
        return resp

    async def _stream_error(self, resp: web.StreamResponse, e: Exception, wire: ChatWire) -> None:
        """Headers are gone already: report the failure as a last event, then end the stream."""
        log.exception("stream failed", exc_info=e)
        await resp.write(wire.error(APIError(500, f"The request failed while streaming: {e}", type="server_error")))

    # ------------------------------------------------------------ response building
    def _absorb(self, job: _Job, p: int, out: Any) -> list[dict]:
        """Fold one engine delta into the job's choices; return the stream chunks it makes."""
        events = []
        if out.metrics is not None:
            job.metrics[p] = out.metrics
        if job.first_token_time is None and any(o.text for o in out.outputs):
            job.first_token_time = time.perf_counter()
        if out.prompt_logprobs is not None:
            job.prompt_logprobs[p] = self._logprobs(job.kind, out.prompt_logprobs, job.prompt_ids[p])
        for o in out.outputs:
            idx = p * job.req.n + o.index
            text = o.text or ""
            echoed = []  # prompt logprob entries that go before this choice's first tokens
            if idx not in job.choices and isinstance(job.req, CompletionRequest) and job.req.echo:
                prompt = job.req.prompts[p]
                text = (prompt if isinstance(prompt, str) else self.tokenizer.decode(prompt)) + text
                echoed = job.prompt_logprobs.get(p, [])
            ch = job.choices.get(idx)
            if ch is None:
                ch = job.choices[idx] = _Choice()
                spec = job.req.tools if isinstance(job.req, ChatRequest) else None
                if spec is not None and spec.choice != "none":
                    ch.tools = tools.ToolStream(tools.CallScanner(spec, self.tool_parser))
            if ch.finish_reason is not None:  # a finished choice has nothing more to say
                continue
            ids = list(o.token_ids or [])
            finish, stop_reason = o.finish_reason, o.stop_reason
            if isinstance(job.req, CompletionRequest) and job.req.score_only:  # max_tokens 0: the prompt only
                text, ids = text[:len(text) - len(o.text or "")], []
                finish, stop_reason = ("length", None) if finish is not None else (None, None)
            ch.num_tokens += len(ids)
            ch.text.append(text)
            lps = self._logprobs(job.kind, o.logprobs, ids) if job.req.num_logprobs is not None else None
            if echoed:
                lps = echoed + (lps or [])
            if lps:
                ch.logprobs.extend(lps)
            if finish is not None:
                ch.finish_reason, ch.stop_reason = finish, stop_reason
            if not job.req.stream:
                continue
            if job.kind == "chat" and not ch.role_sent:
                ch.role_sent = True
                events.append(self._chunk(job, [{"index": idx, "delta": {"role": "assistant", "content": ""},
                                                 "logprobs": None, "finish_reason": None}]))
            calls = []
            if ch.tools is not None:
                text, calls = ch.tools.feed(text, o.finish_reason is not None)
            if text or lps:
                events.append(self._chunk(job, [self._choice_delta(job, idx, text, lps, None)]))
            if calls:
                events.append(self._chunk(job, [{"index": idx, "delta": {"tool_calls": calls}, "logprobs": None,
                                                 "finish_reason": None}]))
            if o.finish_reason is not None:
                events.append(self._chunk(job, [self._choice_delta(job, idx, None, None, ch)]))
        return events

    def _choice_delta(self, job: _Job, idx: int, text: str | None, lps: list | None,
                      done: _Choice | None) -> dict:
        finish = done.finish() if done else None
        if job.kind == "chat":
            c = {"index": idx, "delta": {"content": text} if text is not None else {},
                 "logprobs": {"content": lps} if lps else None, "finish_reason": finish}
        else:
            ch = job.choices[idx]
            c = {"index": idx, "text": text or "", "finish_reason": finish,
                 "logprobs": _completion_logprobs(lps, ch.logprob_chars) if lps else None}
            if lps:
                ch.logprob_chars += sum(len(e["token"]) for e in lps)
        if done:
            c["stop_reason"] = done.stop_reason
        return c

    def _chunk(self, job: _Job, choices: list[dict], usage: dict | None = None) -> dict:
        obj = "chat.completion.chunk" if job.kind == "chat" else "text_completion"
        c = {"id": job.request_id, "object": obj, "created": job.created, "model": self.model,
             "choices": choices}
        if job.req.include_usage:
            c["usage"] = usage
        return c

    def _final_body(self, job: _Job) -> dict:
        choices = []
        for idx in sorted(job.choices):
            ch = job.choices[idx]
            text = "".join(ch.text)
            lp = ch.logprobs if job.req.num_logprobs is not None else None
            if job.kind == "chat":
                message: dict[str, Any] = {"role": "assistant", "content": text}
                if ch.tools is not None:
                    ch.tools.text = text
                    message["content"], calls = ch.tools.message()
                    if calls:
                        message["tool_calls"] = calls
                choices.append({"index": idx, "message": message,
                                "logprobs": {"content": lp} if lp is not None else None,
                                "finish_reason": ch.finish(), "stop_reason": ch.stop_reason})
            else:
                choices.append({"index": idx, "text": text,
                                "logprobs": _completion_logprobs(lp) if lp is not None else None,
                                "finish_reason": ch.finish_reason, "stop_reason": ch.stop_reason})
        obj = "chat.completion" if job.kind == "chat" else "text_completion"
        return {"id": job.request_id, "object": obj, "created": job.created, "model": self.model,
                "choices": choices, "usage": job.usage}

    def _logprobs(self, kind: str, entries: list | None, ids: list[int]) -> list[dict]:
        """Engine logprob entries (one per token of ids) -> chat-style dicts; an entry None (the first
        prompt token's) has logprob and top_logprobs None."""
        res = []
        for i, e in enumerate((entries or [])[-len(ids):] if ids else []):
            if e is None:
                tok = self.tokenizer.decode([ids[i]])
                res.append({"token": tok, "logprob": None, "bytes": list(tok.encode("utf-8")), "top_logprobs": None})
                continue
            tid, lp, top = _unpack_logprob(e)
            tok = self.tokenizer.decode([tid])
            res.append({"token": tok, "logprob": lp, "bytes": list(tok.encode("utf-8")),
                        "top_logprobs": [{"token": (t := self.tokenizer.decode([j])), "logprob": v,
                                          "bytes": list(t.encode("utf-8"))} for j, v in top]})
        return res

    # ------------------------------------------------------------ helpers
    async def _chat_ids(self, messages: list[dict], add_generation_prompt: bool,
                        spec: tools.ToolSpec | None = None) -> list[int]:
        """Render with the model's template and encode, in a thread for large inputs. Tools go in as
        `tools` when the template takes them, else in the default format (server/tools.py), which also
        rewrites tool calls and tool results."""
        functions = spec.functions if spec is not None and spec.choice != "none" else None
        template = getattr(self.tokenizer, "chat_template", None)
        kwargs = {}
        if tools.template_takes_tools(template):
            if functions:
                kwargs["tools"] = spec.tools
        elif functions or any(m.get("tool_calls") or m["role"] == "tool" for m in messages):
            messages = tools.render_default(messages, functions)

        def render_and_encode() -> list[int]:
            try:
                text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                          **kwargs)
            except Exception as e:  # a template may reject a role order, e.g. two system messages
                raise APIError(400, f"The chat template rejected the messages: {e}", param="messages") from None
            return self.tokenizer.encode(text, False)

        return await self._off_loop(sum(len(m["content"] or "") for m in messages), render_and_encode)

    async def _off_loop(self, size: int, fn, *args):
        """Run the chat template / tokenizer on long inputs in a thread, so that the event loop keeps
        streaming other requests (the tokenizer releases the GIL while it works)."""
        if size <= self.long_prompt_chars:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(None, fn, *args)


async def read_json(request: web.Request, read_timeout: float) -> dict:
    """The request's JSON body: 413 when it is too large, 408 when it arrives too slowly."""
    try:
        async with asyncio.timeout(read_timeout):
            raw = await request.read()
    except TimeoutError:
        raise read_timeout_error(read_timeout) from None
    except web.HTTPRequestEntityTooLarge:
        raise APIError(413, f"The request body is larger than {request.client_max_size} bytes.",
                       code="request_too_large") from None
    except web.RequestPayloadError as e:  # e.g. a Content-Encoding it is not in
        raise APIError(400, f"We could not read the body of your request: {e}",
                       code="invalid_body") from None
    return parse_json(raw)


def _input_text(value: Any) -> str:
    """The text of a Responses API `input`: a string, or items whose content is a string or parts
    with `text`."""
    if isinstance(value, str) or value is None:
        return value or ""
    parts = []
    for item in value if isinstance(value, list) else []:
        content = item.get("content") if isinstance(item, dict) else None
        if isinstance(content, str):
            parts.append(content)
        elif isinstance(content, list):
            parts += [p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)]
    return "\n".join(parts)


async def _merged(engine: Any, job: _Job) -> AsyncIterator[tuple[int, Any]]:
    """Run one engine request per prompt; yield (prompt index, delta) as they come.

    On any exit (finished, client gone, timeout) requests that have not finished are aborted.
    """
    rids = [f"{job.request_id}-{i}" for i in range(len(job.prompt_ids))]
    live = set(range(len(rids)))
    prio = job.req.priority
    tasks: list[asyncio.Task] = []
    try:
        if len(rids) == 1:
            gen = engine.generate(job.prompt_ids[0], job.params[0], rids[0], priority=prio)
            try:
                async for out in gen:
                    if out.finished:
                        live.discard(0)
                    yield 0, out
            finally:
                await gen.aclose()
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int) -> None:
            try:
                async for out in engine.generate(job.prompt_ids[i], job.params[i], rids[i], priority=prio):
                    await queue.put((i, out, None))
            except Exception as e:  # handed to the consumer, which re-raises it
                await queue.put((i, None, e))
            await queue.put((i, None, None))

        tasks = [asyncio.create_task(pump(i)) for i in range(len(rids))]
        open_streams = len(tasks)
        while open_streams:
            i, out, err = await queue.get()
            if err is not None:
                raise err
            if out is None:
                open_streams -= 1
                continue
            if out.finished:
                live.discard(i)
            yield i, out
    finally:
        for t in tasks:
            t.cancel()
        for i in live:
            try:
                await asyncio.shield(engine.abort(rids[i]))
            except Exception:  # already gone: nothing to free
                log.debug("abort of %s failed", rids[i], exc_info=True)


def _unpack_logprob(e: Any) -> tuple[int, float, list[tuple[int, float]]]:
    """(token id, logprob, [(id, logprob), ...] best first) from an engine TokenLogprob."""
    return int(e.token_id), float(e.logprob), [(int(i), float(v)) for i, v in (e.top or [])]


def _completion_logprobs(lps: list[dict], pos: int = 0) -> dict:
    """Chat-style logprob entries -> the legacy completions format (text_offset from `pos`)."""
    offsets = []
    for e in lps:
        offsets.append(pos)
        pos += len(e["token"])
    return {"tokens": [e["token"] for e in lps], "token_logprobs": [e["logprob"] for e in lps],
            "top_logprobs": [None if e["top_logprobs"] is None else {t["token"]: t["logprob"] for t in e["top_logprobs"]}
                             for e in lps],
            "text_offset": offsets}


def _sse(obj: dict) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()

