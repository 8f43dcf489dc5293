"""What every request body model shares (schemas.py, responses_request.py, tokenize.py): the field policy and text
that is text.

Field policy (docs/api.md lists every field):
* declared fields are honoured;
* inside a chat message (and its tool calls and text parts), keys this server does not know are what other
  clients add (litellm's `provider_specific_fields`, `cache_control`, ...): dropped, as vLLM does
  (`_ignore_unknown`); at the top level of a body they are refused like the rest;
* `_inert` fields cannot change this server's output (`store`, `metadata`, `service_tier`,
  `prompt_cache_key`, `safety_identifier`, ...): accepted with any value and dropped;
* `_neutral` fields would change the output but are not implemented (`audio`, `prediction`,
  `modalities` other than text, vLLM's `prompt_logprobs`, `bad_words`, ...): accepted only with their neutral
  value (null or the listed ones), otherwise refused with a 400 that names them and says why (`REFUSED`), as is
  any unknown field (`extra="forbid"`).
Every field of vLLM's `ChatCompletionRequest` and `CompletionRequest` is one of these (docs/api.md's table).
Types are strict: `"10"` or `true` is not an integer, `"yes"` or `1` not a boolean.
Nullable fields: a JSON `null` means "use the default".
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, model_validator


def lone_surrogate(value: Any, path: str) -> str | None:
    """The path of the first string in `value` that is not valid UTF-8 text (None when all are)."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path
        return None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        found = lone_surrogate(item, f"{path}[{key}]" if isinstance(key, int) else f"{path}.{key}".lstrip("."))
        if found is not None:
            return found
    return None


def lone_surrogate_in_json(value: Any) -> str | None:
    """What is wrong with JSON parsed from a string field when one of its strings holds half a character
    (a `\\ud800` escape in the field's text), or None."""
    where = lone_surrogate(value, "")
    if where is None:
        return None
    return f"the JSON in it holds a lone UTF-16 surrogate (half of a character) at {where or 'its top level'}: not text"


_NO_BEAM = "beam search is not implemented (speculative sampling decodes one sequence per choice)"
# Why each field accepted only with its neutral value is refused otherwise (the 400's message names it).
REFUSED: Mapping[str, str] = MappingProxyType({
    "audio": "the model has no audio output",
    "modalities": "the model writes text only",
    "prediction": "predicted outputs are not implemented",
    "reasoning_effort": "the model has no reasoning mode to set",
    "verbosity": "the model has no verbosity setting",
    "web_search_options": "no web search here",
    "functions": "the legacy `functions` are not implemented; send `tools`",
    "function_call": "the legacy `function_call` is not implemented; send `tool_choice`",
    "best_of": "best_of > 1 is not implemented (vLLM's V1 engine refuses it too)",
    "use_beam_search": _NO_BEAM,
    "prompt_logprobs": "prompt logprobs are not computed (a prefill scores no positions)",
    "allowed_token_ids": "allowed_token_ids is not implemented",
    "bad_words": "bad_words is not implemented",
    "logits_processors": "logits processors are server code, never loaded per request",
    "structural_tag": "structural tags are not implemented",
    "guided_whitespace_pattern": "JSON is generated compactly (no whitespace between tokens); the pattern cannot "
    "be set",
    "chat_template": "a chat template sent with the request is refused, as vLLM refuses one without "
    "--trust-request-chat-template; the model's own template renders every chat",
    "mm_processor_kwargs": "the model takes text only",
    "kv_transfer_params": "no disaggregated prefill here",
    "vllm_xargs": "no custom extensions are installed to read them",
    "prompt_embeds": "prompts are text or token ids, not embeddings",
    "suffix": "suffix (fill-in-the-middle) is not implemented",
    "whitespace_pattern": "JSON is generated compactly (no whitespace between tokens); the pattern cannot be set",
    "disable_additional_properties": "schemas are followed as given",
})


def _document_policy(schema: dict[str, Any], cls: type[BaseModel]) -> None:
    """The JSON schema says what `_ignore_unknown` does: other keys are allowed (and dropped)."""
    if getattr(cls, "_ignore_unknown", False):
        schema["additionalProperties"] = True


class _Body(BaseModel):
    # strict: numbers, booleans and strings as OpenAI's schema types them (`"10"`, `true` or `10.5` for an
    # integer, `true` or `"1"` for a number, `"yes"` or `1` for a boolean are 400s naming the field, as OpenAI
    # and vLLM answer); an integer is a number.
    model_config = ConfigDict(extra="forbid", strict=True, json_schema_extra=_document_policy)

    _neutral: ClassVar[dict[str, tuple[Any, ...]]] = {}  # field -> values (besides null) that change nothing
    _inert: ClassVar[frozenset[str]] = frozenset()  # fields accepted with any value: they cannot change output
    _ignore_unknown: ClassVar[bool] = False  # True: keys that are neither fields nor listed above are dropped

    @model_validator(mode="before")
    @classmethod
    def _valid_text(cls, data: Any) -> Any:
        """Text the tokenizer cannot take is bad input: a lone UTF-16 surrogate (half of a character, as
        JSON's \\ud800 escapes can write) is not a Unicode character (in any key, ignored ones included)."""
        where = lone_surrogate(data, "")
        if where is not None:
            raise ValueError(f"{where or 'a string'} holds a lone UTF-16 surrogate (half of a character): not text")
        return data

    @model_validator(mode="before")
    @classmethod
    def _drop_neutral(cls, data: Any) -> Any:
        """Drop inert fields, unimplemented ones that carry a neutral value and, with `_ignore_unknown`, keys
        that are none of those nor a field; others stay and are refused."""
        if not isinstance(data, dict):
            return data
        known = {f.alias or name for name, f in cls.model_fields.items()} | set(cls._neutral) | cls._inert
        return {
            k: v
            for k, v in data.items()
            if k not in cls._inert
            and not (k in cls._neutral and (v is None or v in cls._neutral[k]))
            and (k in known or not cls._ignore_unknown)
        }
