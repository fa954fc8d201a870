"""One device's side of a step: the model runner, its inputs, KV pools, graphs, loading and profiling."""
