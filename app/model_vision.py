"""The Models tab's "vision" cell: whether the engine takes images with a checkpoint, and what its tower costs.

A checkpoint takes images when its architecture's tower is one the engine runs (engine/config/vision.py's
VISION_KINDS) and its folder has the image processor (ModelConfig.from_folder drops the image side otherwise, as
the engine does); the cell then names the tower's parameters and its tooltip the bytes the planner counts on every
card (engine/planning/vision.py, the same arithmetic as the fits verdict). A checkpoint with a tower the engine
skips says why it is served as text.
"""
from __future__ import annotations

from engine.config.model import ModelConfig
from engine.config.vision import VISION_KINDS
from engine.planning.vision import tower_params, vision_weights_bytes
from app.model_info import ModelInfo, format_count
from widgets.gpu_panel import format_bytes


def vision_cell(info: ModelInfo) -> tuple[str, str]:
    """(cell text, tooltip) for one model."""
    if info.dtype == "gguf":  # llama.cpp keeps a vision tower in a separate mmproj file, which the engine does not read
        return "—", "A GGUF file: served as text (a vision tower comes as a separate mmproj file, not read here)."
    try:
        cfg = ModelConfig.from_folder(info.path)
    except Exception as exc:  # an odd config: the fits column already says what the planner makes of it
        return "?", f"Its config could not be read for the image side: {exc}"
    if cfg.vision is not None:
        dtype_bytes = 4 if str(cfg.torch_dtype).endswith("float32") else 2
        return (f"✔ images · tower {format_count(tower_params(cfg.vision, cfg.hidden_size))}",
                f"Takes images: the engine runs its vision tower ({cfg.vision.kind}) and image processor. The "
                f"planner counts the tower's {format_bytes(vision_weights_bytes(cfg, dtype_bytes))} of weights on "
                "every card and its activations at the largest image.")
    if not any(key in info.config for key in ("vision_config", "vision_tower_config")):
        return "—", "A text model."
    if info.architecture in VISION_KINDS:
        return ("text only: no image processor", "The folder has a vision tower but no preprocessor_config.json "
                "(or processor_config.json): it is served as text, its tower not loaded. Download the processor "
                "files to send images.")
    return ("text only: tower not run", f"{info.architecture} has a vision tower this engine does not run yet: "
            "it is served as text, its tower not loaded.")
