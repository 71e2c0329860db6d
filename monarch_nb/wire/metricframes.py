"""The METRICS frame: what ``mnb.log`` points look like on the wire.

One JSON frame ``[[step, t, {name: value}], ...]``: data, never pickle.
Encoded on a rank (engine/metrics.py), decoded by the controller
(controller/metricstore.py); both sides import it from here so the format
is written down once.

Non-goals: buffering (engine/metrics.py), storing series (controller/metricstore.py).
"""

from __future__ import annotations

import json
import math
from typing import Any

Point = tuple[int, float, dict[str, float]]  # step, time (s since the epoch), values


def encode(points: list[Point]) -> bytes:
    """The METRICS payload frame. Non-finite values travel as strings
    ("nan", "inf"): strict JSON has no NaN, and a NaN loss must still show."""
    out = []
    for step, t, metrics in points:
        clean = {k: (v if math.isfinite(v) else str(v)) for k, v in metrics.items()}
        out.append([step, round(t, 3), clean])
    return json.dumps(out, separators=(",", ":")).encode()


def decode(frame: Any) -> list[Point]:
    """Points of a verified METRICS frame; malformed entries are skipped."""
    try:
        items = json.loads(bytes(frame))
    except (ValueError, TypeError, RecursionError):  # RecursionError: "[[[[..." nested deep
        return []
    points: list[Point] = []
    if not isinstance(items, list):
        return points
    for item in items:
        try:
            step, t, metrics = item
            points.append((int(step), float(t), {str(k): float(v) for k, v in metrics.items()}))
        except (TypeError, ValueError, AttributeError, OverflowError):
            # OverflowError: a step of 1e999 (int(inf)) or a 400-digit value (float())
            continue
    return points
