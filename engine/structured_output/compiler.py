"""Compile structured-output specs into xgrammar grammars, once per spec (a bounded LRU cache).

The tokenizer's vocabulary is read once, lazily (half a second at 128k tokens), with the model's
vocabulary size so padded logit columns are never allowed, and the model's EOS ids as the tokens
that end a grammar. Thread-safe: the HTTP layer compiles a request's spec (so a bad one is a 400)
and the engine thread then finds it in the cache. A spec xgrammar refuses raises ValueError naming it.
JSON is compact (no free whitespace between tokens): a weak model stuck on newlines would otherwise
spend its whole budget there and end with an unclosed object.
"""
from __future__ import annotations

import collections
import json
import threading

from engine.structured_output.params import StructuredOutputsParams

CACHE_SIZE = 256
_JSON_STRING_CHAR = r'[^\0-\x1f\"\\\r\n\uD800-\uDFFF]'
ANY_OBJECT = '{"type": "object", "additionalProperties": true}'


class GrammarCompiler:
    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int]) -> None:
        self.tokenizer, self.vocab_size, self.eos_token_ids = tokenizer, vocab_size, list(eos_token_ids)
        self._compiler = None
        self._cache: collections.OrderedDict = collections.OrderedDict()
        self._lock = threading.Lock()
        self.num_compiles = 0

    def _xgr_compiler(self):
        import xgrammar as xgr
        with self._lock:
            if self._compiler is None:
                info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                          stop_token_ids=self.eos_token_ids)
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            return self._compiler

    def compile(self, params: StructuredOutputsParams):
        """The CompiledGrammar for `params` (cached); ValueError when the spec is invalid."""
        key = params.key
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        compiled = self._compile(params)
        with self._lock:
            self._cache[key] = compiled
            self.num_compiles += 1
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, params: StructuredOutputsParams):
        compiler = self._xgr_compiler()
        kind, spec = params.key
        try:
            if kind == "json":
                json.loads(spec)
                return compiler.compile_grammar(json_schema_grammar(spec))
            if kind == "json_object":  # any object (xgrammar's builtin JSON grammar also allows arrays)
                return compiler.compile_grammar(json_schema_grammar(ANY_OBJECT))
            if kind == "regex":
                return compiler.compile_regex(spec)
            if kind == "choice":
                return compiler.compile_grammar(choice_grammar(params.choice))
            if kind == "structural_tag":
                return compiler.compile_grammar(structural_tag_grammar(spec))
            return compiler.compile_grammar(spec)
        except Exception as exc:  # noqa: BLE001 - xgrammar raises several types; all mean a bad spec
            text = str(exc).strip().splitlines()
            reason = text[-1] if text else type(exc).__name__
            raise ValueError(f"structured_outputs {kind} is invalid: {reason[:400]}") from None


def json_schema_grammar(schema: str) -> str:
    r"""xgrammar's EBNF for a JSON schema, with string characters limited to what JSON and UTF-8 allow.

    xgrammar 0.2.9 writes a string with minLength/maxLength as `[^\"\\\r\n]{m,n}`, which lets raw control
    characters (U+0000-U+001F) through, and every string class accepts UTF-8-encoded surrogates
    (U+D800-U+DFFF, bytes ED A0-BF xx), which are not valid UTF-8; either way the output would not parse.
    """
    import xgrammar as xgr
    return _strict_json_strings(str(xgr.Grammar.from_json_schema(schema, any_whitespace=False)))


def _strict_json_strings(text: str) -> str:
    for loose in (r'[^\"\\\r\n]', r'[^\0-\x1f\"\\\r\n]'):
        text = text.replace(loose, _JSON_STRING_CHAR)
    return text


def structural_tag_grammar(spec: str) -> str:
    """xgrammar's EBNF for a structural tag: xgrammar's own format (`{"type": "structural_tag", "format":
    ...}`) or vLLM's OpenAI-style one (`{"structures": [{"begin", "schema", "end"}], "triggers": [...]}`:
    free text until a trigger, then the tag whose begin it starts, its JSON, its end), with JSON strings
    limited as in `json_schema_grammar`."""
    import xgrammar as xgr
    tag = json.loads(spec)
    if isinstance(tag, dict) and "structures" in tag:
        tag = {"type": "structural_tag", "format": {
            "type": "triggered_tags", "triggers": tag.get("triggers") or [],
            "tags": [{"type": "tag", "begin": s["begin"], "end": s["end"],
                      "content": {"type": "json_schema", "json_schema": s.get("schema") or {}}}
                     for s in tag["structures"]]}}
    return _strict_json_strings(str(xgr.Grammar.from_structural_tag(tag)))


def choice_grammar(choices: tuple[str, ...]) -> str:
    """EBNF accepting exactly one of `choices` (JSON string escapes are valid EBNF literal escapes)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)
