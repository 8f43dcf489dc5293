"""bench/replay.py: scoring model-free proposers against recorded greedy answers (no model)."""

from __future__ import annotations

import pytest

from bench.replay import replay

PROMPT = [5, 6, 7, 8, 9]
ANSWER = [20, 21, 22, 23, 24, 25, 26, 27, 28, 29]


def test_a_repeated_request_is_drafted_whole_from_the_global_index():
    answers = {f"agent/r{i}": {"prompt": PROMPT, "output": ANSWER} for i in range(2)}
    result = replay(answers, "suffix", 8)
    first, second = result["rounds"]["agent"]
    assert first == 1.0  # nothing in the prompt predicts the answer: one token per step
    assert second == pytest.approx(10 / 2)  # 8 drafts + bonus, then the last token
    assert result["workloads"]["agent"] == [20, 10 + 2, 8, 8]  # tokens, steps, drafted, accepted


def test_ngram_replay_counts_a_copied_answer():
    answers = {"copy/r": {"prompt": [*ANSWER, 1, 2], "output": ANSWER}}
    tokens, steps, drafted, accepted = replay(answers, "ngram", 4)["workloads"]["copy"]
    assert tokens == 10 and steps < 10 and 0 < accepted <= drafted


def test_only_lookahead_proposers_replay():
    with pytest.raises(SystemExit):
        replay({}, "draft", 4)
