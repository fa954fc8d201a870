"""Triton test modules run their kernels interpreted (TRITON_INTERPRET=1), which must be set before triton is
first imported. Without a CUDA device tests/conftest.py sets it for the whole session, so they run in the
pytest process itself. When this process already imported triton compiled (a machine with a card), such a
module reruns itself whole in a fresh interpreted process instead; `fresh_process_tests` gives a module that
test and the fixture that skips everything else in it."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest


def fresh_process_tests(module_file: str, in_interpreter: bool):
    """(test_whole_module_in_a_fresh_process, autouse fixture) for the module at `module_file`."""

    @pytest.mark.skipif(in_interpreter, reason="this process already runs the kernels interpreted")
    def test_whole_module_in_a_fresh_process():
        env = dict(os.environ, TRITON_INTERPRET="1")
        result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", module_file],
                                cwd=Path(module_file).resolve().parents[1], env=env, capture_output=True, text=True,
                                timeout=600)
        assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]

    @pytest.fixture(autouse=True)
    def skip_unless_interpreted(request):
        if not in_interpreter and request.function is not test_whole_module_in_a_fresh_process:
            pytest.skip("triton was imported compiled before this module; test_whole_module_in_a_fresh_process "
                        "runs it")

    return test_whole_module_in_a_fresh_process, skip_unless_interpreted
