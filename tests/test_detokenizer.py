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


def run_ids(det: IncrementalDetokenizer, ids: list[int]) -> str:
    out = []
    for tid in ids:
        det.add(tid)
        out.append(det.take())
        if det.stopped:
            break
    out.append(det.take(final=True))
    return "".join(out)


def test_include_stop_keeps_the_stop_string(tokenizer):
    ids = tokenizer.encode(" one two three END four")
    det = IncrementalDetokenizer(tokenizer, tokenizer.encode("Say:"), ("END",), include_stop=True)
    assert run_ids(det, ids) == " one two three END" and det.stopped


def test_stop_strings_count_only_after_min_tokens(tokenizer):
    ids = tokenizer.encode(" END one two END three")
    early = len(tokenizer.encode(" END"))
    det = IncrementalDetokenizer(tokenizer, tokenizer.encode("Say:"), ("END",), min_tokens=early + 1)
    assert run_ids(det, ids) == " END one two " and det.stopped  # the first END came too early
    det = IncrementalDetokenizer(tokenizer, tokenizer.encode("Say:"), ("END",), min_tokens=early)
    assert run_ids(det, ids) == " " and det.stopped  # END completes at exactly min_tokens tokens: it counts


def test_special_tokens_skipped_kept_or_spaced(tokenizer):
    special = tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids = [*tokenizer.encode(" hi"), special, special, *tokenizer.encode(" there")]
    prompt = tokenizer.encode("Say:")
    assert run_ids(IncrementalDetokenizer(tokenizer, prompt), ids) == " hi there"
    kept = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=False, spaces_between_special_tokens=False)
    assert run_ids(kept, ids) == " hi<|im_end|><|im_end|> there"
    spaced = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=False)
    assert run_ids(spaced, ids) == " hi <|im_end|> <|im_end|>  there"
