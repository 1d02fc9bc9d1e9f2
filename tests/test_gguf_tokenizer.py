"""GGUF vocabularies written the way llama.cpp's convert script writes them, tokenized by us and by a reference.

No real Llama/Gemma/DeepSeek tokenizer files are available offline, so each test trains a small one (SentencePiece
BPE with the `sentencepiece` trainer; byte-level BPE with the `tokenizers` trainer), writes its GGUF, and compares
our GGUF-built tokenizer with the trained original on strings that stress every path.
"""
import io
import json
import re

import gguf
import pytest
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, trainers
from tokenizers import Tokenizer as HFTokenizer

from pyengine.gguf_tokenizer import (
    BYTE,
    CONTROL,
    NORMAL,
    PRE_TOKENIZERS,
    UNKNOWN,
    UNUSED,
    USER_DEFINED,
)
from pyengine.tokenizer import Tokenizer

STRESS = [
    "Hello world", "", " ", "  leading spaces\tand\ttabs\n\n\nnewlines   trailing   ",
    "Ünïcödé façade naïve — “quotes” … ¿qué? ß Ωμέγα Кириллица",
    "combining e\u0301 n\u0303 a\u0308\u0304 \u0915\u094d\u0937 Z\u0351\u0362",
    "emoji 😀🎉 ZWJ 👩‍👩‍👧‍👦 🏳️‍🌈 🧑🏽‍💻 flags 🇫🇷🇯🇵 skin 👍🏽",
    "中文测试，日本語のテキスト、한국어 텍스트。全角！ＡＢＣ",
    "digits 1 12 123 1234 12345678901234567890 3.14159 0x1F 1e-5 ١٢٣٤ ⅫⅣ",
    "def f(x):\n    return x**2  # comment\n\tif a != b: print(f'{a!r}')\n\n\n\t\t}\r\n",
    "i'm you'll they'VE it's DON'T CamelCaseWord HTTPServer iPhone",
    "\u00a0\u2003x\u200b y\r\nz", "    \n\n    indented\n" * 3, "a" * 50 + " " + "=" * 33,
]
TRAIN = [s for s in STRESS if s] * 4 + [
    "The quick brown fox jumps over the lazy dog. Hello there, how are you today? I am fine, thank you!",
    "def main():\n    for i in range(10):\n        print(i, 'hello world')\n    return None\n",
    "在中文里，我们说你好世界。日本語では、こんにちは世界と言います。",
    "Numbers like 2024, 1999 and 42 appear often; so do prices: $3.50, €12,99.",
] * 20


def _write_gguf(path, tokens, types, *, model, pre=None, scores=None, merges=None, bos=None, eos=None,
                unk=None, add_bos=None, add_space_prefix=None, name=None) -> str:
    w = gguf.GGUFWriter(str(path), "llama")
    if name is not None:
        w.add_name(name)
    w.add_tokenizer_model(model)
    if pre is not None:
        w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    if scores is not None:
        w.add_token_scores(scores)
    if merges is not None:
        w.add_token_merges(merges)
    for add, value in ((w.add_bos_token_id, bos), (w.add_eos_token_id, eos), (w.add_unk_token_id, unk),
                       (w.add_add_bos_token, add_bos), (w.add_add_space_prefix, add_space_prefix)):
        if value is not None:
            add(value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


# ---------------------------------------------------------------- SentencePiece (`llama`) vocabularies

SPM_SPECIALS = ["<start_of_turn>", "<end_of_turn>"]  # control symbols
SPM_USER = ["<tool>"]  # a user-defined symbol


@pytest.fixture(scope="module", params=[True, False], ids=["space_prefix", "no_space_prefix"])
def spm(request, tmp_path_factory):
    """A Llama-2-like (dummy prefix) or Gemma-like (none) SentencePiece BPE model, its GGUF read by us."""
    sp, path = _spm_gguf(request.param, tmp_path_factory.mktemp("spm"))
    return sp, Tokenizer.from_model_path(path)


def _spm_gguf(space_prefix: bool, folder, name=None):
    import sentencepiece as spm_lib

    model = io.BytesIO()
    spm_lib.SentencePieceTrainer.train(
        sentence_iterator=iter(TRAIN), model_writer=model, model_type="bpe", vocab_size=700, byte_fallback=True,
        hard_vocab_limit=False, character_coverage=0.99, minloglevel=2, normalization_rule_name="identity",
        add_dummy_prefix=space_prefix, remove_extra_whitespaces=False, split_digits=True,
        allow_whitespace_only_pieces=True, control_symbols=SPM_SPECIALS, user_defined_symbols=SPM_USER,
        max_sentencepiece_length=16)
    sp = spm_lib.SentencePieceProcessor(model_proto=model.getvalue())
    tokens, scores, types = [], [], []
    for i in range(sp.get_piece_size()):  # as convert_hf_to_gguf.py's _create_vocab_sentencepiece
        piece = sp.id_to_piece(i)
        tokens.append(piece)
        scores.append(sp.get_score(i))
        types.append(UNKNOWN if sp.is_unknown(i) else CONTROL if sp.is_control(i) else UNUSED if sp.is_unused(i)
                     else BYTE if sp.is_byte(i) else USER_DEFINED if piece in SPM_USER else NORMAL)
    path = _write_gguf(folder / "spm.gguf", tokens, types, model="llama", scores=scores, bos=sp.bos_id(),
                       eos=sp.eos_id(), unk=sp.unk_id(), add_space_prefix=space_prefix, name=name)
    return sp, path


def _spm_reference(sp, text: str) -> list[int]:
    """llama.cpp's rule over SentencePiece: specials and user-defined tokens whole, each text run between them
    encoded on its own (so each gets the dummy prefix, as in Meta's Llama-2 chat format)."""
    whole = SPM_SPECIALS + SPM_USER + ["<s>", "</s>"]
    ids = []
    for part in re.split("(" + "|".join(map(re.escape, whole)) + ")", text):
        if part in whole:
            ids.append(sp.piece_to_id(part))
        elif part:
            ids += sp.encode(part)
    return ids


def test_sentencepiece_matches_sentencepiece(spm):
    sp, ours = spm
    assert ours.bos_token_id == sp.bos_id() and ours.eos_token_ids == [sp.eos_id()]
    texts = STRESS + ["<start_of_turn>user\nhi <tool> there<end_of_turn>\n<start_of_turn>model\n",
                      "</s> after eos<s>x", "  <tool>  ", "x<end_of_turn><end_of_turn>y"]
    fallback = 0
    for text in texts:
        ids = ours.encode(text, add_special_tokens=False)
        assert ids == _spm_reference(sp, text), text
        assert ours.encode(text) == [sp.bos_id()] + ids  # add_bos defaults on for SentencePiece vocabularies
        fallback += sum(sp.is_byte(i) for i in ids)
        if not any(s in text for s in SPM_SPECIALS + SPM_USER + ["<s>", "</s>"]):
            assert ours.decode(ids) == sp.decode(ids) == text, text  # identity normalization round-trips
    assert fallback > 10  # the strings reach characters the model only has as <0xXX> bytes


def test_phi3_chat_tokens_swallow_following_whitespace(tmp_path):
    """llama.cpp (by model name) and Phi-3's tokenizer.json: its chat tokens rstrip, BOS and <unk> do not."""
    sp, path = _spm_gguf(True, tmp_path, name="Phi-3-mini-4k-instruct")
    ours = Tokenizer.from_model_path(path)
    text = "<s> <start_of_turn>\n  user\n<tool>\thi</s>\n"
    expected = _spm_reference(sp, "<s> <start_of_turn>user\n<tool>hi</s>")
    assert ours.encode(text, add_special_tokens=False) == expected


def test_sentencepiece_streams_like_full_decode(spm):
    """`▁` spacing and byte-fallback pieces come out right when decoded token by token."""
    from pyengine.engine.output import IncrementalDetokenizer

    _, ours = spm
    text = "Hello there, 世界 Ωμέγα 👩‍👩‍👧  done\n\tx"
    prompt, out = ours.encode("Say:"), ours.encode(text, add_special_tokens=False)
    d = IncrementalDetokenizer(ours, prompt, [], False, True)
    deltas = []
    for t in out:
        d.add(t)
        deltas.append(d.pop_delta(False))
    deltas.append(d.pop_delta(True))
    assert "".join(deltas) == d.text == ours.decode(prompt + out, skip_special_tokens=True)[len("Say:"):]
    assert all("\ufffd" not in x for x in deltas)


# ---------------------------------------------------------------- byte-level BPE (`gpt2`) vocabularies

def _split(regex: str) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Split(Regex(regex), behavior="isolated")


def _byte_level(*splits) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence([*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


# The pre-tokenizers of the models' own tokenizer.json files (written independently of our table where the HF
# form differs from a regex; the regex types are checked end to end through our table).
REFERENCE_PRE = {
    "gpt-2": pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    "smollm": pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                       pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]),
    "llama-bpe": _byte_level(_split(r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                                    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")),
    "qwen2": _byte_level(_split(r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")),
}
for _name in ("deepseek-llm", "deepseek-coder", "deepseek-r1-qwen", "falcon", "starcoder", "tekken", "command-r",
              "gpt-4o", "refact", "olmo", "dbrx", "jina-v2-code", "mpt", "stablelm2", "chatglm-bpe", "viking",
              "poro-chat", "bloom", "exaone", "chameleon", "minerva-7b", "gpt3-finnish", "codeshell", "default",
              "seed-coder", "bailingmoe", "deepseek-v3", "tiny_aya", "laguna", "minicpm5"):
    REFERENCE_PRE[_name] = _byte_level(*map(_split, PRE_TOKENIZERS[_name].splits))

BPE_SPECIALS = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "<|im_start|>"]
BPE_USER = ["<think>", "</think>"]
WHOLE_WORD = "Ġzebraphone"  # in the vocabulary without merges: only ignore_merges emits it whole


def _train_bpe(pre: pre_tokenizers.PreTokenizer, ignore_merges: bool) -> tuple[HFTokenizer, list]:
    """The trained tokenizer as a reference (plus a whole-word entry and user tokens) and its merges."""
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(TRAIN, trainers.BpeTrainer(
        vocab_size=900, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=BPE_SPECIALS,
        show_progress=False))
    vocab = tok.get_vocab()
    vocab[WHOLE_WORD] = len(vocab)
    for t in BPE_USER:  # added tokens sit in the vocabulary too, as in real tokenizer.json files
        vocab[t] = len(vocab)
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m)
              for m in json.loads(tok.to_str())["model"]["merges"]]
    ref = HFTokenizer(models.BPE(vocab, merges, ignore_merges=ignore_merges))
    ref.pre_tokenizer, ref.decoder = pre, decoders.ByteLevel()
    ref.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in BPE_SPECIALS])
    ref.add_tokens([AddedToken(t, normalized=False) for t in BPE_USER])
    return ref, merges


@pytest.mark.parametrize("pre_name", sorted(REFERENCE_PRE))
def test_byte_level_bpe_matches_tokenizers(pre_name, tmp_path):
    pre = PRE_TOKENIZERS[pre_name]
    ref, merges = _train_bpe(REFERENCE_PRE[pre_name], pre.ignore_merges)
    vocab = ref.get_vocab(with_added_tokens=True)
    tokens = sorted(vocab, key=vocab.get)
    types = [CONTROL if t in BPE_SPECIALS else USER_DEFINED if t in BPE_USER else NORMAL for t in tokens]
    path = _write_gguf(tmp_path / "bpe.gguf", tokens, types, model="gpt2", pre=pre_name,
                       merges=[" ".join(m) for m in merges], bos=0, eos=1, add_bos=True)
    ours = Tokenizer.from_model_path(path)
    assert ours.bos_token == BPE_SPECIALS[0] and ours.bos_token_id == 0 and ours.eos_token_ids == [1]
    texts = STRESS + ["<｜begin▁of▁sentence｜>sys<｜User｜>hi 1+1?<｜Assistant｜><think>\nok</think>2<｜end▁of▁sentence｜>",
                      "x<|im_start|><|im_start|> <think>y", " zebraphone zebraphones"]
    for text in texts:
        ids = ours.encode(text, add_special_tokens=False)
        assert ids == ref.encode(text, add_special_tokens=False).ids, text
        assert ours.encode(text) == [0] + ids
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=False) == text, text
        assert ours.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True), text
    chat = ours.encode(texts[-3], add_special_tokens=False)
    assert chat[:1] == [0] and 2 in chat and 3 in chat and vocab["<think>"] in chat  # kept whole, verbatim
    whole = ours.encode(" zebraphone", add_special_tokens=False)
    assert (whole == [vocab[WHOLE_WORD]]) == pre.ignore_merges


def test_ignore_merges_types():
    assert PRE_TOKENIZERS["llama-bpe"].ignore_merges and PRE_TOKENIZERS["tekken"].ignore_merges
    assert not PRE_TOKENIZERS["qwen2"].ignore_merges


def test_missing_pre_tokenizer_is_llama_cpp_default(tmp_path, caplog):
    path = _write_gguf(tmp_path / "x.gguf", ["a", "b", "ab", "1", "11"], [NORMAL] * 5, model="gpt2",
                       merges=["a b", "1 1"])
    tok = Tokenizer.from_model_path(path)
    assert "no tokenizer.ggml.pre" in caplog.text
    assert tok.encode("ab11") == [2, 4]


def test_unknown_pre_tokenizer_is_an_error(tmp_path):
    path = _write_gguf(tmp_path / "x.gguf", ["a", "b", "ab"], [NORMAL] * 3, model="gpt2", pre="no-such-pre",
                       merges=["a b"])
    with pytest.raises(ValueError, match="pre-tokenizer type 'no-such-pre' is not supported"):
        Tokenizer.from_model_path(path)


# ---------------------------------------------------------------- Gemma 4 (`gemma4`) vocabularies

G4_CONTROL = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<|turn>", "<turn|>"]
G4_USER = ["<|channel>", "<channel|>"]  # user-defined, as Gemma 4's channel and tool tokens
G4_NEWLINES = 4  # "\n" .. "\n\n\n\n" are tokens (Gemma 4 has runs of 1..31)
# Strings of the kinds llama.cpp's ggml-vocab-*.gguf.inp test files hold (newline and space runs, tabs, digits,
# emoji sequences, scripts with combining marks).
LLAMA_CPP_VOCAB_TESTS = [
    "ied 4 ½ months", "Äpfel", "", " ", "  ", "   ", "\t", "\n", "\n\n", "\n\n\n", "\t\n", "Hello world",
    " Hello world", "Hello World", " Hello World", " Hello World!", "Hello, world!", " Hello, world!",
    " this is 🦙.cpp", "w048 7tuijk dsdfhu", "нещо на Български", "កាន់តែពិសេសអាចខលចេញ",
    "🚀 (normal) 😶\u200d🌫️ (multiple emojis concatenated) ✅ (only emoji that has its own token)", "Hello",
    " Hello", "  Hello", "   Hello", "    Hello", "    Hello\n    Hello", " (", "\n =", "' era",
    "Hello, y'all! How are you 😁 ?我想在apple工作1314151天～", "!!!!!!", "3", "33", "333", "3333", "33333",
    "333333", "3333333", "33333333", "333333333", "Cửa Việt", " discards",
    "\n \n\n \n\n\n \t \t\t \t\n  \n   \n    \n     \n🚀 (normal) 😶\u200d🌫️ ✅ 🦙🦙 3 33 333 3333 3.3 3..3 3...3 "
    "កាន់តែពិសេសអាច😁 ?我想在apple工作1314151天～ ------======= нещо ''''''```````\"\"\"\"......!!!!!!?????? "
    "I've been 'told he's there, 'RE you sure? 'M not sure I'll make it, 'D you like some tea? We'Ve a'lL",
]
G4_TEXTS = STRESS + LLAMA_CPP_VOCAB_TESTS + [
    "<|turn>user\nHi <|channel>thought\n\nok<channel|>there<turn|>\n<|turn>model\n",
    "a\nb\n\nc\n\n\nd\n\n\n\ne\n\n\n\n\nf\n\n\n\n\n\n\n\n\ng", "\n", "\n\n\n\n\n", "\n\n x  \n\n\n\n\n\n\n",
    "  <|channel>  <turn|>\n\n<bos>", "tab\there  two  spaces   three",
]


def _gemma4_gguf(folder, newline_merges: str):
    """A small vocabulary shaped as Gemma 4's: control and user-defined tokens, newline runs, <0xXX> bytes and
    BPE pieces trained on `▁`-spelt text over a small alphabet (so that byte fallback happens). newline_merges:
    "none" (no merge joins newlines), "all" (merges build every newline-run token) or "pair" ("\n \n" only)."""
    tok = HFTokenizer(models.BPE())
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.pre_tokenizer = _split(r"\n+")
    tok.train_from_iterator([t.replace("\n", " ") for t in TRAIN], trainers.BpeTrainer(
        vocab_size=600, limit_alphabet=80, show_progress=False))
    trained = tok.get_vocab()
    merges = [m if isinstance(m, str) else " ".join(m) for m in json.loads(tok.to_str())["model"]["merges"]]
    fixed = G4_CONTROL + G4_USER + ["\n" * n for n in range(1, G4_NEWLINES + 1)] + [f"<0x{b:02X}>" for b in range(256)]
    tokens = fixed + [t for t in sorted(trained, key=trained.get) if t not in fixed]
    types = ([CONTROL] * len(G4_CONTROL) + [USER_DEFINED] * len(G4_USER) + [NORMAL] * G4_NEWLINES + [BYTE] * 256
             + [NORMAL] * (len(tokens) - len(fixed)))
    if newline_merges == "all":
        merges += ["\n" * a + " " + "\n" * (n - a) for n in range(2, G4_NEWLINES + 1) for a in range(1, n)]
    elif newline_merges == "pair":
        merges += ["\n \n"]
    path = _write_gguf(folder / "gemma4.gguf", tokens, types, model="gemma4", merges=merges, bos=2, eos=1,
                       add_bos=False)  # llama.cpp adds BOS for Gemma 4 even so
    return tokens, types, merges, path


def _llama_cpp_gemma4(tokens, types, merges, text: str) -> list[int]:
    """llama.cpp's `gemma4` tokenization (llama-vocab.cpp), written out plainly: control and user-defined tokens
    cut out whole (longest first), spaces spelt `▁`, runs of newlines and of other characters tokenized apart;
    a newline run that is a token is that token, anything else is merged by rank (lowest first, leftmost on
    ties) from single characters, and a piece missing from the vocabulary becomes its <0xXX> bytes."""
    vocab = {t: i for i, t in enumerate(tokens)}
    rank = {}
    for i, m in enumerate(merges):
        cut = m.find(" ", 1)
        rank.setdefault((m[:cut], m[cut + 1:]), i)
    specials = sorted((t for t, ty in zip(tokens, types) if ty in (CONTROL, USER_DEFINED)), key=len, reverse=True)
    fragments: list = [text] if text else []
    for special in specials:  # each special splits every text fragment left by the longer ones
        out = []
        for f in fragments:
            if isinstance(f, int):
                out.append(f)
                continue
            parts = f.split(special)
            for j, part in enumerate(parts):
                if j:
                    out.append(vocab[special])
                if part:
                    out.append(part)
        fragments = out
    ids = []
    for f in fragments:
        if isinstance(f, int):
            ids.append(f)
            continue
        for word in re.findall(r"[^\n]+|\n+", f.replace(" ", "▁")):
            if not word.strip("\n") and word in vocab:
                ids.append(vocab[word])
                continue
            pieces = list(word)
            while True:
                found = [(rank[p], i) for i, p in enumerate(zip(pieces, pieces[1:])) if p in rank]
                if not found:
                    break
                i = min(found)[1]
                pieces[i:i + 2] = [pieces[i] + pieces[i + 1]]
            for p in pieces:
                ids += [vocab[p]] if p in vocab else [vocab[f"<0x{b:02X}>"] for b in p.encode()]
    return ids


@pytest.mark.parametrize("newline_merges", ["none", "all"])
def test_gemma4_matches_llama_cpp(newline_merges, tmp_path, caplog):
    tokens, types, merges, path = _gemma4_gguf(tmp_path, newline_merges)
    ours = Tokenizer.from_model_path(path)
    assert "differently" not in caplog.text
    assert ours.bos_token_id == 2 and ours.eos_token_ids == [1]
    fallback = 0
    for text in G4_TEXTS:
        ids = ours.encode(text, add_special_tokens=False)
        assert ids == _llama_cpp_gemma4(tokens, types, merges, text), text
        assert ours.encode(text) == [2] + ids
        fallback += sum(types[i] == BYTE for i in ids)
        if not any(s in text for s in G4_CONTROL + G4_USER):
            assert ours.decode(ids) == text, text
    assert fallback > 10  # the strings reach characters the vocabulary only has as <0xXX> bytes
    nl = tokens.index("\n")
    assert ours.encode("x\n\n\ny", add_special_tokens=False)[1:-1] == [nl + 2]  # a newline-run token, whole
    six = ours.encode("x" + "\n" * 6, add_special_tokens=False)[1:]
    assert six == ([nl] * 6 if newline_merges == "none" else [nl + 3, nl + 1])  # longer: merged as llama.cpp does


def test_gemma4_newline_tokens_whole_when_merges_disagree(tmp_path, caplog):
    """Merges that build the newline-run tokens only in part: runs up to the longest token still match llama.cpp,
    and the load says that longer runs may not."""
    tokens, types, merges, path = _gemma4_gguf(tmp_path, "pair")
    ours = Tokenizer.from_model_path(path)
    assert "newline runs longer than 4 may tokenize differently" in caplog.text
    for text in G4_TEXTS:
        if "\n" * (G4_NEWLINES + 1) not in text:
            assert ours.encode(text, add_special_tokens=False) == _llama_cpp_gemma4(tokens, types, merges, text), text
