"""GGUF (llama.cpp) as a weight format: the block types this engine reads (types.py, torch-free), a checkpoint
tensor kept in its blocks (weight.py) and the linear method that multiplies by it (method.py)."""
