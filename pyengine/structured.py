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
import json
import re
import threading
from collections import OrderedDict

import torch
import xgrammar as xgr

from pyengine.grammar_pool import GrammarPool
from pyengine.sampling_params import StructuredOutputsParams

_CACHE_SIZE = 256  # compiled grammars kept (least recently used first out)
# JSON schema keywords xgrammar would silently ignore (measured: e.g. multipleOf 2 still accepts 3):
# a schema using one is refused rather than half-enforced.
UNSUPPORTED_KEYWORDS = frozenset({
    "not", "if", "then", "else", "multipleOf", "uniqueItems", "contains", "minContains", "maxContains",
    "dependentRequired", "dependentSchemas", "dependencies", "contentEncoding", "contentMediaType",
    "contentSchema"})
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_SUBSCHEMAS = ("items", "additionalProperties", "unevaluatedProperties", "unevaluatedItems", "propertyNames")


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


def compile_grammar(compiler: xgr.GrammarCompiler, kind: str, text: str) -> xgr.CompiledGrammar:
    """Compile one StructuredOutputsParams.key; ValueError naming the problem (runs in a worker process)."""
    what = {"json": "JSON schema", "json_object": "JSON", "regex": "regex", "choice": "choice",
            "grammar": "grammar"}[kind]
    try:
        if kind == "json":
            schema = json.loads(text)
            check_schema(schema)
            check_refs(schema)
            # strict_mode: no properties beyond the schema's (what OpenAI's strict schemas say, and
            # what keeps a small model on track)
            return compiler.compile_json_schema(text, any_whitespace=False)
        if kind == "json_object":
            return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
        if kind == "regex":
            return compiler.compile_regex(text)
        if kind == "choice":
            return compiler.compile_grammar(choice_grammar(json.loads(text)))
        return compiler.compile_grammar(text)
    except (RuntimeError, ValueError, TypeError) as e:  # xgrammar raises RuntimeError subclasses
        raise ValueError(f"invalid {what} for structured output: {_first_line(e)}") from None


def check_schema(schema, path: str = "#") -> None:
    """ValueError naming the first keyword xgrammar cannot enforce (UNSUPPORTED_KEYWORDS), by its path."""
    if not isinstance(schema, dict):
        if isinstance(schema, bool):
            return
        raise ValueError(f"{path} must be a schema object, got {type(schema).__name__}")
    for key in schema:
        if key in UNSUPPORTED_KEYWORDS:
            raise ValueError(f"unsupported keyword {key!r} at {path}")
    for key in _SUBSCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            for name, sub in schema[key].items():
                check_schema(sub, f"{path}/{key}/{name}")
    for key in _SUBSCHEMA_LISTS:
        if isinstance(schema.get(key), list):
            for i, sub in enumerate(schema[key]):
                check_schema(sub, f"{path}/{key}/{i}")
    for key in _SUBSCHEMAS:
        if isinstance(schema.get(key), dict):
            check_schema(schema[key], f"{path}/{key}")


def check_refs(root) -> None:
    """ValueError for a `$ref` xgrammar would not enforce: one outside the schema (a URL or another
    file: xgrammar ignores it and leaves that part unconstrained) or one that names nothing in it."""
    for path, ref in _refs(root, "#"):
        if not ref.startswith("#"):
            raise ValueError(f"$ref {ref!r} at {path} is not supported: only references within the schema "
                             f"('#/$defs/...') are; put the referenced schema under $defs")
        if resolve_ref(root, ref) is None:
            raise ValueError(f"$ref {ref!r} at {path} names nothing in the schema")


def _refs(node, path: str):
    """(path, value) of every $ref under node."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "$ref" and isinstance(value, str):  # (a dict there is a property named "$ref")
                yield path, value
            else:
                yield from _refs(value, f"{path}/{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _refs(value, f"{path}/{i}")


def resolve_ref(root, ref: str):
    """The subschema a local `$ref` ("#", "#/$defs/A", JSON pointer escapes ~0 ~1) names; None if none."""
    node = root
    for part in ref[1:].split("/")[1:] if ref != "#" else []:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node if isinstance(node, (dict, bool)) else None


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose language is exactly the given strings."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _digest(key: tuple[str, str]) -> str:
    """The cache's key for a grammar: a hash, so the cache does not hold every schema's text."""
    kind, text = key
    return hashlib.sha256(f"{kind}\0{text}".encode()).hexdigest()


def _first_line(e: Exception) -> str:
    """xgrammar's message without its log prefix ("[12:00:00] /path/file.cc:123: ")."""
    text = str(e).strip()
    line = text.splitlines()[0] if text else type(e).__name__
    return re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", line)
