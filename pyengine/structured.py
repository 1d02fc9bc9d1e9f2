"""Grammar-constrained decoding with xgrammar: compiled grammars, one matcher per request, the bitmask.

StructuredOutputs is built once per engine from its tokenizer. compile() turns a request's
StructuredOutputsParams into an xgrammar CompiledGrammar (cached by a hash of the grammar's kind
and text, so a schema every request shares compiles once). Compiles run in worker processes with a
time limit (pyengine/grammar_pool.py); a cached grammar is served from this process. A Request
holds its own GrammarMatcher
(req.grammar). Each step the runner asks fill_bitmask() for the sampling rows' allowed tokens (a
[rows, ceil(vocab/32)] int32 bitmask, rows without a grammar all ones) and the native sampler
applies it; after the step the engine feeds each sampled token to the request's matcher.

A preempted request keeps its output tokens (they are recomputed, not resampled), so its matcher
stays valid as it is: nothing to roll back. EOS is allowed only where the grammar may end: the
matcher's stop tokens are the model's EOS ids, and they are masked out until the grammar accepts.
"""
from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict

import torch
import xgrammar as xgr

from pyengine.grammar_pool import GrammarPool
from pyengine.sampling_params import StructuredOutputsParams

_CACHE_SIZE = 256  # compiled grammars kept (least recently used first out)


class StructuredOutputs:
    def __init__(self, tokenizer, vocab_size: int, eos_ids: list[int], *, max_threads: int = 2,
                 compile_workers: int = 1, compile_timeout: float = 10.0) -> None:
        """tokenizer: pyengine.tokenizer.Tokenizer; vocab_size: the model's (logits width, may exceed the
        tokenizer's); eos_ids: the tokens that end a sequence (the grammar's stop tokens). Grammars
        compile in `compile_workers` processes, each compile within `compile_timeout` seconds
        (pyengine/grammar_pool.py)."""
        hf = tokenizer._tok
        meta = xgr.TokenizerInfo._detect_metadata_from_hf(hf.to_str())
        vocab = [""] * max(vocab_size, hf.get_vocab_size(with_added_tokens=True))
        for token, i in hf.get_vocab(with_added_tokens=True).items():
            vocab[i] = token
        self.info = xgr.TokenizerInfo(vocab[:vocab_size], meta["vocab_type"], vocab_size=vocab_size,
                                      stop_token_ids=list(eos_ids), add_prefix_space=meta["add_prefix_space"])
        self.batch = xgr.BatchGrammarMatcher(max_threads=max_threads)
        # key -> CompiledGrammar, or the ValueError its compile raised (an invalid or too slow grammar
        # is refused again at once instead of taking a worker for another time limit)
        self._cache: OrderedDict[str, xgr.CompiledGrammar | ValueError] = OrderedDict()  # by _digest(key)
        self._lock = threading.Lock()  # compiles finish on the pool's threads, the step loop reads the cache
        self.pool = GrammarPool(self.info.serialize_json(), workers=compile_workers, time_limit=compile_timeout,
                                on_result=self._store, load=self._load)
        self.num_words = -(-vocab_size // 32)

    def compile(self, params: StructuredOutputsParams) -> xgr.CompiledGrammar:
        """The compiled grammar for params (blocking); ValueError naming the problem if xgrammar rejects
        it or it does not compile within the time limit."""
        hit = self._cached(params.key)
        return hit if hit is not None else self.pool.compile(params.key)

    async def compile_async(self, params: StructuredOutputsParams) -> xgr.CompiledGrammar:
        """As compile(), awaiting the worker; a caller that is cancelled stops waiting, and a compile
        nobody waits for any more is killed. A cached grammar returns at once."""
        hit = self._cached(params.key)
        return hit if hit is not None else await self.pool.compile_async(params.key)

    def close(self) -> None:
        """Kill the compile workers (compiles in flight fail)."""
        self.pool.close()

    def _cached(self, key: tuple[str, str]) -> xgr.CompiledGrammar | None:
        key = _digest(key)
        with self._lock:
            hit = self._cache.get(key)
            if hit is None:
                return None
            self._cache.move_to_end(key)
        if isinstance(hit, ValueError):
            raise ValueError(str(hit))
        return hit

    def _load(self, data: str) -> xgr.CompiledGrammar:
        return xgr.CompiledGrammar.deserialize_json(data, self.info)

    def _store(self, key: tuple[str, str], result: xgr.CompiledGrammar | Exception) -> None:
        if not isinstance(result, (xgr.CompiledGrammar, ValueError)):
            return
        key = _digest(key)
        with self._lock:
            self._cache[key] = result
            while len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)

    def matcher(self, params: StructuredOutputsParams) -> xgr.GrammarMatcher:
        return xgr.GrammarMatcher(self.compile(params))

    def new_bitmask(self, rows: int) -> torch.Tensor:
        return torch.empty(rows, self.num_words, dtype=torch.int32)

    def fill_bitmask(self, reqs: list, bitmask: torch.Tensor) -> torch.Tensor | None:
        """Row i of bitmask = request i's allowed next tokens (all ones without a grammar); None when
        no request has one. bitmask: a CPU int32 buffer with >= len(reqs) rows."""
        # a terminated grammar (it took EOS, and ignore_eos kept the request going) constrains nothing
        rows = [i for i, r in enumerate(reqs) if r.grammar is not None and not r.grammar.is_terminated()]
        if not rows:
            return None
        out = bitmask[: len(reqs)]
        if len(rows) < len(reqs):
            out.fill_(-1)
        self.batch.batch_fill_next_token_bitmask([reqs[i].grammar for i in rows], out, rows)
        return out


def _digest(key: tuple[str, str]) -> str:
    """The cache's key for a grammar: a hash, so the cache does not hold every schema's text."""
    kind, text = key
    return hashlib.sha256(f"{kind}\0{text}".encode()).hexdigest()
