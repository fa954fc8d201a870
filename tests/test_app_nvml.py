"""NVML sampler: the real no-GPU path on this machine (nvmlInit raises) and a thin pynvml mock for
the GPU-present display; the tensor-parallel default follows the GPU count."""
import qt_helpers  # noqa: F401  (offscreen Qt, private data dir)

import types

import pynvml
import pytest

from app import nvml_sampler
from app.nvml_sampler import NvmlThread, count_nvidia_gpus
from widgets.gpu_panel import GIB, GpuPanel


def fake_nvml(num_gpus=2):
    def memory(handle):
        return types.SimpleNamespace(used=(handle + 1) * 4 * GIB, total=24 * GIB, free=0)

    return types.SimpleNamespace(
        NVMLError=pynvml.NVMLError, nvmlInit=lambda: None, nvmlShutdown=lambda: None,
        nvmlDeviceGetCount=lambda: num_gpus,
        nvmlDeviceGetHandleByIndex=lambda i: i, nvmlDeviceGetName=lambda h: b"NVIDIA GeForce RTX 4090",
        nvmlDeviceGetMemoryInfo=memory,
        nvmlDeviceGetUtilizationRates=lambda h: types.SimpleNamespace(gpu=50 + h, memory=10),
        nvmlDeviceGetTemperature=lambda h, sensor: 60 + h, NVML_TEMPERATURE_GPU=0,
        nvmlDeviceGetPowerUsage=lambda h: 250_000, nvmlDeviceGetEnforcedPowerLimit=lambda h: 450_000)


def test_real_no_gpu_path(qtbot):
    with pytest.raises(pynvml.NVMLError):
        pynvml.nvmlInit()  # this machine has no NVIDIA driver: the real path under test
    assert count_nvidia_gpus() == 0
    thread = NvmlThread(interval_ms=50)
    panel = GpuPanel()
    qtbot.addWidget(panel)
    thread.unavailable.connect(panel.set_unavailable)
    thread.start()
    try:
        qtbot.waitUntil(lambda: panel.gpu_available is False, timeout=5000)
    finally:
        thread.stop()
    assert panel.status.text().startswith("No NVIDIA GPU detected (NVML unavailable: NVMLError")


def test_mocked_gpus_are_sampled_in_a_thread(qtbot, monkeypatch):
    monkeypatch.setattr(nvml_sampler, "_nvml", lambda: fake_nvml(2))
    assert count_nvidia_gpus() == 2
    thread = NvmlThread(interval_ms=50)
    panel = GpuPanel()
    qtbot.addWidget(panel)
    thread.readings.connect(panel.set_readings)
    batches = []
    thread.readings.connect(batches.append)
    thread.start()
    try:
        qtbot.waitUntil(lambda: len(batches) >= 3, timeout=5000)  # polled repeatedly, not once
    finally:
        thread.stop()
    first = batches[0]
    assert [r.index for r in first] == [0, 1]
    assert first[1].memory_used == 8 * GIB and first[0].power_w == 250.0 and first[1].temperature == 61
    assert first[0].name == "NVIDIA GeForce RTX 4090"
    assert panel.status.text() == "2 NVIDIA GPUs" and "8.00 GiB / 24.00 GiB" in panel._rows[1].vram.format()


def test_a_reading_nvml_does_not_support_is_zero_not_the_end_of_sampling():
    # MIG-enabled cards answer NVML_ERROR_NOT_SUPPORTED for utilisation, some boards for temperature too:
    # the card's memory still reads, so the panel keeps showing it (as it does for unsupported power).
    nvml = fake_nvml(1)

    def not_supported(*args):
        raise pynvml.NVMLError_NotSupported()

    nvml.nvmlDeviceGetUtilizationRates = nvml.nvmlDeviceGetTemperature = not_supported
    reading = nvml_sampler.read_gpu(nvml, 0)
    assert (reading.memory_used, reading.utilization, reading.temperature, reading.power_w) == (4 * GIB, 0, 0, 250.0)
