"""Quantized checkpoints: reading quantization_config, packed-weight linear methods, and their GPU dispatch."""
