"""What a request constrains its output to: response_format, vLLM's guided_* / structured_outputs, or a
forced tool call (tool_choice `required` or a named function), as one StructuredOutputsParams.

At most one source per request (two are a 400 naming the second). The spec is compiled here, in the
grammar compiler's own bounded pool, so a bad or too complex schema is a 400 naming the field before the
engine sees the request; the engine then finds the compiled grammar in the cache (and if it was evicted,
recompiles it in the pool without holding up the step).
"""
from __future__ import annotations

import asyncio
from typing import Any

from engine.entrypoints.openai.errors import OpenAIError, bad_request
from engine.entrypoints.openai.protocol import SamplingFields, ToolDefinition
from engine.entrypoints.openai.served_model import ServedModel
from engine.structured_output.compiler import COMPILE_TIMEOUT_S, GrammarCompilerBusy, GrammarTooComplex
from engine.structured_output.params import StructuredOutputsParams

_VLLM_FIELDS = (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                ("guided_grammar", "grammar"), ("structural_tag", "structural_tag"))


def _from_response_format(req: SamplingFields) -> StructuredOutputsParams | None:
    fmt = req.response_format
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    if fmt.type == "structural_tag":
        if fmt.format is not None:
            return StructuredOutputsParams(structural_tag={"type": "structural_tag", "format": fmt.format})
        if not fmt.structures:
            raise bad_request("response_format structural_tag needs structures (with triggers) or format",
                              "response_format")
        return StructuredOutputsParams(structural_tag={
            "structures": [{"begin": s.begin, "schema": s.structure_schema, "end": s.end} for s in fmt.structures],
            "triggers": fmt.triggers or []})
    if fmt.json_schema is None or fmt.json_schema.json_schema is None:
        raise bad_request("response_format json_schema needs json_schema.schema", "response_format.json_schema")
    return StructuredOutputsParams(json=fmt.json_schema.json_schema)


def _from_structured_outputs(req: SamplingFields) -> StructuredOutputsParams | None:
    so = req.structured_outputs
    if so is None:
        return None
    return StructuredOutputsParams(json=so.json_, regex=so.regex, choice=so.choice, grammar=so.grammar,
                                   structural_tag=so.structural_tag, json_object=bool(so.json_object))


def tool_call_schema(tools: list[ToolDefinition], tool_choice: Any, parallel: bool) -> dict:
    """The JSON schema a forced tool call must match: a named function's arguments object, or (required)
    a list of `{"name", "parameters"}` calls of any tool, as vLLM generates them. Under `required` each tool's
    parameters move into the combined schema's root `$defs` (as `tool<i>`, with its own `$defs` / `definitions`
    beside it as `tool<i>.<name>`), so the `$ref`s that pydantic-made schemas carry still resolve."""
    def params_of(tool: ToolDefinition) -> dict:
        return tool.function.parameters or {"type": "object", "properties": {}}

    if tool_choice != "required":
        return params_of(next(t for t in tools if t.function.name == tool_choice.function.name))
    defs: dict[str, Any] = {}
    calls = []
    for i, t in enumerate(tools):
        defs.update(_hoisted(params_of(t), f"tool{i}"))
        calls.append({"type": "object", "properties": {"name": {"const": t.function.name},
                                                        "parameters": {"$ref": f"#/$defs/tool{i}"}},
                      "required": ["name", "parameters"]})
    schema = {"type": "array", "minItems": 1, "items": calls[0] if len(calls) == 1 else {"anyOf": calls},
              "$defs": defs}
    if not parallel:
        schema["maxItems"] = 1
    return schema


_DEF_KEYS = ("$defs", "definitions")


def _hoisted(schema: dict, tag: str) -> dict[str, Any]:
    """`schema` and its own definitions as root `$defs` entries named `tag` and `tag.<name>`, with every local
    `$ref` ("#", "#/$defs/X/...", "#/definitions/X", "#/properties/...") rewritten to its new place."""
    def ref(target: str) -> str:
        pointer = target[1:]
        for key in _DEF_KEYS:
            prefix = f"/{key}/"
            if pointer.startswith(prefix):
                name, _, rest = pointer[len(prefix):].partition("/")
                return f"#/$defs/{tag}.{name}" + (f"/{rest}" if rest else "")
        return f"#/$defs/{tag}{pointer}"

    def rewrite(node: Any) -> Any:
        if isinstance(node, dict):
            return {k: ref(v) if k == "$ref" and isinstance(v, str) and v.startswith("#") else rewrite(v)
                    for k, v in node.items()}
        if isinstance(node, list):
            return [rewrite(v) for v in node]
        return node

    out = {tag: rewrite({k: v for k, v in schema.items() if k not in _DEF_KEYS})}
    for key in _DEF_KEYS:
        for name, definition in (schema.get(key) or {}).items():
            out[f"{tag}.{name}"] = rewrite(definition)
    return out


def structured_outputs_for(req: SamplingFields, forced_tool_schema: dict | None = None
                           ) -> tuple[StructuredOutputsParams | None, str | None]:
    """(params, the request field they came from); 400 when more than one field asks for a constraint."""
    sources = [("tool_choice", lambda: forced_tool_schema and StructuredOutputsParams(json=forced_tool_schema)),
               ("response_format", lambda: _from_response_format(req)),
               ("structured_outputs", lambda: _from_structured_outputs(req))]
    sources += [(field, lambda field=field, kind=kind: getattr(req, field) is not None and
                 StructuredOutputsParams(**{kind: getattr(req, field)})) for field, kind in _VLLM_FIELDS]
    found: list[tuple[str, StructuredOutputsParams]] = []
    for field, make in sources:
        try:
            params = make()
        except ValueError as exc:
            raise bad_request(f"{field}: {exc}", field) from None
        if params:
            found.append((field, params))
    if len(found) > 1:
        raise bad_request(f"{found[1][0]} cannot be combined with {found[0][0]}: send one output constraint",
                          found[1][0])
    return (found[0][1], found[0][0]) if found else (None, None)


async def compile_or_400(model: ServedModel, params: StructuredOutputsParams | None, field: str | None) -> None:
    """Compile (and cache) the request's grammar in the compiler's pool; an invalid spec, or one over a
    complexity limit (size, depth, COMPILE_TIMEOUT_S), is a 400 naming `field`; a full pool is a 503."""
    if params is None:
        return
    try:
        future = model.grammars.submit(params)
        try:  # shielded: a compile shared with other requests goes on when this client gives up
            await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)), COMPILE_TIMEOUT_S)
        except TimeoutError:
            raise GrammarTooComplex(f"structured_outputs {params.kind} is too complex: compiling it takes longer "
                                    f"than the {COMPILE_TIMEOUT_S:g} s limit") from None
    except GrammarCompilerBusy as exc:
        raise OpenAIError(503, str(exc), code="grammar_compiler_busy") from None
    except ValueError as exc:
        raise bad_request(f"{field}: {exc}".replace("structured_outputs ", ""), field) from None

