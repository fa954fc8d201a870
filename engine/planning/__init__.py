"""Every byte count the engine, the GUI's capacity planner and the router's placement share, one function per
quantity: units.py (GiB, dtypes), weights.py, kv.py (per token and block, state pool, verify scratch),
activations.py (the step's peak, logits and sampler rows), graphs.py (CUDA graphs), speculation.py (a draft model
or MTP head); capacity.py turns one card's measured or estimated profile into a plan, planner.py plans from a
model's shape alone. Torch-free, not even an import inside a function: the app imports it.
"""
