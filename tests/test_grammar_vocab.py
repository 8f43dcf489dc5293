"""The grammar's tokenizer view made from the server's own tokenizer (server/grammar_vocab.py) is llguidance's own
view, token for token and mask for mask: for SmolLM2's byte-level BPE and for a byte-level vocabulary holding all 256
bytes (0xFF among them: llguidance's marker of special tokens) and a non-special added token. A SentencePiece
vocabulary with byte fallback (Llama 2, Mistral, Gemma) and a byte-level one that adds a prefix space get
llguidance's own view."""

from __future__ import annotations

import json

import llguidance
import llguidance.hf
import numpy as np
import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from server.grammar import Grammars
from server.grammar_vocab import token_bytes, token_view

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "n": {"type": "integer"},
                                           "tags": {"type": "array", "items": {"enum": ["été", "naïve", "a b"]}}},
          "required": ["name", "n", "tags"], "additionalProperties": False}
TEXT = ["the quick brown fox jumps over the lazy dog", "été naïve café {\"name\": \"x\"} 12 34", "日本語 ünïcödé \t\n"]


def byte_fallback_tokenizer() -> PreTrainedTokenizerFast:
    """A Llama-2-style tokenizer: BPE over `▁`-marked pieces, the 256 `<0xNN>` byte pieces in the vocabulary, and
    the decoder Replace(▁, space), ByteFallback, Fuse, Strip."""
    chars = sorted(set("".join(TEXT).replace(" ", "▁")) | set("▁abcdefghijklmnopqrstuvwxyz{}\":,0123456789"))
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"<0x{b:02X}>": 3 + b for b in range(256)}
    vocab |= {c: len(vocab) + i for i, c in enumerate(c for c in chars if c not in vocab)}
    merges = [("▁", "t"), ("h", "e"), ("▁t", "he"), ("▁", "a"), ("e", "r")]
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    backend.add_special_tokens([AddedToken(t, special=True) for t in ("<unk>", "<s>", "</s>")])
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def all_bytes_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE whose vocabulary holds every byte (Qwen's and Llama 3's do; SmolLM2's lacks 0xFF), with a
    special and a non-special added token."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|end|>"])
    backend.train_from_iterator(TEXT * 20, trainer)
    backend.add_tokens([AddedToken("<tool call>", special=False)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|end|>")


def walk(view: llguidance.LLTokenizer, steps: int = 60) -> list[bytes]:
    """The masks of `SCHEMA`'s matcher along one path (at each step the middle allowed token is taken)."""
    matcher = llguidance.LLMatcher(view, llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA)),
                                   log_level=0)
    masks = []
    for _ in range(steps):
        mask = matcher.compute_bitmask()
        masks.append(mask)
        allowed = np.unpackbits(np.frombuffer(mask, dtype=np.uint8), bitorder="little").nonzero()[0]
        if matcher.is_stopped() or not len(allowed):
            break
        assert matcher.consume_token(int(allowed[len(allowed) // 2])), matcher.get_error()
    return masks


def check_same_view(tokenizer) -> None:
    eos = [tokenizer.eos_token_id]
    ours, theirs = token_view(tokenizer, None, eos, []), llguidance.hf.from_tokenizer(tokenizer, eos_token=eos,
                                                                                       slices=[])
    n = theirs.vocab_size
    assert ours.vocab_size == n
    assert [ours.decode_bytes([i]) for i in range(n)] == [theirs.decode_bytes([i]) for i in range(n)]
    assert [i for i in range(n) if ours.is_special_token(i)] == [i for i in range(n) if theirs.is_special_token(i)]
    for text in TEXT + ["<|end|> and <tool call> and </s>"]:
        assert ours.tokenize_str(text) == theirs.tokenize_str(text)
    masks = walk(ours)
    assert len(masks) > 10, "the walk reached into the schema"
    assert masks == walk(theirs)


def test_smollm2_view_is_llguidances_own(tokenizer):
    assert token_bytes(tokenizer) is not None, "byte-level BPE: made from the server's tokenizer"
    check_same_view(tokenizer)


def test_a_vocabulary_with_every_byte_is_llguidances_own():
    tokenizer = all_bytes_tokenizer()
    tokens, special = token_bytes(tokenizer)
    assert b"" in tokens and any(tokens[i] == b"" for i in special), "the 0xFF token: special, no text"
    check_same_view(tokenizer)


def test_other_tokenizers_get_llguidances_own_view():
    """A SentencePiece tokenizer puts `▁` before the text it tokenizes (llguidance's own view drops that prefix for
    the fragments it tokenizes), and a byte-level one may add a space: both keep llguidance's own view."""
    spaced = all_bytes_tokenizer()
    spaced.backend_tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    for tokenizer in (byte_fallback_tokenizer(), spaced):
        assert token_bytes(tokenizer) is None
        view = token_view(tokenizer, None, [tokenizer.eos_token_id], [])
        assert view.vocab_size == len(tokenizer)
        assert view.tokenize_str("the lazy dog") == llguidance.hf.from_tokenizer(tokenizer).tokenize_str("the lazy dog")


@pytest.mark.parametrize("slicer", [True, False])
def test_logits_wider_than_the_tokenizer_never_allow_the_extra_ids(tokenizer, slicer):
    """A model whose logits are padded past its tokenizer: the matcher's masks are that wide, the extra ids never
    allowed (not even where the grammar allows any token)."""
    width = len(tokenizer) + 64
    state = Grammars(tokenizer, width, {tokenizer.eos_token_id}, slicer=slicer).state(
        llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA)))
    text = tokenizer.encode('{"name": "ab c", "n": 12, "tags": ["été"]}', add_special_tokens=False)
    masks = state.masks(text)
    assert masks.shape == (len(text) + 1, width)
    assert not masks[:, len(tokenizer):].any()
    assert state.valid_prefix(text) == len(text)
