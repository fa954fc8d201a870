"""The prefix cache's CPU-RAM tier, on the scheduler's side (vLLM's kv_offload, in our size): which host slot holds
which cached block (host_pool.py, LRU), which blocks are worth storing (reuse_gate.py), what one step asks the
workers to copy (transfers.py), and the connector the block pool, the KV cache manager and the scheduler call
(connector.py). Torch-free: the copies themselves are the worker's (engine/worker/kv_offload.py)."""
