"""Doctor rows about the software and the cards themselves: versions, the driver, and every GPU through NVML.

NVML (nvidia-ml-py) answers without creating a CUDA context, so these rows work even when torch is the
CPU build or CUDA cannot start, which is exactly when a user needs them. The NVML module is a parameter
so tests can hand in a stand-in.
"""
from __future__ import annotations

import platform

from engine.doctor.report import Row

GIB = 1024 ** 3
MIN_LINK_WIDTH = 8  # below x8, tensor-parallel all-reduces crawl


def software_rows() -> list[Row]:
    import torch
    rows = [Row("Python", "pass", platform.python_version())]
    build = f"CUDA {torch.version.cuda} build" if torch.version.cuda else "CPU build"
    rows.append(Row("torch", "pass", f"{torch.__version__} ({build})"))
    try:
        import triton
        rows.append(Row("Triton", "pass", triton.__version__))
    except ImportError:
        rows.append(Row("Triton", "warn", "not installed", "pip install triton: the GPU attention backend needs it"))
    return rows


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in text.split(".")[:2])


def nvidia_rows(nvml, torch_cuda_version: str | None, torch_cuda_available: bool, torch_device_count: int) -> list[Row]:
    """Driver, CUDA and one row per card; a single row when there is no NVIDIA GPU (or no driver)."""
    try:
        nvml.nvmlInit()
    except nvml.NVMLError as e:
        return [Row("NVIDIA GPU", "warn", f"none found (NVML: {e}); PagedDesk runs on the CPU",
                    "nothing to do for CPU use; to serve on a GPU install its NVIDIA driver, then installer/setup.sh")]
    try:
        count = nvml.nvmlDeviceGetCount()
        driver_cuda_int = nvml.nvmlSystemGetCudaDriverVersion_v2()
        driver_cuda = f"{driver_cuda_int // 1000}.{driver_cuda_int % 1000 // 10}"
        rows = [Row("Driver", "pass", f"{_text(nvml.nvmlSystemGetDriverVersion())}, CUDA up to {driver_cuda}, "
                                      f"{count} GPU" + ("" if count == 1 else "s"))]
        rows.append(_cuda_row(torch_cuda_version, torch_cuda_available, torch_device_count, driver_cuda))
        rows += [_readable_gpu_row(nvml, i) for i in range(count)]
        if torch_cuda_available and torch_device_count < count:
            rows.append(Row("Visible GPUs", "warn", f"torch sees {torch_device_count} of {count} GPUs",
                            "CUDA_VISIBLE_DEVICES hides some cards; unset it to use them all"))
        return rows
    finally:
        nvml.nvmlShutdown()


def _cuda_row(torch_cuda: str | None, available: bool, device_count: int, driver_cuda: str) -> Row:
    if torch_cuda is None:
        return Row("CUDA", "fail", "torch is the CPU build: the engine would ignore the GPUs",
                   "reinstall with installer/setup.sh (it installs the CUDA build when nvidia-smi answers)")
    if _version(torch_cuda) > _version(driver_cuda):
        return Row("CUDA", "fail", f"torch is built for CUDA {torch_cuda}; the driver supports up to {driver_cuda}",
                   f"update the NVIDIA driver, or install a torch built for CUDA {driver_cuda} or older")
    if not available:
        return Row("CUDA", "fail", f"torch (CUDA {torch_cuda}) cannot start CUDA",
                   "check nvidia-smi and CUDA_VISIBLE_DEVICES; reboot after a driver update")
    return Row("CUDA", "pass", f"torch runs CUDA {torch_cuda} (driver supports {driver_cuda}); {device_count} "
                               "device(s) visible")


def _readable_gpu_row(nvml, index: int) -> Row:
    """A card NVML lists but cannot read (fallen off the bus, no permission) fails its own row; the doctor
    still reports every other card."""
    try:
        return _gpu_row(nvml, index)
    except nvml.NVMLError as e:
        return Row(f"GPU {index}", "fail", f"NVML cannot read this card: {e}",
                   "check nvidia-smi and the kernel log (dmesg); a card that fell off the bus needs a reboot, "
                   "or a reseat and its power cables checked")


def _gpu_row(nvml, index: int) -> Row:
    h = nvml.nvmlDeviceGetHandleByIndex(index)
    memory = nvml.nvmlDeviceGetMemoryInfo(h)
    major, minor = nvml.nvmlDeviceGetCudaComputeCapability(h)
    gen, width = _optional(nvml.nvmlDeviceGetMaxPcieLinkGeneration, h), _optional(nvml.nvmlDeviceGetMaxPcieLinkWidth, h)
    cur_gen, cur_width = _optional(nvml.nvmlDeviceGetCurrPcieLinkGeneration, h), \
        _optional(nvml.nvmlDeviceGetCurrPcieLinkWidth, h)
    link = f"PCIe gen {cur_gen} x{cur_width} (max gen {gen} x{width})" if gen is not None else "PCIe link unknown"
    detail = (f"{_text(nvml.nvmlDeviceGetName(h))}, {memory.total / GIB:.1f} GiB ({memory.used / GIB:.1f} GiB in use), "
              f"compute {major}.{minor}, {link}")
    if (major, minor) < (8, 0):
        return Row(f"GPU {index}", "warn", detail, "compute capability below 8.0: no bfloat16 and no FP8 KV cache; "
                                                   "use --dtype float16")
    if cur_width is not None and cur_width < MIN_LINK_WIDTH:
        return Row(f"GPU {index}", "warn", detail, f"the card runs on a x{cur_width} link: tensor parallel will be "
                                                   "slow; move it to an x16 or x8 slot")
    return Row(f"GPU {index}", "pass", detail)


def _optional(fn, handle):
    """NVML raises NotSupported for some fields on some boards; None then."""
    try:
        return fn(handle)
    except Exception:  # noqa: BLE001 - pynvml's error classes are generated per code
        return None
