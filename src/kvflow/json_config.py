"""Config knobs given as a dict, or as JSON text on the command line (`--speculative-config`,
`--kv-transfer-config`): one reading, so every such knob names its bad keys the same way."""

from __future__ import annotations

import json
from dataclasses import fields


def config_dict(value: dict | str, name: str, cls: type) -> dict:
    """`value` as a dict of `cls`'s fields; ValueError naming `name` and the bad key otherwise."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{name} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a dict (JSON object); got {type(value).__name__}")
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(f"{name} has unknown key {unknown[0]!r}; known keys: {', '.join(sorted(known))}")
    return value
