"""llguidance's view of the server's tokenizer (grammar.py builds its matchers over it), made from the tokenizer the
server already holds.

llguidance's own constructor for a Hugging Face tokenizer (`llguidance.hf.from_tokenizer`) serializes the tokenizer
to JSON and parses a second copy of it in Rust: on Qwen2.5's 152k vocabulary that view held about 90 MiB resident
(the server's own tokenizer about 60), and dropping it gave most of it back to nobody (Rust's heap kept it). What a
matcher needs of a tokenizer is each token's bytes, which ids are special, and a way to tokenize a string. For a
byte-level BPE (Qwen2/2.5/3, Llama 3, SmolLM2: `_byte_level`) the bytes come from the vocabulary's own strings through
GPT-2's byte-to-character table, and tokenizing calls back into the server's tokenizer: about 6 MiB for the same
vocabulary, and the same view (tests/test_grammar_vocab.py holds it against llguidance's own token by token and mask by
mask). Any other tokenizer (SentencePiece's: Llama 2, Mistral, Gemma, Phi-3) gets llguidance's own view.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from functools import cache

import llguidance
import llguidance.hf


@cache
def _byte_of_char() -> dict[str, int]:
    """GPT-2's byte-level table inverted: the character each byte is written as in a byte-level vocabulary -> the
    byte. Printable Latin-1 bytes stand for themselves, the other 68 for the characters from U+0100 on, in order."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {chr(b): b for b in kept}
    shifted = [b for b in range(256) if b not in table.values()]
    table.update({chr(0x100 + i): b for i, b in enumerate(shifted)})
    return table


def _byte_level(tokenizer) -> bool:
    """Whether the tokenizer is a byte-level BPE that tokenizes a piece of text as it stands: decoded by GPT-2's
    byte table alone, with no space put before the text (no `add_prefix_space` pre-tokenizer, no `Prepend`
    normalizer). llguidance tokenizes fragments of a text (a grammar's forced bytes) and its own view drops such a
    prefix; a SentencePiece tokenizer (`▁` prepended) keeps llguidance's own view."""
    backend = tokenizer.backend_tokenizer
    decoder = json.loads(backend.decoder.__getstate__()) if backend.decoder is not None else {}
    if decoder.get("type") != "ByteLevel":
        return False
    parts = (backend.pre_tokenizer, backend.normalizer)
    text = json.dumps([json.loads(part.__getstate__()) for part in parts if part is not None])
    return '"add_prefix_space": true' not in text and '"Prepend"' not in text


def token_bytes(tokenizer) -> tuple[list[bytes], list[int]] | None:
    """Every id's bytes (`len(tokenizer)` of them) and the ids a matcher treats as special (every added token, as
    llguidance's own view does: a grammar's text never spells one), as a matcher reads them; None where the
    tokenizer is not `_byte_level`."""
    if not _byte_level(tokenizer):
        return None
    added = tokenizer.added_tokens_decoder  # id -> AddedToken: its text as it is, not byte-level written
    pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    table = _byte_of_char()
    out: list[bytes] = []
    for i, piece in enumerate(pieces):
        if i in added:
            out.append(added[i].content.encode())
        elif piece is None:
            out.append(b"")
        else:
            out.append(bytes(table[c] for c in piece) if all(c in table for c in piece) else piece.encode())
    special = {i for i in added if i < len(out)}  # every added token, as llguidance's own view marks them
    # byte 0xFF starts llguidance's name of a special token (never UTF-8): a token of that byte (byte-level
    # vocabularies with all 256 bytes have one) is, as llguidance's own view makes it, a special token of no text
    marked = {i for i, b in enumerate(out) if b.startswith(b"\xff")}
    for i in marked:
        out[i] = b""
    return out, sorted(special | marked)


class _Vocabulary:
    """What llguidance's `TokenizerWrapper` reads of a tokenizer: the ids' bytes, the special ids, EOS and BOS, and
    a call that tokenizes a string (the server's tokenizer, without BOS or other added ids)."""

    def __init__(self, tokenizer, tokens: list[bytes], special: list[int]) -> None:
        self._tokenizer = tokenizer
        self.tokens = tokens
        self.special_token_ids = special
        self.eos_token_id = tokenizer.eos_token_id
        self.bos_token_id = tokenizer.bos_token_id

    def __call__(self, text: str) -> list[int]:
        if not isinstance(text, str):  # the wrapper probes with bytes, then hands over strings
            raise TypeError("a string")
        return self._tokenizer.encode(text, add_special_tokens=False)


def token_view(tokenizer, n_vocab: int | None, eos: Sequence[int], slices: list[str] | None) -> llguidance.LLTokenizer:
    """llguidance's tokenizer for `tokenizer`: over its own strings and tokenizing calls where its decoding allows
    (module doc), else llguidance's own view. `n_vocab`: the logits' width where wider than the tokenizer (the ids
    past it never match); `slices` as `llguidance.LLTokenizer` takes them."""
    made = token_bytes(tokenizer)
    if made is None:
        return llguidance.hf.from_tokenizer(tokenizer, n_vocab=n_vocab, eos_token=list(eos), slices=slices)
    tokens, special = made
    if n_vocab is not None and n_vocab > len(tokens):
        tokens = tokens + [b""] * (n_vocab - len(tokens))
    wrapper = llguidance.TokenizerWrapper(_Vocabulary(tokenizer, tokens, special))
    return llguidance.LLTokenizer(wrapper, n_vocab=n_vocab, eos_token=list(eos), slices=slices)
