"""Trained speculation heads shipped with the package (package data): `--speculator eagle`
with no `--eagle-head` drafts with the default model's.

  smollm2-135m-eagle3/  an EAGLE-3 head for the default model (SmolLM2-135M-Instruct, the
                        embedded GGUF), bf16, in the public EAGLE-3 layout
                        (model.safetensors + config.json, whose "base_model" names the
                        target and "training" says how it was trained: training/,
                        python -m scripts.train_eagle)
"""
from __future__ import annotations

import json
from pathlib import Path

DEFAULT_EAGLE_HEAD = Path(__file__).resolve().parent / "smollm2-135m-eagle3"


def shipped_eagle_head(model: str) -> str | None:
    """The shipped EAGLE head's directory when `model` is the default model (its alias,
    runtime.models.loader.DEFAULT_MODEL, or a path to the file that alias resolves to) and
    the head was trained for it; None for any other model."""
    from runtime.models.loader import DEFAULT_MODEL, resolve_model

    config = DEFAULT_EAGLE_HEAD / "config.json"
    if not config.is_file() or json.loads(config.read_text()).get("base_model") != DEFAULT_MODEL:
        return None
    if str(model) != DEFAULT_MODEL:
        try:
            if resolve_model(model).path.resolve() != resolve_model(DEFAULT_MODEL).path.resolve():
                return None
        except (OSError, ValueError):  # not found, or not a model the loader reads
            return None
    return str(DEFAULT_EAGLE_HEAD)
