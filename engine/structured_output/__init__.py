"""Structured outputs: grammar-constrained decoding (JSON schema, JSON object, regex, choice, EBNF grammar).

`params` holds the torch-free request side (`StructuredOutputsParams`, on `SamplingParams`); `compiler`
compiles it once per spec with xgrammar and caches it; `state` is one sequence's matcher; `bitmask`
packs the allowed tokens of a step's rows and applies them to the logits on their device.
"""
