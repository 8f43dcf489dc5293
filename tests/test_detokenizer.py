"""Incremental detokenization: multi-byte characters arrive whole; stop strings never leak."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from server.engine.detokenizer import IncrementalDetokenizer, _StopString


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


@settings(max_examples=400, deadline=None)
@given(
    stops=st.lists(st.text(alphabet="ab", min_size=1, max_size=6), min_size=1, max_size=4),
    chunks=st.lists(st.text(alphabet="abc", max_size=5), max_size=12),
    min_chars=st.integers(min_value=0, max_value=20),
)
@pytest.mark.slow
def test_stop_strings_followed_as_the_text_grows_match_a_search_of_the_whole_text(stops, chunks, min_chars):
    """The incremental matcher cuts where a search of the text so far would (the first stop string, in
    the request's order, completing in the new text; matches completing before stop strings count are
    ignored) and holds back exactly the longest tail that may still become a stop string."""
    text = ""
    matchers = [_StopString(s) for s in stops]
    for chunk in chunks:
        start = len(text)
        text += chunk
        ends = [m.feed(chunk) for m in matchers]
        counts = len(text) >= min_chars
        want = None
        if counts:
            for stop in stops:
                at = text.find(stop, max(0, start - len(stop) + 1))
                if at != -1:
                    want = (stop, at)
                    break
        got = next(((s, start + e + 1 - len(s)) for s, e in zip(stops, ends, strict=True) if e >= 0), None)
        assert (got if counts else None) == want
        longest = max(max((n for n in range(1, len(s)) if text.endswith(s[:n])), default=0) for s in stops)
        assert max(m.matched for m in matchers) == longest
        if want:
            break


def test_long_stop_strings_cost_their_request_a_table_not_a_rescan_per_token(tokenizer):
    """Four stop strings that the output keeps almost matching: following 3,000 tokens costs about the
    same with 100k-character stop strings as with 100-character ones (a rescan of every stop prefix per
    token grew with the square of the output: seconds, and the engine's worker stalled for everyone)."""
    import time

    def follow(length: int) -> float:
        det = IncrementalDetokenizer(tokenizer, tokenizer.encode("Say:"), tuple("a" * length + c for c in "bcde"))
        for s in det._stops:  # built once per request: not what is compared here
            s._table()
        tokens = tokenizer.encode(" aaaa bcd")  # text that starts the stop strings again and again, never ends one
        started = time.process_time()
        for i in range(3000):
            det.add(tokens[i % len(tokens)])
            det.take()
        assert not det.stopped
        return time.process_time() - started

    short, long = follow(100), follow(100_000)
    assert long < 4 * short + 0.3  # CPU seconds within one run: about 1x here, 30x before
