"""AsyncLLM: the engine behind asyncio. The step loop runs in a background thread (torch and the
native kernels release the GIL, so the event loop stays responsive); each request has an
asyncio.Queue fed from that thread with loop.call_soon_threadsafe, one hop per step.

All engine mutations happen on the step thread: generate() and abort() only append commands to a
deque that the thread applies, in order, between steps. A command also sets the engine's interrupt:
a step that is one chunk of a lone prompt (solo_prefill_tokens, often hundreds of tokens) stops before
its next layer and is scheduled again with the newcomer (pyengine/interrupt.py), so a request that
arrives during it waits about one layer of it, not all of it.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from typing import AsyncIterator

from pyengine.config import EngineConfig
from pyengine.engine.engine import Engine, EngineStats
from pyengine.engine.output import RequestOutput
from pyengine.sampling_params import SamplingParams

log = logging.getLogger("pyengine.async")


class EngineDeadError(RuntimeError):
    pass


class AsyncLLM:
    def __init__(self, config: EngineConfig | None = None, *, engine: Engine | None = None, **kwargs) -> None:
        """Loads the model named by config (or EngineConfig(**kwargs)), or wraps a built `engine`."""
        self.engine = engine if engine is not None else Engine(config or EngineConfig(**kwargs))
        self.tokenizer = self.engine.tokenizer
        self.model_config = self.engine.model_config
        self.max_model_len = self.engine.max_model_len
        self.model_name = self.engine.model_name
        self.metrics = self.engine.metrics
        self.plan = self.engine.plan  # the memory plan it logged at start-up (pyengine.plan)
        self.speculative = self.engine.config.speculative  # SpeculativeConfig or None (the web page's panel)
        self._streams: dict[str, asyncio.Queue] = {}
        self._commands: collections.deque[tuple] = collections.deque()
        self._wakeup = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop = False
        self._dead: BaseException | None = None

    # ---- lifecycle -----------------------------------------------------------------------------
    async def start(self) -> None:
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="pyengine-step-loop", daemon=True)
        self._thread.start()

    async def shutdown(self) -> None:
        if self._thread is None:
            return
        self._stop = True
        self._wakeup.set()
        self.engine.close_structured()  # never wait on a grammar compile
        await asyncio.to_thread(self._thread.join)
        self._thread = None
        await asyncio.to_thread(self.engine.close)  # writes what the KV disk tier has queued
        err = EngineDeadError("the engine was shut down")
        for q in self._streams.values():
            q.put_nowait(err)

    def is_healthy(self) -> bool:
        return self._dead is None and (self._thread is None or self._thread.is_alive())

    def stats(self) -> EngineStats:
        return self.engine.stats()

    # ---- requests ------------------------------------------------------------------------------
    async def generate(self, prompt: str | list[int], params: SamplingParams, request_id: str, *,
                       priority: int = 0, prompt_token_ids: list[int] | None = None) -> AsyncIterator[RequestOutput]:
        """Yields RequestOutputs holding deltas (new text and token ids since the last one); the
        last one has finished=True. Raises ValueError for an unusable prompt before queueing."""
        if self._dead is not None:
            raise EngineDeadError(f"the engine stopped after an error: {self._dead!r}")
        if self._thread is None:
            await self.start()
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        if prompt_token_ids is None:
            text, ids = self.engine.tokenize_prompt(prompt)
        else:
            text, ids = (prompt if isinstance(prompt, str) else None), list(prompt_token_ids)
        self.engine.check_prompt(len(ids))
        await self.check_params(params)  # a grammar compiles off the event loop
        q: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = q
        # Arrival is now, not when the step thread picks the request up after its current step.
        self._command(("add", request_id, text, ids, params, priority, time.perf_counter()))
        finished = False
        try:
            while not finished:
                out = await q.get()
                if isinstance(out, BaseException):
                    finished = True
                    raise out
                finished = out.finished
                yield out
        finally:
            self._streams.pop(request_id, None)
            if not finished:  # consumer left (disconnect, cancel): free the request's blocks
                self._command(("abort", request_id))

    async def check_params(self, params: SamplingParams) -> None:
        """Raise ValueError naming what the engine cannot use in params (a token id beyond the
        vocabulary, an invalid grammar, one that does not compile in time). Grammars compile here, off
        the event loop, and stay cached."""
        self.engine.check_params(params, compile_grammar=False)
        if params.structured_outputs is None:
            return
        if self.engine._structured is None:  # built once: the tokenizer's vocabulary for xgrammar (~0.1 s)
            await asyncio.to_thread(lambda: self.engine.structured)
        # the compile runs in a worker process with a time limit (pyengine/grammar_pool.py); a request
        # that leaves stops waiting, and the compile is killed once nobody waits for it
        await self.engine.structured.compile_async(params.structured_outputs)

    async def abort(self, request_id: str) -> None:
        self._command(("abort", request_id))

    def _command(self, cmd: tuple) -> None:
        self._commands.append(cmd)
        self.engine.interrupt.set()
        self._wakeup.set()

    # ---- the step thread -----------------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        while not self._stop:
            engine.interrupt.clear()  # before the commands are taken: one queued after it sets it again
            self._apply_commands()
            if not engine.has_unfinished():
                self._wakeup.wait(0.5)
                self._wakeup.clear()
                continue
            try:
                outs = engine.step()  # a failing model run fails only the requests it is blamed on
            except Exception as exc:  # the engine itself is broken: fail everything, take no more
                log.exception("engine step failed; failing %d requests and stopping", len(engine.groups))
                self._fail_all(exc)
                return
            if outs:
                self._loop.call_soon_threadsafe(self._dispatch, outs)

    def _apply_commands(self) -> None:
        while self._commands:
            cmd = self._commands.popleft()
            if cmd[0] == "add":
                _, rid, text, ids, params, priority, arrival = cmd
                try:
                    self.engine.add_request(rid, text if text is not None else ids, params,
                                            priority=priority, prompt_token_ids=ids, arrival_time=arrival)
                except Exception as exc:
                    self._loop.call_soon_threadsafe(self._dispatch, [(rid, exc)])
            else:
                self.engine.queue_abort(cmd[1])

    def _fail_all(self, exc: Exception) -> None:
        """The engine is dead: every stream ends with the error (queued commands included)."""
        self._dead = exc
        self._stop = True
        try:
            for rid in list(self.engine.groups):
                self.engine.abort_request(rid)
        except Exception:  # best effort: nothing runs after this
            log.exception("aborting after the engine failed")
        self._loop.call_soon_threadsafe(self._dispatch_error, EngineDeadError(f"the engine stopped after an error: {exc!r}"))

    def _dispatch(self, outs: list) -> None:
        for out in outs:
            if isinstance(out, tuple):  # (request_id, exception)
                q = self._streams.get(out[0])
                if q is not None:
                    q.put_nowait(out[1])
                continue
            q = self._streams.get(out.request_id)
            if q is not None:  # an error reaches only the request it was blamed on
                q.put_nowait(out if out.error is None else RuntimeError(f"engine step failed: {out.error}"))

    def _dispatch_error(self, err: Exception) -> None:
        for q in self._streams.values():
            q.put_nowait(err)
