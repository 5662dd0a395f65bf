"""Parsers for knob values that a plain int, float or str cannot express."""

from __future__ import annotations

import argparse
import json
import re
from typing import Any

_UNITS = {"": 1, "b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


def parse_bytes(text: str) -> int:
    """'268435456', '256MiB', '1.5 GiB' -> bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not match or match[2].lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size: use bytes or a KiB/MiB/GiB/TiB suffix, e.g. 256MiB")
    return int(float(match[1]) * _UNITS[match[2].lower()])


def parse_json_object(text: str) -> dict[str, Any]:
    """'{"key": value, ...}' -> dict, for pass-through settings (vLLM EngineArgs)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"{text!r} is not JSON: {err}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{text!r}: give a JSON object, e.g. '{{\"swap_space\": 0}}'")
    return value
