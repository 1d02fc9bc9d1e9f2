"""Per-request log: one row per HTTP generation request, as CSV or JSON Lines (by file extension).

The first six columns are the classic benchmark log (`request_id,start_ts,first_token_ts,end_ts,
input_tokens,output_tokens`); `python -m pyengine.report` reads the file back. Timestamps are Unix
seconds (`first_token_ts`: when the first output text was ready to send, i.e. the first token a
streaming client sees); the `*_s` columns are the stages of the request, in seconds:

    tokenize_s  template + tokenize (HTTP arrival -> handed to the engine)
    queue_s     queued -> first scheduled
    prefill_s   first scheduled -> first token
    decode_s    first token -> last token
    stream_s    detokenize + stream: last token -> response complete

and with speculative decoding, draft_tokens verified and accepted_tokens of them (their ratio: the
request's acceptance rate).

Rows are written by a background thread (the event loop only enqueues), the file is rotated by
size (PATH -> PATH.1 -> PATH.2 ...), and close() flushes everything still queued.
"""
from __future__ import annotations

import csv
import io
import json
import os
import queue
import threading
from dataclasses import asdict, dataclass, fields


@dataclass
class RequestRecord:
    request_id: str
    start_ts: float
    first_token_ts: float | None
    end_ts: float
    input_tokens: int
    output_tokens: int
    queued_ts: float | None
    scheduled_ts: float | None
    cached_tokens: int
    model: str
    status: int
    finish_reason: str | None
    client_request_id: str | None
    endpoint: str
    tokenize_s: float | None
    queue_s: float | None
    prefill_s: float | None
    decode_s: float | None
    stream_s: float | None
    disk_cached_tokens: int = 0  # of cached_tokens, those read back from the KV disk tier
    draft_tokens: int = 0  # speculative decoding: draft tokens verified (0: none)
    accepted_tokens: int = 0  # of which accepted
    host_cached_tokens: int = 0  # of cached_tokens, those read back from the KV host-memory tier


COLUMNS = [f.name for f in fields(RequestRecord)]


class RequestLog:
    """Opens (and so checks) the file at construction: an unwritable path raises OSError at once."""

    def __init__(self, path: str, max_bytes: int = 100 << 20, backups: int = 5) -> None:
        self.path = path
        self.jsonl = path.endswith((".jsonl", ".json"))
        self.max_bytes = max_bytes
        self.backups = backups
        self._file = self._open()
        self._queue: queue.SimpleQueue[RequestRecord | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="pyengine-request-log", daemon=True)
        self._thread.start()

    def write(self, record: RequestRecord) -> None:
        """Never blocks: the row is formatted and written by the log thread."""
        self._queue.put(record)

    def close(self) -> None:
        """Write what is queued, flush, close. Idempotent."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()

    def _open(self) -> io.TextIOWrapper:
        f = open(self.path, "a", newline="", encoding="utf-8")
        if not self.jsonl and f.tell() == 0:
            csv.writer(f).writerow(COLUMNS)
            f.flush()
        return f

    def _run(self) -> None:
        done = False
        while not done:
            batch = [self._queue.get()]
            while not self._queue.empty():  # write what is queued, then flush once
                batch.append(self._queue.get())
            for rec in batch:
                if rec is None:
                    done = True
                    break
                self._file.write(self._format(rec))
                if self._file.tell() >= self.max_bytes:
                    self._rotate()
            self._file.flush()
        self._file.close()

    def _format(self, rec: RequestRecord) -> str:
        row = asdict(rec)
        if self.jsonl:
            return json.dumps(row) + "\n"
        buf = io.StringIO()
        csv.writer(buf).writerow(["" if row[c] is None else row[c] for c in COLUMNS])
        return buf.getvalue()

    def _rotate(self) -> None:
        self._file.close()
        for i in range(self.backups - 1, 0, -1):
            if os.path.exists(f"{self.path}.{i}"):
                os.replace(f"{self.path}.{i}", f"{self.path}.{i + 1}")
        if self.backups > 0:
            os.replace(self.path, f"{self.path}.1")
        else:
            os.remove(self.path)
        self._file = self._open()


def read_records(path: str) -> list[dict]:
    """Rows of a request log (CSV or JSON Lines, also rotated files) as dicts of typed values."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if text.lstrip().startswith("{"):
        return [json.loads(line) for line in text.splitlines() if line.strip()]
    rows = []
    for row in csv.DictReader(io.StringIO(text)):
        rows.append({k: _parse(k, v) for k, v in row.items()})
    return rows


_TEXT_COLUMNS = {"request_id", "model", "finish_reason", "client_request_id", "endpoint"}


def _parse(column: str, value: str):
    if value == "":
        return None
    if column in _TEXT_COLUMNS:
        return value
    ints = ("input_tokens", "output_tokens", "cached_tokens", "disk_cached_tokens", "host_cached_tokens", "status")
    return int(value) if column in ints else float(value)
