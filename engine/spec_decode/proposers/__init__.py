"""Speculative proposers: n-gram, draft model and MTP head."""
