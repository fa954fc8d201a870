"""NVIDIA GPU readings from nvidia-ml-py (pynvml), sampled a few times a second in a worker thread.

`NvmlSampler` lives on its own QThread with its own QTimer; each tick reads memory, utilisation,
temperature and power of every card and emits a list of `GpuReading`. When NVML cannot start (no
driver: `NVMLError_LibraryNotFound`, no cards) it emits `unavailable(reason)` once and stops polling.
`count_nvidia_gpus()` is the same probe for one-off questions such as the tensor-parallel default.
"""
from __future__ import annotations

from PySide6.QtCore import QMetaObject, QObject, Qt, QThread, QTimer, Signal, Slot

from widgets.gpu_panel import GpuReading


def _nvml():
    import pynvml

    return pynvml


def count_nvidia_gpus() -> int:
    """Number of NVIDIA GPUs NVML sees; 0 when NVML or its library is unavailable."""
    try:
        nvml = _nvml()
        nvml.nvmlInit()
    except Exception:
        return 0
    try:
        return int(nvml.nvmlDeviceGetCount())
    except Exception:
        return 0
    finally:
        _shutdown(nvml)


def _shutdown(nvml) -> None:
    try:
        nvml.nvmlShutdown()
    except Exception:
        pass


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def read_gpu(nvml, index: int) -> GpuReading:
    """Memory must read (a card that cannot answer that is gone: the caller stops); utilisation, temperature
    and power are 0 where the board does not report them (NVML_ERROR_NOT_SUPPORTED, e.g. utilisation of
    a MIG-enabled card)."""
    handle = nvml.nvmlDeviceGetHandleByIndex(index)
    memory = nvml.nvmlDeviceGetMemoryInfo(handle)
    util = _optional(lambda: nvml.nvmlDeviceGetUtilizationRates(handle).gpu, nvml)
    temp = _optional(lambda: nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU), nvml)
    power = _optional(lambda: nvml.nvmlDeviceGetPowerUsage(handle) / 1000.0, nvml)  # NVML reports milliwatts
    limit = _optional(lambda: nvml.nvmlDeviceGetEnforcedPowerLimit(handle) / 1000.0, nvml)
    return GpuReading(index, _text(nvml.nvmlDeviceGetName(handle)), int(memory.used), int(memory.total),
                      int(util), int(temp), float(power), float(limit))


def _optional(read, nvml):
    try:
        return read()
    except nvml.NVMLError:  # NotSupported and kin: a lost card already failed its memory read
        return 0


class NvmlSampler(QObject):
    """Worker: `start_sampling` (queued into its thread) polls every `interval_ms`; talks only via signals."""

    readings = Signal(list)
    unavailable = Signal(str)

    def __init__(self, interval_ms: int = 250) -> None:
        super().__init__()
        self.interval_ms = interval_ms
        self._timer: QTimer | None = None
        self._nvml = None
        self._count = 0

    @Slot()
    def start_sampling(self) -> None:
        try:
            nvml = _nvml()
            nvml.nvmlInit()
            self._count = int(nvml.nvmlDeviceGetCount())
        except Exception as e:
            self.unavailable.emit(f"NVML unavailable: {type(e).__name__}")
            return
        self._nvml = nvml
        if self._count == 0:
            self.unavailable.emit("NVML found no devices")
            self.stop_sampling()
            return
        self._timer = QTimer(self, interval=self.interval_ms, timeout=self.sample)
        self._timer.start()
        self.sample()

    @Slot()
    def sample(self) -> None:
        try:
            self.readings.emit([read_gpu(self._nvml, i) for i in range(self._count)])
        except Exception as e:  # driver went away (e.g. GPU fell off the bus): say so, stop polling
            self.unavailable.emit(f"NVML read failed: {type(e).__name__}: {e}")
            self.stop_sampling()

    @Slot()
    def stop_sampling(self) -> None:
        if self._timer is not None:
            self._timer.stop()
            self._timer = None
        if self._nvml is not None:
            _shutdown(self._nvml)
            self._nvml = None


class NvmlThread(QObject):
    """Owns the sampler's QThread: `start()`, `stop()`; re-exposes the sampler's signals."""

    def __init__(self, interval_ms: int = 250, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.sampler = NvmlSampler(interval_ms)
        self.readings = self.sampler.readings
        self.unavailable = self.sampler.unavailable
        self._thread = QThread()
        self.sampler.moveToThread(self._thread)
        self._thread.started.connect(self.sampler.start_sampling)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        if self._thread.isRunning():
            # The sampler's timer belongs to its thread: stop it there, then end the thread.
            QMetaObject.invokeMethod(self.sampler, "stop_sampling", Qt.ConnectionType.BlockingQueuedConnection)
            self._thread.quit()
            self._thread.wait(3000)
