"""Peer-to-peer access between the tensor-parallel cards, and the NCCL environment that follows from it.

Consumer cards (RTX 3090/4090) often cannot reach each other's memory directly; NCCL then has to be told
(NCCL_P2P_DISABLE=1) before it initializes, or it can hang or fail on its first collective. This module
decides the variables; the executor puts them into rank 0's environment and every worker's before NCCL
starts. A value the user already set always wins.
"""
from __future__ import annotations

import logging
from itertools import permutations
from typing import Callable, Mapping

logger = logging.getLogger("pagedesk.engine")


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
