"""A `tokenizers.Tokenizer` rebuilt from GGUF vocabulary metadata, producing llama.cpp's token ids.

Two vocabulary kinds (`tokenizer.ggml.model`):

- `gpt2`: byte-level BPE. The text is split by the regexes its `tokenizer.ggml.pre` type names (the table below,
  learnt from llama.cpp's `llama-vocab.cpp`; each regex splits every piece the previous one left, keeping matches
  and the gaps between them), then merged by rank. Types llama.cpp marks `ignore_merges` (Llama-3, Tekken, ...)
  emit a pre-token that is itself in the vocabulary as that one id, before any merge.
- `llama`: SentencePiece BPE (Llama-2, Mistral, TinyLlama, Gemma). See `_sentencepiece`.
- `gemma4`: BPE over `▁`-spelt text with `<0xXX>` byte fallback (Gemma 4). See `_gemma4`.

Control and user-defined tokens are kept verbatim and matched whole inside text, as transformers does (llama.cpp
with parse_special, the mode chat templates need).
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tokenizers import (
    AddedToken,
    Regex,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
)
from tokenizers import Tokenizer as HFTokenizer

logger = logging.getLogger(__name__)

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6  # llama.cpp token types

# Split regexes, in the form the models' own tokenizer.json files write them (Oniguruma, as HF tokenizers runs).
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_CONTRACTIONS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
_LLAMA3 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN2 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN35 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+"
           r"|\s+(?!\S)|\s+")
_UPPER, _LOWER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]", r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
_CASED_WORDS = (  # tekken / gpt-4o: upper-case letters then lower-case ones are one word; $ = a suffix
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+$|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*$")
_TEKKEN = _CASED_WORDS.replace("$", "") + r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_GPT4O = (_CASED_WORDS.replace("$", _CONTRACTIONS + "?")
          + r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_BLOOM = r" ?[^(\s|.,!?\x{2026}\x{3002}\x{FF0C}\x{3001}\x{964}\x{6D4}\x{60C})]+"
_CJK = r"[\x{4E00}-\x{9FA5}\x{800}-\x{4E00}\x{AC00}-\x{D7FF}]+"
_DEEPSEEK_LETTERS = (  # deepseek-llm's letters, copied as code points (some have canonical decompositions)
    r"\s?[A-Za-z\x{B5}\x{C0}-\x{D6}\x{D8}-\x{F6}\x{F8}-\x{1BA}\x{1BC}-\x{1BF}\x{1C4}-\x{293}\x{295}-\x{2AF}"
    r"\x{370}-\x{373}\x{376}\x{377}\x{37B}-\x{37D}\x{37F}\x{386}\x{388}-\x{38A}\x{38C}\x{38E}-\x{3A1}"
    r"\x{3A3}-\x{3F5}\x{3F7}-\x{481}\x{48A}-\x{52F}\x{531}-\x{556}\x{10A0}-\x{10C5}\x{13A0}-\x{13F5}"
    r"\x{13F8}-\x{13FD}\x{1C90}-\x{1CBA}\x{1CBD}-\x{1CBF}\x{1D00}-\x{1D2B}\x{1D6B}-\x{1D77}\x{1D79}-\x{1D9A}"
    r"\x{1E00}-\x{1F15}\x{1F18}-\x{1F1D}\x{1F20}-\x{1F45}\x{1F48}-\x{1F4D}\x{1F50}-\x{1F57}\x{1F59}\x{1F5B}"
    r"\x{1F5D}\x{1F5F}-\x{1F7D}\x{1F80}-\x{1FB4}\x{1FB6}-\x{1FBC}\x{1FBE}\x{1FC2}-\x{1FC4}\x{1FC6}-\x{1FCC}"
    r"\x{1FD0}-\x{1FD3}\x{1FD6}-\x{1FDB}\x{1FE0}-\x{1FEC}\x{1FF2}-\x{1FF4}\x{1FF6}-\x{1FFC}\x{2102}\x{2107}"
    r"\x{210A}-\x{2113}\x{2115}\x{2119}-\x{211D}\x{2124}\x{2126}\x{2128}\x{212A}-\x{212D}\x{212F}-\x{2134}"
    r"\x{2139}\x{213C}-\x{213F}\x{2145}-\x{2149}\x{214E}\x{2183}\x{2184}\x{2C00}-\x{2C7B}\x{2C7E}-\x{2CE4}"
    r"\x{2CEB}-\x{2CEE}\x{2CF2}\x{2CF3}\x{A640}-\x{A66D}\x{A680}-\x{A69B}\x{A722}-\x{A76F}\x{A771}-\x{A787}"
    r"\x{A78B}-\x{A78E}\x{AB70}-\x{ABBF}\x{FB00}-\x{FB06}\x{FB13}-\x{FB17}\x{FF21}-\x{FF3A}\x{FF41}-\x{FF5A}"
    r"\x{10400}-\x{1044F}\x{104B0}-\x{104D3}\x{104D8}-\x{104FB}\x{10C80}-\x{10CB2}\x{10CC0}-\x{10CF2}"
    r"\x{118A0}-\x{118DF}\x{1E900}-\x{1E943}]+"
)
_DEEPSEEK_PUNCT = r"\s?[!-/:-~\x{FF01}-\x{FF0F}\x{FF1A}-\x{FF5E}\x{2018}-\x{201F}\x{3000}-\x{3002}]+"
_KANA_HAN = r"[\x{4E00}-\x{9FA5}\x{3040}-\x{309F}\x{30A0}-\x{30FF}]+"
_DEEPSEEK3_WORDS = (r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
                    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


@dataclass(frozen=True)
class PreTokenizer:
    """How one `tokenizer.ggml.pre` type splits text before BPE (llama.cpp's flags for it included)."""

    splits: tuple[str, ...]
    ignore_merges: bool = False  # a pre-token found whole in the vocabulary is one id (no merging)
    add_bos: bool = False  # llama.cpp's default when the file has no tokenizer.ggml.add_bos_token


def _types(names: str, *splits: str, **flags: bool) -> dict[str, PreTokenizer]:
    return dict.fromkeys(names.split(), PreTokenizer(splits, **flags))


PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    **_types("default", r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"),
    **_types("gpt-2 phi-2 mpt olmo jais trillion granite-docling exaone4 jina-es jina-de jina-v2-es jina-v2-de "
             "jina-v1-en jina-v2-code roberta-bpe gigachat a.x-4.0 mellum modern-bert", _GPT2),
    **_types("starcoder refact command-r smollm codeshell exaone minerva-7b mellum2", r"\p{N}", _GPT2),
    **_types("falcon", r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]"),
    **_types("llama3 llama-v3 llama-bpe falcon3 falcon-h1 pixtral midm-2.0 lfm2 jina-v5-nano", _LLAMA3,
             ignore_merges=True, add_bos=True),
    **_types("dbrx smaug-bpe chatglm-bpe", _LLAMA3),
    **_types("glm4 glm5", _LLAMA3, ignore_merges=True),
    **_types("qwen2 deepseek-r1-qwen kormo f2llmv2 megrez stablelm2 hunyuan solar-open grok-2", _QWEN2),
    **_types("qwen35", _QWEN35),
    **_types("deepseek-llm", r"[\r\n]", _DEEPSEEK_LETTERS, _DEEPSEEK_PUNCT, r"\s+$", _CJK,
             r"\p{N}+"),
    **_types("deepseek-coder", r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK, r"\p{N}"),
    **_types("deepseek-v3 hunyuan-dense joyai-llm hy_v4", r"\p{N}{1,3}", _KANA_HAN, _DEEPSEEK3_WORDS),
    **_types("poro-chat bloom gpt3-finnish", _BLOOM),
    **_types("viking", _BLOOM, r"\p{N}"),
    **_types("tekken", _TEKKEN, ignore_merges=True, add_bos=True),
    **_types("gpt-4o llama4 kanana2 talkie minimax-m2", _GPT4O),
    **_types("chameleon", r"<sentinel:[0-9]+>", r"(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z", r"([\t\n]|    |  )",
             r"\p{N}", r"[\p{P}!-/:-@\[-`{-~]", _GPT2, add_bos=True),
    **_types("seed-coder", _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+"
             r"|\s+(?!\S)|\s+"),
    **_types("bailingmoe bailingmoe2 llada-moe", r"'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}"
             r"| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"),
    **_types("ufakzeka", r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"),
    **_types("laguna", r"[^\n]+|[\n]+", _QWEN2),
    **_types("minicpm5", r"\p{N}{1,3}", _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}+"
             r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+", ignore_merges=True),
    **_types("tiny_aya cohere2moe", r"\d{1,3}(?=(?:\d{3})*\b)", _GPT4O),
}


def gguf_tokenizer(meta: Callable[..., Any]) -> tuple[HFTokenizer, dict[str, Any]]:
    """A `tokenizers.Tokenizer` and a tokenizer_config-like dict from GGUF metadata (meta(key, default) -> value)."""
    kind = meta("tokenizer.ggml.model")
    tokens: list[str] = list(meta("tokenizer.ggml.tokens"))
    types = list(meta("tokenizer.ggml.token_type") or [NORMAL] * len(tokens))
    if kind == "gpt2":
        tok, add_bos_default = _byte_level_bpe(tokens, types, meta)
    elif kind == "llama":
        tok, add_bos_default = _sentencepiece(tokens, types, meta), True
    elif kind == "gemma4":
        tok, add_bos_default = _gemma4(tokens, meta), True
    else:
        raise ValueError(f"GGUF tokenizer model {kind!r} is not supported (gpt2, llama, gemma4)")
    # Verbatim, whole, never split by the model: control tokens as specials, user-defined ones as plain added tokens.
    lstrip, rstrip = _whitespace_eaters(meta, tokens, types)
    for ty, add in ((CONTROL, tok.add_special_tokens), (USER_DEFINED, tok.add_tokens)):
        add([AddedToken(t, normalized=False, special=ty == CONTROL, lstrip=t in lstrip, rstrip=t in rstrip)
             for t, tt in zip(tokens, types) if tt == ty])

    def name(key: str) -> str | None:
        i = meta(f"tokenizer.ggml.{key}_token_id")
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    config = {
        "bos_token": name("bos"),
        "eos_token": name("eos"),
        "unk_token": name("unknown"),
        "pad_token": name("padding"),
        # llama.cpp always adds BOS for Gemma 4, whatever the file says (Gemma 4 degrades without it).
        "add_bos_token": True if kind == "gemma4" else meta("tokenizer.ggml.add_bos_token", add_bos_default),
        "add_eos_token": meta("tokenizer.ggml.add_eos_token", False),
        "chat_template": meta("tokenizer.chat_template"),
    }
    eos_ids = [meta(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    config["extra_eos_ids"] = [int(i) for i in eos_ids if i is not None]
    _set_post_processor(tok, config)
    return tok, config


def _whitespace_eaters(meta, tokens: list[str], types: list[int]) -> tuple[set[str], set[str]]:
    """Tokens that swallow the whitespace before (lstrip) / after (rstrip) them, as their models' tokenizer.json
    says. GGUF does not store this; llama.cpp sets it by model name, and so do we."""
    name = (meta("general.name") or "").lower()
    if "phi-3" in name or "phi3" in name:  # Phi-3's chat tokens: "<|user|>\nHi<|end|>\n" has no newline tokens
        rstrip = {t for t, ty in zip(tokens, types) if ty in (CONTROL, USER_DEFINED)} | {"</s>"}
        return set(), rstrip - {"<unk>", "<s>", "<|endoftext|>"}
    if any(p in (meta("tokenizer.ggml.pre") or "") for p in ("jina-v2-de", "jina-v2-es", "jina-v2-code")):
        return {"<mask>"}, set()
    return set(), set()


def _byte_level_bpe(tokens: list[str], types: list[int], meta) -> tuple[HFTokenizer, bool]:
    """GPT-2-style BPE: normal tokens are stored byte-level spelled (Ġ for space), others verbatim."""
    pre_name = meta("tokenizer.ggml.pre")
    if pre_name is None:  # what llama.cpp does, loudly, for files converted before the key existed
        logger.warning("GGUF vocabulary has no tokenizer.ggml.pre; using llama.cpp's 'default' pre-tokenizer")
        pre_name = "default"
    pre = PRE_TOKENIZERS.get(pre_name)
    if pre is None:
        raise ValueError(f"GGUF pre-tokenizer type {pre_name!r} is not supported "
                         f"(supported: {', '.join(sorted(PRE_TOKENIZERS))})")
    merges = [tuple(m.split(" ", 1)) for m in (meta("tokenizer.ggml.merges") or [])]
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = HFTokenizer(models.BPE(vocab, merges, fuse_unk=False, ignore_merges=pre.ignore_merges))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in pre.splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    return tok, pre.add_bos


def _sentencepiece(tokens: list[str], types: list[int], meta) -> HFTokenizer:
    """SentencePiece BPE as llama.cpp's `llm_tokenizer_spm` runs it, expressed as a `tokenizers` BPE.

    llama.cpp (like SentencePiece) prefixes each run of text with one space when `add_space_prefix` says so (at the
    start and after every special token), spells spaces `▁`, then over the whole run repeatedly merges the adjacent
    pair whose concatenation is the highest-scoring vocabulary entry (leftmost on ties); characters that end up in
    no entry become their `<0xXX>` byte tokens. A `tokenizers` BPE performs the same merges given every split
    (left, right) of every entry with both halves in the vocabulary, ranked by the entry's score: the lowest rank
    it merges first is the highest score, leftmost on ties. The two orders differ only between two splits of one
    entry that are both adjacent at once (X+Y == Y+X, e.g. "▁ ▁▁" and "▁▁ ▁"), where SentencePiece takes the
    leftmost and the BPE the split with the shorter left half, and between two entries of equal score (ranked by
    id here); vocabularies SentencePiece trains give every entry its own score. A Unigram model would not do: it
    maximises the summed score of the whole segmentation, which is not what merging by score produces.
    """
    scores = list(meta("tokenizer.ggml.scores") or [0.0] * len(tokens))
    vocab = {t: i for i, t in enumerate(tokens)}
    mergeable = {t for t, ty in zip(tokens, types) if ty in (NORMAL, USER_DEFINED, UNUSED)}
    by_score = sorted((i for i, t in enumerate(tokens) if t in mergeable), key=lambda i: (-scores[i], i))
    merges = [(t[:cut], t[cut:]) for t in map(tokens.__getitem__, by_score)
              for cut in range(1, len(t)) if t[:cut] in mergeable and t[cut:] in mergeable]
    unk_id = meta("tokenizer.ggml.unknown_token_id")
    byte_fallback = any(ty == BYTE for ty in types)
    tok = HFTokenizer(models.BPE(vocab, merges, unk_token=tokens[unk_id] if unk_id is not None else None,
                                 fuse_unk=True, byte_fallback=byte_fallback))
    space_prefix = bool(meta("tokenizer.ggml.add_space_prefix", True))
    spaces = normalizers.Replace(" ", "▁")
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), spaces]) if space_prefix else spaces
    tok.pre_tokenizer = None
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
                                    + ([decoders.Strip(content=" ", left=1, right=0)] if space_prefix else []))
    return tok


def _gemma4(tokens: list[str], meta) -> HFTokenizer:
    """Gemma 4's BPE as llama.cpp's `gemma4` tokenizer runs it, expressed as a `tokenizers` BPE.

    llama.cpp spells every space `▁` (no prefix space), cuts the text into runs of newlines and runs of
    everything else, and merges each run by the file's merge ranks (lowest first, leftmost on ties), starting
    from single characters; a final piece missing from the vocabulary becomes its `<0xXX>` byte tokens. One
    exception: a run of newlines that is itself a token is that token, whatever the merges make of it. A
    `tokenizers` BPE does all of this but the exception; `_newline_runs` arranges that part.
    """
    vocab = {t: i for i, t in enumerate(tokens)}
    merges: dict[tuple[str, str], None] = {}  # in rank order; a repeated pair keeps its first rank, as in llama.cpp
    for m in meta("tokenizer.ggml.merges") or []:
        cut = m.find(" ", 1)  # llama.cpp's split: the first space after the first character
        left, right = (m[:cut], m[cut + 1:]) if cut > 0 else ("", "")
        if left in vocab and right in vocab and left + right in vocab:  # others could only yield bytes
            merges.setdefault((left, right))
    split, extra = _newline_runs(vocab, list(merges))
    tok = HFTokenizer(models.BPE(vocab, extra + list(merges), fuse_unk=False, byte_fallback=True, ignore_merges=False))
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(split), behavior="isolated")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    return tok


def _newline_runs(vocab: dict[str, int], merges: list[tuple[str, str]]) -> tuple[str, list[tuple[str, str]]]:
    """The pre-tokenizer regex and the merges to put first that make a newline run of length 1..K (all tokens)
    one token, as llama.cpp does, and leave longer runs to the file's merges (llama.cpp merges those)."""
    k = 0
    while "\n" * (k + 1) in vocab:
        k += 1
    newline_merges = [(a, b) for a, b in merges if a.strip("\n") == b.strip("\n") == ""]
    if k < 2 or all(_bpe_newlines(n, newline_merges) == 1 for n in range(2, k + 1)):
        return r"\n+", []  # the file's own merges already give each whole-run token
    have = set(newline_merges)
    extra = [m for n in range(2, k + 1) for a in range(1, n) if (m := ("\n" * a, "\n" * (n - a))) not in have]
    if not newline_merges:
        # No newline merges: llama.cpp leaves a run longer than K as single newlines. Cutting such runs into
        # single newlines here keeps the added merges (which would join them) to runs of 1..K.
        return rf"(?<!\n)\n{{1,{k}}}(?!\n)|\n", extra
    logger.warning("GGUF gemma4 vocabulary: newline runs longer than %d may tokenize differently from llama.cpp", k)
    return r"\n+", extra


def _bpe_newlines(n: int, merges: list[tuple[str, str]]) -> int:
    """How many pieces BPE by these merges' ranks leaves of a run of n newlines."""
    rank = {m: i for i, m in enumerate(merges)}
    pieces = ["\n"] * n
    while True:
        best = min(((rank[p], i) for i, p in enumerate(zip(pieces, pieces[1:])) if p in rank), default=None)
        if best is None:
            return len(pieces)
        i = best[1]
        pieces[i:i + 2] = [pieces[i] + pieces[i + 1]]


def _set_post_processor(tok: HFTokenizer, config: dict[str, Any]) -> None:
    """BOS/EOS added by encode(add_special_tokens=True), as add_bos_token/add_eos_token say."""
    bos = config["bos_token"] if config.get("add_bos_token") else None
    eos = config["eos_token"] if config.get("add_eos_token") else None
    single = " ".join(([f"{bos}:0"] if bos else []) + ["$A:0"] + ([f"{eos}:0"] if eos else []))
    special = [(t, tok.token_to_id(t)) for t in (bos, eos) if t]
    tok.post_processor = processors.TemplateProcessing(single=single, special_tokens=special)
