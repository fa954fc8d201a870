"""The real agent CLIs, at the versions pinned in installer/agent-clients.txt, get answers through a real server.

Claude Code (`claude -p`, Anthropic Messages), Codex (`codex exec`, Responses) and opencode (`opencode run`, chat
completions) run in print/exec mode with app/agent_wiring.py's wiring (what `pagedesk launch` does) against a
uvicorn server on 127.0.0.1 whose tiny scripted model answers "Hello from PagedDesk." (conftest's
scripted_api_server). Each test asserts that every request the client made got a 2xx (the server's access log)
and that it printed the answer. A client missing from .work/agents is skipped with the exact install line
(installer/setup.sh --dev installs them); it never passes without running. Each client's home and config are
temporary; their system prompts and tool lists are cut down (a CPU prefill of their full ~30k-token prompts takes
minutes here), keeping the request shapes that broke them: Claude Code's system turn inside `messages`, adaptive
thinking, output_config, context_management and metadata; Codex's client_metadata, its namespace tool and its
hosted web_search tool.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from app.agent_wiring import PACKAGES, Endpoint, wiring
from server_harness import MODEL_NAME, access_records

ROOT = Path(__file__).resolve().parents[1]
PINS = ROOT / "installer" / "agent-clients.txt"
BIN = ROOT / ".work" / "agents" / "node_modules" / ".bin"
ANSWER = "Hello from PagedDesk."
RUN_TIMEOUT_S = 420
SHORT_PROMPT = "You are a coding agent. Answer briefly."


def pins() -> dict[str, tuple[str, str]]:
    """agent -> (npm package, version), from installer/agent-clients.txt."""
    out = {}
    for line in PINS.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            agent, package, version = line.split()
            out[agent] = (package, version)
    return out


def binary(agent: str) -> str:
    """The pinned CLI's path, or a skip naming the install line."""
    package, version = pins()[agent]
    path = BIN / PACKAGES[agent][1]
    install = f"npm install --prefix .work/agents {package}@{version}   (or: bash installer/setup.sh --dev)"
    if shutil.which("node") is None:
        pytest.skip(f"node is not installed; then: {install}")
    if not path.exists():
        pytest.skip(f"{package}@{version} is not installed; run: {install}")
    with tempfile.TemporaryDirectory() as home:  # a CLI may write its home folder even for --version
        shown = subprocess.run([str(path), "--version"], capture_output=True, text=True, timeout=60, cwd=home,
                               env=_base_env(Path(home))).stdout
    if version not in shown:
        pytest.skip(f"{package} at .work/agents is {shown.strip()!r}, not the pinned {version}; run: {install}")
    return str(path)


def _base_env(home: Path) -> dict[str, str]:
    path = os.pathsep.join([str(Path(shutil.which("node") or "/usr/bin/node").parent), "/usr/bin", "/bin"])
    return {"PATH": path, "HOME": str(home), "LANG": "C.UTF-8", "TERM": "dumb", "NO_COLOR": "1"}


def run_agent(server, tmp_path: Path, command: list[str], env: dict[str, str], path: str):
    """Run one CLI; (completed process, the access records of its requests), asserting every request got a 2xx on
    `path` and the answer was printed."""
    work = tmp_path / "work"
    work.mkdir()
    with access_records() as records:
        done = subprocess.run(command, env={**_base_env(tmp_path), **env}, cwd=work, capture_output=True, text=True,
                              timeout=RUN_TIMEOUT_S, stdin=subprocess.DEVNULL)
    report = f"rc={done.returncode}\nstdout:\n{done.stdout[-3000:]}\nstderr:\n{done.stderr[-3000:]}\n{records}"
    assert records, "the client made no request\n" + report
    assert all(200 <= r.status < 300 for r in records), report
    assert any(r.path == path for r in records), report
    assert done.returncode == 0 and ANSWER in done.stdout, report
    return done, records


def endpoint(server) -> Endpoint:
    return Endpoint(server.url, None, MODEL_NAME, 32768)


@pytest.mark.parametrize("output", [[], ["--output-format", "stream-json", "--verbose"]], ids=["text", "stream-json"])
def test_claude_code_print_mode(scripted_api_server, tmp_path, output):
    claude = binary("claude")
    wired = wiring("claude", endpoint(scripted_api_server))
    run_agent(scripted_api_server, tmp_path, [claude, *wired.args, "-p", "hello", "--system-prompt", SHORT_PROMPT,
                                              "--tools", "Read", *output], wired.env, "/v1/messages")


def test_codex_exec(scripted_api_server, tmp_path):
    codex = binary("codex")
    wired = wiring("codex", endpoint(scripted_api_server))
    (tmp_path / "codex").mkdir()
    (tmp_path / "instructions.md").write_text(SHORT_PROMPT)
    # web_search back on (the wiring turns it off): the request must carry Codex's hosted tool, which is ignored.
    # The goal tools and the bundled skills' list are off: with them the prompt is ~17k tokens, without ~13k,
    # and the CPU prefill of it is most of this test's time; the namespace tool (multi_agent_v1) stays.
    extra = ["-c", f"model_instructions_file={json.dumps(str(tmp_path / 'instructions.md'))}",
             "-c", 'web_search="cached"', "-c", "features.goals=false", "-c", "skills.bundled.enabled=false"]
    run_agent(scripted_api_server, tmp_path, [codex, "exec", "--skip-git-repo-check", *wired.args, *extra, "hello"],
              {**wired.env, "CODEX_HOME": str(tmp_path / "codex")}, "/v1/responses")


OPENCODE_TOOLS_OFF = ("bash", "edit", "glob", "grep", "skill", "task", "todowrite", "webfetch", "write")


def test_opencode_run(scripted_api_server, tmp_path):
    opencode = binary("opencode")
    wired = wiring("opencode", endpoint(scripted_api_server))
    config = json.loads(wired.env["OPENCODE_CONFIG_CONTENT"])
    config["agent"] = {"build": {"prompt": SHORT_PROMPT}}
    config["tools"] = {name: False for name in OPENCODE_TOOLS_OFF}  # `read` stays: the request carries a tool
    env = {**wired.env, "OPENCODE_CONFIG_CONTENT": json.dumps(config), "OPENCODE_DISABLE_LSP_DOWNLOAD": "1",
           "OPENCODE_DISABLE_DEFAULT_PLUGINS": "1"}
    run_agent(scripted_api_server, tmp_path, [opencode, "run", "hello"], env, "/v1/chat/completions")


def test_pagedesk_launch_runs_claude_against_the_endpoint(scripted_api_server, tmp_path):
    """`pagedesk launch claude --url ... -- -p hello`: the launcher finds the served model and its context length
    on /v1/models and runs the CLI with the wiring (the CLI found in .work/agents, no Qt imported)."""
    binary("claude")
    command = [sys.executable, "-c", "import sys; from app.main import main; code = main(sys.argv); "
               "assert not any(m.startswith('PySide6') for m in sys.modules); sys.exit(code)",
               "launch", "claude", "--url", scripted_api_server.url, "--",
               "-p", "hello", "--system-prompt", SHORT_PROMPT, "--tools", "Read"]
    env = {"PYTHONPATH": str(ROOT), "QT_QPA_PLATFORM": "offscreen"}
    run_agent(scripted_api_server, tmp_path, command, env, "/v1/messages")


def test_pagedesk_launch_without_a_server_says_what_to_do(capsys):
    from app.launch import main as launch
    with pytest.raises(SystemExit, match="no server answers at http://127.0.0.1:9"):
        launch(["codex", "--url", "http://127.0.0.1:9"])
    with pytest.raises(SystemExit, match="pass --model"):
        launch(["codex"]) if _nothing_on_8000() else pytest.skip("a server answers on 127.0.0.1:8000")


def test_pagedesk_launch_asks_for_the_key(agent_api_server, monkeypatch):
    from app.launch import main as launch
    monkeypatch.delenv("PAGEDESK_API_KEY", raising=False)
    with pytest.raises(SystemExit, match="needs its API key"):
        launch(["claude", "--url", agent_api_server.url, "--print-env"])


def _nothing_on_8000() -> bool:
    from app.launch import DEFAULT_URL, find_endpoint
    return find_endpoint(DEFAULT_URL, None, None) is None


def test_pagedesk_launch_print_env(scripted_api_server, capsys):
    from app.launch import main as launch
    assert launch(["opencode", "--url", scripted_api_server.url, "--print-env"]) == 0
    line = capsys.readouterr().out
    assert line.startswith("OPENCODE_CONFIG_CONTENT=") and f"{scripted_api_server.url}/v1" in line
    assert '"context": 32768' in line and line.rstrip().endswith("opencode")
