"""Tokenizer tests on the trained model's vocabulary.

The oracle is an independent pure-Python byte-level BPE (`reference_encode`): the pre-tokenizer
regex rebuilt with Python's `re` from `unicodedata` categories, GPT-2's byte map, and the textbook
merge-lowest-rank loop. It shares no code with `hybrid.tokenizer` or the `tokenizers` library.
"""
from __future__ import annotations

import re
import sys
import unicodedata

import gguf
import pytest

from hybrid.errors import ModelError
from hybrid.tokenizer import Tokenizer

TEXTS = [
    "Hello, world!",
    "def fib(n: int) -> int:\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "class Foo(object):\n\tpass\n\n\n# comment with  two spaces\r\n",
    "I'm sure you'll see they've DON'T it's we'd THEY'RE",
    "x = 1234567890 + 3.14159e-10",
    "   leading and trailing spaces   ",
    "a  \t\n\n  b   \n\n\n   c\n",
    "日本語のテキストと中文文本",
    "emoji 🎉🚀 and a family 👨‍👩‍👧 and a flag 🇫🇷",
    "accents: café naïve résumé Ångström",
    "decomposed: cafe\u0301 nai\u0308ve",
    "Привет, мир! مرحبا بالعالم สวัสดีครับ",
    "mixed😀text123with456numbers",
    "tabs\tand\u00a0nbsp and\u3000ideographic space",
    "!!! ??? ... ,,, ;;; --- === >>> <<<",
]

# --- the independent oracle ---------------------------------------------------------------

# Unicode's White_Space property, which the regex engines' \s follows (Python's \s also takes
# \x1c-\x1f, so it is not used here).
WS = "\t\n\x0b\x0c\r \x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"


def _category_class(prefix: str) -> str:
    """A character-class body for every code point whose general category starts with `prefix`."""
    ranges, start = [], None
    for cp in range(sys.maxunicode + 2):
        inside = cp <= sys.maxunicode and unicodedata.category(chr(cp)).startswith(prefix)
        if inside and start is None:
            start = cp
        elif not inside and start is not None:
            ranges.append((start, cp - 1))
            start = None
    return "".join(re.escape(chr(a)) if a == b else f"{re.escape(chr(a))}-{re.escape(chr(b))}"
                   for a, b in ranges)


@pytest.fixture(scope="module")
def reference_regex():
    L, M, N = _category_class("L"), _category_class("M"), _category_class("N")
    contractions = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
    tail = rf"|[{WS}]*[\r\n]+|[{WS}]+(?![^{WS}])|[{WS}]+"
    return {
        "qwen35": re.compile(contractions + rf"|[^\r\n{L}{N}]?[{L}{M}]+|[{N}]"
                             rf"| ?[^{WS}{L}{M}{N}]+[\r\n]*" + tail),
        "qwen2": re.compile(contractions + rf"|[^\r\n{L}{N}]?[{L}]+|[{N}]"
                            rf"| ?[^{WS}{L}{N}]+[\r\n]*" + tail),
    }


def _byte_to_unicode():
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def _bpe(word: str, ranks: dict) -> list[str]:
    parts = list(word)
    while len(parts) > 1:
        pairs = [(ranks.get((a, b), float("inf")), i) for i, (a, b) in enumerate(zip(parts, parts[1:]))]
        rank, _ = min(pairs)
        if rank == float("inf"):
            break
        best = min(p for p in pairs if p[0] == rank)[1]
        pair = (parts[best], parts[best + 1])
        merged, i = [], 0
        while i < len(parts):  # GPT-2: merge every occurrence of the best pair, left to right
            if i + 1 < len(parts) and (parts[i], parts[i + 1]) == pair:
                merged.append(parts[i] + parts[i + 1])
                i += 2
            else:
                merged.append(parts[i])
                i += 1
        parts = merged
    return parts


def reference_encode(text: str, meta: dict, regex) -> list[int]:
    vocab = {t: i for i, t in enumerate(meta["tokenizer.ggml.tokens"])}
    ranks = {tuple(m.split(" ", 1)): r for r, m in enumerate(meta["tokenizer.ggml.merges"])}
    b2u = _byte_to_unicode()
    words = [m.group(0) for m in regex.finditer(text)]
    assert "".join(words) == text, "the reference regex must cover the text"
    ids = []
    for word in words:
        ids += [vocab[p] for p in _bpe("".join(b2u[b] for b in word.encode("utf-8")), ranks)]
    return ids


# --- fixtures -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def meta(trained_model_q4km):
    reader = gguf.GGUFReader(trained_model_q4km)
    return {k: f.contents() for k, f in reader.fields.items() if k.startswith("tokenizer.")}


@pytest.fixture(scope="module")
def tok(meta):
    return Tokenizer.from_metadata(meta)


# --- encoding -----------------------------------------------------------------------------

def test_byte_map_oracle_is_gpt2s():
    b2u = _byte_to_unicode()
    assert b2u[ord(" ")] == "Ġ" and b2u[ord("\n")] == "Ċ" and b2u[ord("A")] == "A"
    assert len(set(b2u.values())) == 256


@pytest.mark.parametrize("text", TEXTS)
def test_ids_match_reference_bpe(tok, meta, reference_regex, text):
    assert tok.encode(text) == reference_encode(text, meta, reference_regex["qwen35"])


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tok, text):
    assert tok.decode(tok.encode(text)) == text


MARK_TEXT = "cafe\u0301 nai\u0308ve x\u0301y !\u0301 e\u0301\u0301!"


@pytest.mark.parametrize("pre", ["qwen35", "qwen2"])
def test_regex_split_matches_reference(meta, reference_regex, pre):
    tok = Tokenizer.from_metadata({**meta, "tokenizer.ggml.pre": pre})
    for text in TEXTS + [MARK_TEXT]:
        assert tok.pre_tokenize(text) == reference_regex[pre].findall(text), text
        assert tok.encode(text) == reference_encode(text, meta, reference_regex[pre]), text


def test_qwen35_keeps_combining_marks_with_letters(meta):
    """The one difference between the two regexes: qwen35 keeps a combining accent in its word."""
    qwen2 = Tokenizer.from_metadata({**meta, "tokenizer.ggml.pre": "qwen2"})
    qwen35 = Tokenizer.from_metadata(meta)
    assert qwen35.pre_tokenize("cafe\u0301 x") == ["cafe\u0301", " x"]
    assert qwen2.pre_tokenize("cafe\u0301 x") == ["cafe", "\u0301", " x"]


def test_no_nfc_normalisation(tok):
    """llama.cpp does not normalise: composed and decomposed é give different ids."""
    assert tok.encode("caf\u00e9") != tok.encode("cafe\u0301")
    assert tok.decode(tok.encode("cafe\u0301")) == "cafe\u0301"


def test_digits_are_split_one_by_one(tok):
    ids = tok.encode("1234567890")
    assert [tok.token_bytes(i) for i in ids] == [c.encode() for c in "1234567890"]
    # a space before a number stays its own token: the digits never merge with it
    assert tok.token_bytes(tok.encode(" 42")[-1]) == b"2"


def test_no_bos_added_when_gguf_does_not_ask(tok, meta):
    assert meta["tokenizer.ggml.add_bos_token"] is False
    assert tok.encode("hi")[0] != tok.bos_id
    assert tok.encode("") == []


def test_add_special_forces_bos(meta):
    with_bos = Tokenizer.from_metadata({**meta, "tokenizer.ggml.bos_token_id": 8187,
                                        "tokenizer.ggml.add_bos_token": True})
    assert with_bos.encode("hi")[0] == 8187
    assert with_bos.encode("hi", add_special=False)[0] != 8187
    plain = Tokenizer.from_metadata({**meta, "tokenizer.ggml.bos_token_id": 8187})
    assert plain.encode("hi")[0] != 8187
    assert plain.encode("hi", add_special=True)[0] == 8187


# --- special tokens -----------------------------------------------------------------------

def test_control_tokens_parse_as_single_ids(tok):
    im_start, im_end = tok.token_to_id("<|im_start|>"), tok.token_to_id("<|im_end|>")
    assert (im_start, im_end) == (8188, 8189)
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>\n")
    assert ids[0] == im_start and im_end in ids
    assert ids[1:ids.index(im_end)] == tok.encode("user\nhi")


def test_parse_special_false_leaves_control_tokens_as_text(tok, meta, reference_regex):
    text = "<|im_start|>user<|im_end|>"
    ids = tok.encode(text, parse_special=False)
    assert 8188 not in ids and 8189 not in ids
    assert ids == reference_encode(text, meta, reference_regex["qwen35"])
    assert tok.decode(ids) == text


def test_user_defined_tokens_always_match(tok):
    """`<think>` is user-defined (type 4): llama.cpp matches it even without parse_special."""
    think, end_think = tok.token_to_id("<think>"), tok.token_to_id("</think>")
    assert tok.encode("<think>x</think>", parse_special=False) == [think] + tok.encode("x") + [end_think]


def test_skip_special_drops_control_keeps_user_defined(tok):
    ids = tok.encode("<|im_start|>a<think>b</think><|im_end|>")
    assert tok.decode(ids) == "<|im_start|>a<think>b</think><|im_end|>"
    assert tok.decode(ids, skip_special=True) == "a<think>b</think>"


def test_end_of_generation_set(tok):
    assert tok.eos_id == 8189 and tok.pad_id == 8187
    assert tok.eog_ids == {8187, 8189}  # <|endoftext|>, <|im_end|>
    assert tok.is_eog(8189) and tok.is_eog(8187) and not tok.is_eog(8188)


def test_fim_tokens_end_generation_by_name(meta):
    """llama.cpp adds <|fim_pad|>/<|repo_name|>/<|file_sep|> to the EOG set by their text."""
    extra = ["<|fim_pad|>", "<|repo_name|>", "<|fim_prefix|>"]  # appended as *normal* tokens
    tok = Tokenizer.from_metadata({
        **meta,
        "tokenizer.ggml.tokens": list(meta["tokenizer.ggml.tokens"]) + extra,
        "tokenizer.ggml.token_type": list(meta["tokenizer.ggml.token_type"]) + [1, 1, 1]})
    pad, repo, prefix = 8192, 8193, 8194
    assert {pad, repo} <= tok.eog_ids and prefix not in tok.eog_ids
    assert tok.is_control(pad) and tok.is_control(prefix)  # forced to control, as llama.cpp
    assert tok.encode("<|fim_prefix|>") == [prefix]
    assert tok.encode("<|fim_prefix|>", parse_special=False) != [prefix]


# --- decoding -----------------------------------------------------------------------------

def test_stream_decoder_holds_split_characters(tok):
    text = "日本🎉é"
    ids = tok.encode(text)
    assert len(ids) > len(text), "the test needs characters split across tokens"
    stream = tok.stream_decoder()
    outs = [stream.push(i) for i in ids]
    assert "".join(outs) + stream.flush() == text
    assert "\ufffd" not in "".join(outs)
    assert outs[0] == ""  # the first byte of 日 alone is not a character yet


def test_stream_decoder_flush_reports_an_incomplete_character(tok):
    ids = tok.encode("🎉")
    stream = tok.stream_decoder()
    assert "".join(stream.push(i) for i in ids[:-1]) == ""
    assert stream.flush() == "\ufffd"


def test_invalid_utf8_decodes_to_replacement_characters(tok):
    lead_byte = tok.encode("日")[0]  # 0xE6 alone
    assert tok.token_bytes(lead_byte) == b"\xe6"
    assert tok.decode([lead_byte]) == "\ufffd"
    assert tok.decode([lead_byte] + tok.encode("ok")) == "\ufffdok"


def test_token_bytes_and_bad_ids(tok):
    assert tok.token_bytes(tok.encode(" hello")[0])[:1] == b" "
    assert tok.token_bytes(8188) == b"<|im_start|>"
    assert tok.n_vocab == 8192
    with pytest.raises(Exception, match="outside the vocabulary"):
        tok.decode([8192])
    with pytest.raises(Exception, match="outside the vocabulary"):
        tok.token_bytes(-1)


# --- unsupported files --------------------------------------------------------------------

def test_spm_tokenizer_is_refused(meta):
    with pytest.raises(ModelError, match="'llama'.*SentencePiece"):
        Tokenizer.from_metadata({**meta, "tokenizer.ggml.model": "llama"})


def test_unknown_pre_tokenizer_is_refused_by_name(meta):
    with pytest.raises(ModelError, match="'llama-bpe'"):
        Tokenizer.from_metadata({**meta, "tokenizer.ggml.pre": "llama-bpe"})
    no_pre = {k: v for k, v in meta.items() if k != "tokenizer.ggml.pre"}
    with pytest.raises(ModelError, match="tokenizer.ggml.pre"):
        Tokenizer.from_metadata(no_pre)


def test_missing_tokenizer_and_bad_ids_are_refused(meta):
    with pytest.raises(ModelError, match="no tokenizer"):
        Tokenizer.from_metadata({})
    with pytest.raises(ModelError, match="eos_token_id"):
        Tokenizer.from_metadata({**meta, "tokenizer.ggml.eos_token_id": 10**6})


# --- llama.cpp itself, where it is installed ----------------------------------------------

def test_ids_match_llama_cpp(tok, trained_model_q4km):
    llama_cpp = pytest.importorskip(
        "llama_cpp", reason="llama-cpp-python is not installed (pip install -e .[parity]); "
                            "the reference-BPE tests cover the ids meanwhile")
    llm = llama_cpp.Llama(model_path=str(trained_model_q4km), vocab_only=True, verbose=False)
    for text in TEXTS + ["<|im_start|>user\nhi<|im_end|>\n<think>\n"]:
        assert tok.encode(text) == llm.tokenize(text.encode("utf-8"), add_bos=False, special=True), text
