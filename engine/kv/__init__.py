"""The KV cache's bookkeeping: blocks and their pool, KV specs and groups, per-group managers, state slots."""
