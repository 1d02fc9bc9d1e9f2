"""Stored responses and conversations (the Responses API's state), behind a small interface.

`ConversationStore` is all the handlers know; `SQLiteStore` is the embedded implementation (one
file, or ":memory:"). Another backend (Postgres) implements the same async methods.

Objects are stored as the JSON the API returns (a response, a conversation item), plus the columns
needed to find them. Every row belongs to an owner (a digest of the caller's API key): a lookup by
another owner finds nothing, so the handlers answer 404, never 403.
"""
from __future__ import annotations

import abc
import asyncio
import collections
import concurrent.futures
import contextvars
import json
import logging
import os
import sqlite3
import time
from typing import Any, Callable, TypeVar

log = logging.getLogger("server.store")
T = TypeVar("T")
# The calling request's running total of the time store calls worked on the store's thread (SQLite
# and JSON, not waiting for the thread), when it keeps one: the server reports it per request.
work_clock: contextvars.ContextVar[list[float] | None] = contextvars.ContextVar("store_work_clock", default=None)


class StoreOpenError(Exception):
    """The store cannot be opened (unreadable, not a database, written by a newer version)."""


class StoreUnavailable(Exception):
    """The store cannot serve this request now (locked, disk full, I/O error): the request gets a 503;
    what was stored before is untouched."""


class ConversationStore(abc.ABC):
    """Responses (with the input items each was given) and conversations (ordered items).

    History of a response = the history of its previous response + its input items + its output.
    Methods that look up by id return None (or False) when the id is unknown to that owner.
    """

    @abc.abstractmethod
    async def put_response(self, owner: str, response: dict, input_items: list[dict]) -> None:
        """Store a finished response. When it belongs to a conversation (response["conversation"]),
        its input and output items are appended to that conversation in the same transaction."""

    @abc.abstractmethod
    async def get_response(self, owner: str, response_id: str) -> dict | None: ...

    @abc.abstractmethod
    async def response_input_items(self, owner: str, response_id: str) -> list[dict] | None: ...

    @abc.abstractmethod
    async def response_history(self, owner: str, response_id: str) -> list[dict] | None:
        """Items of the chain ending at response_id, oldest first: each response's input, then output."""

    @abc.abstractmethod
    async def delete_response(self, owner: str, response_id: str) -> bool: ...

    @abc.abstractmethod
    async def create_conversation(self, owner: str, conversation: dict, items: list[dict]) -> None: ...

    @abc.abstractmethod
    async def get_conversation(self, owner: str, conversation_id: str) -> dict | None: ...

    @abc.abstractmethod
    async def update_conversation(self, owner: str, conversation_id: str, metadata: dict) -> dict | None:
        """Replace the conversation's metadata; the updated conversation."""

    @abc.abstractmethod
    async def conversation_items(self, owner: str, conversation_id: str, *, after: str | None = None,
                                 limit: int | None = None, descending: bool = False) -> list[dict] | None:
        """Items in order (or reversed), starting after the item `after`; at most `limit`."""

    @abc.abstractmethod
    async def add_items(self, owner: str, conversation_id: str, items: list[dict]) -> bool: ...

    @abc.abstractmethod
    async def delete_conversation(self, owner: str, conversation_id: str) -> bool: ...

    @abc.abstractmethod
    async def close(self) -> None: ...


# Schema migrations, applied in order, each a list of statements; schema_version holds how many have
# run. Append, never edit.
MIGRATIONS = [
    [
        """CREATE TABLE responses (
            id TEXT PRIMARY KEY,
            owner TEXT NOT NULL,
            created_at INTEGER NOT NULL,
            previous_response_id TEXT,
            input_items TEXT NOT NULL,  -- JSON list: the items the request sent
            body TEXT NOT NULL          -- JSON: the response object as returned
        )""",
        """CREATE TABLE conversations (
            id TEXT PRIMARY KEY,
            owner TEXT NOT NULL,
            created_at INTEGER NOT NULL,
            body TEXT NOT NULL
        )""",
        """CREATE TABLE conversation_items (
            conversation_id TEXT NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
            position INTEGER NOT NULL,
            id TEXT NOT NULL,
            item TEXT NOT NULL,
            PRIMARY KEY (conversation_id, position)
        )""",
        "CREATE UNIQUE INDEX conversation_item_ids ON conversation_items(conversation_id, id)",
    ],
]

_HISTORY = """
WITH RECURSIVE chain(id, prev, depth) AS (
    SELECT id, previous_response_id, 0 FROM responses WHERE id = ? AND owner = ?
    UNION ALL
    SELECT r.id, r.previous_response_id, chain.depth + 1
    FROM responses r JOIN chain ON r.id = chain.prev WHERE r.owner = ?
)
SELECT r.input_items, r.body FROM chain JOIN responses r ON r.id = chain.id ORDER BY chain.depth DESC
"""


class SQLiteStore(ConversationStore):
    """SQLite through the stdlib driver. One connection, used by one worker thread: every call runs
    there (never on the event loop), one at a time, so writes are serialised within the process;
    across processes SQLite's own locks do it, waiting up to `busy_timeout` seconds."""

    def __init__(self, path: str, busy_timeout: float = 5.0, history_cache: int = 4096) -> None:
        self.path = path
        # (owner, response id) -> the history a continuation of that response starts from, for the
        # latest written responses: the next turn of a chain reads it without a trip to the database.
        # Touched on the event loop only. Any delete clears it (it could hold a deleted response).
        self._histories: collections.OrderedDict[tuple[str, str], list[dict]] = collections.OrderedDict()
        self.history_cache = history_cache
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="store")
        try:
            if path != ":memory:":
                os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            self.db = sqlite3.connect(path, timeout=busy_timeout, isolation_level=None,
                                      check_same_thread=False)
            self.db.execute("PRAGMA foreign_keys = ON")
            if path != ":memory:":
                self.db.execute("PRAGMA journal_mode = WAL")  # readers never wait for a writer
                self.db.execute("PRAGMA synchronous = NORMAL")  # durable at checkpoints; no fsync per commit
            self._migrate()
        except (sqlite3.Error, OSError) as e:
            self._pool.shutdown()
            raise StoreOpenError(f"cannot open the conversation store {path}: {e}") from None

    def _migrate(self) -> None:
        with self._transaction():
            self.db.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)")
            row = self.db.execute("SELECT version FROM schema_version").fetchone()
            version = row[0] if row else 0
            if version > len(MIGRATIONS):
                raise sqlite3.DatabaseError(f"its schema version {version} is newer than this server's "
                                            f"({len(MIGRATIONS)}); upgrade the server")
            for statements in MIGRATIONS[version:]:  # one by one: executescript() would commit
                for statement in statements:
                    self.db.execute(statement)
            if row is None:
                self.db.execute("INSERT INTO schema_version VALUES (?)", (len(MIGRATIONS),))
            else:
                self.db.execute("UPDATE schema_version SET version = ?", (len(MIGRATIONS),))

    def _transaction(self):
        return _Transaction(self.db)

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        """Run fn on the store's thread; an SQLite failure becomes StoreUnavailable."""
        clock = work_clock.get()

        def call() -> T:
            start = time.perf_counter()
            try:
                return fn(*args)
            except sqlite3.Error as e:
                log.warning("store %s failed: %s", self.path, e)
                raise StoreUnavailable(str(e)) from None
            finally:
                if clock is not None:  # the caller awaits this call: nothing else touches it meanwhile
                    clock[0] += time.perf_counter() - start
        return await asyncio.get_running_loop().run_in_executor(self._pool, call)

    # ---- responses ---------------------------------------------------------------------------
    async def put_response(self, owner: str, response: dict, input_items: list[dict]) -> None:
        conv = (response.get("conversation") or {}).get("id")
        row = (response["id"], owner, int(response["created_at"]), response.get("previous_response_id"))

        def put() -> None:
            insert = ("INSERT INTO responses VALUES (?, ?, ?, ?, ?, ?)",
                      (*row, json.dumps(input_items), json.dumps(response)))
            if conv is None:  # one statement: its own transaction (one call, not three)
                self.db.execute(*insert)
                return
            with self._transaction():
                self.db.execute(*insert)
                if self._owns(owner, conv):
                    self._append(conv, input_items + response["output"])
        await self._run(put)
        prev = response.get("previous_response_id")
        before = [] if prev is None else self._histories.get((owner, prev))
        if before is not None and conv is None:
            self._remember((owner, response["id"]), before + input_items + response["output"])

    async def get_response(self, owner: str, response_id: str) -> dict | None:
        row = await self._run(self._one, "SELECT body FROM responses WHERE id = ? AND owner = ?",
                              (response_id, owner))
        return json.loads(row[0]) if row else None

    async def response_input_items(self, owner: str, response_id: str) -> list[dict] | None:
        row = await self._run(self._one, "SELECT input_items FROM responses WHERE id = ? AND owner = ?",
                              (response_id, owner))
        return json.loads(row[0]) if row else None

    async def response_history(self, owner: str, response_id: str) -> list[dict] | None:
        cached = self._histories.get((owner, response_id))
        if cached is not None:
            self._histories.move_to_end((owner, response_id))
            return list(cached)
        rows = await self._run(self._all, _HISTORY, (response_id, owner, owner))
        if not rows:
            return None
        items: list[dict] = []
        for input_items, body in rows:
            items += json.loads(input_items) + json.loads(body)["output"]
        self._remember((owner, response_id), items)
        return list(items)

    async def delete_response(self, owner: str, response_id: str) -> bool:
        self._histories.clear()
        return await self._run(self._delete, "DELETE FROM responses WHERE id = ? AND owner = ?",
                               (response_id, owner))

    def _remember(self, key: tuple[str, str], items: list[dict]) -> None:
        self._histories[key] = items
        if len(self._histories) > self.history_cache:
            self._histories.popitem(last=False)

    # ---- conversations -----------------------------------------------------------------------
    async def create_conversation(self, owner: str, conversation: dict, items: list[dict]) -> None:
        def create() -> None:
            with self._transaction():
                self.db.execute("INSERT INTO conversations VALUES (?, ?, ?, ?)",
                                (conversation["id"], owner, conversation["created_at"], json.dumps(conversation)))
                self._append(conversation["id"], items)
        await self._run(create)

    async def get_conversation(self, owner: str, conversation_id: str) -> dict | None:
        row = await self._run(self._one, "SELECT body FROM conversations WHERE id = ? AND owner = ?",
                              (conversation_id, owner))
        return json.loads(row[0]) if row else None

    async def update_conversation(self, owner: str, conversation_id: str, metadata: dict) -> dict | None:
        def update() -> dict | None:
            with self._transaction():
                row = self._one("SELECT body FROM conversations WHERE id = ? AND owner = ?", (conversation_id, owner))
                if row is None:
                    return None
                conversation = {**json.loads(row[0]), "metadata": metadata}
                self.db.execute("UPDATE conversations SET body = ? WHERE id = ?",
                                (json.dumps(conversation), conversation_id))
                return conversation
        return await self._run(update)

    async def conversation_items(self, owner: str, conversation_id: str, *, after: str | None = None,
                                 limit: int | None = None, descending: bool = False) -> list[dict] | None:
        order, cmp = ("DESC", "<") if descending else ("ASC", ">")

        def items() -> list[dict] | None:
            if not self._owns(owner, conversation_id):
                return None
            sql, args = "SELECT item FROM conversation_items WHERE conversation_id = ?", [conversation_id]
            if after is not None:
                sql += (f" AND position {cmp} (SELECT position FROM conversation_items"
                        " WHERE conversation_id = ? AND id = ?)")
                args += [conversation_id, after]
            sql += f" ORDER BY position {order}"
            if limit is not None:
                sql += " LIMIT ?"
                args.append(limit)
            return [json.loads(r[0]) for r in self.db.execute(sql, args)]
        return await self._run(items)

    async def add_items(self, owner: str, conversation_id: str, items: list[dict]) -> bool:
        def add() -> bool:
            with self._transaction():
                if not self._owns(owner, conversation_id):
                    return False
                self._append(conversation_id, items)
                return True
        return await self._run(add)

    async def delete_conversation(self, owner: str, conversation_id: str) -> bool:
        return await self._run(self._delete, "DELETE FROM conversations WHERE id = ? AND owner = ?",
                               (conversation_id, owner))

    async def close(self) -> None:
        await asyncio.get_running_loop().run_in_executor(self._pool, self.db.close)
        self._pool.shutdown()

    # ---- on the store's thread ---------------------------------------------------------------
    def _one(self, sql: str, args: tuple) -> tuple | None:
        return self.db.execute(sql, args).fetchone()

    def _all(self, sql: str, args: tuple) -> list[tuple]:
        return self.db.execute(sql, args).fetchall()

    def _delete(self, sql: str, args: tuple) -> bool:
        return self.db.execute(sql, args).rowcount > 0

    def _owns(self, owner: str, conversation_id: str) -> bool:
        return self._one("SELECT 1 FROM conversations WHERE id = ? AND owner = ?",
                         (conversation_id, owner)) is not None

    def _append(self, conversation_id: str, items: list[dict]) -> None:
        (last,) = self._one("SELECT COALESCE(MAX(position), -1) FROM conversation_items WHERE conversation_id = ?",
                            (conversation_id,))
        self.db.executemany("INSERT INTO conversation_items VALUES (?, ?, ?, ?)",
                            [(conversation_id, last + 1 + i, it["id"], json.dumps(it)) for i, it in enumerate(items)])


class _Transaction:
    """BEGIN IMMEDIATE (take the write lock up front, so a locked database fails before any work) ...
    COMMIT, or ROLLBACK on any error."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self.db = db

    def __enter__(self) -> None:
        self.db.execute("BEGIN IMMEDIATE")

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if exc_type is None:
                self.db.execute("COMMIT")
        finally:  # an error, or a COMMIT that failed (e.g. disk full): leave nothing half-written
            if self.db.in_transaction:
                self.db.execute("ROLLBACK")


def default_path() -> str:
    """Where `python -m server` keeps its store unless told otherwise: the user's data directory."""
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return os.path.join(base, "pyengine", "store.sqlite3")
