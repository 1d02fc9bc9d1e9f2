"""Grammar compiles in worker processes: bounded, time-limited, killable, merged.

xgrammar compiles in C++ and cannot be interrupted from Python, and some JSON schemas take minutes
(an anyOf of hundreds of objects). A compile run on a thread would keep its CPU and memory after its
client left. So a compile runs in a worker process (`python -m pyengine.grammar_pool`) that holds
the engine's TokenizerInfo; the worker sends the CompiledGrammar back serialized (xgrammar's
serialize_json, a few ms for a typical schema) and the caller keeps it in its in-process cache, so
a request whose grammar is cached never pays the round trip.

GrammarPool runs `workers` such processes, each driven by one daemon thread that takes jobs off a
queue. A job is one (kind, text): identical compiles in flight share one job, and every waiter gets
its result. A worker is killed (and started again for the next job) when its compile passes the
time limit, or when every waiter of its job has left (the client disconnected). close() kills the
workers without waiting on them.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import os
import pickle
import queue
import select
import struct
import subprocess
import sys
import threading
import time
from typing import Any, BinaryIO, Callable

_HEADER = struct.Struct("<Q")  # the length of a pickled message
_POLL_S = 0.05  # how often a driver thread checks its job's waiters while the worker compiles


class CompileTimeout(ValueError):
    """The compile passed the time limit (a ValueError: the request gets a 400)."""


class CompileAbandoned(Exception):
    """Every waiter of the job left before it finished."""


class CompileCrashed(ValueError):
    """The worker died compiling the grammar (e.g. out of memory): the grammar is refused (a 400)."""


def send(stream: BinaryIO, obj: Any) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_HEADER.pack(len(data)) + data)
    stream.flush()


def receive(stream: BinaryIO) -> Any:
    """The next message; EOFError when the other side is gone."""
    size = _HEADER.unpack(_read_exact(stream, _HEADER.size))[0]
    return pickle.loads(_read_exact(stream, size))


def _read_exact(stream: BinaryIO, n: int) -> bytes:
    """n bytes (an unbuffered pipe returns what has arrived, so read until there are n)."""
    parts, left = [], n
    while left:
        chunk = stream.read(left)
        if not chunk:
            raise EOFError
        parts.append(chunk)
        left -= len(chunk)
    return b"".join(parts)


class _Job:
    """One compile that one or more requests wait on."""

    def __init__(self, key: tuple[str, str]) -> None:
        self.key = key
        self.future: concurrent.futures.Future = concurrent.futures.Future()
        self.waiters = 0  # requests still waiting (changed under the pool's lock)


class _Worker:
    """One worker process: stdin takes (kind, text), stdout answers ("ok", bytes) or ("error", text)."""

    def __init__(self, info_json: str) -> None:
        # the worker imports the same pyengine as this process, whatever the working directory
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=path)
        self.proc = subprocess.Popen([sys.executable, "-m", "pyengine.grammar_pool"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env=env, bufsize=0)
        send(self.proc.stdin, info_json)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:  # a broken pipe to a killed process: nothing to flush
                pass


class GrammarPool:
    """Compiles grammars in `workers` processes; each compile gets at most `time_limit` seconds of its
    worker (waiting for a free worker is not counted). `on_result(key, result)` runs in the driver
    thread when a job finishes, before its waiters wake (the caller's cache)."""

    def __init__(self, info_json: str, *, workers: int = 1, time_limit: float = 10.0,
                 on_result: Callable[[tuple[str, str], Any], None] | None = None,
                 load: Callable[[bytes], Any] = lambda data: data) -> None:
        if workers < 1:
            raise ValueError(f"grammar compile workers must be >= 1, got {workers}")
        if time_limit <= 0:
            raise ValueError(f"grammar compile time limit must be > 0 seconds, got {time_limit}")
        self.info_json = info_json
        self.time_limit = time_limit
        self.on_result = on_result
        self.load = load  # serialized compiled grammar -> the object waiters get (runs in the driver thread)
        self._jobs: dict[tuple[str, str], _Job] = {}
        self._lock = threading.Lock()
        self._queue: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        # started now: a worker takes seconds to start (it imports xgrammar), the first compile need not wait
        self._workers: list[_Worker | None] = [_Worker(info_json) for _ in range(workers)]
        self._closed = False
        self.num_compiles = 0  # jobs sent to a worker
        self.num_killed = 0  # workers killed for a timeout or an abandoned job
        for i in range(workers):
            threading.Thread(target=self._drive, args=(i,), name=f"grammar-compile-{i}", daemon=True).start()

    # ---- callers ------------------------------------------------------------------------------
    def submit(self, key: tuple[str, str]) -> _Job:
        """The job compiling key (a new one, or the one already in flight); the caller is one more
        waiter and must call release() if it stops waiting before the job is done."""
        with self._lock:
            if self._closed:
                raise RuntimeError("the grammar compiler was shut down")
            job = self._jobs.get(key)
            if job is None:
                job = self._jobs[key] = _Job(key)
                job.waiters = 1  # before a driver thread can see it (they read waiters without the lock)
                self._queue.put(job)
            else:
                job.waiters += 1
            return job

    def release(self, job: _Job) -> None:
        with self._lock:
            job.waiters -= 1

    def compile(self, key: tuple[str, str]) -> Any:
        """Blocking: the compiled result; ValueError (CompileTimeout included) when it fails."""
        while True:
            job = self.submit(key)
            try:
                return job.future.result()
            except CompileAbandoned:  # joined a job just as its last waiter left it: start another
                continue
            finally:
                self.release(job)

    async def compile_async(self, key: tuple[str, str]) -> Any:
        """As compile(); a cancelled caller stops waiting, and a job nobody waits for is killed."""
        while True:
            job = self.submit(key)
            try:  # shield: one waiter's cancel must not cancel the job the others share
                return await asyncio.shield(asyncio.wrap_future(job.future))
            except CompileAbandoned:  # joined a job just as its last waiter left it: start another
                continue
            finally:
                self.release(job)

    def close(self) -> None:
        """Kill the workers now; jobs in flight or queued fail."""
        with self._lock:
            self._closed = True
            jobs = list(self._jobs.values())
        for _ in self._workers:
            self._queue.put(None)
        for w in list(self._workers):
            if w is not None:
                w.kill()
        for job in jobs:
            _settle(job.future, RuntimeError("the grammar compiler was shut down"))

    # ---- driver threads -----------------------------------------------------------------------
    def _drive(self, slot: int) -> None:
        while True:
            job = self._queue.get()
            if job is None or self._closed:
                return
            try:
                result: Any = self._run(slot, job)
            except Exception as e:  # noqa: BLE001 - handed to the waiters
                result = e
            with self._lock:
                self._jobs.pop(job.key, None)
            if not isinstance(result, (CompileAbandoned, RuntimeError)) and self.on_result is not None:
                self.on_result(job.key, result)
            if isinstance(result, Exception):
                _settle(job.future, result)
            else:
                job.future.set_result(result)

    def _run(self, slot: int, job: _Job) -> Any:
        if job.waiters <= 0:
            raise CompileAbandoned
        worker = self._workers[slot]
        if worker is None or worker.proc.poll() is not None:
            worker = self._workers[slot] = _Worker(self.info_json)
        self.num_compiles += 1
        try:
            send(worker.proc.stdin, job.key)
        except OSError:
            self._drop(slot)
            raise RuntimeError("the grammar compiler worker exited") from None
        deadline = None  # counted from the worker's "started" message (its start-up is not the grammar's)
        out = worker.proc.stdout
        while True:
            if self._closed:
                raise RuntimeError("the grammar compiler was shut down")
            if job.waiters <= 0:
                self._drop(slot, killed=True)
                raise CompileAbandoned
            if deadline is not None and time.monotonic() > deadline:
                self._drop(slot, killed=True)
                raise CompileTimeout(f"the grammar did not compile within the {self.time_limit:g} s limit "
                                     f"(--grammar-compile-timeout); simplify the schema")
            ready, _, _ = select.select([out], [], [], _POLL_S)
            if not ready:
                continue
            try:
                status, value = receive(out)
            except (EOFError, OSError, pickle.UnpicklingError):
                self._drop(slot)
                if deadline is None:  # it died starting up, not on this grammar
                    raise RuntimeError("the grammar compiler worker exited") from None
                raise CompileCrashed("the grammar compiler failed on this grammar (its process exited)") from None
            if status == "started":
                deadline = time.monotonic() + self.time_limit
            elif status == "ok":
                return self.load(value)
            else:
                raise ValueError(value)

    def _drop(self, slot: int, killed: bool = False) -> None:
        """Kill the slot's worker and start its successor (the next compile finds it ready)."""
        worker, self._workers[slot] = self._workers[slot], None
        if worker is not None:
            worker.kill()
        self.num_killed += killed
        if not self._closed:
            self._workers[slot] = _Worker(self.info_json)


def _settle(future: concurrent.futures.Future, exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)


def _serve(stdin: BinaryIO, stdout: BinaryIO) -> None:
    """The worker: build the compiler from the TokenizerInfo, then answer compiles until stdin closes."""
    import xgrammar as xgr

    from pyengine.grammars import compile_grammar

    parent = os.getppid()
    threading.Thread(target=_exit_with_parent, args=(parent,), daemon=True).start()
    info = xgr.TokenizerInfo.deserialize_json(receive(stdin))
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    while True:
        try:
            kind, text = receive(stdin)
        except EOFError:
            return
        send(stdout, ("started", None))
        try:
            reply = ("ok", compile_grammar(compiler, kind, text).serialize_json())
        except ValueError as e:
            reply = ("error", str(e))
        send(stdout, reply)


def _exit_with_parent(parent: int) -> None:
    """A worker in a long compile does not read stdin, so it would outlive a server that died: it
    checks for its parent instead."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(0)


if __name__ == "__main__":
    _serve(sys.stdin.buffer, sys.stdout.buffer)
