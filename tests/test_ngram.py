"""Prompt lookup: what it proposes, and how long the match behind each proposal is."""

from __future__ import annotations

from server.speculation.ngram import MATCH_CAP, ngram_lookup, ngram_match


def test_longest_suffix_ngram_proposes_what_followed_its_latest_occurrence():
    tokens = [1, 2, 3, 9, 1, 2, 3, 8, 5, 1, 2, 3]
    # [1, 2, 3] occurs at 0 and 4; the latest earlier one (4) was followed by 8, 5, 1.
    assert ngram_lookup(tokens, 3, n_max=3, n_min=1) == [8, 5, 1]
    assert ngram_lookup(tokens, 1, n_max=3, n_min=1) == [8]
    assert ngram_lookup([4, 5, 6], 3, n_max=3, n_min=1) == []  # nothing repeats
    assert ngram_lookup(tokens, 0, n_max=3, n_min=1) == []


def test_falls_back_to_shorter_ngrams_and_respects_n_min():
    tokens = [7, 1, 5, 6, 2, 1]  # "2 1" never occurred before, "1" did (followed by 5)
    assert ngram_match(tokens, 2, n_max=2, n_min=1) == ([5, 6], 1)
    assert ngram_match(tokens, 2, n_max=2, n_min=2) == ([], 0)


def test_match_length_extends_past_the_ngram_to_the_whole_copied_run():
    passage = [10, 11, 12, 13, 14, 15, 16]
    tokens = [1, *passage, 2, 3, *passage[:5]]  # the text is copying the passage: 5 tokens in
    drafts, length = ngram_match(tokens, 2, n_max=2, n_min=1)
    assert drafts == [15, 16]
    assert length == 5  # all five copied tokens agree, not just the 2-gram looked up
    # a one-token coincidence stays a one-token match
    assert ngram_match([5, 9, 8, 7, 9], 1, n_max=3, n_min=1) == ([8], 1)
    long = list(range(100, 140))
    assert ngram_match([*long, 0, *long[:30]], 1, n_max=4, n_min=1)[1] == MATCH_CAP
