"""Peer-to-peer access between the tensor-parallel cards, and the NCCL environment that follows from it.

Consumer cards (RTX 3090/4090) often cannot reach each other's memory directly, and some boards (an
IOMMU, a PCIe switch, a driver that disables P2P on GeForce) report access through
cudaDeviceCanAccessPeer yet deliver corrupt data or hang. So `peer_copy_works` trusts a real copy: a
buffer written on one card, copied to the other and compared there, once per device pair. When any
pair fails, NCCL has to be told (NCCL_P2P_DISABLE=1) before it initializes. This module decides the
variables; the executor puts them into rank 0's environment and every worker's before NCCL starts. A
value the user already set always wins.
"""
from __future__ import annotations

import functools
import logging
from itertools import permutations
from typing import Callable, Mapping

logger = logging.getLogger("pagedesk.engine")


COPY_TEST_ELEMENTS = 1 << 20  # 4 MiB of int32: more than one DMA chunk, quick on any link


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
