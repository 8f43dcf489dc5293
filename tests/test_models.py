"""Model loading: local directories, dtypes, and the shared-tokenizer check at start-up."""

from __future__ import annotations

import copy

import pytest
import torch

from server.model.loading import check_same_tokenizer, load_draft_like, load_model
from tests.models import as_loaded, tiny_llama


@pytest.mark.slow
def test_local_directory_loads_in_the_requested_dtype(tmp_path, tokenizer):
    model = tiny_llama(len(tokenizer))
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    loaded = load_model(str(tmp_path), dtype="bfloat16", device="cpu")
    assert loaded.dtype == torch.bfloat16 and next(loaded.model.parameters()).dtype == torch.bfloat16
    assert loaded.name == tmp_path.name and loaded.tokenizer.get_vocab() == tokenizer.get_vocab()


def test_draft_with_another_tokenizer_is_refused_naming_both(tokenizer, tiny_target):
    other_tok = copy.deepcopy(tokenizer)
    other_tok.add_tokens(["<not-in-the-target>"])
    draft = as_loaded(tiny_llama(len(other_tok)), other_tok, "other-draft")
    with pytest.raises(ValueError, match="other-draft.*tiny-target"):
        check_same_tokenizer(tiny_target, draft)


def test_target_weights_as_draft_in_another_dtype(tiny_target):
    draft = load_draft_like(tiny_target, "target", dtype="bfloat16", cache_dir=None)
    assert draft.dtype == torch.bfloat16 and draft.tokenizer is tiny_target.tokenizer
    assert next(tiny_target.model.parameters()).dtype == torch.float32  # the target is untouched
