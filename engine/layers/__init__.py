"""Model building blocks: linear, norm, rotary embedding, attention over the paged KV cache."""
