"""Drive a real IPython kernel through jupyter_client, the way a notebook does.

``KernelSession.run(code)`` executes a cell and collects, for that cell only
(matched by parent msg_id), its stream output, results, display data and
error, waiting for the kernel to go idle — never sleeping blindly.
"""

from __future__ import annotations

import contextlib
import queue
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from jupyter_client.manager import KernelManager, start_new_kernel


@dataclass
class CellResult:
    msg_id: str
    stdout: str = ""
    stderr: str = ""
    results: list[str] = field(default_factory=list)  # text/plain of execute_result
    displays: list[str] = field(default_factory=list)
    error: dict[str, Any] | None = None
    status: str = ""
    prompts: list[str] = field(default_factory=list)  # input requests answered
    asking: bool = False  # an input request waits for its answer

    @property
    def traceback(self) -> str:
        return "\n".join(self.error["traceback"]) if self.error else ""

    @property
    def text(self) -> str:
        return self.stdout + self.stderr + "".join(self.results) + "".join(self.displays)


# An answer typed into an input request: a line, or a function of what the
# cell printed so far that gives the line once it can be typed (None: not yet).
Answer = str | Callable[[CellResult], str | None]


class KernelSession:
    def __init__(self) -> None:
        self.km: KernelManager
        self.km, self.kc = start_new_kernel(kernel_name="python3", startup_timeout=60)
        self.late: dict[str, list[dict[str, Any]]] = {}
        # IOPub messages read while waiting for a debug_event, for collect()
        self._stash: list[dict[str, Any]] = []
        self.debug_events: list[dict[str, Any]] = []  # every debug_event's content, in order
        self._dap_seq = 0

    @property
    def pid(self) -> int:
        return self.km.provisioner.process.pid  # type: ignore[union-attr]

    def execute(self, code: str, allow_stdin: bool = False) -> str:
        return self.kc.execute(code, allow_stdin=allow_stdin)

    def collect(self, msg_id: str, timeout: float = 120.0,
                answers: list[Answer] | None = None) -> CellResult:
        """Output of cell ``msg_id`` until the kernel is idle. ``answers``
        are typed, in order, into input requests (pdb prompts), the way a
        user types into the notebook's input box; a callable answer is typed
        once it returns a line (the user waits until they see something)."""
        res = CellResult(msg_id)
        deadline = time.monotonic() + timeout
        pending = list(answers or [])
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"cell {msg_id} did not finish in {timeout} s; so far: {res}")
            if answers is not None:
                self._answer_input(res, pending)
            try:
                msg = self._next_iopub(min(left, 0.1) if answers is not None else min(left, 1.0))
            except queue.Empty:
                continue
            parent = msg["parent_header"].get("msg_id")
            if parent != msg_id:
                self.late.setdefault(parent, []).append(msg)
                continue
            self._apply(res, msg)
            if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
                res.status = self.reply_status(msg_id, deadline)
                return res

    def _next_iopub(self, timeout: float) -> dict[str, Any]:
        if self._stash:
            return self._stash.pop(0)
        msg: dict[str, Any] = self.kc.get_iopub_msg(timeout=timeout)
        if msg["msg_type"] == "debug_event":
            self.debug_events.append(msg["content"])
        return msg

    # -- the Jupyter debugger protocol, as JupyterLab speaks it -------------------------
    def dap(self, command: str, arguments: dict[str, Any] | None = None,
            timeout: float = 60.0) -> dict[str, Any]:
        """One DAP request in a ``debug_request`` on the control channel
        (what JupyterLab's debugger sends); the ``debug_reply``'s content."""
        self._dap_seq += 1
        msg = self.kc.session.msg("debug_request", {
            "type": "request", "seq": self._dap_seq, "command": command,
            "arguments": arguments or {}})
        self.kc.control_channel.send(msg)
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no debug_reply to {command} in {timeout} s")
            reply = self.kc.get_control_msg(timeout=left)
            if reply["parent_header"].get("msg_id") == msg["header"]["msg_id"]:
                return dict(reply["content"])

    def debug_event(self, predicate: Callable[[dict[str, Any]], bool], timeout: float = 60.0,
                    after: int = 0) -> dict[str, Any]:
        """The first ``debug_event`` (from number ``after`` on) that
        ``predicate`` accepts, reading IOPub until it comes; what else is
        read stays for :meth:`collect`."""
        deadline = time.monotonic() + timeout
        seen = after
        while True:
            for event in self.debug_events[seen:]:
                if predicate(event):
                    return event
            seen = len(self.debug_events)
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no such debug_event in {timeout} s; got {self.debug_events[after:]}")
            self._read_iopub(min(left, 0.2))

    def _read_iopub(self, timeout: float) -> None:
        """One IOPub message, if one comes within ``timeout``: a debug_event
        is kept in :attr:`debug_events`, anything else for :meth:`collect`."""
        try:
            msg = self.kc.get_iopub_msg(timeout=timeout)
        except queue.Empty:
            return
        if msg["msg_type"] == "debug_event":
            self.debug_events.append(msg["content"])
        else:
            self._stash.append(msg)

    def wait_output(self, msg_id: str, text: str, timeout: float = 60.0) -> None:
        """Read IOPub until cell ``msg_id`` printed ``text`` (what is read
        stays for :meth:`collect`)."""
        deadline = time.monotonic() + timeout
        while not any(m["msg_type"] == "stream" and m["parent_header"].get("msg_id") == msg_id
                      and text in m["content"]["text"] for m in self._stash):
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"cell {msg_id} did not print {text!r} in {timeout} s")
            self._read_iopub(min(left, 0.2))

    def reply_status(self, msg_id: str, deadline: float) -> str:
        """Status of ``msg_id``'s execute_reply, skipping replies to other
        requests (jupyter_client's wait_for_ready leaves kernel_info replies
        queued on a loaded machine)."""
        while True:
            reply = self.kc.get_shell_msg(timeout=max(deadline - time.monotonic(), 10.0))
            if reply["parent_header"].get("msg_id") == msg_id:
                return str(reply["content"]["status"])

    def run(self, code: str, timeout: float = 120.0,
            answers: list[Answer] | None = None) -> CellResult:
        return self.collect(self.execute(code, allow_stdin=answers is not None), timeout, answers)

    def _answer_input(self, res: CellResult, pending: list[Answer]) -> None:
        if not res.asking:
            try:
                msg = self.kc.get_stdin_msg(timeout=0.01)
            except queue.Empty:
                return
            if msg["msg_type"] != "input_request":
                return
            res.prompts.append(msg["content"]["prompt"])
            res.asking = True
        # Out of answers: continue (the test sees it in res.prompts) rather
        # than leave the kernel blocked in input() for the rest of the module.
        answer = pending[0] if pending else "c"
        line = answer(res) if callable(answer) else answer
        if line is None:
            return  # asked again after more output
        if pending:
            pending.pop(0)
        res.asking = False
        self.kc.input(line)

    @staticmethod
    def _apply(res: CellResult, msg: dict[str, Any]) -> None:
        kind, content = msg["msg_type"], msg["content"]
        if kind == "stream":
            if content["name"] == "stdout":
                res.stdout += content["text"]
            else:
                res.stderr += content["text"]
        elif kind == "execute_result":
            res.results.append(content["data"].get("text/plain", ""))
        elif kind in ("display_data", "update_display_data"):
            res.displays.append(content["data"].get("text/plain", ""))
        elif kind == "error":
            res.error = content

    def output_for(self, msg_id: str) -> str:
        """Stream text that arrived for ``msg_id`` after its cell finished."""
        text = ""
        for msg in self.late.get(msg_id, []):
            if msg["msg_type"] == "stream":
                text += msg["content"]["text"]
        return text

    def drain(self, timeout: float = 0.2) -> None:
        """Move iopub messages that are already queued into ``late``."""
        while True:
            try:
                msg = self._next_iopub(timeout)
            except queue.Empty:
                return
            self.late.setdefault(msg["parent_header"].get("msg_id"), []).append(msg)

    def close(self) -> None:
        self.kc.stop_channels()
        if self.km.is_alive():
            self.km.shutdown_kernel(now=False)

    def end(self) -> None:
        """Best effort, for a test's cleanup: the kernel may be gone already
        (shut down, restarted, SIGKILLed by the test)."""
        with contextlib.suppress(Exception):
            self.close()
        with contextlib.suppress(Exception):
            if self.km.has_kernel:
                self.km.shutdown_kernel(now=True)
            self.km.cleanup_resources()


MAGICS = "get_ipython().find_magic('monarch').__self__"


@contextlib.contextmanager
def kernel_with_mesh(n: int = 3) -> Any:
    """A real kernel with ``%monarch start -n N --backend cpu`` done; the mesh
    is stopped and the kernel shut down afterwards, whatever happened."""
    ks = KernelSession()
    try:
        assert ks.run("%load_ext monarch_nb").status == "ok"
        r = ks.run(f"%monarch start -n {n} --backend cpu --no-dashboard", timeout=180)
        assert r.status == "ok", r
        yield ks
    finally:
        with contextlib.suppress(Exception):
            ks.run(f"_m = {MAGICS}.mesh\nif _m is not None and _m.running:\n    _m.stop()",
                   timeout=30)
        ks.close()
