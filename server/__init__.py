"""Specula: an OpenAI-compatible inference server whose worker runs speculative decoding."""

__version__ = "0.1.0"
