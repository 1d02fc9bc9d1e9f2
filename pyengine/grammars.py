"""Compiling a structured-output request into an xgrammar grammar: the schema checks (keywords xgrammar
would silently ignore, references that point outside the schema) and the compile itself. It runs in the
grammar worker processes (pyengine/grammar_pool.py), so it imports neither the engine nor the pool."""
from __future__ import annotations

import json
import re

import xgrammar as xgr

# JSON schema keywords xgrammar would silently ignore (measured: e.g. multipleOf 2 still accepts 3):
# a schema using one is refused rather than half-enforced.
UNSUPPORTED_KEYWORDS = frozenset({
    "not", "if", "then", "else", "multipleOf", "uniqueItems", "contains", "minContains", "maxContains",
    "dependentRequired", "dependentSchemas", "dependencies", "contentEncoding", "contentMediaType",
    "contentSchema"})
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_SUBSCHEMAS = ("items", "additionalProperties", "unevaluatedProperties", "unevaluatedItems", "propertyNames")


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


def _first_line(e: Exception) -> str:
    """xgrammar's message without its log prefix ("[12:00:00] /path/file.cc:123: ")."""
    text = str(e).strip()
    line = text.splitlines()[0] if text else type(e).__name__
    return re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", line)
