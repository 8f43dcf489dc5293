"""Incremental detokenization: multi-byte characters arrive whole; stop strings never leak."""

from __future__ import annotations

from server.engine.detokenizer import IncrementalDetokenizer


def stream(
    tokenizer, text: str, stop: tuple[str, ...] = (), prompt: str = "Say:"
) -> tuple[list[str], IncrementalDetokenizer]:
    det = IncrementalDetokenizer(tokenizer, tokenizer.encode(prompt), stop)
    pieces = []
    for tid in tokenizer.encode(text):
        det.add(tid)
        pieces.append(det.take())
        if det.stopped:
            break
    pieces.append(det.take(final=True))
    return pieces, det


def test_pieces_concatenate_to_the_text_and_never_split_characters(tokenizer):
    text = " naïve café — 日本語 😀 ok"
    pieces, _ = stream(tokenizer, text)
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)


def test_stop_string_is_cut_and_never_partially_emitted(tokenizer):
    pieces, det = stream(tokenizer, " one two three END four", stop=("END",))
    assert det.stopped
    assert "".join(pieces) == " one two three "
    assert not any("E" in p for p in pieces)


def test_held_back_prefix_is_released_when_it_is_not_a_stop(tokenizer):
    pieces, det = stream(tokenizer, " alpha ENDING", stop=("END.",))
    assert not det.stopped
    assert "".join(pieces) == " alpha ENDING"


def test_a_sequence_ending_inside_a_character_releases_what_its_tokens_decode_to(tokenizer):
    ids = tokenizer.encode(" ok 😀")
    cut = ids[:-1]  # the emoji spans several byte tokens: stop before its last one
    assert tokenizer.decode(cut).endswith("\ufffd")
    det = IncrementalDetokenizer(tokenizer, tokenizer.encode("Say:"))
    pieces = []
    for tid in cut:
        det.add(tid)
        pieces.append(det.take())
    assert not any("\ufffd" in p for p in pieces)  # never while the sequence runs
    pieces.append(det.take(final=True))
    assert "".join(pieces) == tokenizer.decode(cut)
