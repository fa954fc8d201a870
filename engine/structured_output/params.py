"""StructuredOutputsParams: what a request constrains its output to (vLLM's field names); torch-free.

Exactly one kind per request: a JSON schema, any JSON object, a regex, a choice of strings, an EBNF
grammar (xgrammar's dialect, which reads GBNF) or a structural tag (JSON inside given begin/end tags, free
text elsewhere: xgrammar's format or vLLM's `structures`/`triggers` one). `key` is the spec the compiler
reads; `canonical_key` identifies it in the compile cache. A schema given as a dict is kept in the client's
key order, never sorted: the grammar generates properties in the order it reads them, and clients put
`reasoning` before `answer` on purpose. So the canonical form sorts every JSON key except the names in a
`properties` map: another order of those is another grammar, anything else is a cache hit.
"""
from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Any

KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")
MAX_SPEC_CHARS = 200_000


@dataclass(frozen=True)
class StructuredOutputsParams:
    json: str | dict | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | list[str] | None = None
    grammar: str | None = None
    structural_tag: str | dict | None = None

    def __post_init__(self) -> None:
        asked = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(asked) != 1:
            raise ValueError(f"structured_outputs must set exactly one of {', '.join(KINDS)}; got "
                             f"{', '.join(asked) or 'none'}")
        for kind in ("json", "structural_tag"):
            if isinstance(getattr(self, kind), dict):
                object.__setattr__(self, kind, json.dumps(getattr(self, kind)))
        if self.choice is not None:
            choice = tuple(self.choice)
            if not choice or not all(isinstance(c, str) and c for c in choice):
                raise ValueError("structured_outputs choice must be a non-empty list of non-empty strings")
            object.__setattr__(self, "choice", choice)
        if len(self.key[1]) > MAX_SPEC_CHARS:
            raise ValueError(f"structured_outputs {self.kind} is {len(self.key[1])} characters; at most "
                             f"{MAX_SPEC_CHARS}")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @functools.cached_property
    def canonical_key(self) -> tuple[str, str]:
        """`key` with JSON specs in one canonical form (keys sorted but for property names, which keep their
        order: it is the output's order): the compile cache's key. The compiler itself reads `key`."""
        kind, spec = self.key
        if kind in ("json", "structural_tag"):
            try:
                spec = json.dumps(_canonical(json.loads(spec)), separators=(",", ":"))
            except (ValueError, RecursionError):
                pass  # not JSON: the compile reports it
        return kind, spec

    @property
    def key(self) -> tuple[str, str]:
        value: Any = getattr(self, self.kind)
        return self.kind, value if isinstance(value, str) else json.dumps(value)


def _canonical(value: Any, property_names: bool = False) -> Any:
    """Sort dict keys recursively, except the keys of a `properties` map (property names, in output order)."""
    if isinstance(value, list):
        return [_canonical(v) for v in value]
    if not isinstance(value, dict):
        return value
    keys = list(value) if property_names else sorted(value)
    return {k: _canonical(value[k], property_names=k == "properties" and not property_names
                          and isinstance(value[k], dict)) for k in keys}
