"""Prompts the target writes itself, for self-distillation without a downloaded dataset.

Magpie (Xu et al. 2024, arXiv 2406.08464): an instruction-tuned model fed only its chat template up to
where the user's text begins (the "pre-query" template) writes a plausible user message, because that
is what its training taught it follows. Sampled at temperature ~1 this gives prompts in the target's
own idea of what users ask: far more varied than templates, with no data to download or ship.

A message counts only if the model ended it itself (its stop token within `max_tokens`) and it is new
(case and spacing aside); the template prompts passed in `exclude` are never repeated.
"""

from __future__ import annotations

import logging
import time

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from server.draft_head.data import _stop_ids, answer_batch

log = logging.getLogger(__name__)

_MARK = "\u0000PROMPT\u0000"


def pre_query_ids(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The chat template rendered up to where a user message's text begins (system prompt included)."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("writing prompts needs a chat template: the target's tokenizer has none")
    text = tokenizer.apply_chat_template([{"role": "user", "content": _MARK}], add_generation_prompt=False,
                                         tokenize=False)
    return tokenizer.encode(text[: text.index(_MARK)], add_special_tokens=False)


def _key(text: str) -> str:
    return " ".join(text.lower().split())


def generate_prompts(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    count: int,
    *,
    batch_size: int = 64,
    max_tokens: int = 64,
    temperature: float = 1.0,
    seed: int = 0,
    exclude: list[str] | tuple[str, ...] = (),
    time_limit: float | None = None,
) -> list[str]:
    """Up to `count` distinct user messages written by `model`: fewer if batches stop yielding new ones
    (3 batches in a row with none, or 4x the batches `count` needs) or no batch may start any more
    (`time_limit` seconds)."""
    deadline = None if time_limit is None else time.monotonic() + time_limit
    prefix = pre_query_ids(tokenizer)
    stops = _stop_ids(model, tokenizer)
    seen = {_key(p) for p in exclude}
    prompts: list[str] = []
    barren = 0
    budget = 4 * -(-count // batch_size)
    for n in range(budget):
        if len(prompts) >= count or barren >= 3 or (deadline is not None and time.monotonic() > deadline):
            break
        rows = min(batch_size, 2 * (count - len(prompts)))
        gen = torch.Generator(device=model.device).manual_seed(seed * 1_000_003 + n)
        new = 0
        for sample in answer_batch(model, [prefix] * rows, stops, max_tokens, temperature, gen):
            answer = sample.ids[sample.prompt_len:].tolist()
            if not answer or answer[-1] not in stops:
                continue  # cut off at max_tokens: not a whole message
            text = tokenizer.decode(answer[:-1], skip_special_tokens=True).strip()
            if not text or _key(text) in seen or len(prompts) >= count:
                continue
            seen.add(_key(text))
            prompts.append(text)
            new += 1
        barren = 0 if new else barren + 1
    log.info("the target wrote %d prompts", len(prompts))
    return prompts
