"""Peer-to-peer access between the tensor-parallel cards, and the NCCL environment that follows from it.

Consumer cards (RTX 3090/4090) often cannot reach each other's memory directly, and some boards (an
IOMMU, a PCIe switch, a driver that disables P2P on GeForce) report access through
cudaDeviceCanAccessPeer yet deliver corrupt data or hang. So `peer_copy_works` trusts a real copy: a
buffer written on one card, copied to the other and compared there, once per device pair. When any
pair fails, NCCL has to be told (NCCL_P2P_DISABLE=1) before it initializes. This module decides the
variables; the executor puts them into rank 0's environment and every worker's before NCCL starts. A
value the user already set always wins.

The copy needs a CUDA context on both cards, and a context stays for the life of the process (a few
hundred MiB): done in rank 0 it took memory from card 1 that rank 1's sizing then counted as "other
programs", shrinking the pool of every card. So the engine asks `PeerAccessCache`, which runs every pair's
copy in one throwaway spawned process and keeps the answers in a small JSON file in the user's cache
folder, keyed by driver version and the cards' UUIDs (a new driver or another card probes again).
`pagedesk-doctor` calls `peer_copy_works` directly: it is a diagnosis, so it always copies.
"""
from __future__ import annotations

import functools
import json
import logging
import multiprocessing as mp
import os
from itertools import permutations
from pathlib import Path
from typing import Callable, Mapping

logger = logging.getLogger("pagedesk.engine")


COPY_TEST_ELEMENTS = 1 << 20  # 4 MiB of int32: more than one DMA chunk, quick on any link
PROBE_TIMEOUT_S = 120.0  # the probe process imports torch and makes a context per card; a hang is a plain no
CACHE_FILE = "peer_access.json"


@functools.cache
def peer_copy_works(src: int, dst: int) -> bool:
    """cuda:src -> cuda:dst peer access is claimed AND a copied buffer arrives intact (cached per pair)."""
    import torch
    if not torch.cuda.can_device_access_peer(src, dst):
        return False
    try:
        ok = copy_arrives_intact(f"cuda:{src}", f"cuda:{dst}")
    except RuntimeError as e:  # an "illegal address" or peer-mapping error is a plain no
        logger.warning("peer copy cuda:%d->cuda:%d failed: %s", src, dst, e)
        return False
    if not ok:
        logger.warning("peer copy cuda:%d->cuda:%d delivered different data although the driver reports "
                       "peer access (IOMMU or board limitation)", src, dst)
    return ok


def copy_arrives_intact(src: str, dst: str) -> bool:
    """Write a pattern on `src`, copy it to `dst` and compare it there with the same pattern made on `dst`."""
    import torch
    sent = torch.arange(COPY_TEST_ELEMENTS, dtype=torch.int32, device=src) * 7 + 3
    received = sent.to(dst)
    expected = torch.arange(COPY_TEST_ELEMENTS, dtype=torch.int32, device=dst) * 7 + 3
    return bool(torch.equal(received, expected))


def nccl_environment(num_ranks: int, can_access_peer: Callable[[int, int], bool],
                     environ: Mapping[str, str]) -> dict[str, str]:
    """Variables to set on every rank: NCCL_P2P_DISABLE=1 when any pair of cards lacks P2P access."""
    if num_ranks < 2 or "NCCL_P2P_DISABLE" in environ:
        return {}
    missing = [(a, b) for a, b in permutations(range(num_ranks), 2) if not can_access_peer(a, b)]
    if not missing:
        logger.info("peer-to-peer access works between all %d cards; NCCL may use P2P", num_ranks)
        return {}
    pairs = ", ".join(f"cuda:{a}->cuda:{b}" for a, b in missing)
    logger.warning("no peer-to-peer access between the cards (%s): setting NCCL_P2P_DISABLE=1 so tensor "
                   "parallel goes through host memory over PCIe", pairs)
    return {"NCCL_P2P_DISABLE": "1"}


def cache_dir() -> Path:
    """$PAGEDESK_CACHE_DIR, else $XDG_CACHE_HOME/pagedesk, else ~/.cache/pagedesk."""
    if os.environ.get("PAGEDESK_CACHE_DIR"):
        return Path(os.environ["PAGEDESK_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pagedesk"


def probe_pairs(pairs: list[tuple[int, int]]) -> dict[tuple[int, int], bool]:
    """Run in the probe process: `peer_copy_works` for every pair."""
    return {pair: peer_copy_works(*pair) for pair in pairs}


def _probe_child(target: Callable, pairs: list[tuple[int, int]], answers) -> None:
    try:
        answers.send(("ok", target(pairs)))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which treats it as "no P2P"
        answers.send(("error", f"{type(exc).__name__}: {exc}"))


def probe_in_child(pairs: list[tuple[int, int]], target: Callable = probe_pairs,
                   timeout_s: float = PROBE_TIMEOUT_S) -> dict[tuple[int, int], bool]:
    """`target(pairs)` in a throwaway spawned process, so its CUDA contexts end with it. A probe that fails,
    dies or hangs answers "no peer access" for every pair (the safe setting: NCCL through host memory)."""
    ctx = mp.get_context("spawn")
    reader, writer = ctx.Pipe(duplex=False)
    process = ctx.Process(target=_probe_child, args=(target, pairs, writer), name="pagedesk-peer-probe",
                          daemon=True)
    process.start()
    writer.close()
    try:
        if reader.poll(timeout_s):
            status, payload = reader.recv()
            if status == "ok":
                return payload
            logger.warning("the peer-to-peer probe failed (%s); treating every pair as without P2P", payload)
        else:
            logger.warning("the peer-to-peer probe gave no answer in %.0f s; treating every pair as without P2P",
                           timeout_s)
    except (EOFError, OSError):
        logger.warning("the peer-to-peer probe died (exit code %s); treating every pair as without P2P",
                       process.exitcode)
    finally:
        reader.close()
        process.join(timeout=5.0)
        if process.is_alive():
            process.kill()
            process.join(timeout=5.0)
    return {pair: False for pair in pairs}


def card_identity(num_ranks: int) -> tuple[str, list[str]]:
    """(driver version, each card's UUID), read without creating a CUDA context."""
    import torch
    uuids = [str(torch.cuda.get_device_properties(i).uuid) for i in range(num_ranks)]
    return _driver_version(), uuids


def _driver_version() -> str:
    try:
        import pynvml
        pynvml.nvmlInit()
        try:
            version = pynvml.nvmlSystemGetDriverVersion()
        finally:
            pynvml.nvmlShutdown()
        return version.decode() if isinstance(version, bytes) else str(version)
    except Exception:  # noqa: BLE001 - without NVML the torch build's CUDA version is the best key we have
        import torch
        return f"cuda-{torch.version.cuda}"


class PeerAccessCache:
    """`can_access_peer(a, b)` for `nccl_environment`, answered from the cache file or, for pairs it lacks,
    by one probe process for all of them; new answers are written back."""

    def __init__(self, num_ranks: int, identity: Callable[[int], tuple[str, list[str]]] = card_identity,
                 probe: Callable[[list[tuple[int, int]]], dict] = probe_in_child,
                 path: Path | None = None) -> None:
        self.path = path or cache_dir() / CACHE_FILE
        driver, uuids = identity(num_ranks)
        self.keys = {(a, b): f"{driver}|{uuids[a]}|{uuids[b]}" for a, b in permutations(range(num_ranks), 2)}
        stored = self._load()
        self.answers = {pair: stored[key] for pair, key in self.keys.items() if isinstance(stored.get(key), bool)}
        missing = [pair for pair in self.keys if pair not in self.answers]
        if missing:
            self.answers.update(probe(missing))
            self._store(stored)

    def __call__(self, src: int, dst: int) -> bool:
        return self.answers[(src, dst)]

    def _load(self) -> dict:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def _store(self, stored: dict) -> None:
        stored.update({self.keys[pair]: ok for pair, ok in self.answers.items()})
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(stored, indent=1, sort_keys=True))
            tmp.replace(self.path)  # two engines starting at once never read a half-written file
        except OSError as exc:
            logger.warning("cannot write the peer-access cache %s (%s); the next start probes again", self.path, exc)
