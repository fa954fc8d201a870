"""Build a small C kernel of ours on the user's machine, once, and load it (ctypes).

Some CPU kernels need what numba cannot express: explicit SIMD tiles and prefetch hints (kernels/rows_gemm.c). They
are compiled here with the system C compiler (`$CC`, else `cc`, `gcc` or `clang`) for this CPU (`-O3
-march=native`) into the user's cache folder (`$PAGEDESK_KERNEL_CACHE`, else `$XDG_CACHE_HOME/pagedesk/kernels`,
else `~/.cache/pagedesk/kernels`), named by a hash of the source, the compiler, the flags and the CPU's feature
flags, so an edit, another compiler or another CPU builds anew and a cached build never runs on a CPU it was not
built for. The build writes a temporary file and renames it, so processes starting together (tensor-parallel
workers) never load half a file. No compiler, a failed build or a library that does not load: `load` returns
None with the reason in `why_not`, and the caller keeps its portable kernel. The library is loaded as a PyDLL: its
calls keep the GIL. They are microseconds to a few milliseconds long, and a thread that lets the GIL go for each
waits to get it back behind the server's event loop (up to the 5 ms switch interval per call: a served stream ran
15-20% slower so). Imports nothing of ours.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

FLAGS = ("-O3", "-march=native", "-std=gnu11", "-shared", "-fPIC", "-pthread")
BUILD_TIMEOUT_S = 120.0
POINTER, SIZE, FLOAT = ctypes.c_void_p, ctypes.c_long, ctypes.c_float  # the argument types `load` declares
_loaded: dict[Path | tuple[Path, ...], ctypes.CDLL | None] = {}
why_not: dict[str, str] = {}  # source name -> why it has no native build in this process


def cache_dir() -> Path:
    if os.environ.get("PAGEDESK_KERNEL_CACHE"):
        return Path(os.environ["PAGEDESK_KERNEL_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "pagedesk" / "kernels"


def find_compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def cpu_features() -> str:
    """What -march=native depends on: the CPU's model and feature flags (Linux), else the platform's words."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [line for line in f if line.startswith(("flags", "Features", "model name"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return f"{platform.machine()} {platform.processor()}"


def _compiler_version(compiler: str) -> str:
    done = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30)
    return done.stdout


def build(source: Path | tuple[Path, ...], compiler: str) -> Path:
    """The library built from `source` (one C file, or several linked into one library, named after the first)
    for this CPU, from the cache when it is there; raises with the compiler's message when the build fails."""
    sources = (source,) if isinstance(source, Path) else tuple(source)
    source = sources[0]
    key = hashlib.sha256(b"\0".join([*(s.read_bytes() for s in sources), _compiler_version(compiler).encode(),
                                     " ".join(FLAGS).encode(), cpu_features().encode()])).hexdigest()[:20]
    folder = cache_dir()
    target = folder / f"{source.stem}-{key}.so"
    if target.is_file():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(prefix=f".{source.stem}-", suffix=".so", dir=folder)
    os.close(fd)
    try:
        done = subprocess.run([compiler, *FLAGS, *map(str, sources), "-o", partial], capture_output=True, text=True,
                              timeout=BUILD_TIMEOUT_S)
        if done.returncode != 0:
            raise RuntimeError(f"{Path(compiler).name} failed on {source.name}: {done.stderr.strip()[-800:]}")
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    return target


def load(source: Path | tuple[Path, ...], functions: dict[str, list]) -> ctypes.CDLL | None:
    """`source` (one C file or several, as `build` takes them) built (or found in the cache) and loaded, once per
    process, its `functions` declared (name -> argument types; they return nothing); None, with
    `why_not[name of the first source]`, where it cannot be."""
    if source in _loaded:
        return _loaded[source]
    key, source = source, source if isinstance(source, Path) else source[0]
    library = None
    compiler = find_compiler()
    if compiler is None:
        why_not[source.name] = "no C compiler (set CC, or install gcc)"
    else:
        try:
            library = ctypes.PyDLL(str(build(key, compiler)))
            for name, argtypes in functions.items():
                function = getattr(library, name)
                function.argtypes, function.restype = argtypes, None
        except (OSError, RuntimeError, AttributeError, subprocess.SubprocessError) as exc:
            library, why_not[source.name] = None, str(exc)
    if library is None:
        logger.warning("%s: not built for this CPU, the portable kernels run instead (%s)", source.name,
                       why_not[source.name])
    _loaded[key] = library
    return library
