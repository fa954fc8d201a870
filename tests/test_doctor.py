"""pagedesk-doctor: the CLI on this GPU-less machine, the row logic against a stand-in NVML, and the on-card
measurements run on CPU with the torch backend (and gloo for the all-reduce)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from engine.doctor import __main__ as doctor_cli
from engine.doctor.checks import collect_rows, guarded
from engine.doctor.kernel_checks import attention_parity, decode_tokens_per_s
from engine.doctor.report import Row, exit_code, format_table, rows_from_json
from engine.doctor.system import nvidia_rows

GIB = 1024 ** 3


def test_cli_on_a_machine_without_nvidia_gpu(capsys):
    assert doctor_cli.main([]) == 0
    table = capsys.readouterr().out
    assert "NVIDIA GPU  WARN    none found" in table and "0 failed" in table
    assert doctor_cli.main(["--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    gpu_rows = [r for r in report["rows"] if "GPU" in r["check"]]
    assert report["exit_code"] == 0 and len(gpu_rows) == 1 and gpu_rows[0]["status"] == "warn"
    assert {r["check"] for r in report["rows"]} == {"Python", "torch", "Triton", "NVIDIA GPU"}


class FakeNvml:
    """pynvml's calls the doctor makes, for two cards: a 3090 on x16 and a 4090 on a x4 link."""

    class NVMLError(Exception):
        pass

    def __init__(self, cards=None, driver_cuda=12080, present=True):
        self.cards = cards if cards is not None else [
            dict(name="NVIDIA GeForce RTX 3090", total=24 * GIB, used=GIB, cc=(8, 6), link=(4, 16)),
            dict(name="NVIDIA GeForce RTX 4090", total=24 * GIB, used=0, cc=(8, 9), link=(4, 4))]
        self.driver_cuda, self.present, self.shut = driver_cuda, present, False

    def nvmlInit(self):
        if not self.present:
            raise self.NVMLError("NVML Shared Library Not Found")

    def nvmlShutdown(self):
        self.shut = True

    def nvmlDeviceGetCount(self):
        return len(self.cards)

    def nvmlSystemGetDriverVersion(self):
        return b"570.86.15"

    def nvmlSystemGetCudaDriverVersion_v2(self):
        return self.driver_cuda

    def nvmlDeviceGetHandleByIndex(self, i):
        return self.cards[i]

    def nvmlDeviceGetName(self, h):
        return h["name"]

    def nvmlDeviceGetMemoryInfo(self, h):
        return SimpleNamespace(total=h["total"], used=h["used"])

    def nvmlDeviceGetCudaComputeCapability(self, h):
        return h["cc"]

    nvmlDeviceGetMaxPcieLinkGeneration = nvmlDeviceGetCurrPcieLinkGeneration = lambda self, h: h["link"][0]
    nvmlDeviceGetMaxPcieLinkWidth = lambda self, h: 16  # noqa: E731 - the slot could do x16
    nvmlDeviceGetCurrPcieLinkWidth = lambda self, h: h["link"][1]  # noqa: E731


def test_two_cards_one_on_a_narrow_link():
    nvml = FakeNvml()
    rows = nvidia_rows(nvml, "12.8", True, 2)
    assert [(r.check, r.status) for r in rows] == [("Driver", "pass"), ("CUDA", "pass"), ("GPU 0", "pass"),
                                                   ("GPU 1", "warn")]
    assert rows[0].detail == "570.86.15, CUDA up to 12.8, 2 GPUs"
    assert rows[2].detail == ("NVIDIA GeForce RTX 3090, 24.0 GiB (1.0 GiB in use), compute 8.6, PCIe gen 4 x16 "
                              "(max gen 4 x16)")
    assert "x4 link" in rows[3].remedy and nvml.shut
    assert exit_code(rows) == 0


@pytest.mark.parametrize("torch_cuda,available,message", [
    (None, False, "torch is the CPU build"),
    ("13.0", False, "torch is built for CUDA 13.0; the driver supports up to 12.8"),
    ("12.8", False, "cannot start CUDA")])
def test_cuda_problems_fail_with_a_remedy(torch_cuda, available, message):
    rows = nvidia_rows(FakeNvml(), torch_cuda, available, 0)
    cuda = next(r for r in rows if r.check == "CUDA")
    assert cuda.status == "fail" and message in cuda.detail and cuda.remedy
    assert exit_code(rows) == 1


def test_old_card_and_hidden_cards_warn():
    nvml = FakeNvml(cards=[dict(name="Tesla T4", total=16 * GIB, used=0, cc=(7, 5), link=(3, 16))] * 2)
    rows = nvidia_rows(nvml, "12.8", True, 1)
    assert "no bfloat16" in rows[2].remedy and rows[-1].check == "Visible GPUs" and "CUDA_VISIBLE_DEVICES" in \
        rows[-1].remedy


def test_no_nvidia_gpu_is_one_row():
    rows = collect_rows(FakeNvml(present=False))
    assert [r.check for r in rows if "GPU" in r.check] == ["NVIDIA GPU"] and exit_code(rows) == 0


def test_a_check_that_raises_becomes_a_fail_row():
    def broken():
        raise RuntimeError("CUDA error: an illegal memory access was encountered\nCUDA kernel errors might be ...")
    row = guarded("Decode speed", broken, "report it")
    assert row == Row("Decode speed", "fail", "RuntimeError: CUDA error: an illegal memory access was encountered",
                      "report it")


def test_table_and_json_round_trip():
    rows = [Row("GPU 0", "pass", "fine"), Row("P2P cuda:0->cuda:1", "warn", "no P2P", "nothing to do")]
    assert format_table(rows).splitlines() == [
        "CHECK               STATUS  DETAIL", "GPU 0               PASS    fine",
        "P2P cuda:0->cuda:1  WARN    no P2P", "                            → nothing to do",
        "1 passed, 1 warnings, 0 failed"]
    from engine.doctor.report import to_json
    assert rows_from_json(to_json(rows)) == rows


def test_attention_parity_reports_a_wrong_kernel(monkeypatch):
    assert attention_parity("cpu", torch.float32, torch.float32, backend="torch") is None
    assert attention_parity("cpu", torch.float32, torch.float8_e4m3fn, backend="torch") is None
    import kernels
    write, attend = kernels.get_attention_backend("torch")
    monkeypatch.setattr(kernels, "get_attention_backend",
                        lambda name: (write, attend if name == "torch" else lambda *a: attend(*a) * 1.1))
    assert "max difference" in attention_parity("cpu", torch.float32, torch.float32, backend="wrong")


def test_decode_speed_of_a_tiny_model_runs_on_cpu():
    assert decode_tokens_per_s("cpu", torch.float32, "torch", batch=2, context=20, steps=2) > 0


def test_allreduce_bandwidth_with_gloo():
    from engine.doctor.allreduce import allreduce_bus_bandwidth
    assert allreduce_bus_bandwidth(2, "gloo", nbytes=2**20, iters=2, timeout_s=60) > 0


class LostCardNvml(FakeNvml):
    """The second card fell off the bus: NVML lists it but every call on it fails (NVML_ERROR_GPU_IS_LOST)."""

    def nvmlDeviceGetHandleByIndex(self, i):
        if i == 1:
            raise self.NVMLError("GPU is lost")
        return self.cards[i]


def test_a_card_nvml_cannot_read_is_a_fail_row_not_a_crash():
    nvml = LostCardNvml()
    rows = nvidia_rows(nvml, "12.8", True, 2)
    assert [(r.check, r.status) for r in rows] == [("Driver", "pass"), ("CUDA", "pass"), ("GPU 0", "pass"),
                                                   ("GPU 1", "fail")]
    assert "GPU is lost" in rows[3].detail and "nvidia-smi" in rows[3].remedy and nvml.shut
    assert exit_code(rows) == 1


@pytest.mark.parametrize("preset,expected", [(None, "PCI_BUS_ID"), ("FASTEST_FIRST", "FASTEST_FIRST")])
def test_cuda_numbers_cards_as_nvml_does_unless_told_otherwise(preset, expected):
    # The doctor's "GPU i" rows and the app's GPU panel come from NVML (PCI bus order); cuda:i must be the same card.
    env = {k: v for k, v in os.environ.items() if k != "CUDA_DEVICE_ORDER"}
    if preset:
        env["CUDA_DEVICE_ORDER"] = preset
    done = subprocess.run([sys.executable, "-c", "import engine, os; print(os.environ['CUDA_DEVICE_ORDER'])"],
                          cwd=Path(__file__).resolve().parents[1], env=env, capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == expected, done.stderr
