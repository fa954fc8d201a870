"""A CPU stand-in for CUDA graphs, for the graph tests (engine/worker/graphs/: decode and piecewise graphs).

`TapeGraphBackend` is a graph backend (engine/worker/graphs/backend.py) whose "graph" is the list of aten ops a
captured region ran: replay runs them again on the very same tensors and writes each op's result into the tensor
it produced at capture, which gives CUDA graphs' semantics (fixed addresses, Python values frozen at capture). It
also refuses at capture time, naming the op, what a card's stream capture would refuse (`PieceCaptureError`):
- a host sync or a data-dependent shape: `.item()`, `nonzero`, boolean-mask indexing, `unique`, `bincount`, ...;
- a device -> host copy: `.tolist()`, `.numpy()`, `.cpu()` (any tensor: on a card it is a device tensor);
- a host -> device copy: `.to(device)` or `.copy_` of a host tensor into a device one (seen on fake CUDA
  tensors, tests/test_fake_cuda.py, where host and device differ), and, with `refuse_host_data`, any tensor made
  from host data (`torch.tensor`, `as_tensor`, `from_numpy`: on a card a pageable copy to the device);
- a read of the bucket's attention metadata outside attention (piecewise graphs).
On fake CUDA tensors (no data) only capture means anything: the check runs, replay is not asked for. Each tape
counts its kernels and the bytes of the tensors its ops made (`num_kernels`, `fresh_bytes`): what a graph of it
would launch and hold. Production never uses it: on a card the graphs are real CUDA graphs.
"""
from __future__ import annotations

import contextlib

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from engine.layers.attention import AttentionMetadata

# Ops a captured region cannot contain: each copies a value to the host, or sizes its output by data.
# bincount is one on CUDA (it sizes its output by the largest value, read on the host) though not on CPU.
HOST_SYNC_OPS = frozenset({"aten::_local_scalar_dense", "aten::nonzero", "aten::item", "aten::unique_consecutive",
                           "aten::_unique2", "aten::masked_select", "aten::equal", "aten::is_nonzero",
                           "aten::bincount", "aten::histc", "aten::nonzero_static", "aten::unique_dim",
                           "aten::_unique", "aten::argwhere"})
_INHERITED = object()  # a guarded method the class did not define itself (Tensor's come from TensorBase)
HOST_DATA_OPS = frozenset({"aten::lift_fresh", "aten::lift_fresh_copy"})  # torch.tensor / as_tensor / from_numpy


class PieceCaptureError(RuntimeError):
    """Something in a captured region cannot be captured (a host sync or copy, a metadata read outside attention)."""


def _is_device(t: torch.Tensor) -> bool:
    return t.device.type not in ("cpu", "meta")


def _data_dependent(name: str, args, kwargs) -> bool:
    """Ops whose output shape follows the data: boolean-mask indexing, repeat_interleave without output_size."""
    if name in ("aten::index", "aten::index_put", "aten::index_put_", "aten::_index_put_impl_"):
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices)
    if name == "aten::repeat_interleave":
        return isinstance(args[0], torch.Tensor) and (len(args) < 2 or isinstance(args[1], torch.Tensor)) and \
            kwargs.get("output_size") is None
    return False


class _Tape(TorchDispatchMode):
    """Records the aten ops of one captured region; refuses what a card's stream capture would refuse."""

    def __init__(self, forbidden_storages: set[int], refuse_host_data: bool) -> None:
        super().__init__()
        self.ops: list[tuple] = []
        self.forbidden = forbidden_storages
        self.refuse_host_data = refuse_host_data
        self.num_kernels = 0  # ops that would launch work on a card (views and aliases excluded)
        self.fresh_bytes = 0  # bytes of the tensors the region's ops made (a graph pool holds about these)
        self._saved: list[tuple] = []

    def __enter__(self):
        # Python-level guards, on Tensor and on FakeTensor where a test fixture gave it its own (fake_cuda's tolist):
        # these reach the host without an aten op the mode could see (tolist, numpy), or hide the devices from it.
        self._saved = [(cls, name, cls.__dict__.get(name, _INHERITED)) for cls in (torch.Tensor, FakeTensor)
                       for name in ("tolist", "numpy", "cpu", "copy_") if cls is torch.Tensor or name in cls.__dict__]
        for cls, name, old in self._saved:
            guard = _copy_guard(getattr(cls, name)) if name == "copy_" else \
                _refused(f"Tensor.{name}()", "copies a tensor to the host (a host sync)")
            setattr(cls, name, guard)
        return super().__enter__()

    def __exit__(self, *exc):
        for cls, name, old in self._saved:
            if old is _INHERITED:
                delattr(cls, name)
            else:
                setattr(cls, name, old)
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name
        if name in HOST_SYNC_OPS or _data_dependent(name, args, kwargs):
            raise PieceCaptureError(f"{name} in a captured graph: it needs a value on the host (a host sync) or "
                                    "sizes its output by data, which a CUDA graph cannot replay")
        if self.refuse_host_data and name in HOST_DATA_OPS:
            raise PieceCaptureError(f"{name} in a captured graph: a tensor made from host data (torch.tensor, "
                                    "as_tensor, from_numpy) is a pageable host -> device copy on a card, which "
                                    "stream capture refuses; make it once outside the forward")
        if name == "aten::_to_copy" and isinstance(args[0], torch.Tensor):
            target = kwargs.get("device")
            if target is not None and (torch.device(target).type == "cpu") != (not _is_device(args[0])):
                raise PieceCaptureError(f"{name} from {args[0].device} to {target} in a captured graph: a copy "
                                        "between host and device, which stream capture refuses")
        inputs = {_storage(t) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        if inputs & self.forbidden:
            raise PieceCaptureError(f"{name} in a graph piece reads the attention metadata (block tables, "
                                    "sequence lengths): only the eager attention may, since a piece keeps "
                                    "the shapes and values of its capture")
        out = func(*args, **kwargs)
        # Whether the result aliases an input is decided on the tensors, not the schema: aten::to and reshape
        # may return a view or a new tensor, and the schema marks both as possible views.
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        fresh = not any(_storage(t) in inputs for t in outs)
        if fresh and outs:
            self.fresh_bytes += sum(t.untyped_storage().nbytes() for t in outs)
        if fresh or _mutates(func):
            self.num_kernels += 1
        self.ops.append((func, args, kwargs, out, fresh))
        return out


def _refused(what: str, why: str):
    def refuse(self, *args, **kwargs):
        raise PieceCaptureError(f"{what} in a captured graph {why}, which a CUDA graph cannot replay")
    return refuse


def _copy_guard(copy_):
    def guarded(self, src, *args, **kwargs):
        if isinstance(src, torch.Tensor) and _is_device(self) and not _is_device(src):
            raise PieceCaptureError(f"copy_ of a host tensor {tuple(src.shape)} into a {self.device} tensor in a "
                                    "captured graph: a pageable host -> device copy, which stream capture refuses")
        return copy_(self, src, *args, **kwargs)
    return guarded


def _storage(t: torch.Tensor) -> int:
    """One key per storage, also for fake tensors (their storage has no data pointer)."""
    if isinstance(t, FakeTensor) or t.device.type == "meta":
        return t.untyped_storage()._cdata
    return t.untyped_storage().data_ptr()


def _mutates(func) -> bool:
    return any(a.alias_info is not None and a.alias_info.is_write for a in func._schema.arguments)


class TapeGraphBackend:
    """CPU stand-in for CUDA graphs: a 'graph' is the list of aten ops a captured region ran; replay runs them
    again on the very same tensors and writes each op's result into the tensor it produced at capture.
    `refuse_host_data`: also refuse tensors made from host data (off by default until every family builds its
    constants outside the forward: Gemma's embedding scale, issue 32 item 1)."""

    def __init__(self, refuse_host_data: bool = False) -> None:
        self.forbidden: set[int] = set()
        self.refuse_host_data = refuse_host_data
        self.replays = 0  # graphs or pieces replayed (tests count them)
        self.tapes: list[_Tape] = []  # every captured tape, in capture order (tests read their counts)

    def start(self) -> None:
        pass

    def watch_bucket(self, meta: AttentionMetadata) -> None:
        """No piece of this bucket may read its batch layout: only the eager attention may."""
        self.forbidden = {_storage(t) for t in (meta.block_tables, meta.seq_lens, meta.query_start_loc)}

    @contextlib.contextmanager
    def graph(self):
        """A whole forward captured into one tape (decode and verify graphs: attention inside, metadata static)."""
        self.forbidden = set()
        tape = self.begin()
        try:
            yield tape
        except BaseException:
            self.abort(tape)
            raise
        self.end(tape)

    def capturing(self):
        return torch.inference_mode()

    def begin(self):
        tape = _Tape(self.forbidden, self.refuse_host_data)
        tape.__enter__()
        return tape

    def end(self, tape) -> None:
        tape.__exit__(None, None, None)
        self.tapes.append(tape)

    def abort(self, tape) -> None:
        tape.__exit__(None, None, None)

    def finish(self) -> None:
        pass

    @staticmethod
    def keep(t: torch.Tensor) -> torch.Tensor:
        return t  # the tape holds every tensor of its ops anyway; CPU memory is not the question here

    def replay(self, tape) -> None:
        self.replays += 1
        for func, args, kwargs, out, fresh in tape.ops:
            if _mutates(func):  # in-place and out= ops: their effect is the point
                func(*args, **kwargs)
            elif fresh:  # a new tensor at capture: recompute, write it where later ops read it
                result = func(*args, **kwargs)
                for dst, src in zip(tree_flatten(out)[0], tree_flatten(result)[0]):
                    if isinstance(dst, torch.Tensor):
                        dst.copy_(src)
            # else a view of an input: it already shows the input's new values
