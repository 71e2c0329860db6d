"""Payload layouts of plain data built on one side and read on the other:
one encode/decode pair per layout, imported by both sides, so the format is
written down once (as wire/metricframes.py does for METRICS).

* OUTPUT items: ``[[stream, text], ...]`` (JSON), an OUTPUT message's payload
  and a RESULT's payload frame 0 when its meta has ``o`` (engine/loop.py,
  engine/capture.py -> controller/calls/output.py).
* The flight recorder's tail: a JSON object (engine/flightrec.py
  ``Recorder.tail``), a STACKS_REPLY's payload frame 0 when the STACKS asked
  for ``flight`` (-> controller/inspector.py, controller/analysis/collectives.py).
* A debugger request's arguments and its answer's or event's body: a JSON
  object, the payload of DEBUGGER and DEBUGGER_EVENT (controller/rankdebug.py
  <-> engine/dap_rank.py).

(RESULT's shared-memory and chunk descriptors are wire/shm.py's and
wire/chunks.py's own pairs; METRICS is wire/metricframes.py.)

Data, never pickle. Decoders read outside input (a verified message from a
rank that may be buggy): they bound the size, and raise :class:`PayloadError`
for anything malformed, which the caller counts and drops. No other
exception leaves a decoder.
"""

from __future__ import annotations

import json
from typing import Any

MAX_OUTPUT_BYTES = 256 << 20  # one OUTPUT chunk or a RESULT's last output
MAX_FLIGHT_BYTES = 64 << 20  # one rank's flight-recorder tail
MAX_DEBUGGER_BYTES = 16 << 20  # one debugger request or answer (a page of variables)

OutputItems = list[tuple[str, str]]  # (stream, text), in order


class PayloadError(ValueError):
    """A payload frame that does not fit its layout (the caller drops it)."""


def _json(frame: Any, limit: int, what: str) -> Any:
    try:
        raw = bytes(frame)
    except (TypeError, ValueError) as e:
        raise PayloadError(f"{what}: not a byte frame") from e
    if len(raw) > limit:
        raise PayloadError(f"{what}: {len(raw)} bytes, more than {limit}")
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as e:  # RecursionError: "[[[[..." nested deep
        raise PayloadError(f"{what}: not JSON") from e


def encode_output(items: list[list[str]]) -> bytes:
    """The OUTPUT payload frame of ``[[stream, text], ...]``."""
    return json.dumps(items, separators=(",", ":")).encode()


def decode_output(frame: Any) -> OutputItems:
    """The items of an OUTPUT frame; PayloadError unless it is a JSON list of
    [stream, text] string pairs at most MAX_OUTPUT_BYTES long."""
    items = _json(frame, MAX_OUTPUT_BYTES, "output")
    if type(items) is not list:
        raise PayloadError("output: not a list")
    out: OutputItems = []
    for item in items:
        if type(item) is not list or len(item) != 2:
            raise PayloadError("output: an item is not a [stream, text] pair")
        stream, text = item
        if type(stream) is not str or type(text) is not str:
            raise PayloadError("output: stream and text must be strings")
        out.append((stream, text))
    return out


def encode_flight(tail: dict[str, Any]) -> bytes:
    """The STACKS_REPLY payload frame of a flight-recorder tail."""
    return json.dumps(tail).encode()


def decode_flight(frame: Any) -> dict[str, Any]:
    """A flight-recorder tail; PayloadError unless it is a JSON object at
    most MAX_FLIGHT_BYTES long whose ``ops``, ``calls`` and ``torch_ops`` are
    lists and ``groups`` an object, where present (their rows are read by
    controller/analysis/collectives.py through flight.decode, which skips bad ones)."""
    tail = _json(frame, MAX_FLIGHT_BYTES, "flight")
    if type(tail) is not dict:
        raise PayloadError("flight: not an object")
    for key in ("ops", "calls", "torch_ops"):
        if key in tail and type(tail[key]) is not list:
            raise PayloadError(f"flight: {key} is not a list")
    if "groups" in tail and type(tail["groups"]) is not dict:
        raise PayloadError("flight: groups is not an object")
    return tail


def encode_debugger(body: dict[str, Any]) -> bytes:
    """The payload frame of a DEBUGGER request's arguments or a
    DEBUGGER_EVENT's body (a value's repr that JSON cannot hold is replaced:
    the frame is always made)."""
    return json.dumps(body, separators=(",", ":"), default=repr).encode()


def decode_debugger(frame: Any) -> dict[str, Any]:
    """A debugger request's arguments or answer's body; PayloadError unless
    it is a JSON object at most MAX_DEBUGGER_BYTES long."""
    body = _json(frame, MAX_DEBUGGER_BYTES, "debugger")
    if type(body) is not dict:
        raise PayloadError("debugger: not an object")
    return body
