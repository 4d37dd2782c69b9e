"""flexengine: LLM inference with FlexAttention over a paged KV cache."""
