"""LangChain against a live server: a `bind_tools(tool_choice="any")` agent loop and `create_agent(...,
response_format=...)`. Run in the compat venv: python compat/langchain_check.py BASE_URL MODEL."""

from __future__ import annotations

import sys

from langchain.agents import create_agent
from langchain_core.messages import HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from pydantic import BaseModel


@tool
def get_weather(city: str) -> str:
    """The current weather in a city."""
    return f"18 C and sunny in {city}"


class Weather(BaseModel):
    """A weather report."""

    city: str
    sunny: bool


def main(base_url: str, model: str) -> None:
    llm = ChatOpenAI(model=model, base_url=f"{base_url}/v1", api_key="unused", temperature=0, max_tokens=120)

    # 1. bind_tools(tool_choice="any") (LangChain's name for `required`): an agent loop that runs the tool.
    forced = llm.bind_tools([get_weather], tool_choice="any")
    messages = [HumanMessage("What is the weather in Paris?")]
    reply = forced.invoke(messages)
    assert reply.tool_calls, reply
    for call in reply.tool_calls:
        assert call["name"] == "get_weather" and isinstance(call["args"].get("city"), str), call
    messages.append(reply)
    messages += [ToolMessage(get_weather.invoke(c["args"]), tool_call_id=c["id"]) for c in reply.tool_calls]
    final = llm.bind_tools([get_weather]).invoke(messages)  # the loop goes on until the model answers
    print("bind_tools(any):", [c["args"] for c in reply.tool_calls], "->", repr(final.content[:60]),
          final.tool_calls)

    # 2. create_agent with a response_format (sends tool_choice required with the schema as a tool).
    agent = create_agent(llm, tools=[get_weather], response_format=Weather)
    result = agent.invoke({"messages": [HumanMessage("What is the weather in Paris?")]},
                          {"recursion_limit": 12})
    structured = result["structured_response"]
    assert isinstance(structured, Weather), result
    print("create_agent(response_format):", structured, f"({len(result['messages'])} messages)")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
