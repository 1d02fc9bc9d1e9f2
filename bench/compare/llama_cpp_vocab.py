"""Our GGUF tokenizers against llama.cpp's own tokenizer test data: ids compared string by string.

llama.cpp keeps vocabulary-only GGUF files (`ggml-vocab-<name>.gguf`, no tensors) in its `models/` folder, and
beside most of them `<file>.inp` (test strings separated by the line `__ggml_vocab_test__`) and `<file>.out`
(llama.cpp's ids for each string, one line each). Its `tests/test-tokenizer-0.cpp` tokenizes every string with
`common_tokenize(ctx, text, add_special=false, parse_special=false)`; this script reads the two files as that
test does (same separator and line handling, repeated strings kept once with their last ids) and tokenizes the
same way: no BOS/EOS, and control tokens in the text are plain text (user-defined tokens still match whole).

The folder ships in the llama-cpp-python sdist, under `vendor/llama.cpp/models`:

    pip download --no-deps --no-binary :all: llama-cpp-python && tar xzf llama_cpp_python-*.tar.gz
    python bench/compare/llama_cpp_vocab.py --models llama_cpp_python-*/vendor/llama.cpp/models

Prints one row per vocabulary: its tokenizer model, the number of strings, how many give exactly llama.cpp's
ids, and the first string that does not (ours against llama.cpp's). Vocabularies we cannot load are listed as
"unsupported" with the reason. Exits 1 when any supported vocabulary has a mismatch.
"""
from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the checkout

from pyengine.gguf_tokenizer import gguf_tokenizer  # noqa: E402
from pyengine.model.gguf import open_gguf  # noqa: E402

SEPARATOR = "\n__ggml_vocab_test__\n"


@dataclass
class Result:
    """One vocabulary's comparison (unsupported set when we cannot load it)."""

    vocab: str
    model: str
    strings: int
    matches: int = 0
    first_mismatch: str = ""
    unsupported: str = ""


def _parts(text: str, sep: str) -> list[str]:
    """`text` cut at `sep` as test-tokenizer-0.cpp's read_tests cuts it: a trailing separator (or an empty
    file) yields no empty last part."""
    parts = text.split(sep)
    return parts[:-1] if parts[-1] == "" else parts


def read_tests(vocab: Path) -> dict[str, list[int]]:
    """The test strings and llama.cpp's ids for them, keyed as test-tokenizer-0.cpp's std::map (last wins).
    Read as bytes: text mode would turn a test string's "\\r\\n" into "\\n"."""
    inputs = _parts(Path(f"{vocab}.inp").read_bytes().decode(), SEPARATOR)
    outputs = _parts(Path(f"{vocab}.out").read_bytes().decode(), "\n")
    if len(inputs) != len(outputs):
        raise ValueError(f"{vocab.name}: {len(inputs)} strings in .inp but {len(outputs)} lines in .out")
    return {text: [int(t) for t in line.strip().split(" ")] if line.strip() else []
            for text, line in zip(inputs, outputs)}


def model_name(meta: Callable[..., Any]) -> str:
    """The vocabulary's tokenizer model, with its pre-tokenizer type when the file names one."""
    pre = meta("tokenizer.ggml.pre")
    return str(meta("tokenizer.ggml.model")) + (f" / {pre}" if pre else "")


def compare(vocab: Path) -> Result:
    """Our ids against llama.cpp's for every test string of one vocabulary, tokenized as llama.cpp's test does
    (add_special=false; parse_special=false: control tokens are not matched inside text)."""
    tests = read_tests(vocab)
    meta = open_gguf(str(vocab)).meta
    result = Result(vocab.name.removeprefix("ggml-vocab-").removesuffix(".gguf"), model_name(meta), len(tests))
    try:
        tok, _ = gguf_tokenizer(meta)
    except ValueError as exc:
        result.unsupported = str(exc)
        return result
    tok.encode_special_tokens = True
    for text, expected in tests.items():
        ours = tok.encode(text, add_special_tokens=False).ids
        if ours == expected:
            result.matches += 1
        elif not result.first_mismatch:
            result.first_mismatch = f"{text!r}: ours {ours} vs llama.cpp {expected}"
    return result


def table(results: list[Result]) -> str:
    """A Markdown table of the results."""
    rows = ["| vocab | tokenizer model | strings | exact matches | first mismatch |", "|---|---|---|---|---|"]
    for r in results:
        detail = f"unsupported: {r.unsupported}" if r.unsupported else r.first_mismatch
        matches = "-" if r.unsupported else str(r.matches)
        rows.append(f"| {r.vocab} | {r.model} | {r.strings} | {matches} | {detail.replace('|', '&#124;')} |")
    return "\n".join(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", required=True, type=Path,
                        help="llama.cpp's models folder (vendor/llama.cpp/models in the llama-cpp-python sdist)")
    args = parser.parse_args()
    vocabs = sorted(p for p in args.models.glob("ggml-vocab-*.gguf")
                    if Path(f"{p}.inp").exists() and Path(f"{p}.out").exists())
    if not vocabs:
        parser.error(f"{args.models}: no ggml-vocab-*.gguf with .inp and .out beside it")
    results = [compare(v) for v in vocabs]
    print(table(results))
    return int(any(r.matches != r.strings for r in results if not r.unsupported))


if __name__ == "__main__":
    sys.exit(main())
