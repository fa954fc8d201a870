"""The prefix cache's CPU-RAM tier (--kv-offloading-size): how many block ids and state snapshots its host memory holds
on each rank, and the RAM it takes — what the engine allocates, the planner shows and the Models tab's "fits?" counts.

The size is vLLM's: GiB over all tensor-parallel ranks, each rank holding its own shard of every block (its KV heads)
in pinned host memory, so a rank's share is size / tp. A host block is one block id's pages over every cache slot,
exactly the device pool's `bytes_per_block` on that rank (integer KV formats with their scales). A hybrid model's tier
also keeps state snapshots at block boundaries (a hit must restore the recurrent state where it ends): they take at
most STATE_SHARE of the tier, at least one when two fit. Torch-free.
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.kv.kv_cache_interface import KVCacheLayout
from engine.planning.units import GIB, format_bytes

STATE_SHARE = 0.25  # of a hybrid model's tier, at most, for state snapshots (each one a whole sequence's state)


@dataclass(frozen=True)
class HostTierPlan:
    num_blocks: int  # host slots for block ids, on every rank
    num_state_slots: int  # host slots for a hybrid model's state snapshots
    bytes_per_block: int  # one rank's
    state_slot_bytes: int  # one rank's
    tensor_parallel_size: int = 1

    @property
    def bytes_per_rank(self) -> int:
        return self.num_blocks * self.bytes_per_block + self.num_state_slots * self.state_slot_bytes

    @property
    def total_bytes(self) -> int:
        """The host RAM the tier takes over all ranks (what a person budgets)."""
        return self.bytes_per_rank * self.tensor_parallel_size

    def num_tokens(self, block_size: int) -> int:
        return self.num_blocks * block_size

    def summary(self, block_size: int) -> str:
        states = f" and {self.num_state_slots} state snapshots" if self.num_state_slots else ""
        return (f"CPU-RAM tier {format_bytes(self.total_bytes)}: {self.num_blocks:,} blocks "
                f"({self.num_tokens(block_size):,} tokens){states}")


def plan_host_tier(layout: KVCacheLayout, size_gib: float, tensor_parallel_size: int = 1) -> HostTierPlan:
    """`layout`: one rank's KV layout (model_kv_layout with the same tp and KV dtype as the device pool)."""
    per_rank = int(size_gib * GIB) // tensor_parallel_size
    state_bytes = layout.state_bytes_per_seq
    states = 0
    if state_bytes:
        states = int(per_rank * STATE_SHARE) // state_bytes or (1 if per_rank >= 2 * state_bytes else 0)
    blocks = max(0, (per_rank - states * state_bytes) // layout.bytes_per_block)
    return HostTierPlan(blocks, states, layout.bytes_per_block, state_bytes, tensor_parallel_size)


def check_host_tier(plan: HostTierPlan, size_gib: float) -> None:
    """A tier too small for one block is a mistake in the flag, said with the numbers."""
    if plan.num_blocks < 1:
        raise ValueError(f"--kv-offloading-size {size_gib:g} GiB holds no KV block: one block id takes "
                         f"{format_bytes(plan.bytes_per_block)} on each of {plan.tensor_parallel_size} rank(s); "
                         f"give at least {plan.bytes_per_block * plan.tensor_parallel_size / GIB:.3f} GiB")
