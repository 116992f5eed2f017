"""Byte-level BPE tokenizer built from GGUF metadata, matching llama.cpp (MODEL_FORMAT.md §7).

Pipeline, as llama.cpp's `llm_tokenizer_bpe`:
  text -> cut out special tokens (control/unknown only with parse_special; user-defined always)
       -> per remaining fragment: pre-tokenizer regex split -> GPT-2 byte-to-unicode -> BPE by merge rank.
The regex split and the BPE run in the `tokenizers` library; the special-token cut is ours, so that
it follows llama.cpp's rules exactly. No Unicode normalisation (llama.cpp applies none; HF applies NFC).
"""
from __future__ import annotations

import codecs
from typing import Any, Iterable, Mapping, Sequence

from tokenizers import Regex, Tokenizer as HFTokenizer, models, pre_tokenizers

from .errors import HybridError, ModelError
from .metadata import Meta, shown

# llama.cpp's forms (src/llama-vocab.cpp): `(?i:'s|...)` spelled out as character classes.
PRE_TOKENIZER_REGEX = {
    "qwen35": (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
               r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+"),
    "qwen2": (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
              r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
              r"|\s*[\r\n]+|\s+(?!\S)|\s+"),
}

# tokenizer.ggml.token_type values (llama.cpp `llama_token_type`).
UNDEFINED, NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = range(7)

# llama.cpp finds end-of-generation tokens by their text (llama-vocab.cpp, "maintain a list of
# tokens that cause end-of-generation"); every one of them is also forced to the control type.
EOG_TOKEN_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
    "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
    "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
})
# FIM pad / repo / file-separator tokens end generation too; the other FIM tokens are only forced
# to control. Each tuple: (GGUF key that names the id, texts llama.cpp recognises, ends generation).
FIM_TOKENS = (
    ("tokenizer.ggml.fim_pre_token_id",
     ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<PRE>", "<|code_prefix|>"), False),
    ("tokenizer.ggml.fim_suf_token_id",
     ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<SUF>", "<|code_suffix|>"), False),
    ("tokenizer.ggml.fim_mid_token_id",
     ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<MID>", "<|code_middle|>"), False),
    ("tokenizer.ggml.fim_pad_token_id",
     ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"), True),
    ("tokenizer.ggml.fim_rep_token_id",
     ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"), True),
    ("tokenizer.ggml.fim_sep_token_id", ("<|file_sep|>",), True),
)


def _gpt2_byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable code points (the alphabet of the vocab)."""
    printable = list(range(0x21, 0x7F)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


# Translating a vocab string with this table gives code points < 256 equal to the raw bytes,
# so `.encode("latin-1")` turns a byte-level token into its bytes in C speed.
_UNICODE_TO_LATIN1 = {ord(c): b for b, c in _gpt2_byte_to_unicode().items()}


def _byte_level_to_bytes(piece: str) -> bytes:
    try:
        return piece.translate(_UNICODE_TO_LATIN1).encode("latin-1")
    except UnicodeEncodeError:
        # A char outside the byte-level alphabet (a malformed vocab entry): keep it as UTF-8.
        return b"".join(bytes([_UNICODE_TO_LATIN1[ord(c)]]) if ord(c) in _UNICODE_TO_LATIN1
                        else c.encode("utf-8", "surrogateescape") for c in piece)


def _token_piece(text: str, kind: int) -> bytes:
    """Bytes a token stands for, as llama.cpp's token_to_piece(special=True)."""
    if kind == NORMAL:
        return _byte_level_to_bytes(text)
    if kind in (CONTROL, USER_DEFINED, UNKNOWN):
        # stored as plain text, not byte-level encoded; a text that was not UTF-8 in the file
        # was read with surrogateescape and gives back its own bytes
        return text.encode("utf-8", "surrogateescape")
    if kind == BYTE and len(text) == 6 and text.startswith("<0x"):
        return bytes([int(text[3:5], 16)])
    return b""  # unused/undefined tokens print nothing in llama.cpp


class Tokenizer:
    """A GGUF byte-level BPE vocabulary: encode, decode, special and end-of-generation tokens."""

    def __init__(self, tokens: Sequence[str], kinds: Sequence[int], merges: Sequence[tuple[str, str]],
                 pre: str, *, bos_id: int | None, eos_id: int | None, pad_id: int | None,
                 add_bos: bool, add_eos: bool, eog_ids: Iterable[int]):
        if pre not in PRE_TOKENIZER_REGEX:
            raise ModelError(f"pre-tokenizer {shown(pre)} is not supported "
                             f"(supported: {', '.join(PRE_TOKENIZER_REGEX)})")
        self.pre = pre
        self.n_vocab = len(tokens)
        self.bos_id, self.eos_id, self.pad_id = bos_id, eos_id, pad_id
        self.add_bos, self.add_eos = add_bos, add_eos
        self.eog_ids = frozenset(eog_ids)
        self._texts = list(tokens)
        self._kinds = list(kinds)
        self._text_to_id = {t: i for i, t in enumerate(self._texts)}  # later duplicates win, as llama.cpp
        self._pieces = [_token_piece(t, k) for t, k in zip(self._texts, self._kinds)]
        # Longest first, as llama.cpp's special-token cache (ties by id so the order is deterministic).
        self._special = sorted(
            ((i, t) for i, (t, k) in enumerate(zip(self._texts, self._kinds))
             if k in (CONTROL, USER_DEFINED, UNKNOWN)),
            key=lambda it: (-len(it[1].encode("utf-8", "surrogateescape")), it[0]))
        self._bpe = _build_bpe(self._text_to_id, merges, pre)

    # --- construction -------------------------------------------------------------------
    @classmethod
    def from_metadata(cls, meta: Mapping[str, Any]) -> "Tokenizer":
        """Build from GGUF key/value metadata (`tokenizer.ggml.*`)."""
        m = Meta(meta)      # every value type-checked, the key named in any error
        model = m.str("tokenizer.ggml.model", None)
        if model is None:
            raise ModelError("the model file has no tokenizer (tokenizer.ggml.model is missing)")
        if model != "gpt2":
            kind = {"llama": "SentencePiece", "bert": "WordPiece", "t5": "Unigram",
                    "rwkv": "RWKV"}.get(model, "unknown")
            raise ModelError(f"tokenizer model {shown(model)} ({kind}) is not supported: "
                             "only byte-level BPE ('gpt2') tokenizers are")
        pre = m.str("tokenizer.ggml.pre", None)
        if pre is None:
            raise ModelError("tokenizer.ggml.pre is missing: cannot tell which pre-tokenizer the "
                             f"model needs (supported: {', '.join(PRE_TOKENIZER_REGEX)})")
        if pre not in PRE_TOKENIZER_REGEX:
            raise ModelError(f"pre-tokenizer {shown(pre)} is not supported "
                             f"(supported: {', '.join(PRE_TOKENIZER_REGEX)})")

        tokens = m.strs("tokenizer.ggml.tokens", None)
        if tokens is None or len(tokens) == 0:
            raise ModelError("tokenizer.ggml.tokens is missing or empty")
        # llama.cpp renames empty entries so that every text maps to one id.
        tokens = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
        n = len(tokens)
        kinds = m.ints("tokenizer.ggml.token_type", None, lo=-2**31)
        if kinds is None:
            kinds = [NORMAL] * n
        elif len(kinds) < n:
            raise ModelError(f"tokenizer.ggml.token_type has {len(kinds)} entries for {n} tokens")
        kinds = kinds[:n]
        merges = _parse_merges(m.strs("tokenizer.ggml.merges", None))

        def token_id(key: str) -> int | None:
            return m.int(key, None, lo=0, hi=n - 1)

        bos_id = token_id("tokenizer.ggml.bos_token_id")
        eos_id = token_id("tokenizer.ggml.eos_token_id")
        pad_id = token_id("tokenizer.ggml.padding_token_id")
        add_bos = m.bool("tokenizer.ggml.add_bos_token", False)
        add_eos = m.bool("tokenizer.ggml.add_eos_token", False)
        if add_bos and bos_id is None:
            raise ModelError("tokenizer.ggml.add_bos_token is true but there is no bos_token_id")
        if add_eos and eos_id is None:
            raise ModelError("tokenizer.ggml.add_eos_token is true but there is no eos_token_id")

        eog: set[int] = set()
        text_to_id = {t: i for i, t in enumerate(tokens)}
        for key, texts, ends_generation in FIM_TOKENS:
            fim_id = token_id(key)
            if fim_id is None:
                fim_id = next((text_to_id[t] for t in texts if t in text_to_id), None)
            if fim_id is not None:
                if kinds[fim_id] != UNKNOWN:
                    kinds[fim_id] = CONTROL
                if ends_generation:
                    eog.add(fim_id)
        for text in EOG_TOKEN_TEXTS & text_to_id.keys():
            tid = text_to_id[text]
            eog.add(tid)
            if kinds[tid] != UNKNOWN:
                kinds[tid] = CONTROL
        for key in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
            if (tid := token_id(key)) is not None:
                eog.add(tid)
        if eos_id is not None:
            eog.add(eos_id)
        return cls(tokens, kinds, merges, pre, bos_id=bos_id, eos_id=eos_id, pad_id=pad_id,
                   add_bos=add_bos, add_eos=add_eos, eog_ids=eog)

    # --- encode -------------------------------------------------------------------------
    def encode(self, text: str, add_special: bool | None = None,
               parse_special: bool = True) -> list[int]:
        """Token ids of `text`.

        add_special: None adds BOS/EOS as the GGUF asks (add_bos_token/add_eos_token; Qwen asks
        neither); True adds BOS even if the GGUF does not ask (EOS still as the GGUF asks);
        False adds nothing. parse_special: control tokens written in the text (`<|im_start|>`)
        become their ids; False leaves them as plain text. User-defined tokens (`<think>`) are
        always matched whole, as llama.cpp and HF do.
        """
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise HybridError(f"text to tokenize is not valid Unicode: {e.reason} at {e.start}") from None
        want_bos = self.add_bos if add_special is None else add_special
        want_eos = self.add_eos if add_special is not False else False
        if want_bos and self.bos_id is None:
            raise HybridError("this model has no BOS token to add")
        ids: list[int] = [self.bos_id] if want_bos else []
        for fragment in self._split_special(text, parse_special):
            if isinstance(fragment, int):
                ids.append(fragment)
            else:
                ids.extend(self._encode_fragment(fragment))
        if want_eos:
            ids.append(self.eos_id)
        return ids

    def _encode_fragment(self, fragment: str) -> list[int]:
        try:
            return self._bpe.encode(fragment, add_special_tokens=False).ids
        except BaseException as e:
            # a Rust panic (PanicException, a BaseException) on a malformed vocabulary
            if isinstance(e, (KeyboardInterrupt, SystemExit, MemoryError)):
                raise
            raise HybridError(f"the model's tokenizer failed on this text: {shown(str(e))}") from None

    def pre_tokenize(self, text: str) -> list[str]:
        """The words the pre-tokenizer regex cuts `text` into before BPE (special tokens are not
        looked for here): for checking the regex against other implementations."""
        return [text[a:b] for _, (a, b) in self._bpe.pre_tokenizer.pre_tokenize_str(text)]

    def _split_special(self, text: str, parse_special: bool) -> list[str | int]:
        """llama.cpp's tokenizer_st_partition: cut every occurrence of each special token out of
        the raw-text fragments, longest token first."""
        fragments: list[str | int] = [text] if text else []
        for tid, special in self._special:
            if not parse_special and self._kinds[tid] != USER_DEFINED:
                continue
            if special not in text:
                continue
            cut: list[str | int] = []
            for fragment in fragments:
                if isinstance(fragment, int) or special not in fragment:
                    cut.append(fragment)
                    continue
                for k, part in enumerate(fragment.split(special)):
                    if k:
                        cut.append(tid)
                    if part:
                        cut.append(part)
            fragments = cut
        return fragments

    # --- decode -------------------------------------------------------------------------
    def token_bytes(self, token_id: int) -> bytes:
        """The bytes token `token_id` stands for (a control token gives its text)."""
        self._check_id(token_id)
        return self._pieces[token_id]

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        """Text of `ids`; bytes that are not valid UTF-8 become U+FFFD. skip_special drops
        control tokens (`<|im_end|>`) but keeps user-defined ones (`<think>`), as llama.cpp."""
        return b"".join(self._piece(i, skip_special) for i in ids).decode("utf-8", errors="replace")

    def stream_decoder(self, skip_special: bool = False) -> "StreamDecoder":
        return StreamDecoder(self, skip_special)

    def _piece(self, token_id: int, skip_special: bool) -> bytes:
        self._check_id(token_id)
        if skip_special and self._kinds[token_id] in (CONTROL, UNKNOWN):
            return b""
        return self._pieces[token_id]

    def _check_id(self, token_id: int) -> None:
        if not 0 <= token_id < self.n_vocab:
            raise HybridError(f"token id {token_id} is outside the vocabulary of {self.n_vocab} tokens")

    # --- token properties ---------------------------------------------------------------
    def is_eog(self, token_id: int) -> bool:
        return token_id in self.eog_ids

    def is_control(self, token_id: int) -> bool:
        self._check_id(token_id)
        return self._kinds[token_id] in (CONTROL, UNKNOWN)

    def token_text(self, token_id: int) -> str:
        """The vocabulary entry as stored in the GGUF (byte-level encoded for normal tokens)."""
        self._check_id(token_id)
        return self._texts[token_id]

    def token_to_id(self, text: str) -> int | None:
        """Id of the vocabulary entry `text` (e.g. '<|im_end|>'), or None."""
        return self._text_to_id.get(text)


class StreamDecoder:
    """Incremental detokenizer: `push` returns only complete UTF-8 text, holding back the bytes
    of a character that is split across tokens until the rest arrives."""

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = False):
        self._tokenizer = tokenizer
        self._skip_special = skip_special
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        return self._utf8.decode(self._tokenizer._piece(token_id, self._skip_special))

    def flush(self) -> str:
        """Whatever is held back (an incomplete character comes out as U+FFFD)."""
        return self._utf8.decode(b"", final=True)


def _parse_merges(merges: Sequence[str] | None) -> list[tuple[str, str]]:
    if merges is None or len(merges) == 0:
        raise ModelError("tokenizer.ggml.merges is missing: a BPE tokenizer needs its merges")
    pairs = []
    for rank, merge in enumerate(merges):
        # Split at the first space after position 0, as llama.cpp does.
        pos = merge.find(" ", 1)
        if pos < 0:
            raise ModelError(f"tokenizer.ggml.merges[{rank}] = {shown(merge)} is not 'left right'")
        pairs.append((merge[:pos], merge[pos + 1:]))
    return pairs


def _utf8_clean(text: str) -> bool:
    try:
        text.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def _build_bpe(vocab: dict[str, int], merges: list[tuple[str, str]], pre: str):
    # Entries that are not valid UTF-8 (kept with surrogateescape) cannot cross into the Rust
    # library and can never come out of the byte-level pre-tokenizer either: BPE goes without them.
    if not _utf8_clean("".join(vocab)):
        vocab = {t: i for t, i in vocab.items() if _utf8_clean(t)}
    if not _utf8_clean("".join(a + b for a, b in merges)):
        merges = [(a, b) for a, b in merges if _utf8_clean(a + b)]
    # A merge whose parts or result are not in the vocabulary can never apply (llama.cpp finds
    # no id for it either); the library rejects some such merges and panics on others.
    merges = [(a, b) for a, b in merges if a in vocab and b in vocab and a + b in vocab]
    try:
        bpe = HFTokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=False))
    except BaseException as e:
        # The library reports e.g. a merge whose parts are not in the vocab; on some malformed
        # vocabularies its Rust code panics, which reaches Python as pyo3's PanicException, a
        # BaseException: that is the file's fault too. Interrupts and exits pass through.
        if isinstance(e, (KeyboardInterrupt, SystemExit, MemoryError)):
            raise
        raise ModelError(f"the tokenizer vocabulary/merges are inconsistent: {shown(str(e))}") from None
    bpe.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRE_TOKENIZER_REGEX[pre]), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    return bpe
