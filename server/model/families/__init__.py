"""The model families the server runs on its own modules, and the one decision of whether it serves a config.

Adding an architecture is one file here (its names, its config read into a `Spec`: base.py) plus one line in
`FAMILIES`. `family_of(config)` is the only place that decides support; `unsupported(config)` says why not (the
server then runs transformers' modules for it, or names the architecture in its error)."""

from __future__ import annotations

from typing import Any

from server.model.families import gemma, llama, mistral, phi3, qwen2, qwen3
from server.model.families.base import Family, Spec

FAMILIES: tuple[Family, ...] = (llama.FAMILY, mistral.FAMILY, qwen2.FAMILY, qwen3.FAMILY, gemma.GEMMA2, gemma.GEMMA3,
                                phi3.FAMILY)

__all__ = ["FAMILIES", "Family", "Spec", "by_gguf_arch", "family_of", "spec_of", "unsupported"]


def _named(config: Any) -> Family | None:
    model_type = getattr(config, "model_type", None)
    return next((f for f in FAMILIES if model_type in f.model_types), None)


def unsupported(config: Any) -> str | None:
    """Why the server's modules do not serve `config` exactly (None: they do)."""
    family = _named(config)
    if family is None:
        known = ", ".join(t for f in FAMILIES for t in f.model_types)
        return f"architecture {getattr(config, 'model_type', None)!r} (the server's modules serve {known})"
    problem = family.check(config)
    return f"{family.name} with {problem}" if problem else None


def family_of(config: Any) -> Family | None:
    """The family that serves `config` exactly, or None (see `unsupported`)."""
    return _named(config) if unsupported(config) is None else None


def spec_of(config: Any) -> Spec | None:
    family = family_of(config)
    return family.spec(config) if family is not None else None


def by_gguf_arch(arch: str) -> Family | None:
    """The family of a GGUF file's `general.architecture`."""
    return next((f for f in FAMILIES if f.gguf_arch == arch), None)
