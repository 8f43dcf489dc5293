"""The openai package's Responses helpers against a live server: `responses.create` plain and streamed,
`responses.stream`, a function tool round trip (`previous_response_id` and a `function_call_output`) and
`responses.parse` with `text_format`. Run in the compat venv: python compat/responses_check.py BASE_URL MODEL."""

from __future__ import annotations

import json
import sys
from typing import Literal

import openai
from pydantic import BaseModel

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


class City(BaseModel):
    name: str
    country: str
    continent: Literal["Africa", "Americas", "Asia", "Europe", "Oceania"]
    is_capital: bool


def main(base_url: str, model: str) -> None:
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=300)
    common = {"model": model, "temperature": 0, "max_output_tokens": 48}

    plain = client.responses.create(input="Say hello to Ada.", instructions="Be brief.", **common)
    assert plain.output_text and plain.status in ("completed", "incomplete"), plain
    with client.responses.stream(input="Say hello to Ada.", instructions="Be brief.", **common) as stream:
        events = list(stream)
    assert events[-1].type == f"response.{plain.status}", events[-1].type
    streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert streamed == plain.output_text, (streamed, plain.output_text)
    print("create / stream:", repr(plain.output_text[:50]), plain.status, f"{len(events)} events, same text")

    call_resp = client.responses.create(input="What is the weather in Paris?", tools=[WEATHER],
                                        tool_choice="required", **{**common, "max_output_tokens": 120})
    calls = [item for item in call_resp.output if item.type == "function_call"]
    assert calls and call_resp.status == "completed", call_resp.output
    results = [{"type": "function_call_output", "call_id": c.call_id,
                "output": f"18 C and sunny in {json.loads(c.arguments)['city']}"} for c in calls]
    answer = client.responses.create(input=results, previous_response_id=call_resp.id, tools=[WEATHER], **common)
    assert answer.output and answer.previous_response_id == call_resp.id
    print("function tool round trip:", [c.arguments for c in calls], "->", repr(answer.output_text[:50]))

    parsed = client.responses.parse(input="Tell me about Paris as JSON.", text_format=City,
                                    **{**common, "max_output_tokens": 120})
    assert isinstance(parsed.output_parsed, City), parsed.output_text
    print("parse(text_format):", parsed.output_parsed)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
