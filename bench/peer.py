"""The peer: Hugging Face transformers `generate()` on the same weights, one client, greedy.

Variants: `hf-none` (plain greedy), `hf-prompt-lookup` (`prompt_lookup_num_tokens`), and
`hf-assisted` (`assistant_model` = the server's default draft: the target's weights in bf16).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from server.model.loading import LoadedModel

PEER_METHODS = ("hf-none", "hf-prompt-lookup", "hf-assisted")


@dataclass(frozen=True)
class PeerRun:
    completion_tokens: int
    wall_s: float


def chat_ids(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    """Token ids exactly as the server renders a chat (template text, then no special tokens)."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


class Peer:
    def __init__(self, target: LoadedModel, draft: LoadedModel | None, prompt_lookup_tokens: int = 10) -> None:
        self.target = target
        self.draft = draft
        self.prompt_lookup_tokens = prompt_lookup_tokens
        tok = target.tokenizer
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id

    def available(self, method: str) -> bool:
        return method != "hf-assisted" or self.draft is not None

    @torch.no_grad()
    def generate(self, method: str, prompt_ids: list[int], max_tokens: int, ignore_eos: bool = False) -> PeerRun:
        """`ignore_eos`: exactly `max_tokens` new tokens (as the server's `ignore_eos`)."""
        ids = torch.tensor([prompt_ids], device=self.target.device)
        kwargs: dict = {"min_new_tokens": max_tokens} if ignore_eos else {}
        if method == "hf-prompt-lookup":
            kwargs["prompt_lookup_num_tokens"] = self.prompt_lookup_tokens
        elif method == "hf-assisted":
            assert self.draft is not None
            kwargs["assistant_model"] = self.draft.model
        elif method != "hf-none":
            raise ValueError(f"unknown peer method {method!r}")
        started = time.perf_counter()
        out = self.target.model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_tokens,
            do_sample=False,
            temperature=None,
            top_p=None,
            top_k=None,
            pad_token_id=self.pad_id,
            **kwargs,
        )
        wall = time.perf_counter() - started
        new = out[0, ids.shape[1] :].tolist()
        eos = self.target.model.generation_config.eos_token_id
        eos_ids = set(eos if isinstance(eos, list) else [eos]) if eos is not None else set()
        # Count through the first EOS (as the server counts its stop token), not padding after it.
        n = len(new) if ignore_eos else next((i + 1 for i, t in enumerate(new) if t in eos_ids), len(new))
        return PeerRun(completion_tokens=n, wall_s=wall)
