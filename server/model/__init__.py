"""Running Hugging Face causal LMs for the engine: loading, the batched KV cache, the forward."""
