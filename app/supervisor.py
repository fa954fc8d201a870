"""EngineSupervisor: runs `pagedesk-serve` as a QProcess in its own process group and minds it.

Start checks the configured port with a bind like the server's own; when another process really
holds it, start refuses and emits `port_busy` (who holds it, and the next free port to offer) rather
than moving the endpoint behind the user's back. It launches the engine in a new session so the
whole group (engine plus tensor-parallel workers) can be signalled at once, while the process's
`finished` signal reports an early exit at once. READY comes from the served model answering
(app/readiness_probe.py: /health, the model's state in /v1/models, a one-token completion), never from
a port being open; with several models behind the router, a main model that cannot load leaves the
endpoint up but FAILED with the router's error (`failed`) until it loads. Output (stdout and stderr
merged) goes to the `log` signal and to a bounded tail holding only the current run. A crash reports
the exit code and that run's last lines and restarts with exponential backoff up to a cap; a
configuration error (exit 2) or an out-of-memory at load (exit 3, or "out of memory" in the log) is
never restarted, because it would fail the same way. The engine gets `--exit-with-parent <this pid>`, so
it ends when the app dies by any means, SIGKILL included (while the window only hides into the tray the
app process lives on, and so does its engine). Stop and quit pass through STOPPING: SIGTERM to
the group, then SIGKILL after a grace period, and any member left behind by a dead leader is killed.
The running engine is recorded in the data folder (app/engine_record.py); an engine a previous app left
running can be adopted (`adopt`): it is then watched by pid and the same probe, and stopped through its group.
"""
from __future__ import annotations

import os
import signal
import sys
import time
from collections import deque
from dataclasses import replace
from pathlib import Path
from typing import Any

from PySide6.QtCore import QObject, QProcess, QProcessEnvironment, QTimer, Signal

from app.engine_record import EngineRecord, clear_record, new_record, pid_alive, write_record
from app.readiness_probe import ReadinessProbe
from app.paths import REPO_ROOT
from app.port_check import next_free_port, port_is_free, port_owner
from app.settings import serve_argv
from engine.config.model_discovery import default_model_name

STOPPED, STARTING, READY, STOPPING, CRASHED = "STOPPED", "STARTING", "READY", "STOPPING", "CRASHED"
FAILED = "FAILED"  # the endpoint runs, but its main model cannot serve (the router's engine for it failed)
CONFIG_EXIT_CODE = 2  # engine/entrypoints/serve.py's EXIT_CONFIG_ERROR (serve.py is not one of the
#                      torch-free modules the app may import, so the numbers are repeated here)
OOM_EXIT_CODE = 3  # engine/entrypoints/serve.py's EXIT_OUT_OF_MEMORY
OOM_TEXT = "out of memory"
POSIX = os.name == "posix"
SIGTERM, SIGKILL = signal.SIGTERM, getattr(signal, "SIGKILL", signal.SIGTERM)


def serve_command() -> list[str]:
    """The `pagedesk-serve` console script installed beside this Python, else the module it runs."""
    script = Path(sys.executable).with_name("pagedesk-serve.exe" if os.name == "nt" else "pagedesk-serve")
    return [str(script)] if script.is_file() else [sys.executable, "-m", "engine.entrypoints.serve"]


def masked_argv(argv: list[str]) -> list[str]:
    """argv for the log: the value after --api-key replaced by stars, so the key never reaches a screen."""
    masked = ["****" if i and argv[i - 1] == "--api-key" else a for i, a in enumerate(argv)]
    return ["--api-key=****" if a.startswith("--api-key=") else a for a in masked]


def connect_host(bind_host: str) -> str:
    """Where a client on this machine reaches a server bound to `bind_host`."""
    return "127.0.0.1" if bind_host in ("", "0.0.0.0", "::") else bind_host


class EngineSupervisor(QObject):
    state_changed = Signal(str)
    log = Signal(str)  # a chunk of merged stdout/stderr lines
    ready = Signal(str)  # base URL
    crashed = Signal(int, str)  # exit code (-1: killed by a signal), last log lines
    message = Signal(str)  # something the user should read: restart scheduled, OOM, configuration error
    endpoint_up = Signal(str)  # base URL: something listens there and answers /health (the router, before READY)
    failed = Signal(str)  # the main model cannot serve, in the server's words (state FAILED)
    progress = Signal(str)  # what STARTING waits for ("loading the model")
    port_busy = Signal(str, int, str, int)  # host, port, who holds it ("" if unknown), next free port (0: none)

    def __init__(self, command: list[str] | None = None, max_restarts: int = 3, backoff_s: float = 1.0,
                 grace_s: float = 5.0, tail_lines: int = 400, exit_with_parent: bool = True,
                 parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.command = command or serve_command()
        self.exit_with_parent = exit_with_parent
        self.max_restarts = max_restarts
        self.backoff_s = backoff_s
        self.grace_s = grace_s
        self.state = STOPPED
        self.tail: deque[str] = deque(maxlen=tail_lines)
        self.process: QProcess | None = None
        self.base_url = ""
        self.restarts = 0
        self.last_exit_code: int | None = None
        self._pgid: int | None = None
        self._partial = ""
        self._stopping = False
        self._launch: tuple[str, dict[str, Any], list[str]] | None = None
        self._probe = ReadinessProbe(parent=self)
        self._probe.answered.connect(self._on_answered)
        self._probe.failed.connect(self._on_model_failed)
        self._probe.endpoint_up.connect(lambda: self.endpoint_up.emit(self.base_url))
        self._probe.progress.connect(self.progress)
        self.failure = ""  # why the main model does not serve, while FAILED
        self._restart_timer = QTimer(self, singleShot=True, timeout=self._restart_now)
        self._kill_timer = QTimer(self, singleShot=True, timeout=lambda: self._signal_group(SIGKILL))
        self._stable_timer = QTimer(self, singleShot=True, interval=60_000, timeout=self._reset_restarts)
        self.adopted: EngineRecord | None = None  # an engine a previous app left running, taken over
        self._adopted_watch = QTimer(self, interval=250, timeout=self._watch_adopted)
        self._recorded_pid: int | None = None  # the pid in the data folder's engine record, while it is ours

    # ---- public API -------------------------------------------------------------------------------
    def start(self, model: str, values: dict[str, Any], extra_argv: list[str] | None = None) -> bool:
        """Launch the engine; False (with a message or `port_busy`) when it is already running or the port is taken."""
        if self.running:
            self.message.emit("The engine is already running; stop it first.")
            return False
        values = dict(values)
        host, port = values.get("host") or "127.0.0.1", int(values.get("port") or 8000)
        values["port"] = port
        if not port_is_free(host, port):
            owner = port_owner(port) or ""
            self.message.emit(f"Port {port} on {host} is in use" + (f" by {owner}" if owner else "") +
                              "; the engine was not started.")
            self.port_busy.emit(host, port, owner, next_free_port(host, port + 1) or 0)
            return False
        self._restart_timer.stop()
        self._launch = (model, values, list(extra_argv or []))
        self.restarts = 0
        self._spawn()
        return True

    def begin_stop(self) -> None:
        """STOPPING now, without a signal yet: the caller closes its streams, then calls `stop`. A death in
        between counts as the stop, not as a crash."""
        self._restart_timer.stop()
        self._probe.stop()
        if self.running:
            self._stopping = True
            self._set_state(STOPPING)

    def stop(self) -> None:
        """SIGTERM the group now, SIGKILL after the grace period; STOPPED once the process is gone."""
        self.begin_stop()
        if not self.running:
            self._set_state(STOPPED)
            return
        self._append_log(f"[pagedesk] Stop: SIGTERM to the engine (pid {self.pid}) and its workers; SIGKILL after "
                         f"{self.grace_s:g} s if still running.\n")
        self._signal_group(SIGTERM)
        self._kill_timer.start(int(self.grace_s * 1000))

    def restart(self) -> None:
        """Start again with the last launch settings (after a crash or a stop)."""
        if self._launch is None or self.running:
            return
        self._restart_timer.stop()
        self.restarts = 0
        self._spawn()

    def shutdown(self) -> None:
        """Blocking stop for application quit: TERM the group, wait the grace period, KILL what is left."""
        self._restart_timer.stop()
        self._probe.stop()
        process = self.process
        if process is not None:
            self._stopping = True
            self._signal_group(SIGTERM)
            if not process.waitForFinished(int(self.grace_s * 1000)):
                self._signal_group(SIGKILL)
                process.waitForFinished(3000)
        elif self.adopted is not None:
            self._stopping = True
            self._signal_group(SIGTERM)
            if not _wait_gone(self.adopted.pid, self.grace_s):
                self._signal_group(SIGKILL)
                _wait_gone(self.adopted.pid, 3.0)
            self._watch_adopted()
        self._signal_group(SIGKILL)  # stragglers whose leader already exited

    def clear_failure(self) -> bool:
        """Forget the last crash once the model or settings change, or a new start is tried: STOPPED again, the
        crash's log tail dropped, and no automatic restart pending (it would relaunch the old settings). True
        when there was a failure to forget."""
        if self.running or self.state != CRASHED:
            return False
        self._restart_timer.stop()
        self.tail.clear()
        self.last_exit_code = None
        self._set_state(STOPPED)
        return True

    @property
    def restart_pending(self) -> bool:
        """An automatic restart is scheduled (Stop cancels it)."""
        return self._restart_timer.isActive()

    @property
    def port(self) -> int | None:
        return int(self._launch[1]["port"]) if self._launch else None

    @property
    def pid(self) -> int | None:
        if self.adopted is not None:
            return self.adopted.pid
        return int(self.process.processId()) if self.process is not None else None

    @property
    def running(self) -> bool:
        """An engine process is ours to mind: one we launched, or one we took over."""
        return self.process is not None or self.adopted is not None

    def adopt(self, record: EngineRecord, api_key: str | None = None) -> bool:
        """Take over an engine a previous app left running: STARTING until its model answers, then READY
        at its URL; Stop and quit signal its process group. False when an engine is already ours."""
        if self.running:
            return False
        self._restart_timer.stop()
        self.adopted, self._pgid = record, record.pgid
        self._launch, self.restarts, self._stopping, self.failure = None, 0, False, ""
        self.tail.clear()
        self.base_url = record.base_url
        write_record(replace(record, app_pid=os.getpid()))
        self._set_state(STARTING)
        self._append_log(f"[pagedesk] Took over the engine left running: pid {record.pid}, {record.model}, "
                         f"{record.base_url}.\n")
        self._adopted_watch.start()
        self._probe.start(self.base_url, None, api_key)
        return True

    def argv(self) -> list[str]:
        assert self._launch is not None
        model, values, extra = self._launch
        # The flag, not an environment variable: workers the engine spawns must not inherit our pid.
        watch = ["--exit-with-parent", str(os.getpid())] if self.exit_with_parent and POSIX else []
        return [*self.command, *serve_argv(model, values, extra), *watch]

    # ---- process lifecycle --------------------------------------------------------------------------
    def _spawn(self) -> None:
        assert self._launch is not None
        _model, values, _extra = self._launch
        argv = self.argv()
        process = QProcess(self)
        process.setProcessChannelMode(QProcess.ProcessChannelMode.MergedChannels)
        process.setProcessEnvironment(self._environment())
        process.setWorkingDirectory(str(REPO_ROOT))
        if POSIX:
            process.setUnixProcessParameters(QProcess.UnixProcessFlag.CreateNewSession)
        # Bound-method slots (not lambdas): Qt drops them if this supervisor is destroyed first.
        process.readyReadStandardOutput.connect(self._on_ready_read)
        process.finished.connect(self._on_process_finished)
        process.errorOccurred.connect(self._on_process_error)
        self.process = process
        self._stopping = False
        self._partial = ""
        self.tail.clear()  # a crash report shows this run's lines, never an earlier run's
        self.failure = ""
        self.base_url = f"http://{connect_host(values.get('host') or '127.0.0.1')}:{values['port']}"
        self._set_state(STARTING)  # first: a new run's logs start empty, with this command as their first line
        self._append_log(f"$ {' '.join(masked_argv(argv))}\n")
        process.started.connect(self._on_started)
        process.start(argv[0], argv[1:])

    def _on_ready_read(self) -> None:
        self._on_output(self.sender())

    def _on_process_finished(self, code: int, status: QProcess.ExitStatus) -> None:
        self._on_finished(self.sender(), code, status)

    def _on_process_error(self, error: QProcess.ProcessError) -> None:
        self._on_error(self.sender(), error)

    def _on_started(self) -> None:
        process = self.sender()
        if process is self.process:
            self._pgid = int(process.processId()) if POSIX else None
            model, values, _extra = self._launch
            try:
                self._recorded_pid = int(process.processId())
                write_record(new_record(self._recorded_pid, self.base_url, int(values["port"]), model))
            except OSError as exc:  # a full or read-only data folder must not stop the engine
                self._append_log(f"[pagedesk] could not record the engine in the data folder: {exc}\n")
            self._probe.start(self.base_url, self.served_name, values.get("api_key"))

    @staticmethod
    def _environment() -> QProcessEnvironment:
        env = QProcessEnvironment.systemEnvironment()
        path = env.value("PYTHONPATH", "")
        env.insert("PYTHONPATH", str(REPO_ROOT) + (os.pathsep + path if path else ""))
        env.insert("PYTHONUNBUFFERED", "1")
        return env

    def _on_output(self, process: QProcess) -> None:
        text = self._partial + bytes(process.readAllStandardOutput().data()).decode("utf-8", "replace")
        complete, _, self._partial = text.rpartition("\n")
        if complete:
            self._append_log(complete + "\n")

    def _append_log(self, text: str) -> None:
        self.tail.extend(text.splitlines())
        self.log.emit(text)

    @property
    def served_name(self) -> str | None:
        """The main model's id on the endpoint: --served-model-name, else what the engine names it by default."""
        if self._launch is None:
            return None
        model, values, _extra = self._launch
        return values.get("served_model_name") or default_model_name(model)

    @property
    def main_model(self) -> str:
        """The main model's id as the endpoint lists it (what the readiness probe asked), "" before it is known."""
        return self._probe.model or self.served_name or ""

    def _on_answered(self) -> None:
        if self.state in (STARTING, FAILED) and self.running:
            if self.failure:
                self._append_log(f"[pagedesk] {self.main_model} answers now.\n")
            self.failure = ""
            self._set_state(READY)
            self._stable_timer.start()
            self.ready.emit(self.base_url)

    def _on_model_failed(self, message: str) -> None:
        """The endpoint is up but its main model cannot serve: FAILED, in the server's words, until it loads."""
        if self.state in (STARTING, FAILED, READY) and self.running:
            self.failure = message
            self._append_log(f"[pagedesk] {self.main_model or 'the model'} cannot serve: {message}\n")
            self._set_state(FAILED)
            self.failed.emit(message)
            self.message.emit(f"The endpoint is up, but {self.main_model or 'the model'} cannot serve: {message}. "
                              "Fix the model or settings, then Restart (or Load it in the Loaded models tab).")

    def _on_error(self, process: QProcess, error: QProcess.ProcessError) -> None:
        if error == QProcess.ProcessError.FailedToStart and process is self.process:
            self._append_log(f"could not start {self.command[0]}: {process.errorString()}\n")
            self._on_finished(process, 127, QProcess.ExitStatus.CrashExit)

    def _on_finished(self, process: QProcess, code: int, status: QProcess.ExitStatus) -> None:
        if process is not self.process:
            return
        if self._partial:
            self._append_log(self._partial + "\n")
            self._partial = ""
        self._kill_timer.stop()
        self._stable_timer.stop()
        self._probe.stop()
        self._signal_group(SIGKILL)  # leader gone: take any worker left in its group with it
        if self._recorded_pid is not None:
            clear_record(self._recorded_pid)
        self.process, self._pgid, self._recorded_pid = None, None, None
        process.deleteLater()
        if self._stopping:
            self._stopping = False
            self._append_log(f"[pagedesk] The engine stopped (exit code {code}).\n")
            self._set_state(STOPPED)
            return
        exit_code = code if status == QProcess.ExitStatus.NormalExit else -1
        self._report_crash(exit_code)

    def _report_crash(self, exit_code: int) -> None:
        self.last_exit_code = exit_code
        last_lines = "\n".join(list(self.tail)[-20:])
        self._set_state(CRASHED)
        how = "was killed by a signal" if exit_code < 0 else f"exited with code {exit_code}"
        self.crashed.emit(exit_code, last_lines)
        if exit_code == OOM_EXIT_CODE or OOM_TEXT in "\n".join(list(self.tail)[-50:]).lower():
            self.message.emit(f"The engine {how}: out of memory while loading the model. Not restarting — "
                              "lower --gpu-memory-utilization or --max-model-len, use --kv-cache-dtype fp8, "
                              "raise --tensor-parallel-size or pick a smaller model.")
            return
        if exit_code == CONFIG_EXIT_CODE:
            self.message.emit(f"The engine stopped at start: {self.error_line() or 'configuration error'}. "
                              "Not restarting — fix the model or settings, then press Start.")
            return
        if self.restarts >= self.max_restarts:
            self.message.emit(f"The engine {how}; gave up after {self.restarts} automatic restarts. "
                              "Read the log, then press Start.")
            return
        delay = self.backoff_s * 2 ** self.restarts
        self.restarts += 1
        self.message.emit(f"The engine {how}; restarting in {delay:.0f} s "
                          f"(attempt {self.restarts} of {self.max_restarts}).")
        self._restart_timer.start(int(delay * 1000))
        self.state_changed.emit(self.state)  # same state, but Stop now has a restart to cancel

    def error_line(self) -> str:
        """The engine's last "error: …" line of this run, without the prefix ("" if none)."""
        for line in reversed(self.tail):
            if line.startswith("error:"):
                return line[len("error:"):].strip()
        return ""

    def _watch_adopted(self) -> None:
        """The adopted engine is gone (it is not our child, so only its pid can tell): STOPPED after a stop,
        else CRASHED with no automatic restart (this app never had its launch settings)."""
        record = self.adopted
        if record is None or pid_alive(record.pid):
            return
        self._adopted_watch.stop()
        self._kill_timer.stop()
        self._stable_timer.stop()
        self._probe.stop()
        self._signal_group(SIGKILL)
        clear_record(record.pid)
        self.adopted, self._pgid = None, None
        if self._stopping:
            self._stopping = False
            self._append_log(f"[pagedesk] The engine taken over (pid {record.pid}) stopped.\n")
            self._set_state(STOPPED)
            return
        self.last_exit_code = -1
        self._set_state(CRASHED)
        self.crashed.emit(-1, f"the engine taken over (pid {record.pid}) exited; its log belonged to the earlier app")
        self.message.emit("The engine taken over from the earlier app exited. Press Start to launch it again.")

    def _restart_now(self) -> None:
        if self.process is None and self._launch is not None:
            self._spawn()

    def _reset_restarts(self) -> None:
        self.restarts = 0

    def _signal_group(self, sig: int) -> None:
        if POSIX and self._pgid is not None:
            try:
                os.killpg(self._pgid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        elif self.process is not None:
            self.process.kill() if sig == SIGKILL else self.process.terminate()

    def _set_state(self, state: str) -> None:
        if state != self.state:
            self.state = state
            self.state_changed.emit(state)


def _wait_gone(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not pid_alive(pid):
            return True
        time.sleep(0.05)
    return not pid_alive(pid)
