"""Sampling: parameters, per-step metadata, the device sampler and its state, pooling, rejection sampling."""
