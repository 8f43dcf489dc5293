"""`serve --record-traffic DIR`: finished choices land as JSONL that `distill --traffic` trains on."""

from __future__ import annotations

import json

from server.config import Settings
from server.draft_head.data import build_from_traffic, read_traffic
from server.traffic import TrafficRecorder
from tests.api_helpers import MODEL, chat_body, running_app, sse_json


async def test_finished_choices_are_recorded_with_the_tokens_the_target_saw(tiny_engine_factory, tokenizer, tmp_path):
    traffic = tmp_path / "traffic"
    async with running_app(tiny_engine_factory, record_traffic=str(traffic)) as (_, client):
        chat = await client.post("/v1/chat/completions", json=chat_body(max_tokens=6, temperature=0, n=2))
        streamed = await client.post(
            "/v1/chat/completions", json=chat_body("Stream me", max_tokens=5, temperature=0, stream=True)
        )
        text = await client.post(
            "/v1/completions", json={"model": MODEL, "prompt": ["Once upon", [5, 6, 7]], "max_tokens": 4}
        )
        assert chat.status_code == streamed.status_code == text.status_code == 200
    records = read_traffic(traffic)  # the app has shut down: the writer flushed and closed its file
    assert len(records) == 2 + 1 + 2

    by_output = {r.output: r for r in records}
    hello = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hello there"}], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    for choice in chat.json()["choices"]:
        record = by_output[choice["message"]["content"]]
        assert record.prompt_ids == hello and record.messages == [{"role": "user", "content": "Hello there"}]
        assert len(record.output_ids) == 6
    streamed_text = "".join(c["choices"][0]["delta"].get("content") or "" for c in sse_json(streamed.text)
                            if c["choices"])
    assert by_output[streamed_text].messages[0]["content"] == "Stream me"

    raw = [json.loads(line) for f in traffic.glob("*.jsonl") for line in f.read_text().splitlines()]
    completions = [r for r in raw if "messages" not in r]
    assert {tuple(r["prompt_ids"]) for r in completions} == {tuple(tokenizer("Once upon")["input_ids"]), (5, 6, 7)}
    assert [r.get("prompt") for r in completions if r["prompt_ids"] == [5, 6, 7]] == [None]  # ids only


def test_distill_teacher_forces_recorded_traffic_exactly(tiny_target, tmp_path):
    recorder = TrafficRecorder(tmp_path / "traffic")
    recorder.record({"messages": [{"role": "user", "content": "hi"}]}, [1, 9, 4, 7], "ab", [11, 12, 2])
    recorder.record({}, [3, 3], "c", [13])
    recorder.close()
    samples = build_from_traffic(tmp_path / "data", tiny_target.model, tiny_target.tokenizer, tmp_path / "traffic",
                                 progress=False)
    assert [s.ids.tolist() for s in samples] == [[1, 9, 4, 7, 11, 12, 2], [3, 3, 13]]
    assert [s.prompt_len for s in samples] == [4, 2]


def test_recording_is_off_by_default():
    assert Settings.load().record_traffic is None
