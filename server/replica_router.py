"""Prefix-aware choice of an engine replica (used by server/ray.py; plain Python, no Ray).

Each replica's prefix cache holds the KV blocks of the prompts it served. The router remembers, per
full prompt block, which replica computed it last, keyed by a chain hash of every token up to the
end of that block (the same key a block pool uses), so a lookup walks a new prompt's blocks and
finds the replica holding its longest cached prefix. A conversation (the client's session id)
sticks to its replica. Either way a replica more than `max_imbalance` requests busier than the
least-loaded one is passed over, so one hot prefix cannot pile every request onto one replica.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass, field


@dataclass
class RouterConfig:
    block_size: int = 16  # tokens per prefix block: the engine's KV block size
    max_imbalance: int = 8  # in-flight requests a prefix/session replica may have beyond the least loaded
    max_entries: int = 1 << 20  # remembered blocks (and sessions), least recently used dropped first
    affinity: bool = True  # False: least-loaded only (a baseline for what prefix routing buys)


@dataclass
class Replica:
    name: str
    in_flight: int = 0  # requests this router sent and that have not ended
    healthy: bool = True  # false from a failure until the replica answers again


@dataclass
class Decision:
    index: int  # the replica
    reason: str  # "session" | "prefix" | "least_loaded"
    matched_blocks: int = 0  # leading prompt blocks the replica was remembered to hold


@dataclass
class PrefixRouter:
    replicas: list[Replica]
    config: RouterConfig = field(default_factory=RouterConfig)

    def __post_init__(self) -> None:
        self._blocks: collections.OrderedDict[int, int] = collections.OrderedDict()  # chain hash -> replica
        self._sessions: collections.OrderedDict[str, int] = collections.OrderedDict()
        self._turn = 0  # rotates ties between equally loaded replicas

    def block_hashes(self, token_ids: list[int]) -> list[int]:
        """One hash per full block, each covering every token from the start to the block's end."""
        bs, h, out = self.config.block_size, 0, []
        for i in range(0, len(token_ids) - bs + 1, bs):
            h = hash((h, tuple(token_ids[i:i + bs])))
            out.append(h)
        return out

    def choose(self, token_ids: list[int], session: str | None = None,
               exclude: frozenset[int] = frozenset()) -> Decision | None:
        """The replica for a prompt; None when no healthy replica is left outside `exclude`."""
        live = [i for i, r in enumerate(self.replicas) if r.healthy and i not in exclude]
        if not live:
            return None
        least = min(self.replicas[i].in_flight for i in live)

        def usable(i: int | None) -> bool:
            return i in live and self.replicas[i].in_flight <= least + self.config.max_imbalance

        hashes = self.block_hashes(token_ids) if self.config.affinity else []
        if session is not None and self.config.affinity and usable(self._sessions.get(session)):
            return Decision(self._sessions[session], "session", self._matched(hashes, self._sessions[session]))
        for n in range(len(hashes), 0, -1):
            owner = self._blocks.get(hashes[n - 1])
            if usable(owner):
                return Decision(owner, "prefix", n)
        idle = [i for i in live if self.replicas[i].in_flight == least]
        self._turn += 1
        return Decision(idle[self._turn % len(idle)], "least_loaded")

    def record(self, index: int, token_ids: list[int], session: str | None = None) -> None:
        """`index` now holds this prompt's blocks (and the session)."""
        for h in self.block_hashes(token_ids):
            self._remember(self._blocks, h, index)
        if session is not None:
            self._remember(self._sessions, session, index)

    def forget(self, index: int) -> None:
        """The replica lost its cache (it died or restarted): nothing routes to it by prefix."""
        for table in (self._blocks, self._sessions):
            for key in [k for k, v in table.items() if v == index]:
                del table[key]

    def _matched(self, hashes: list[int], index: int) -> int:
        return next((n for n in range(len(hashes), 0, -1) if self._blocks.get(hashes[n - 1]) == index), 0)

    def _remember(self, table: collections.OrderedDict, key, index: int) -> None:
        table[key] = index
        table.move_to_end(key)
        if len(table) > self.config.max_entries:
            table.popitem(last=False)
