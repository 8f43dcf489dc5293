"""litellm against a live server: its documented tool round trip (the assistant message it returns, with
the `provider_specific_fields` it adds, goes back into the history) and `litellm.responses`.
Run in the compat venv: python compat/litellm_check.py BASE_URL MODEL."""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no network: the bundled cost map

import litellm  # noqa: E402

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def main(base_url: str, model: str) -> None:
    common = {"model": f"openai/{model}", "api_base": f"{base_url}/v1", "api_key": "unused", "temperature": 0,
              "max_tokens": 120}
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = litellm.completion(messages=messages, tools=[WEATHER], tool_choice="required", **common)
    message = first.choices[0].message
    assert message.tool_calls, message
    messages.append(message)  # litellm's own Message object, provider_specific_fields and all
    for call in message.tool_calls:
        city = json.loads(call.function.arguments)["city"]
        messages.append({"role": "tool", "tool_call_id": call.id, "name": call.function.name,
                         "content": f"18 C and sunny in {city}"})
    second = litellm.completion(messages=messages, tools=[WEATHER], **common)
    print("tool round trip:", [c.function.arguments for c in message.tool_calls], "->",
          repr((second.choices[0].message.content or "")[:60]), second.choices[0].finish_reason)

    resp = litellm.responses(model=f"openai/{model}", api_base=f"{base_url}/v1", api_key="unused",
                             input="Name three primary colours.", max_output_tokens=40, temperature=0)
    text = "".join(p.text for item in resp.output if item.type == "message" for p in item.content)
    assert text, resp
    print("responses:", repr(text[:60]), resp.usage.output_tokens, "tokens")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
