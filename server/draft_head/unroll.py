"""Multi-step drafting over whole sequences at once ("training-time test", as in EAGLE-3).

At inference the head drafts autoregressively: depth 1 reads the target's real feature f_c, depth k
reads its own depth k-1 prediction. To train and measure that in one go for every start position j of
a sequence, depth k is one more forward pass over all rows j, appended to the same cache:

    keys:   [ depth 1 rows 0..L-1 | depth 2 rows 0..L-1 | ... | depth k rows 0..L-1 ]
    query (depth k, row j) sees depth-1 keys 0..j (real features up to f_j) and its own chain's
    deeper keys at row j only (depths 2..k of start j), exactly what a draft of depth k started
    after f_j would see.

Row j of depth k reads (g_{k-1}[j], x_{j+k}) at position j+k and predicts f_{j+k}, where g_0 = f and
g_k is depth k's output. With teacher-forced tokens this is the draft chain conditioned on drafts
1..k-1 having been right, which is all acceptance needs (a chain stops at the first miss).
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from server.draft_head.model import EagleHead


def unrolled_features(
    head: EagleHead,
    hidden: torch.Tensor,  # [B, T, H] target features f_0..f_{T-1} (right-padded)
    ids: torch.Tensor,  # [B, T] tokens x_0..x_{T-1}
    lengths: torch.Tensor,  # [B] real tokens per row
    depth: int,
    input_noise: float = 0.0,
) -> list[torch.Tensor]:
    """Depth 1..`depth` predictions, each [B, T-1, H]: entry [b, j] of depth k predicts f_{j+k}.

    `input_noise` > 0 adds Gaussian noise of that std to the real input features (training only).
    Rows with j+k > length-1 have no target and are garbage (callers mask them); no query ever has
    an empty softmax row, so no NaNs appear anywhere.
    """
    batch, total, _ = hidden.shape
    rows = total - 1
    device = hidden.device
    dtype = head.fc.weight.dtype
    j = torch.arange(rows, device=device)
    key_real = j[None, :] + 1 < lengths[:, None]  # [B, rows]: x_{i+1} exists for depth-1 key i
    causal = j[None, :] <= j[:, None]  # [rows, rows]: key i visible to query j
    eye = torch.eye(rows, dtype=torch.bool, device=device)
    cache = DynamicCache()
    feats = hidden[:, :-1].to(dtype)  # [B, rows, H] g_0 = f_0..f_{T-2}
    if input_noise > 0:
        feats = feats + input_noise * torch.randn_like(feats)
    outputs: list[torch.Tensor] = []
    blocks: list[torch.Tensor] = []  # allowed-key blocks of the current depth's mask, [B, rows, rows] each
    for k in range(1, depth + 1):
        tok = torch.zeros(batch, rows, dtype=torch.long, device=device)
        tok[:, : total - k] = ids[:, k:]  # x_{j+k}; beyond the end: token 0, masked out by the loss
        if k == 1:
            blocks = [(causal[None] & key_real[:, None, :]) | eye[None]]
        else:
            blocks = [blocks[0]] + [eye[None].expand(batch, rows, rows)] * (k - 1)
        allowed = torch.cat(blocks, dim=-1)[:, None]  # [B, 1, rows, k*rows]
        mask = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, torch.finfo(dtype).min)
        position_ids = (j + k)[None].expand(batch, rows)
        out, cache = head(feats, tok, position_ids=position_ids, attention_mask=mask, cache=cache,
                          use_cache=True)
        outputs.append(out)
        feats = out
    return outputs


def target_index(lengths: torch.Tensor, prompt_lens: torch.Tensor, rows: int, k: int) -> torch.Tensor:
    """Mask [B, rows] of depth-k entries that count: f_{j+k} exists and predicts an answer token
    (j+k >= prompt_len-1, the last prompt token's feature predicting the first answer token included)."""
    j = torch.arange(rows, device=lengths.device)[None, :] + k
    return (j <= lengths[:, None] - 1) & (j >= prompt_lens[:, None] - 1)
