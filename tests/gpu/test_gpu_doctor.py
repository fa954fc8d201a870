"""pagedesk-doctor on a machine with a GPU: JSON out, every on-card check ran and passed."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.gpu


def test_doctor_json_on_the_gpu():
    done = subprocess.run([sys.executable, "-m", "engine.doctor", "--json"], capture_output=True, text=True,
                          timeout=300)
    report = json.loads(done.stdout)
    rows = {r["check"]: r for r in report["rows"]}
    print("\n".join(f"{r['check']}: {r['status']} {r['detail']}" for r in report["rows"]))
    for check in ("Driver", "CUDA", "GPU 0", "Triton attention cuda:0", "FP8 KV cache (fp8_e4m3)", "Decode speed"):
        assert check in rows, f"missing row {check}: {sorted(rows)}"
    failed = [r for r in report["rows"] if r["status"] == "fail"]
    assert not failed and done.returncode == 0, failed
