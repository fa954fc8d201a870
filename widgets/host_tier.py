"""The prefix cache's CPU-RAM tier beside the block map: a bar of the host slots in use and a few lines of counts.

The tier (--kv-offloading-size) holds blocks the GPU's prefix cache evicted, in host RAM, and copies them back when a
prompt needs them again, so its picture is how full it is and what it has saved: prompt tokens restored instead of
recomputed, and the bytes that moved each way. Plain data in (`TierPicture`, from the engine state's `kv_offload`),
widgets out: no app or engine imports.
"""
from __future__ import annotations

from dataclasses import dataclass

from PySide6.QtWidgets import QLabel, QProgressBar, QVBoxLayout, QWidget

from widgets.gpu_panel import format_bytes


@dataclass
class TierPicture:
    num_blocks: int
    blocks_held: int
    capacity_bytes: int
    hit_tokens: int
    miss_tokens: int
    bytes_stored: int
    bytes_loaded: int
    loads_in_flight: int = 0
    num_state_slots: int = 0
    states_held: int = 0

    @classmethod
    def from_dict(cls, data: dict) -> "TierPicture":
        return cls(**{k: int(data.get(k, 0)) for k in cls.__dataclass_fields__})

    def summary(self) -> str:
        states = f"\n{self.states_held} of {self.num_state_slots} state snapshots" if self.num_state_slots else ""
        loading = f"\n{self.loads_in_flight} request(s) waiting for copies" if self.loads_in_flight else ""
        return (f"{self.blocks_held:,} of {self.num_blocks:,} blocks · {format_bytes(self.capacity_bytes)}{states}\n"
                f"restored {self.hit_tokens:,} prompt tokens · missed {self.miss_tokens:,}\n"
                f"to RAM {format_bytes(self.bytes_stored)} · back {format_bytes(self.bytes_loaded)}{loading}")


class HostTierWidget(QWidget):
    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.title = QLabel("<b>CPU-RAM tier</b>")
        self.bar = QProgressBar(minimum=0, maximum=1000, textVisible=True)
        self.bar.setToolTip("Host slots holding blocks the GPU's prefix cache evicted (--kv-offloading-size)")
        self.details = QLabel(wordWrap=True)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        for w in (self.title, self.bar, self.details):
            layout.addWidget(w)
        layout.addStretch(1)

    def set_tier(self, tier: TierPicture) -> None:
        used = tier.blocks_held / tier.num_blocks if tier.num_blocks else 0.0
        self.bar.setValue(round(1000 * used))
        self.bar.setFormat(f"{100 * used:.1f}% used")
        self.details.setText(tier.summary())
