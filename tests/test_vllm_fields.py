"""Every field of vLLM's `ChatCompletionRequest` and `CompletionRequest` is honoured with its meaning or refused
with a 400 that names it and says why (docs/api.md, "vLLM's request fields"): one test per field.

Most tests run on a scripted engine (its reply is a fixed text, its requests are recorded), so they check what
the server sends the engine (prompt ids, priority, ids) and makes of the reply; the grammar fields run on the
tiny model, whose output they constrain."""

from __future__ import annotations

import copy
import json
import logging
import re
from typing import Any

import pytest

from server.api.body_policy import REFUSED
from server.api.prompts import ModelInfo, chat_prompt_ids, completion_prompt_ids
from server.api.schemas import ChatCompletionRequest, CompletionRequest
from server.types import ServingLimits
from tests.api_helpers import MODEL, running_app, sse_json
from tests.scripted_engine import ScriptedEngine

CHAT, COMP = "/v1/chat/completions", "/v1/completions"
SCRIPT = "Sure, here it is."
SCRIPTED = "scripted-model"
USER = [{"role": "user", "content": "Tell me a story."}]

# vLLM's request fields (vllm/entrypoints/openai/protocol.py: the V1 server's, plus the `guided_*` family and
# `best_of` of the releases before `structured_outputs`), each honoured, inert or refused here.
VLLM_CHAT_FIELDS = (
    "messages", "model", "frequency_penalty", "logit_bias", "logprobs", "top_logprobs", "max_tokens",
    "max_completion_tokens", "n", "presence_penalty", "response_format", "seed", "stop", "stream", "stream_options",
    "temperature", "top_p", "tools", "tool_choice", "reasoning_effort", "include_reasoning", "parallel_tool_calls",
    "user", "best_of", "use_beam_search", "top_k", "min_p", "repetition_penalty", "length_penalty", "stop_token_ids",
    "include_stop_str_in_output", "ignore_eos", "min_tokens", "skip_special_tokens", "spaces_between_special_tokens",
    "truncate_prompt_tokens", "prompt_logprobs", "allowed_token_ids", "bad_words", "echo", "add_generation_prompt",
    "continue_final_message", "add_special_tokens", "documents", "chat_template", "chat_template_kwargs",
    "mm_processor_kwargs", "guided_json", "guided_regex", "guided_choice", "guided_grammar", "structural_tag",
    "guided_decoding_backend", "guided_whitespace_pattern", "structured_outputs", "priority", "request_id",
    "logits_processors", "return_tokens_as_token_ids", "return_token_ids", "cache_salt", "kv_transfer_params",
    "vllm_xargs",
)
VLLM_COMPLETION_FIELDS = (
    "model", "prompt", "prompt_embeds", "best_of", "echo", "frequency_penalty", "logit_bias", "logprobs", "max_tokens",
    "n", "presence_penalty", "seed", "stop", "stream", "stream_options", "suffix", "temperature", "top_p", "user",
    "use_beam_search", "top_k", "min_p", "repetition_penalty", "length_penalty", "stop_token_ids",
    "include_stop_str_in_output", "ignore_eos", "min_tokens", "skip_special_tokens", "spaces_between_special_tokens",
    "truncate_prompt_tokens", "allowed_token_ids", "prompt_logprobs", "add_special_tokens", "response_format",
    "guided_json", "guided_regex", "guided_choice", "guided_grammar", "guided_decoding_backend",
    "guided_whitespace_pattern", "structured_outputs", "priority", "request_id", "logits_processors",
    "return_tokens_as_token_ids", "return_token_ids", "cache_salt", "kv_transfer_params", "vllm_xargs",
)


def policy(model: type) -> set[str]:
    """The fields a body model knows: declared (honoured), inert, or neutral-only."""
    return {f.alias or name for name, f in model.model_fields.items()} | set(model._inert) | set(model._neutral)


@pytest.mark.parametrize(("model", "fields"), [(ChatCompletionRequest, VLLM_CHAT_FIELDS),
                                               (CompletionRequest, VLLM_COMPLETION_FIELDS)])
def test_every_vllm_field_has_a_policy_and_every_refusal_a_reason(model, fields):
    assert set(fields) - policy(model) == set()
    refused = {k for k, values in model._neutral.items()}
    assert refused - set(REFUSED) == set()  # each one says why in its 400


def test_the_docs_table_lists_every_vllm_field():
    from pathlib import Path

    doc = (Path(__file__).resolve().parent.parent / "docs" / "api.md").read_text()
    table = doc.split("### vLLM's request fields", 1)[1].split("\n#", 1)[0]
    listed = set(re.findall(r"`([a-z_]+)`", table))
    assert set(VLLM_CHAT_FIELDS) | set(VLLM_COMPLETION_FIELDS) <= listed


# ---- a scripted engine: what reaches the engine, what comes back -------------------------------------------
@pytest.fixture
async def scripted(tokenizer):
    engine = ScriptedEngine(tokenizer, SCRIPT, per_step=2)
    async with running_app(lambda **_: engine) as (_, client):
        yield client, engine


def chat(**extra: Any) -> dict[str, Any]:
    return {"model": SCRIPTED, "messages": USER, "max_tokens": 32, **extra}


def comp(**extra: Any) -> dict[str, Any]:
    return {"model": SCRIPTED, "prompt": "Once upon a time", "max_tokens": 32, **extra}


def rendered(engine: ScriptedEngine) -> str:
    return engine.tokenizer.decode(engine.requests[-1].prompt_token_ids)


def with_template(tokenizer, template: str):
    """A copy of `tokenizer` with its own chat template (the session's tokenizer is left alone)."""
    other = copy.copy(tokenizer)
    other.chat_template = template
    return other


QWEN3_LIKE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


async def test_chat_template_kwargs_reach_the_template(tokenizer):
    engine = ScriptedEngine(with_template(tokenizer, QWEN3_LIKE), SCRIPT)
    async with running_app(lambda **_: engine) as (_, client):
        plain = await client.post(CHAT, json=chat())
        assert plain.status_code == 200, plain.text
        assert "<think>" not in rendered(engine)
        empty = await client.post(CHAT, json=chat(chat_template_kwargs={}))
        assert empty.status_code == 200 and "<think>" not in rendered(engine)
        off = await client.post(CHAT, json=chat(chat_template_kwargs={"enable_thinking": False}))
        assert off.status_code == 200, off.text
        assert rendered(engine).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
        unread = await client.post(CHAT, json=chat(chat_template_kwargs={"not_in_the_template": 1}))
        assert unread.status_code == 200 and "<think>" not in rendered(engine)
        bad = await client.post(CHAT, json=chat(chat_template_kwargs={"tokenize": True}))
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "chat_template_kwargs"


async def test_add_generation_prompt_false_leaves_the_assistant_prefix_out(scripted, tokenizer):
    client, engine = scripted
    assert (await client.post(CHAT, json=chat())).status_code == 200
    assert rendered(engine).endswith("<|im_start|>assistant\n")
    assert (await client.post(CHAT, json=chat(add_generation_prompt=False))).status_code == 200
    assert rendered(engine) == tokenizer.apply_chat_template(USER, tokenize=False, add_generation_prompt=False)


async def test_continue_final_message_continues_the_assistants_answer(scripted):
    client, engine = scripted
    history = [*USER, {"role": "assistant", "content": "Once upon a time"}]
    r = await client.post(CHAT, json=chat(messages=history, continue_final_message=True))
    assert r.status_code == 200, r.text
    assert rendered(engine).endswith("<|im_start|>assistant\nOnce upon a time")  # open: no <|im_end|>
    both = await client.post(CHAT, json=chat(messages=history, continue_final_message=True,
                                             add_generation_prompt=True))
    assert both.status_code == 400 and "cannot both be true" in both.json()["error"]["message"]


@pytest.mark.parametrize("stream", [False, True])
async def test_chat_echo_starts_the_reply_with_the_final_assistant_message(scripted, stream):
    client, _ = scripted
    history = [*USER, {"role": "assistant", "content": "Once upon a time,"}]
    body = chat(messages=history, continue_final_message=True, echo=True, stream=stream)
    r = await client.post(CHAT, json=body)
    assert r.status_code == 200, r.text
    if stream:
        content = "".join(c["choices"][0]["delta"].get("content") or "" for c in sse_json(r.text) if c["choices"])
    else:
        content = r.json()["choices"][0]["message"]["content"]
    assert content == "Once upon a time," + SCRIPT
    after_user = await client.post(CHAT, json=chat(echo=True))  # the final message is the user's: nothing echoed
    assert after_user.json()["choices"][0]["message"]["content"] == SCRIPT


@pytest.mark.parametrize("stream", [False, True])
async def test_completions_echo_returns_the_prompt(scripted, stream):
    client, _ = scripted
    r = await client.post(COMP, json=comp(echo=True, stream=stream, n=2))
    assert r.status_code == 200, r.text
    if stream:
        texts = {0: "", 1: ""}
        for c in sse_json(r.text):
            for choice in c["choices"]:
                texts[choice["index"]] += choice["text"]
    else:
        texts = {c["index"]: c["text"] for c in r.json()["choices"]}
    assert texts == {0: "Once upon a time" + SCRIPT, 1: "Once upon a time" + SCRIPT}
    ids = await client.post(COMP, json=comp(prompt=[19556, 28], echo=True))
    assert ids.json()["choices"][0]["text"].startswith("Hello")
    refused = await client.post(COMP, json=comp(echo=True, logprobs=1))
    assert refused.status_code == 400 and "prompt's logprobs" in refused.json()["error"]["message"]


async def test_priority_reaches_the_scheduler(scripted):
    """The ordering itself: tests/test_scheduler.py (lower first, first come first served within one)."""
    client, engine = scripted
    assert (await client.post(CHAT, json=chat(priority=-5))).status_code == 200
    assert engine.requests[-1].priority == -5
    assert (await client.post(COMP, json=comp(priority=3, n=2))).status_code == 200
    assert [r.priority for r in engine.requests[-2:]] == [3, 3]
    assert (await client.post(COMP, json=comp())).status_code == 200 and engine.requests[-1].priority == 0
    bad = await client.post(CHAT, json=chat(priority="high"))
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "priority"


async def test_request_id_names_the_response_and_its_log_line(scripted, caplog):
    client, engine = scripted
    with caplog.at_level(logging.INFO, logger="specula.request"):
        first, second = [await client.post(CHAT, json=chat(request_id="job-42")) for _ in range(2)]
        text = await client.post(COMP, json=comp(request_id="job-43"))
    assert first.json()["id"] == second.json()["id"] == "chatcmpl-job-42"  # the same id twice: both served
    assert text.json()["id"] == "cmpl-job-43"
    ids = [r.request_id for r in engine.requests[-3:]]
    assert len(set(ids)) == 3 and all(i.startswith(("chatcmpl-job-42-", "cmpl-job-43-")) for i in ids)
    assert sum("chatcmpl-job-42" in r.getMessage() for r in caplog.records) == 2
    streamed = await client.post(CHAT, json=chat(request_id="job-44", stream=True))
    assert {c["id"] for c in sse_json(streamed.text)} == {"chatcmpl-job-44"}
    bad = await client.post(CHAT, json=chat(request_id="has space"))
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "request_id"


async def test_truncate_prompt_tokens_keeps_the_last_n(scripted, tokenizer):
    client, engine = scripted
    prompt = " ".join(f"word{i}" for i in range(200))
    full = tokenizer(prompt)["input_ids"]
    assert (await client.post(COMP, json=comp(prompt=prompt, truncate_prompt_tokens=10))).status_code == 200
    assert list(engine.requests[-1].prompt_token_ids) == full[-10:]
    ids = list(range(300, 340))
    assert (await client.post(COMP, json=comp(prompt=ids, truncate_prompt_tokens=7))).status_code == 200
    assert list(engine.requests[-1].prompt_token_ids) == ids[-7:]
    r = await client.post(CHAT, json=chat(truncate_prompt_tokens=5))
    whole = tokenizer.apply_chat_template(USER, tokenize=False, add_generation_prompt=True)
    assert r.status_code == 200 and list(engine.requests[-1].prompt_token_ids) == tokenizer(whole)["input_ids"][-5:]
    assert r.json()["usage"]["prompt_tokens"] == 5
    for bad in (0, -2, 10**9):
        refused = await client.post(COMP, json=comp(truncate_prompt_tokens=bad))
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "truncate_prompt_tokens", bad


async def test_truncate_prompt_tokens_takes_a_prompt_far_beyond_the_context(tiny_engine_factory, tokenizer):
    """Without it such a prompt is a 400 (context_length_exceeded); with it only the tail is tokenized."""
    async with running_app(tiny_engine_factory) as (_, client):
        huge = "the cat sat on the mat. " * 3000
        body = {"model": MODEL, "prompt": huge, "max_tokens": 2}
        assert (await client.post(COMP, json=body)).status_code == 400
        r = await client.post(COMP, json={**body, "truncate_prompt_tokens": 50})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == 50


class RecordingTokenizer:
    """A tokenizer that adds a marker token (id `BOS`) when asked to add special tokens, recording each call's
    choice (SmolLM2's own adds none)."""

    BOS = 2

    def __init__(self, tokenizer) -> None:
        self.inner, self.calls = tokenizer, []
        self.chat_template = tokenizer.chat_template

    def __len__(self) -> int:
        return len(self.inner)

    def __call__(self, text: str, add_special_tokens: bool = True, **kw: Any) -> dict[str, list[int]]:
        self.calls.append(add_special_tokens)
        ids = self.inner(text, add_special_tokens=False)["input_ids"]
        return {"input_ids": ([self.BOS] if add_special_tokens else []) + ids}

    def apply_chat_template(self, *args: Any, **kwargs: Any) -> str:
        return self.inner.apply_chat_template(*args, **kwargs)


def test_add_special_tokens_adds_the_tokenizers_own(tokenizer):
    tok = RecordingTokenizer(tokenizer)
    info = ModelInfo(MODEL, tok, ServingLimits(4096, len(tokenizer), ("none",)), "none", 4, 16, 8)
    base = {"model": MODEL, "prompt": "Hello"}
    bos = RecordingTokenizer.BOS
    assert completion_prompt_ids(info, CompletionRequest.model_validate(base))[0][0] == bos  # default true
    off = CompletionRequest.model_validate({**base, "add_special_tokens": False})
    assert completion_prompt_ids(info, off)[0][0] != bos
    chat_base = {"model": MODEL, "messages": USER}
    assert chat_prompt_ids(info, ChatCompletionRequest.model_validate(chat_base))[0] != bos  # default false
    on = ChatCompletionRequest.model_validate({**chat_base, "add_special_tokens": True})
    assert chat_prompt_ids(info, on)[0] == bos
    assert tok.calls == [True, False, False, True]


@pytest.mark.parametrize("stream", [False, True])
async def test_return_token_ids_gives_the_prompts_and_the_replys_ids(scripted, stream):
    client, engine = scripted
    r = await client.post(CHAT, json=chat(return_token_ids=True, stream=stream))
    assert r.status_code == 200, r.text
    prompt = list(engine.requests[-1].prompt_token_ids)
    if stream:
        chunks = sse_json(r.text)
        assert chunks[0]["prompt_token_ids"] == prompt
        ids = [t for c in chunks for choice in c["choices"] for t in choice.get("token_ids", [])]
    else:
        assert r.json()["prompt_token_ids"] == prompt
        ids = r.json()["choices"][0]["token_ids"]
    assert ids == engine.script_ids
    text = await client.post(COMP, json=comp(return_token_ids=True, stream=stream))
    if stream:
        choices = [choice for c in sse_json(text.text) for choice in c["choices"]]
        assert choices[0]["prompt_token_ids"] == list(engine.requests[-1].prompt_token_ids)
        assert [t for choice in choices for t in choice.get("token_ids", [])] == engine.script_ids
    else:
        choice = text.json()["choices"][0]
        assert choice["prompt_token_ids"] == list(engine.requests[-1].prompt_token_ids)
        assert choice["token_ids"] == engine.script_ids
    plain = await client.post(CHAT, json=chat())
    assert "prompt_token_ids" not in plain.json() and "token_ids" not in plain.json()["choices"][0]


async def test_documents_reach_a_template_that_reads_them(tokenizer):
    rag = ("{% for d in documents or [] %}[{{ d.title }}: {{ d.text }}]\n{% endfor %}"
           "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}")
    engine = ScriptedEngine(with_template(tokenizer, rag), SCRIPT)
    async with running_app(lambda **_: engine) as (_, client):
        docs = [{"title": "Cats", "text": "Cats sleep a lot."}]
        assert (await client.post(CHAT, json=chat(documents=docs))).status_code == 200
        assert rendered(engine).startswith("[Cats: Cats sleep a lot.]\nuser: Tell me a story.")


async def test_inert_vllm_fields_change_nothing(scripted):
    client, engine = scripted
    plain = await client.post(CHAT, json=chat())
    inert = await client.post(CHAT, json=chat(length_penalty=2.0, guided_decoding_backend="xgrammar",
                                              include_reasoning=False))
    assert inert.status_code == 200, inert.text
    assert inert.json()["choices"] == plain.json()["choices"]
    text = await client.post(COMP, json=comp(length_penalty=0.5, guided_decoding_backend="outlines"))
    assert text.status_code == 200, text.text


# (endpoint, field, a value that would change the output, a neutral value accepted)
REFUSALS = [
    (CHAT, "use_beam_search", True, False),
    (CHAT, "best_of", 2, 1),
    (COMP, "best_of", 3, 1),
    (CHAT, "prompt_logprobs", 1, None),
    (COMP, "prompt_logprobs", 0, None),
    (CHAT, "allowed_token_ids", [1, 2], None),
    (COMP, "bad_words", ["cat"], []),
    (CHAT, "logits_processors", ["my.Processor"], []),
    (CHAT, "structural_tag", "{}", None),
    (COMP, "guided_whitespace_pattern", " ", None),
    (CHAT, "kv_transfer_params", {"do_remote_decode": True}, None),
    (COMP, "vllm_xargs", {"a": 1}, {}),
    (CHAT, "chat_template", "{{ messages }}", None),
    (CHAT, "mm_processor_kwargs", {"size": 1}, {}),
    (COMP, "prompt_embeds", "AAAA", None),
    (COMP, "suffix", "The end.", ""),
    (CHAT, "reasoning_effort", "low", None),
]


@pytest.mark.parametrize(("path", "field", "value", "neutral"), REFUSALS, ids=lambda v: v if isinstance(v, str) else "")
async def test_an_unimplemented_field_is_refused_naming_it_and_why(scripted, path, field, value, neutral):
    client, _ = scripted
    body = chat() if path == CHAT else comp()
    r = await client.post(path, json={**body, field: value})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == field and error["code"] == "unsupported_field"
    assert REFUSED[field] in error["message"]
    assert (await client.post(path, json={**body, field: neutral})).status_code == 200


async def test_vllm_structured_output_spellings_that_are_not_served(scripted):
    client, _ = scripted
    tag = await client.post(CHAT, json=chat(response_format={"type": "structural_tag", "structures": []}))
    assert tag.status_code == 400 and "structural_tag" in tag.json()["error"]["message"]
    pattern = await client.post(COMP, json=comp(structured_outputs={"regex": "a+", "whitespace_pattern": " "}))
    error = pattern.json()["error"]
    assert pattern.status_code == 400 and error["param"] == "structured_outputs.whitespace_pattern"
    assert REFUSED["whitespace_pattern"] in error["message"]
    two = await client.post(COMP, json=comp(structured_outputs={"regex": "a+", "choice": ["a"]}))
    assert two.status_code == 400 and "regex and choice" in two.json()["error"]["message"]


# ---- the grammar fields, on the tiny model ------------------------------------------------------------------
@pytest.fixture
async def tiny(tiny_engine_factory):
    async with running_app(tiny_engine_factory) as (_, client):
        yield client


def sampled(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "The answer is", "max_tokens": 12, "temperature": 1.0, "seed": 3, "n": 3,
            **extra}


@pytest.mark.slow
async def test_guided_grammar_in_gbnf_and_lark(tiny):
    for grammar in ('root ::= "yes" | "no" | "maybe not"', 'start: "yes" | "no" | "maybe not"'):
        r = await tiny.post(COMP, json=sampled(guided_grammar=grammar))
        assert r.status_code == 200, r.text
        assert {c["text"] for c in r.json()["choices"]} <= {"yes", "no", "maybe not"}
    bad = await tiny.post(COMP, json=sampled(guided_grammar="root ::= ("))
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "guided_grammar"


@pytest.mark.slow
async def test_structured_outputs_constrains_as_the_guided_fields_do(tiny):
    choice = await tiny.post(COMP, json=sampled(structured_outputs={"choice": ["red", "green"]}))
    assert {c["text"] for c in choice.json()["choices"]} <= {"red", "green"}
    regex = await tiny.post(COMP, json=sampled(structured_outputs={"regex": "[0-9]{3}"}))
    assert all(re.fullmatch("[0-9]{3}", c["text"]) for c in regex.json()["choices"]), regex.json()
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    body = {"model": MODEL, "messages": USER, "max_tokens": 20, "temperature": 0,
            "structured_outputs": {"json": schema, "disable_any_whitespace": True}}
    r = await tiny.post(CHAT, json=body)
    assert r.status_code == 200, r.text
    content = r.json()["choices"][0]["message"]["content"]
    if r.json()["choices"][0]["finish_reason"] == "stop":
        assert isinstance(json.loads(content)["ok"], bool)
    grammar = await tiny.post(COMP, json=sampled(structured_outputs={"grammar": 'root ::= "a" | "b"'}))
    assert {c["text"] for c in grammar.json()["choices"]} <= {"a", "b"}
