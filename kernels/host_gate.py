"""Whether a host kernel (numba's, or a native build's over raw pointers) may run on some tensors instead of torch's
ops: plain float32 CPU tensors or parameters (not fake or subclassed: those have no memory to read), no gradient,
no trace compiling them and no TorchDispatchMode watching (a CPU graph tape or an op count must see torch's ops).
Shared by kernels/cpu_linear.py and kernels/cpu_host_ops.py. Imports nothing of ours.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode


PLAIN = (torch.Tensor, nn.Parameter)  # a Parameter over a tensor subclass (a fake one) has the subclass's type instead


def eager_cpu_float32(*tensors: torch.Tensor) -> bool:
    if torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None:  # first: asks nothing of a tensor
        return False
    # type() is exact on purpose: FakeTensor and other subclasses have no storage to read; is_cpu, not device.type,
    # builds no torch.device per check (1.2 instead of 3.8 µs for two tensors)
    for t in tensors:
        if type(t) not in PLAIN or t.dtype != torch.float32 or not t.is_cpu or t.requires_grad:
            return False
    return True
