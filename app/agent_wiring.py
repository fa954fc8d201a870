"""How each agent CLI (Claude Code, Codex, opencode) is pointed at a PagedDesk endpoint: environment and arguments.

One truth for `pagedesk launch` (app/launch.py), the Endpoint tab's copy-ready snippets and the tests that run the
real CLIs. Nothing here writes a file: Claude Code reads environment variables, Codex takes `-c` overrides
(a provider of its own, `pagedesk`, on the Responses API), opencode reads its config from
OPENCODE_CONFIG_CONTENT, which it merges over the user's own. Every model role an agent has (Claude Code's
opus/sonnet/haiku and subagents, opencode's small model) names the served model, and the context window is
the server's `max_model_len`, so the agents size their requests and compaction to it. Telemetry and update
checks are off. Torch-free and Qt-free.
"""
from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field

AGENTS = ("claude", "codex", "opencode")
# (npm package, binary) of each agent; the pinned versions the tests run are in installer/agent-clients.txt
PACKAGES = {"claude": ("@anthropic-ai/claude-code", "claude"), "codex": ("@openai/codex", "codex"),
            "opencode": ("opencode-ai", "opencode")}
KEY_ENV = "PAGEDESK_API_KEY"  # the key Codex reads (its env_key); the others get it directly
NO_KEY = "pagedesk"  # what to send when the endpoint is open: the CLIs refuse to start without a key


@dataclass(frozen=True)
class Endpoint:
    base_url: str  # http://127.0.0.1:8000 (no /v1)
    api_key: str | None
    model: str
    context_length: int


@dataclass
class Wiring:
    env: dict[str, str] = field(default_factory=dict)
    args: list[str] = field(default_factory=list)  # before the user's own arguments

    def shell(self, binary: str) -> str:
        """A copy-ready shell line."""
        exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env.items())
        return f"{exports} {binary} {' '.join(shlex.quote(a) for a in self.args)}".strip()


def max_output_tokens(context_length: int) -> int:
    """An answer's budget: a quarter of the window, at most Claude Code's default of 32000."""
    return max(256, min(32000, context_length // 4))


def claude(ep: Endpoint) -> Wiring:
    env = {"ANTHROPIC_BASE_URL": ep.base_url, "ANTHROPIC_AUTH_TOKEN": ep.api_key or NO_KEY, "ANTHROPIC_API_KEY": "",
           "CLAUDE_CODE_MAX_CONTEXT_TOKENS": str(ep.context_length),
           "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(max_output_tokens(ep.context_length)),
           "DISABLE_TELEMETRY": "1", "DISABLE_ERROR_REPORTING": "1", "DISABLE_AUTOUPDATER": "1",
           "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1"}
    for role in ("ANTHROPIC_MODEL", "ANTHROPIC_DEFAULT_OPUS_MODEL", "ANTHROPIC_DEFAULT_SONNET_MODEL",
                 "ANTHROPIC_DEFAULT_HAIKU_MODEL", "ANTHROPIC_SMALL_FAST_MODEL", "CLAUDE_CODE_SUBAGENT_MODEL"):
        env[role] = ep.model
    return Wiring(env)


def _toml(value: str) -> str:
    return json.dumps(value)  # a JSON string is a valid TOML basic string


def codex(ep: Endpoint) -> Wiring:
    provider = (f"{{name={_toml('PagedDesk')}, base_url={_toml(ep.base_url + '/v1')}, wire_api={_toml('responses')}, "
                f"env_key={_toml(KEY_ENV)}}}")
    overrides = ["model_provider=pagedesk", f"model_providers.pagedesk={provider}", f"model={_toml(ep.model)}",
                 f"model_context_window={ep.context_length}",
                 # a hosted tool: the server ignores it, so the model would be offered a search it cannot run
                 "web_search=\"disabled\"", "check_for_update_on_startup=false", "analytics.enabled=false"]
    args = [a for o in overrides for a in ("-c", o)]
    return Wiring({KEY_ENV: ep.api_key or NO_KEY}, args)


def opencode(ep: Endpoint) -> Wiring:
    limit = {"context": ep.context_length, "output": max_output_tokens(ep.context_length)}
    config = {"provider": {"pagedesk": {"npm": "@ai-sdk/openai-compatible", "name": "PagedDesk",
                                        "options": {"baseURL": ep.base_url + "/v1", "apiKey": ep.api_key or NO_KEY},
                                        "models": {ep.model: {"name": ep.model, "limit": limit}}}},
              "model": f"pagedesk/{ep.model}", "small_model": f"pagedesk/{ep.model}", "autoupdate": False,
              "share": "disabled"}
    return Wiring({"OPENCODE_CONFIG_CONTENT": json.dumps(config), "OPENCODE_DISABLE_AUTOUPDATE": "1",
                   "OPENCODE_DISABLE_SHARE": "1", "OPENCODE_DISABLE_MODELS_FETCH": "1"})


WIRINGS = {"claude": claude, "codex": codex, "opencode": opencode}


def wiring(agent: str, ep: Endpoint) -> Wiring:
    return WIRINGS[agent](ep)
