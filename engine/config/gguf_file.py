"""Read a GGUF file's header: its metadata and where each tensor's bytes are, for one file or a split set.

A GGUF (llama.cpp's format) is a header — magic, version, key/value metadata, tensor infos (name, dims, ggml
type, offset) — followed by the aligned tensor data. This reads the header with `struct` over an mmap and
never touches the data: scalars and numeric arrays are decoded, string arrays (a vocabulary of 150k tokens, as
many merges) are only counted, and read on request (`string_array`), so a header reads in well under a second
(gguf-py's GGUFReader decodes every string into its own numpy array: 34 s for a 151k-token vocabulary here).
A split set (`name-00001-of-00003.gguf`, llama.cpp's gguf-split) is found from any of its parts; every part
must be there, and each tensor must lie inside its file, so a missing part, a truncated download or a tensor
type this engine does not read is a ValueError naming it before anything is loaded. Torch-free: the app lists
GGUF files with the same reader the engine loads them with.
"""
from __future__ import annotations

import mmap
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.quantization.gguf.types import GgmlType, check_supported, ggml_type

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
SPLIT_NAME = re.compile(r"^(?P<stem>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")
# value type id -> struct format of a scalar (8: string, 9: array)
SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


@dataclass(frozen=True, slots=True)
class StringArray:
    """A string array left undecoded: its length, and where its first element starts in `file`."""
    count: int
    file: Path
    offset: int

    def __len__(self) -> int:
        return self.count


@dataclass(frozen=True, slots=True)
class GgufTensorInfo:
    name: str
    type: GgmlType
    shape: tuple[int, ...]  # torch order, outermost first: a weight is [out_features, in_features]
    file: Path
    offset: int  # absolute byte offset of the data in `file`
    nbytes: int

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass
class GgufHeader:
    files: tuple[Path, ...]  # one, or every part of a split set in order
    metadata: dict[str, Any]  # the first file's key/values (string arrays as StringArray)
    tensors: dict[str, GgufTensorInfo] = field(default_factory=dict)

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def arch_value(self, key: str, default: Any = None) -> Any:
        """`<architecture>.<key>`, e.g. arch_value("context_length")."""
        return self.metadata.get(f"{self.architecture}.{key}", default)

    @property
    def file_bytes(self) -> int:
        return sum(f.stat().st_size for f in self.files)

    def bytes_by_type(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for t in self.tensors.values():
            out[t.type.name] = out.get(t.type.name, 0) + t.nbytes
        return out


def is_gguf(path: str | Path) -> bool:
    return str(path).lower().endswith(".gguf")


def split_parts(path: Path) -> tuple[Path, ...]:
    """Every part of the split set `path` belongs to, in order (just `path` when it is not a split name); a
    missing part is a ValueError naming it."""
    m = SPLIT_NAME.match(path.name)
    if m is None:
        return (path,)
    count = int(m["count"])
    parts = tuple(path.with_name(f"{m['stem']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1))
    missing = [p.name for p in parts if not p.is_file()]
    if missing:
        raise ValueError(f"{path.name} is part of a split GGUF of {count} files, but {', '.join(missing)} "
                         f"{'is' if len(missing) == 1 else 'are'} missing from {path.parent}; download every "
                         "part into one folder")
    return parts


def read_gguf_header(path: str | Path, check_types: bool = True) -> GgufHeader:
    """The header of a GGUF file or split set (any part may be named). `check_types`: refuse, by tensor and type
    name, a tensor stored in a type this engine does not read (the app lists such files without loading them)."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise ValueError(f"GGUF file {path} does not exist")
    files = split_parts(path)
    header = None
    for no, file in enumerate(files):
        metadata, tensors = _read_one(file)
        if header is None:
            header = GgufHeader(files, metadata)
        _check_split(file, metadata, no, len(files))
        for info in tensors:
            if info.name in header.tensors:
                raise ValueError(f"GGUF tensor {info.name!r} appears twice ({header.tensors[info.name].file.name} "
                                 f"and {file.name})")
            header.tensors[info.name] = info
    expected = header.metadata.get("split.tensors.count")
    if expected is not None and int(expected) != len(header.tensors):
        raise ValueError(f"{files[0].name}: the split set should hold {expected} tensors, its {len(files)} "
                         f"files hold {len(header.tensors)}")
    if check_types:
        for info in header.tensors.values():
            check_supported(info.name, info.type.id)
    return header


def string_array(value: StringArray) -> list[str]:
    """Decode a string array the header left undecoded (e.g. tokenizer.ggml.tokens)."""
    with open(value.file, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        reader = _Reader(data, value.file)
        reader.pos = value.offset
        return [reader.string() for _ in range(value.count)]


def _check_split(file: Path, metadata: dict, no: int, count: int) -> None:
    found_count = int(metadata.get("split.count", 1))
    found_no = int(metadata.get("split.no", 0))
    if count > 1 and (found_count != count or found_no != no):
        raise ValueError(f"{file.name} says it is part {found_no + 1} of {found_count} (split.no, split.count), "
                         f"its name says part {no + 1} of {count}")
    if count == 1 and found_count > 1:
        raise ValueError(f"{file.name} is part {found_no + 1} of a split GGUF of {found_count} files "
                         "(split.count), but its name is not <name>-0000N-of-0000M.gguf; restore the parts' names")


class _Reader:
    """Little-endian reads over the header's bytes; running off the end is a truncation error."""

    def __init__(self, data, file: Path) -> None:
        self.data, self.file, self.pos = data, file, 0

    def take(self, fmt: str) -> Any:
        size = struct.calcsize("<" + fmt)
        if self.pos + size > len(self.data):
            raise ValueError(f"{self.file.name} ends inside its GGUF header (at byte {self.pos} of "
                             f"{len(self.data)}): the file is truncated; download it again")
        value = struct.unpack_from("<" + fmt, self.data, self.pos)
        self.pos += size
        return value[0] if len(value) == 1 else value

    def string(self) -> str:
        n = self.take("Q")
        if self.pos + n > len(self.data):
            self.take(f"{n}s")  # raises the truncation error
        s = bytes(self.data[self.pos:self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return s

    def skip_string(self) -> None:
        n = self.take("Q")  # read before the sum: take() moves pos
        self.pos += n

    def value(self, vtype: int) -> Any:
        if vtype == 8:
            return self.string()
        if vtype in SCALARS:
            return self.take(SCALARS[vtype])
        if vtype != 9:
            raise ValueError(f"{self.file.name}: unknown GGUF metadata value type {vtype} at byte {self.pos}")
        item_type, count = self.take("I"), self.take("Q")
        if item_type == 8:
            start = self.pos
            for _ in range(count):
                self.skip_string()
            if self.pos > len(self.data):
                raise ValueError(f"{self.file.name} ends inside its GGUF header: the file is truncated")
            return StringArray(count, self.file, start)
        if item_type in SCALARS:
            return list(self.take(f"{count}{SCALARS[item_type]}")) if count != 1 else [self.take(SCALARS[item_type])]
        return [self.value(item_type) for _ in range(count)]  # arrays of arrays


def _read_one(file: Path) -> tuple[dict[str, Any], list[GgufTensorInfo]]:
    size = file.stat().st_size
    if size < 24:
        raise ValueError(f"{file.name} has {size} bytes, too few for a GGUF header: the file is truncated")
    with open(file, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        r = _Reader(data, file)
        if bytes(data[:4]) != GGUF_MAGIC:
            raise ValueError(f"{file.name} is not a GGUF file (it starts with {bytes(data[:4])!r}, not b'GGUF')")
        r.pos = 4
        version = r.take("I")
        if version not in (2, 3):
            raise ValueError(f"{file.name} is GGUF version {version}; versions 2 and 3 are read (a big-endian file "
                             "reads as a huge version)")
        n_tensors, n_kv = r.take("Q"), r.take("Q")
        metadata = {}
        for _ in range(n_kv):
            key = r.string()
            metadata[key] = r.value(r.take("I"))
        raw = []
        for _ in range(n_tensors):
            name = r.string()
            dims = [r.take("Q") for _ in range(r.take("I"))]
            raw.append((name, dims, r.take("I"), r.take("Q")))
        alignment = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        data_start = -(-r.pos // alignment) * alignment
    tensors = []
    for name, dims, type_id, offset in raw:
        t = ggml_type(type_id)
        shape = tuple(reversed(dims))  # GGUF lists the fastest-varying dim first
        numel = 1
        for d in shape:
            numel *= d
        if shape and shape[-1] % t.block_size:
            raise ValueError(f"GGUF tensor {name!r} of shape {list(shape)} is not whole {t.name} blocks of "
                             f"{t.block_size}")
        info = GgufTensorInfo(name, t, shape, file, data_start + offset, t.nbytes(numel))
        if info.offset + info.nbytes > size:
            raise ValueError(f"{file.name} is truncated: tensor {name!r} ends at byte {info.offset + info.nbytes}, "
                             f"the file has {size} bytes; download it again")
        tensors.append(info)
    return metadata, tensors
