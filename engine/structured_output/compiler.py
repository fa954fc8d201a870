"""Compile structured-output specs into xgrammar grammars, once per spec, in a small pool of threads.

The tokenizer's vocabulary is read once, lazily (half a second at 128k tokens), with the model's
vocabulary size so padded logit columns are never allowed, and the model's EOS ids as the tokens
that end a grammar. `submit` returns a future: a cache hit (an LRU keyed by the spec's canonical form,
where only the order of property names matters) is already done, a spec being compiled is shared, and anything else runs
in a bounded pool (COMPILE_WORKERS threads, at most MAX_PENDING_COMPILES waiting), never on the caller's
thread; the pool's threads run at a lower CPU priority (COMPILE_NICE), so a compile takes only what the
engine's step and the server leave and a bystander's step is never behind a grammar bomb (xgrammar releases
the interpreter lock while it compiles, so the OS scheduler decides). Thread-safe: the HTTP layer waits on a request's compile (so a bad spec is a 400, and one over
COMPILE_TIMEOUT_S a 400 "too complex"), and the engine thread only ever checks whether a future is done.
A schema past MAX_SCHEMA_NODES or MAX_SCHEMA_DEPTH is refused before any compile. A spec xgrammar refuses,
or one that matches no text at all (not even a first token), raises ValueError naming it. JSON is compact (no free whitespace between tokens): a weak model stuck on
newlines would otherwise spend its whole budget there and end with an unclosed object.
"""
from __future__ import annotations

import collections
import json
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor

from engine.structured_output.params import StructuredOutputsParams

CACHE_SIZE = 256
COMPILE_WORKERS = 2  # compiles at once: each is one CPU-bound thread, so bystanders keep the other cores
MAX_PENDING_COMPILES = 64  # distinct specs compiling or queued; past that a new one is refused (503)
COMPILE_TIMEOUT_S = 20.0  # a client waits this long for its spec; longer is "too complex" (400)
MAX_SCHEMA_NODES = 10_000  # objects, arrays and values in a JSON schema / structural tag
MAX_SCHEMA_DEPTH = 64
COMPILE_NICE = 10  # the pool's threads are this much nicer than the process: ~10% of a core against a busy thread


class GrammarTooComplex(ValueError):
    """A spec over a complexity limit (nodes, depth, compile time); the message names the limit."""


class GrammarCompilerBusy(RuntimeError):
    """MAX_PENDING_COMPILES distinct specs are already compiling or queued."""
_JSON_STRING_CHAR = r'[^\0-\x1f\"\\\r\n\uD800-\uDFFF]'
ANY_OBJECT = '{"type": "object", "additionalProperties": true}'


class GrammarCompiler:
    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int]) -> None:
        self.tokenizer, self.vocab_size, self.eos_token_ids = tokenizer, vocab_size, list(eos_token_ids)
        self._compiler = None
        self._cache: collections.OrderedDict = collections.OrderedDict()
        self._lock = threading.Lock()
        self._pending: dict[tuple[str, str], Future] = {}  # canonical key -> the compile in progress
        self._pool = ThreadPoolExecutor(max_workers=COMPILE_WORKERS, thread_name_prefix="pagedesk-grammar",
                                        initializer=_lower_priority)
        self.num_compiles = 0

    def _xgr_compiler(self):
        import xgrammar as xgr
        with self._lock:
            if self._compiler is None:
                info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                          stop_token_ids=self.eos_token_ids)
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            return self._compiler

    def submit(self, params: StructuredOutputsParams) -> Future:
        """A future of the CompiledGrammar for `params`: done at once on a cache hit, shared with a compile of
        the same spec in progress, else queued in the pool. Raises GrammarTooComplex (a ValueError) for a spec
        over the size limits and GrammarCompilerBusy when too many compiles wait; the future fails with
        ValueError when xgrammar refuses the spec."""
        key = params.canonical_key
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return _done(self._cache[key])
            if key in self._pending:
                return self._pending[key]
        check_complexity(params)
        with self._lock:
            if key in self._pending:
                return self._pending[key]
            if len(self._pending) >= MAX_PENDING_COMPILES:
                raise GrammarCompilerBusy(f"{len(self._pending)} grammars are compiling or queued (the limit); "
                                          "retry shortly")
            future = self._pending[key] = self._pool.submit(self._compile_and_cache, key, params)
        return future

    def compile(self, params: StructuredOutputsParams, timeout: float | None = COMPILE_TIMEOUT_S):
        """The CompiledGrammar for `params`, waiting at most `timeout` seconds (GrammarTooComplex past it)."""
        future = self.submit(params)
        try:
            return future.result(timeout)
        except TimeoutError:
            raise GrammarTooComplex(f"structured_outputs {params.kind} is too complex: compiling it takes longer "
                                    f"than the {timeout:g} s limit") from None

    def shutdown(self) -> None:
        """Drop queued compiles; one in progress ends on its own (xgrammar cannot be interrupted)."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _compile_and_cache(self, key: tuple[str, str], params: StructuredOutputsParams):
        try:
            compiled = self._compile(params)
        except BaseException:
            with self._lock:
                self._pending.pop(key, None)
            raise
        with self._lock:  # pending and cached swap under one lock, so no submit in between compiles it again
            self._pending.pop(key, None)
            self._cache[key] = compiled
            self.num_compiles += 1
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, params: StructuredOutputsParams):
        compiled = self._compile_spec(params)
        if not _allows_a_first_token(compiled):
            raise ValueError(f"structured_outputs {params.kind} matches no text: it allows no first token, so "
                             "nothing could be generated")
        return compiled

    def _compile_spec(self, params: StructuredOutputsParams):
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


def _lower_priority() -> None:
    """Each pool thread, as it starts: COMPILE_NICE nicer than the process (Linux niceness is per thread)."""
    if hasattr(os, "setpriority"):
        try:
            tid = threading.get_native_id()
            os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, 0) + COMPILE_NICE))
        except OSError:  # a platform that refuses: compiles then share the CPU evenly, as before
            pass


def _allows_a_first_token(compiled) -> bool:
    """Whether a matcher at the grammar's start allows any token (a stop token counts: the empty text)."""
    import xgrammar as xgr
    bitmask = xgr.allocate_token_bitmask(1, compiled.tokenizer_info.vocab_size)
    xgr.GrammarMatcher(compiled).fill_next_token_bitmask(bitmask)
    return bool(bitmask.any())


def check_complexity(params: StructuredOutputsParams) -> None:
    """GrammarTooComplex when a JSON spec has more than MAX_SCHEMA_NODES nodes or nests deeper than
    MAX_SCHEMA_DEPTH (counted without recursion, so no spec can exhaust the stack here)."""
    if params.kind not in ("json", "structural_tag"):
        return
    try:
        root = json.loads(params.key[1])
    except (ValueError, RecursionError):
        return  # not JSON: the compile reports it
    nodes, stack = 0, [(root, 1)]
    while stack:
        value, depth = stack.pop()
        nodes += 1
        if nodes > MAX_SCHEMA_NODES:
            raise GrammarTooComplex(f"structured_outputs {params.kind} is too complex: more than "
                                    f"{MAX_SCHEMA_NODES} schema nodes (the limit)")
        if depth > MAX_SCHEMA_DEPTH:
            raise GrammarTooComplex(f"structured_outputs {params.kind} is too complex: nested deeper than "
                                    f"{MAX_SCHEMA_DEPTH} levels (the limit)")
        children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
        stack += [(child, depth + 1) for child in children]


def _done(value) -> Future:
    future: Future = Future()
    future.set_result(value)
    return future


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
