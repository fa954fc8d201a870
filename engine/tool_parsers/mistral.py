"""mistral: `[TOOL_CALLS]` followed by a JSON list of `{"name", "arguments"}` (v0.3 templates) or by
`name[ARGS]{...}` pairs (v11+ templates)."""
from __future__ import annotations

import json

from engine.tool_parsers.base import ToolCall, ToolParser, call_from_json

TAG = "[TOOL_CALLS]"


class MistralToolParser(ToolParser):
    name = "mistral"
    markers = (TAG,)

    def parse_calls(self, section: str, final: bool) -> list[ToolCall] | None:
        if not final:
            return []
        calls: list[ToolCall] = []
        for part in section.split(TAG)[1:]:
            part = part.strip()
            if "[ARGS]" in part:
                name, _, args = part.partition("[ARGS]")
                call = call_from_json({"name": name.strip(), "arguments": args.strip()})
                if call is None:
                    return None
                calls.append(call)
                continue
            try:
                obj = json.loads(part)
            except json.JSONDecodeError:
                return None
            for item in obj if isinstance(obj, list) else [obj]:
                call = call_from_json(item)
                if call is None:
                    return None
                calls.append(call)
        return calls
