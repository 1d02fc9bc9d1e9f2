"""Grammar-constrained decoding with xgrammar: compiled grammars, one matcher per request, the bitmask.

StructuredOutputs is built once per engine from its tokenizer. compile() turns a request's
StructuredOutputsParams into an xgrammar CompiledGrammar (cached by a hash of the grammar's kind
and text, so a schema every request shares compiles once). Compiles run in worker processes with a
time limit (pyengine/grammar_pool.py); a cached grammar is served from this process. A Request
holds its own GrammarMatcher
(req.grammar). Each step the runner asks fill_bitmask() for the sampling rows' allowed tokens (a
[rows, ceil(vocab/32)] int32 bitmask, rows without a grammar all ones) and the native sampler
applies it; after the step the engine feeds each sampled token to the request's matcher.

Speculative decoding (pyengine/engine/spec_decode.py): a request verifying drafts has one sampling row
per draft plus one; fill_bitmask() steps its matcher through the drafts (and back) so that each row gets
the mask of the grammar state after the drafts before it, as the non-speculative engine would at that
output position. spec_decode.accepted_prefix() cuts drafts at the first token the grammar refuses,
and jump_forward_tokens() gives the tokens of the text the grammar forces next (drafts that need no model).

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
        self._tokenizer = tokenizer

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
        """One row of bitmask per sampling row: a request verifying drafts (req.spec_token_ids) has
        1 + len(drafts) rows in a row, the j-th its allowed tokens after its first j drafts; every other
        request one row, its allowed next tokens. Rows without a grammar are all ones. None when no request
        has one. bitmask: a CPU int32 buffer with >= len(reqs) rows."""
        batch, through = [], []  # first rows of requests without drafts / with drafts, under a live grammar
        i = 0
        while i < len(reqs):
            req = reqs[i]
            # a terminated grammar (it took EOS, and ignore_eos kept the request going) constrains nothing
            if req.grammar is not None and not req.grammar.is_terminated():
                (through if req.spec_token_ids else batch).append(i)
            i += 1 + len(req.spec_token_ids)
        if not batch and not through:
            return None
        out = bitmask[: len(reqs)]
        if len(batch) < len(reqs):
            out.fill_(-1)
        if batch:
            self.batch.batch_fill_next_token_bitmask([reqs[i].grammar for i in batch], out, batch)
        for i in through:
            _fill_through_drafts(reqs[i].grammar, reqs[i].spec_token_ids, out, i)
        return out

    def jump_forward_tokens(self, matcher: xgr.GrammarMatcher) -> list[int]:
        """The tokens of the text the grammar forces from matcher's state (e.g. '{"name": "' where a schema
        opens with a required key), as the tokenizer encodes that text; [] when nothing is forced or the
        encoding does not give the text back. The tokenizer's encoding is how the model saw such text in
        training, so it is the likeliest to be what the model produces; where it is not (the model would
        split the text otherwise, or extend its last token into the free text after it), verification
        rejects the draft from there on, so the output stays the model's own either way."""
        text = matcher.find_jump_forward_string()
        if not text:
            return []
        ids = self._tokenizer.encode(text, add_special_tokens=False)
        return ids if self._tokenizer.decode(ids) == text else []

def _fill_through_drafts(matcher: xgr.GrammarMatcher, drafts: list[int], out: torch.Tensor, row: int) -> None:
    """Rows row .. row + len(drafts) of out: the matcher's mask after each prefix of drafts; matcher is left
    as it was. Rows after a draft the grammar refuses, or after it terminated, stay as they are (all ones):
    the row of the refused draft masks it out, so verification rejects it and never samples them."""
    n = 0
    for j in range(len(drafts) + 1):
        if matcher.is_terminated():
            break
        matcher.fill_next_token_bitmask(out, row + j)
        if j == len(drafts) or not matcher.accept_token(drafts[j]):
            break
        n += 1
    if n:
        matcher.rollback(n)


def _digest(key: tuple[str, str]) -> str:
    """The cache's key for a grammar: a hash, so the cache does not hold every schema's text."""
    kind, text = key
    return hashlib.sha256(f"{kind}\0{text}".encode()).hexdigest()
