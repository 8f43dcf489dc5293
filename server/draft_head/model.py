"""`EagleHead`: an EAGLE-1 style draft head that drafts from the target's own hidden states.

One draft step at position t reads the target's hidden state f_t and the embedding of the token that
follows, x_{t+1}, and predicts the next hidden state:

    f̂_{t+1} = Decoder(fc([embed(x_{t+1}) ; f_t]))          # one Llama decoder layer
    q(x_{t+2}) = softmax(W_fr · f̂_{t+1}) over the FR vocabulary, 0 elsewhere

Hidden states follow the engine's contract: f_t is the target's last hidden state *after* its final
norm, exactly what the LM head reads. The head therefore predicts post-norm features and its output
goes straight into the target's LM head, with no norm of its own in between: this is EAGLE-1, whose
features are the base `LlamaModel` outputs (post-norm) and whose single layer feeds `lm_head`
directly. Regression and classification then look at the same space, and a drafted feature can be
fed back as the next step's f without any change of scale.

FR-Spec: the head scores only the `N` tokens the target emits most often (`vocab_ids`, stored in the
config). The rows of the target's LM head for those ids are taken from the target at load time, so
the shipped file holds only `fc` and the decoder layer. Tokens outside the FR vocabulary get q = 0,
which keeps speculative sampling lossless (the rejection sampler only needs q(x) > 0 for what is
drafted).

The decoder part is a one-layer Llama decoder stack (fed through `inputs_embeds`) of its target's module family
(server/model/decoder.py's for a served target, transformers' `LlamaModel` for distillation), so the engine's
batched KV machinery (a cache object, per-row `position_ids`, a 4D additive mask) drives it exactly as it drives
the target. Position convention: the pair (f_t, x_{t+1}) sits at position t+1,
the position of the token it embeds.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from server.model import checkpoints, decoder
from server.model.tables import BlockTable, Fp16Table, table_dtype

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
FORMAT = "specula-eagle-head-v1"


@dataclass
class HeadConfig:
    """What a saved head needs besides its weights (written as `config.json`)."""

    target_name: str  # the target it was trained for (informational; the checks below are what bind)
    hidden_size: int
    vocab_size: int  # the target's full vocabulary size
    vocab_ids: list[int]  # FR vocabulary: token ids the head can draft, most frequent first
    decoder: dict[str, Any]  # LlamaConfig of the one-layer decoder, as `to_dict()` gives it
    training: dict[str, Any] = field(default_factory=dict)  # command, tokens seen, held-out acceptance...
    format: str = FORMAT


NO_SPECIAL_TOKENS = {"pad_token_id": None, "bos_token_id": None, "eos_token_id": None}


def decoder_config(target_config: Any) -> dict[str, Any]:
    """A one-layer Llama config's values with the target's width, heads and rotary settings and no vocabulary."""
    cfg = target_config.to_dict()
    keep = (
        "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
        "hidden_act", "rms_norm_eps", "rope_parameters", "rope_theta", "rope_scaling", "max_position_embeddings",
        "attention_bias", "mlp_bias",
    )
    kwargs = {k: cfg[k] for k in keep if cfg.get(k) is not None}
    # vocab_size 1: the decoder is only ever fed `inputs_embeds`, its own embedding table is unused; it has
    # no special tokens either (Llama's default ids 1 and 2 lie outside a one-token vocabulary: a warning).
    return {**kwargs, "model_type": "llama", "num_hidden_layers": 1, "vocab_size": 1, "tie_word_embeddings": False,
            **NO_SPECIAL_TOKENS}


def _decoder(values: dict[str, Any], target: nn.Module) -> nn.Module:
    """The head's one-layer decoder, from the same module family as its target's: decoder.py's for a served target
    (which runs only through the lean forward), transformers' `LlamaModel` for one whose forwards a tool calls
    (distillation trains the head through transformers' forward)."""
    if isinstance(target, decoder.CausalLM):
        return decoder.Decoder(checkpoints.config_from_dict({**values, checkpoints.COMPLETE: True}))  # all given
    from transformers import LlamaConfig, LlamaModel

    from server.model.attention import register_with_transformers

    register_with_transformers()
    dcfg = LlamaConfig.from_dict(values)
    dcfg._attn_implementation = target.config._attn_implementation or "sdpa"
    return LlamaModel(dcfg)


def head_dtype(lm_head: nn.Module) -> torch.dtype:
    """The dtype a head runs in: its target's LM head's, except fp16 on CPU (a quantized target's table,
    quantized.py), which runs as bf16: oneDNN's bf16 kernels serve the head there (fp16 has none on CPU)."""
    dtype, device = table_dtype(lm_head)
    if dtype == torch.float16 and device.type == "cpu":
        return torch.bfloat16
    return dtype


def vocab_rows(module: nn.Module) -> int:
    """The rows of a target's LM head (its vocabulary), without building a dense copy of a quantized one."""
    return int(getattr(module, "out_features", 0) or module.weight.shape[0])


def _rows(module: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of an embedding table or LM head's matrix (a quantized table's dequantized: quantized.py)."""
    table = getattr(module, "table", module)
    if isinstance(table, BlockTable | Fp16Table):
        return table.rows(ids)
    return module.weight.detach()[ids]


class _Borrowed:
    """A module of the target's a head reads but does not own: shared by copies of the head, never a child."""

    def __init__(self, table: nn.Module | None) -> None:
        self.table = table

    def __deepcopy__(self, memo: dict) -> _Borrowed:
        return self


class EagleHead(nn.Module):
    """The draft head. Build with `EagleHead.create(target, vocab_ids)` or `EagleHead.from_pretrained`.

    Frozen pieces borrowed from the target (never saved): its input embedding table and the FR rows of
    its LM head. Trainable: `fc` [2H -> H] and `decoder` (one Llama layer, final norm replaced by
    identity, see the module docstring).
    """

    def __init__(self, config: HeadConfig, target: nn.Module) -> None:
        super().__init__()
        check_target(config, target)
        self.config = config
        hidden = config.hidden_size
        self.fc = nn.Linear(2 * hidden, hidden, bias=True)
        # heads saved before `decoder_config` cleared them carry Llama's default special ids (1, 2), out
        # of a one-token vocabulary: cleared here too, so loading one does not warn
        self.decoder = _decoder({**config.decoder, **NO_SPECIAL_TOKENS}, target)
        self.decoder.norm = nn.Identity()  # predicted features are post-norm already (module docstring)
        table = target.get_input_embeddings()  # [vocab, H], shared, frozen
        head = target.get_output_embeddings()  # [vocab, H]
        device = table_dtype(head)[1]
        ids = torch.tensor(config.vocab_ids, dtype=torch.long, device=device)
        self.register_buffer("vocab_ids", ids, persistent=False)  # [N]
        self.register_buffer("lm_head_fr", _rows(head, ids).clone(), persistent=False)  # [N, H]
        self.to(device=device, dtype=head_dtype(head))
        # the target's own table, in its own dtype (not a converted copy: 57 MB for SmolLM2): see `embed`. A
        # quantized target's table (quantized.BlockTable, Fp16Table: its values may move into the head kernel's
        # tiles) is looked up through its module, kept outside this module's children (it is the target's, never
        # saved or moved with the head)
        blocks = table if isinstance(table, BlockTable | Fp16Table) else None
        self.__dict__["_blocks"] = _Borrowed(blocks)
        self.register_buffer("embed_weight", table.weight.detach() if blocks is None else None, persistent=False)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """The target's input embeddings of `ids`, in the head's dtype: [..., H]."""
        if self._blocks.table is not None:
            return self._blocks.table.rows(ids).to(self.fc.weight.dtype)
        return F.embedding(ids, self.embed_weight).to(self.fc.weight.dtype)

    # ---- construction and files -----------------------------------------------------------------
    @classmethod
    def create(cls, target: nn.Module, vocab_ids: list[int], target_name: str, seed: int = 0,
               init: str = "random") -> EagleHead:
        """A freshly initialised head for `target` drafting over `vocab_ids` (seeded). `init="last-layer"`
        starts the decoder layer as a copy of the target's last decoder layer (fc stays random)."""
        if init not in ("random", "last-layer"):
            raise ValueError(f"init must be 'random' or 'last-layer', not {init!r}")
        cfg = HeadConfig(
            target_name=target_name,
            hidden_size=target.config.hidden_size,
            vocab_size=vocab_rows(target.get_output_embeddings()),
            vocab_ids=[int(i) for i in vocab_ids],
            decoder=decoder_config(target.config),
        )
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            head = cls(cfg, target)
        if init == "last-layer":
            head.decoder.layers[0].load_state_dict(target.model.layers[-1].state_dict())
        return head

    def trainable_state(self) -> dict[str, torch.Tensor]:
        """The weights a file holds: `fc` and the decoder layer (no borrowed target tensors)."""
        return {k: v for k, v in self.state_dict().items() if not k.startswith("decoder.embed_tokens")}

    def save_pretrained(self, path: str | Path, dtype: torch.dtype = torch.bfloat16) -> None:
        """Write `model.safetensors` (weights in `dtype`, bf16 by default: half the bytes) + `config.json`."""
        out = Path(path)
        out.mkdir(parents=True, exist_ok=True)
        tensors = {k: v.detach().to("cpu", dtype).contiguous() for k, v in self.trainable_state().items()}
        save_file(tensors, str(out / WEIGHTS_FILE), metadata={"format": FORMAT})
        # Readable JSON, except the FR ids, which stay on one line (thousands of them).
        text = json.dumps({**asdict(self.config), "vocab_ids": "@ids@"}, indent=1)
        (out / CONFIG_FILE).write_text(text.replace('"@ids@"', json.dumps(self.config.vocab_ids)) + "\n")

    @classmethod
    def from_pretrained(cls, path: str | Path, target: nn.Module) -> EagleHead:
        """Load a saved head for `target`, in the target's dtype and device; refuses a head made for
        another target shape or vocabulary (ValueError)."""
        src = Path(path)
        if not (src / CONFIG_FILE).is_file() or not (src / WEIGHTS_FILE).is_file():
            raise FileNotFoundError(f"no draft head at {src} (needs {CONFIG_FILE} and {WEIGHTS_FILE})")
        raw = json.loads((src / CONFIG_FILE).read_text())
        if raw.get("format") != FORMAT:
            raise ValueError(f"{src / CONFIG_FILE}: not a draft head config (format {raw.get('format')!r})")
        head = cls(HeadConfig(**raw), target)
        dtype = head_dtype(target.get_output_embeddings())
        state = {k: v.to(dtype) for k, v in load_file(str(src / WEIGHTS_FILE)).items()}
        missing, unexpected = head.load_state_dict(state, strict=False)
        missing = [k for k in missing if not k.startswith("decoder.embed_tokens")]
        if missing or unexpected:
            raise ValueError(f"{src / WEIGHTS_FILE}: missing {missing}, unexpected {unexpected}")
        return head.eval()

    # ---- the forward pass -----------------------------------------------------------------------
    @property
    def num_vocab(self) -> int:
        """N, the size of the FR vocabulary."""
        return int(self.vocab_ids.shape[0])

    def forward(
        self,
        hidden: torch.Tensor,  # [B, W, H] target (or drafted) features f_t
        next_ids: torch.Tensor,  # [B, W] the tokens x_{t+1} that follow them
        **decoder_kwargs: Any,  # position_ids, attention_mask, past_key_values, use_cache: as for LlamaModel
    ) -> tuple[torch.Tensor, Any]:
        """Predicted features f̂_{t+1} [B, W, H] and the decoder's cache (None unless use_cache)."""
        embeds = self.embed(next_ids)  # [B, W, H]
        x = self.fc(torch.cat([embeds, hidden.to(embeds.dtype)], dim=-1))  # [B, W, H]
        out = self.decoder(inputs_embeds=x, **decoder_kwargs)
        return out.last_hidden_state, out.past_key_values

    def fr_logits(self, features: torch.Tensor) -> torch.Tensor:
        """Logits over the FR vocabulary [..., N] for features [..., H] (position n is `vocab_ids[n]`)."""
        return features @ self.lm_head_fr.T

    def full_logits(self, fr_logits: torch.Tensor) -> torch.Tensor:
        """Scatter FR logits [..., N] into the full vocabulary [..., V], -inf elsewhere, so that any
        softmax / temperature / top-k / top-p processing of them gives q = 0 outside the FR vocab."""
        shape = (*fr_logits.shape[:-1], self.config.vocab_size)
        full = torch.full(shape, float("-inf"), dtype=fr_logits.dtype, device=fr_logits.device)
        return full.index_copy_(-1, self.vocab_ids, fr_logits)


def check_target(config: HeadConfig, target: nn.Module) -> None:
    """Refuse a head whose shapes or vocabulary do not match `target` (ValueError)."""
    hidden = target.config.hidden_size
    vocab = vocab_rows(target.get_output_embeddings())
    if config.hidden_size != hidden or config.vocab_size != vocab:
        raise ValueError(
            f"draft head for {config.target_name!r} (hidden {config.hidden_size}, vocab {config.vocab_size}) "
            f"does not fit this target (hidden {hidden}, vocab {vocab})"
        )
    if not config.vocab_ids or min(config.vocab_ids) < 0 or max(config.vocab_ids) >= vocab:
        raise ValueError("draft head vocab_ids must be non-empty token ids of the target's vocabulary")
    if len(set(config.vocab_ids)) != len(config.vocab_ids):
        raise ValueError("draft head vocab_ids repeat a token id")
