"""The host agent's control channel: one JSON object per line, over the
ssh / srun session that started the agent (its stdin: controller to agent;
its stdout: agent to controller).

Why this channel: the session is authenticated and encrypted by ssh (srun:
munge and slurm's own), it exists before anything listens on either side,
and its end is each side's signal that the other is gone. A rank's spec
(its environment, keys included) travels here, never on a command line.

Nothing on it is unpickled: every line is parsed as JSON and checked
against its kind's fields (:func:`decode`) before use; a malformed or
unknown line is dropped by the reader, which counts it.

What does not travel here: calls, results and the output of user code go
over each rank's own signed ZeroMQ channel to the controller (end to end:
an agent cannot make a rank run anything). Only the rank's log (its stdout
and stderr) comes through the agent, so that ``%monarch logs`` and the
death causes read it as for a local rank.

Non-goals: starting the agent (launchers.py), the agent (hostagent.py),
its controller-side handle (agents.py).
"""

from __future__ import annotations

import json
from typing import Any

MAX_LINE = 64 << 20  # a line longer than this is dropped (a log burst is cut in pieces first)
# what a warm process or a spare takes from the ranks' environment before it
# knows its rank: what torch reads at import
IMPORT_ENV = ("OMP_NUM_THREADS", "PYTHONPATH", "MKL_NUM_THREADS")

# controller -> agent
TO_AGENT: dict[str, dict[str, type | tuple[type, ...]]] = {
    # start ``rank`` (incarnation ``inc``) with ``env`` on top of the agent's
    # own environment; ``spare``: keep a warm spare for the next one
    # ``sid``: this spawn's number, unique for the agent's life; every
    # message about the process it starts carries it (a rank restarted with
    # the same incarnation is still another process)
    # ``relay``: the routing id of the agent's one connection to the
    # controller, which carries the rank's main channel (wire/hostrelay.py);
    # "" for none (the rank then connects its own DEALER)
    # ``fork``, ``preload``: the mesh's (MeshConfig): fork the rank from the
    # host's warm process, which imports ``preload`` (procs/hostagent.py)
    "spawn": {"sid": int, "rank": int, "inc": int, "env": dict, "spare": bool, "relay": str,
              "fork": bool, "preload": list},
    # the same settings at the mesh's start, before any spawn: the agent
    # starts its warm process at once (every host's imports torch side by
    # side); ``env``: what torch reads at import (IMPORT_ENV of the ranks')
    "warm": {"fork": bool, "preload": list, "env": dict},
    # ``tree``: the rank's whole process group (killpg), else its process
    "signal": {"sid": int, "sig": int, "tree": bool},
    "ping": {},
    # stop: ranks still alive after ``grace`` seconds are killed, then the agent exits
    "stop": {"grace": (int, float)},
    # a kept mesh (keptagent.py). door: the first line to a door process (the
    # key goes to an agent it starts); attach: the answer to a challenge
    # (``mac``: keptagent.attach_mac), who attaches, and whether it takes over
    "door": {"key": str, "start": bool},
    "attach": {"mac": str, "pid": int, "host": str, "force": bool},
    # keep: what a new controller will need (setup cells, events, budgets),
    # handed back in ``attached``; detach: the controller lets go on purpose
    "keep": {"state": dict},
    "detach": {},
}

# agent -> controller
FROM_AGENT: dict[str, dict[str, type | tuple[type, ...]]] = {
    "hello": {"host": str, "pid": int},
    "started": {"sid": int, "pid": int, "spare": bool},
    # ``flight``: the rank's persisted flight records file, base64 ("" if none)
    "exit": {"sid": int, "code": int, "flight": str},
    "log": {"sid": int, "data": str},
    # every tick: the agent is alive; ``states``: sid -> its process state
    # letter (R running, S sleeping, T stopped, Z zombie, D disk wait);
    # ``relay``: its relay's counts (hostrelay.Relay.counts; {} without one)
    "tick": {"states": dict, "relay": dict},
    "error": {"text": str},
    # a kept mesh's agent (keptagent.py): challenge to a controller that
    # connects; attached: its ranks' processes (sid, rank, inc, pid, ident,
    # code: None while alive) and the kept state; refused: why not (held by
    # another controller, a wrong key); taken: another controller took over
    "challenge": {"nonce": str},
    "attached": {"children": list, "state": dict},
    "refused": {"text": str},
    "taken": {"text": str},
}


def encode(op: str, **fields: Any) -> bytes:
    return json.dumps({"op": op, **fields}, separators=(",", ":")).encode() + b"\n"


def decode(line: bytes, kinds: dict[str, dict[str, type | tuple[type, ...]]]) -> dict[str, Any]:
    """The message on ``line`` if it is one of ``kinds`` with every field
    of the right type; ValueError otherwise (the caller drops it)."""
    if len(line) > MAX_LINE:
        raise ValueError("line too long")
    try:
        msg = json.loads(line)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"not JSON: {exc}") from None
    if not isinstance(msg, dict):
        raise ValueError("not a JSON object")
    op = msg.get("op")
    fields = kinds.get(op) if isinstance(op, str) else None
    if fields is None:
        raise ValueError(f"unknown op {op!r}")
    for name, typ in fields.items():
        value = msg.get(name)
        # bool is an int in Python, never on this wire
        if not isinstance(value, typ) or (isinstance(value, bool) and typ is not bool):
            raise ValueError(f"{op}: field {name!r} is {type(value).__name__}")
    return msg


def string_map(value: dict[Any, Any]) -> dict[str, str]:
    """A JSON object of strings (an environment); ValueError otherwise."""
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise ValueError("an environment maps strings to strings")
    return value


__all__ = ["FROM_AGENT", "IMPORT_ENV", "MAX_LINE", "TO_AGENT", "decode", "encode", "string_map"]
