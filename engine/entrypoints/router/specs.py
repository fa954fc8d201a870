"""What the router serves: a `ModelSpec` per model name, from `--model NAME=PATH`, `--models-dir` and `--models-config`.

Engine flags use the command line's names everywhere (engine/config/flags.py's FLAGS): flags given on the command
line apply to every model, and a `[models.NAME]` table of the TOML file overrides them for that model (it may
also add a model: `model = "PATH"`). The router's own flags (host, port, API key, TTL, ...) never reach an
engine: each engine listens on a private loopback port with a key of its own.
"""
from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.config.flags import (FLAGS, FLAGS_BY_NAME, MODEL_TTL_ACTIONS, ROUTER_FLAGS, ROUTER_FLAGS_BY_NAME,
                                 EngineConfig)
from engine.config.model_discovery import default_model_name, servable_models

# Flags the router sets on each engine itself, or keeps for the endpoint.
ROUTER_OWNED = ("model", "served_model_name", "host", "port", "api_key", "allowed_hosts", "data_parallel_size")
ENGINE_FLAG_NAMES = tuple(f.name for f in FLAGS if f.name not in ROUTER_OWNED)
PER_MODEL_ROUTER_FLAGS = ("model_ttl", "model_ttl_action")


@dataclass
class ModelSpec:
    name: str
    path: str
    engine_flags: dict[str, Any] = field(default_factory=dict)  # EngineConfig fields, non-default only
    data_parallel_size: int = 1
    model_ttl: float | None = None  # seconds idle before unload; None: never
    discovered: bool = False  # found under --models-dir (or the HF cache), not named by the user
    model_ttl_action: str = "unload"  # what the TTL does: unload the engines, or sleep them (level 1)

    def engine_config(self) -> EngineConfig:
        """The engine's configuration as one replica would parse it (validated), for planning."""
        config = EngineConfig.from_kwargs(model=self.path, served_model_name=self.name, serving=True,
                                          **self.engine_flags)
        config.validate()
        return config


@dataclass
class RouterConfig:
    models: dict[str, ModelSpec]
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    allowed_hosts: str | None = None
    max_loaded_models: int | None = None
    memory_budget: float | None = None  # GiB per card (CPU: the host)
    device: str = "auto"
    gpu_memory_utilization: float = 0.9


def split_model_arg(value: str) -> tuple[str | None, str]:
    """'NAME=PATH' → (NAME, PATH); a plain path or repo id (no '=' before any '/') → (None, value)."""
    name, sep, path = value.partition("=")
    if sep and name and "/" not in name and not Path(value).exists():
        return name, path
    return None, value


def parse_flag_value(name: str, value: Any, where: str) -> Any:
    """A TOML value checked against the flag's type: the same names and types as the command line."""
    flag = FLAGS_BY_NAME.get(name) or ROUTER_FLAGS_BY_NAME.get(name)
    if flag is None:
        raise ValueError(f"{where}: unknown flag {name!r}; use the command line's flag names, e.g. max-model-len")
    if flag.type is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, flag.type) or (flag.type is int and isinstance(value, bool)):
        raise ValueError(f"{where}: {flag.cli} must be {flag.type.__name__}, got {value!r}")
    return value


def read_models_config(path: str) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """(top-level flags, {model name: its flags}) from the TOML file; flag names with '-' or '_'."""
    try:
        data = tomllib.loads(Path(path).read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ValueError(f"--models-config {path}: {exc}") from None
    def flags(table: dict[str, Any], where: str) -> dict[str, Any]:
        out = {}
        for key, value in table.items():
            name = key.replace("-", "_")
            out[name] = parse_flag_value(name, value, where)
        return out
    tables = data.pop("models", {})
    if not isinstance(tables, dict) or not all(isinstance(t, dict) for t in tables.values()):
        raise ValueError(f"--models-config {path}: models must be tables, e.g. [models.chat]")
    return flags(data, path), {name: flags(t, f"{path} [models.{name}]") for name, t in tables.items()}


def build_specs(model_args: list[str], args: dict[str, Any]) -> RouterConfig:
    """The router's configuration from the parsed flags (`args`: engine and router flags by name) and every
    `--model` value. ValueError names what is wrong."""
    top, per_model = read_models_config(args["models_config"]) if args.get("models_config") else ({}, {})
    merged = {**args, **{k: v for k, v in top.items() if args.get(k) == _default(k)}}
    shared = {n: merged[n] for n in ENGINE_FLAG_NAMES if merged.get(n) is not None and merged[n] != _default(n)}
    paths: dict[str, str] = {}
    for value in model_args:
        name, path = split_model_arg(value)
        name = name or merged.get("served_model_name") or default_model_name(path)
        if name in paths:
            raise ValueError(f"--model: the name {name!r} is given twice; name each model NAME=PATH")
        paths[name] = path
    discovered: set[str] = set()
    if merged.get("models_dir"):
        if not Path(merged["models_dir"]).is_dir():
            raise ValueError(f"--models-dir {merged['models_dir']} is not a folder")
        for name, folder in servable_models(merged["models_dir"]).items():
            if name not in paths:
                paths[name] = str(folder)
                discovered.add(name)
    for name, table in per_model.items():
        if "model" in table:
            paths[name] = table["model"]
            discovered.discard(name)
        elif name not in paths:
            raise ValueError(f"--models-config [models.{name}] has no model = \"PATH\" and no --model names it")
    if not paths:
        raise ValueError("--model is required: a Hugging Face model folder or hub repo id (or --models-dir DIR)")
    specs = {}
    for name, path in paths.items():
        table = {k: v for k, v in per_model.get(name, {}).items() if k != "model"}
        flags = {**shared, **{k: v for k, v in table.items() if k in ENGINE_FLAG_NAMES}}
        spec = ModelSpec(name, path, flags, int(table.get("data_parallel_size", merged.get("data_parallel_size") or 1)),
                         table.get("model_ttl", merged.get("model_ttl")), name in discovered)
        spec.model_ttl_action = table.get("model_ttl_action", merged.get("model_ttl_action")) or "unload"
        if spec.model_ttl_action not in MODEL_TTL_ACTIONS:
            raise ValueError(f"{name}: --model-ttl-action must be one of {', '.join(MODEL_TTL_ACTIONS)}, "
                             f"got {spec.model_ttl_action!r}")
        if spec.data_parallel_size < 1:
            raise ValueError(f"{name}: --data-parallel-size must be >= 1, got {spec.data_parallel_size}")
        specs[name] = spec
    return RouterConfig(specs, merged.get("host") or "127.0.0.1", int(merged.get("port") or 8000),
                        merged.get("api_key"), merged.get("allowed_hosts"), merged.get("max_loaded_models"),
                        merged.get("memory_budget"), merged.get("device") or "auto",
                        float(merged.get("gpu_memory_utilization") or 0.9))


def _default(name: str) -> Any:
    flag = FLAGS_BY_NAME.get(name) or ROUTER_FLAGS_BY_NAME.get(name)
    return flag.default if flag else None


def wants_router(model_args: list[str], args: dict[str, Any]) -> bool:
    """More than one model or replica, or a router feature: the router; else today's single engine."""
    return (len(model_args) > 1 or (args.get("data_parallel_size") or 1) > 1
            or any(args.get(f.name) not in (None, f.default) for f in ROUTER_FLAGS))
