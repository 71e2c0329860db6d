"""The rank process: ``python -m monarch_nb.worker`` (started by the supervisor).

Two threads:

* the **main thread** owns the ``main`` channel (a local rank's link to its
  controller, wire/link.py; else a DEALER socket): it receives CALL/EXEC
  messages, runs user code in the rank's persistent namespace (signals, CUDA
  and torch.distributed all want the main thread) and sends the RESULT;
* the **control thread** owns the ``ctl`` DEALER socket: heartbeats, controller
  pings, interrupts, output chunks and (later) stacks. It keeps answering while
  the main thread is stuck in a collective or a C call.

Interrupts are delivered as SIGINT to the main thread by the control thread,
and only raise ``KeyboardInterrupt`` if they target the call that is running:
a late interrupt for a call that already finished must not kill the next one.

No orphans: the parent-death signal (Linux prctl) kills the rank with its
controller's process; a rank that hears no ping for ``controller_timeout``
seconds exits too (remote hosts, or a parent that was SIGSTOPped).

Non-goals: respawn decisions (controller/supervisor), formatting output.
"""

from __future__ import annotations

import ast
import collections
import ctypes
import faulthandler
import importlib
import linecache
import os
import signal
import sys
import threading
import time
import traceback
import types
from typing import Any

import zmq

from .. import config
from ..backends import init_group, keep_links_to, native_crash_stacks
from ..config import RankEnv
from ..wire import chunks, gpuipc, payloads, serialize, shm
from ..wire.channels import LinkChannel, MainChannel, SocketChannel, dealer
from ..wire.link import Link
from ..wire.metas import meta_of
from ..wire.metricframes import encode as encode_metrics
from ..wire.protocol import Codec, Kind, Message
from . import context as _context
from . import dap_rank, debug, flightrec, kept, metrics, pgcompat, spare, warm
from .capture import OutputBuffer, RankStream
from .health import HealthProbe
from .membership import Membership

# signal.getsignal converts the handler to an enum, raising and catching a
# ValueError when it is a function: too slow to run after every call.
_getsignal = importlib.import_module("_signal").getsignal
_SIGINT = int(signal.SIGINT)

HEARTBEAT_S = 0.5
OUTPUT_FLUSH_S = 0.02
METRICS_FLUSH_S = 0.2  # mnb.log batches while a call runs (the rest goes with the RESULT)
_WORKER_FILE = __file__.removesuffix("c")


def _set_parent_death_signal() -> None:
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class Worker:
    def __init__(self, env: RankEnv) -> None:
        self.env = env
        ident = env.identity  # unguessable: a local process cannot squat it
        self.ctx = zmq.Context()
        self.main_id = f"{ident}.main"
        self.ctl_id = f"{ident}.ctl"
        self.main_codec = Codec(env.key, self.main_id)
        self.ctl_codec = Codec(env.key, self.ctl_id)
        # The main channel: a local rank's link (wire/link.py: a socket pair
        # with its controller, no ZeroMQ threads on the call path), else a DEALER.
        self.main: MainChannel = (
            LinkChannel(Link.inherited(env.link_fd, env.max_message_bytes, env.link_shm))
            if env.link_fd is not None
            else SocketChannel(dealer(self.ctx, self.main_id, env.controller, env.curve)))
        # The control channel: a DEALER of its own, or, behind a host agent, a
        # second link to the agent (wire/hostrelay.py), so a host has one
        # connection to the controller and heartbeats go up in its batches.
        self.ctl: MainChannel = (
            LinkChannel(Link.inherited(env.ctl_link_fd, env.max_message_bytes))
            if env.ctl_link_fd is not None
            else SocketChannel(dealer(self.ctx, self.ctl_id, env.controller, env.curve)))
        self.dropped: collections.Counter[str] = collections.Counter()
        self.output = OutputBuffer()
        self.metrics = metrics.buffer()
        self.calls = serialize.CallCache()
        self.running_call = 0
        self.interrupt_call = 0
        # a call whose INTERRUPT said it cannot finish (a member is gone for
        # good): the group is left once it is over (Membership.release_peers)
        self.leave_after = 0
        # Interrupts that arrived before their call started (queued behind
        # another call, or overtaking it on the other socket), and calls done.
        self.cancelled: set[int] = set()
        # the group across re-formations, and the messages read ahead while
        # waiting for one (served first, in order: see serve)
        self.members = Membership(env, self.main, self.main_codec, self.dropped,
                                  self._send_main, lambda: self.running_call)
        self.finished: collections.deque[int] = collections.deque(maxlen=4096)
        # Shared memory with the controller (wire/shm.py): only a rank on its
        # controller's host, which knows the controller's pid, uses it. The
        # segments of results sent, by token, until the controller's RELEASE.
        self.shm_peer = ((env.controller_pid or env.parent_pid) if env.shm_threshold is not None
                         else None)
        # A kept mesh's rank keeps what the next controller needs (engine/kept.py).
        self.keeper = kept.Keeper(env.kept_epoch) if env.kept_epoch is not None else None
        if self.keeper is not None:
            self.metrics.history = collections.deque(maxlen=kept.MAX_POINTS)
        self.segments: dict[str, shm.Segment] = {}
        # CUDA results by IPC handle (wire/gpuipc.py): the shares stay
        # there, by token, until the controller copied them and says RELEASE.
        gpuipc.configure(env.gpu_ipc)
        self.stopping = False
        self.main_thread_id = threading.get_ident()
        self.last_ping = time.monotonic()
        self.user_module = types.ModuleType("__main__")
        self.user_module.__dict__["__builtins__"] = __builtins__
        self.namespace = self.user_module.__dict__
        # A debugger (or input()) on the main thread waits for a line: the
        # control thread sends this prompt after the output before it.
        self.prompt_out: tuple[int, str] | None = None
        self._cell_argv: list[str] = sys.argv
        self.stdin = debug.RelayStdin(self._ask_input, lambda: self.output.take_partial("stdout"),
                                      self.main_thread_id)
        # JupyterLab's debugger on this rank (dap_rank.py): armed only while
        # the rank is debugged and has breakpoints
        self.dbg = dap_rank.RankDebugger(
            lambda: self.running_call,
            lambda: signal.pthread_kill(self.main_thread_id, signal.SIGINT),
            Worker._execute.__code__)

    # -- start-up ------------------------------------------------------------
    def start(self) -> None:
        env = self.env
        _context._set(
            rank=env.rank, world_size=env.world_size, mesh_rank=env.mesh_rank,
            local_rank=env.local_rank,
            incarnation=env.incarnation, backend=env.backend, generation=env.generation,
            await_reform=self.members.await_reform, mesh_size=env.mesh_size,
            reform_waiting=self.members.reform_waiting,
        )
        log = sys.stdout
        sys.stdout = RankStream("stdout", self.output, log)
        sys.stderr = RankStream("stderr", self.output, sys.__stderr__)
        sys.stdin = self.stdin  # pdb, breakpoint() and input() ask the notebook
        sys.breakpointhook = debug.breakpointhook
        sys.modules["__main__"] = self.user_module
        # a crash (SIGSEGV, SIGABRT...) dumps every thread's Python stack into
        # the rank's log, where the controller quotes it (procs/deathcause.py)
        faulthandler.enable(2, all_threads=True)  # fd 2: the rank's log
        native_crash_stacks()  # and every thread's native stack before it (backends.py)
        self._sigint = self._on_sigint  # one bound method, compared after each call
        signal.signal(signal.SIGINT, self._sigint)
        threading.Thread(target=self._control_thread, name=debug.CONTROL_THREAD, daemon=True).start()
        flightrec.enable_torch_recorder()  # before the group: torch reads it once
        keep_links_to(env.controller)  # never shut down with the group (backends.py)
        try:
            device = init_group(env.backend, env.rank, env.world_size, env.master_addr,
                                env.master_port)
        except BaseException as exc:  # report, then die: the controller decides
            text = "".join(traceback.format_exception(exc))
            self._send_main(Kind.FAILED_START, meta={"error": f"{type(exc).__name__}: {exc}", "tb": text})
            print(text, file=sys.__stderr__, end="")
            self._exit(2)
        pgcompat.install()  # the user's init/destroy_process_group keep the mesh's group
        flightrec.install()  # the collective flight recorder (on by default)
        # argparse names the program after sys.argv[0]: the cell, not worker.py
        self._cell_argv = sys.argv = ["<mnb-cell>"]
        self._prime_namespace()
        self._send_main(Kind.READY, meta={"device": device, "pid": os.getpid()})

    def _prime_namespace(self) -> None:
        """The names every rank's user namespace starts with (README, "Rank
        namespaces"): ``mnb``, ``torch``, ``dist``, ``rank``, ``world_size``,
        ``local_rank``, ``device``. Set at start (a respawned rank gets its
        own) and again after each re-formation, from the group itself."""
        import torch
        import torch.distributed as dist

        # The package this rank runs from, already loaded (its __init__ ran
        # before this module): handed to the user as `mnb`, not imported here,
        # so the engine takes no dependency on the root's front-end hooks.
        mnb = sys.modules[__name__.partition(".")[0]]
        world = dist.get_world_size() if dist.is_initialized() else _context.world_size()
        _context._set(world_size=world)
        # the torch group's numbers (dense, fewer ranks after a shrink): what
        # dist.get_rank() says; mnb.mesh_rank() is the mesh's
        self.namespace.update(mnb=mnb, torch=torch, dist=dist, rank=_context.rank(),
                              world_size=world, local_rank=self.env.local_rank,
                              device=_context.device())

    # -- main thread -----------------------------------------------------------
    def serve(self) -> None:
        recv, codec, pending, dropped = self.main.recv, self.main_codec, self.members.pending, self.dropped
        while not self.stopping:
            try:
                msg = pending.popleft() if pending else recv(codec, dropped)
            except KeyboardInterrupt:  # a stray interrupt while idle
                continue
            except EOFError:  # the controller closed this rank's link: it is gone
                break
            if msg is None:
                continue
            kind = msg.kind
            if kind is Kind.CALL or kind is Kind.EXEC:
                self._execute(msg)
            elif msg.kind == Kind.REFORM:
                try:
                    self.members.reform(msg)
                except RuntimeError:
                    pass  # reported to the controller in REFORMED
                self._prime_namespace()
            elif msg.kind == Kind.STOP:
                break
        self._exit(0)

    def _execute(self, msg: Message) -> None:
        # This is the rank's half of every call: each step costs a few
        # microseconds at most in the usual case (nothing printed or logged
        # between calls, no debugger), which the no-op benchmark measures.
        call = msg.call
        leftover = self.output.begin(call)
        if leftover:
            self._send_main(Kind.OUTPUT, [payloads.encode_output(leftover)], call=0, meta={"n": -1})
        if self.stdin.answered:  # only after a debugger session
            self.stdin.reset()
        mbuf = self.metrics
        if mbuf.used:  # only once mnb.log was called in this process
            left = mbuf.begin(call)  # logged between calls (by a user thread)
            if left:
                self._send_main(Kind.METRICS, [encode_metrics(left)], meta={"n": -1})
        self.running_call = call
        flightrec.call_begin(call, msg.meta)  # its span; strict mode (check_collectives)
        generation = meta_of(msg, Kind.CALL).get("generation", 0)  # (EXEC: the same field)
        if _context._state.get("call_generation") != generation:
            _context._set(call_generation=int(generation))
        ok, value, error = True, None, None
        dbg = self.dbg  # JupyterLab's debugger: armed, the user's code runs under its tracer
        try:
            try:
                if call in self.cancelled:
                    self.cancelled.discard(call)
                    raise KeyboardInterrupt("interrupted before it started")
                if msg.kind == Kind.CALL:
                    frames = msg.payload
                    cmeta = meta_of(msg, Kind.CALL)
                    if "parts" in cmeta:  # verified message: join the pieces
                        frames = chunks.join(frames, cmeta["parts"])
                    if "shm" in cmeta:  # verified message: map the big frames
                        frames = shm.attach(frames, cmeta["shm"], peer_pid=self.shm_peer,
                                            mesh_id=self.env.mesh_id,
                                            max_bytes=self.env.max_message_bytes)
                    fn, args, kwargs = self.calls.load(frames)
                    if self.keeper is not None:  # what a new controller is told it was
                        self.keeper.running_what = getattr(fn, "__qualname__", "a function")
                    if dbg.armed:
                        dbg.begin(sys._getframe())
                    value = fn(*args, **kwargs)
                else:
                    code = (bytes(memoryview(msg.payload[0])).decode() if msg.payload
                            else meta_of(msg, Kind.EXEC).get("code", ""))  # (payload: protocol.exec_parts)
                    if dbg.armed:
                        dbg.begin(sys._getframe())
                    name = meta_of(msg, Kind.EXEC).get("name", "<mnb-cell>")
                    if self.keeper is not None:
                        self.keeper.running_what = name
                    value = self._run_cell(code, name)
            finally:
                if dbg.tracing:
                    dbg.end()
                self.finished.append(call)  # before running_call drops: see _control
                self.running_call = 0
                if _getsignal(_SIGINT) is not self._sigint:
                    # pdb.set_trace() installs pdb's own handler on "c"
                    signal.signal(signal.SIGINT, self._sigint)
        except BaseException as exc:  # the rank survives whatever the user code does
            ok, error = False, self._describe(exc)
            # kept for %monarch debug, as the interactive interpreter keeps it
            sys.last_exc, sys.last_type, sys.last_value, sys.last_traceback = (  # type: ignore[attr-defined]
                exc, type(exc), exc, exc.__traceback__)
            self.members.release_peers(exc, error, leave=self.leave_after == call)
        flightrec.call_end(ok)
        n_out, tail = self.output.finish()
        if (n_out or tail) and isinstance(sys.stdout, RankStream):
            sys.stdout.flush()  # into the rank's log file too (%monarch logs)
        # mnb.log points: the rest goes on this socket ahead of the RESULT;
        # batches the control thread sent are counted like output chunks.
        # (mbuf.used may have turned True during this call: its points then
        # go ahead of the RESULT, uncounted, as if logged between calls)
        n_m, points = mbuf.finish() if mbuf.used else (0, [])
        if points:
            self._send_main(Kind.METRICS, [encode_metrics(points)], call=call, meta={"n": -1})
        # Defaults (ok, no chunks) are left out: a plain success carries no
        # JSON at all, which is most of the no-op path.
        meta: dict[str, Any] = {} if ok else {"ok": False}
        if n_out:
            meta["n_out"] = n_out
        if n_m:
            meta["n_m"] = n_m
        payload: list[Any] = []
        if ok and value is not None:
            try:
                payload = serialize.dumps(value)
            except serialize.SerializationError as exc:
                meta["ok"] = False
                error = {
                    "type": "SerializationError",
                    "msg": f"the result ({type(value).__name__}) cannot be sent back: {exc}; "
                    "return something picklable, or keep it on the rank in a variable",
                    "tb": "",
                }
            size = sum(memoryview(p).nbytes for p in payload)
            if size > self.env.max_message_bytes:
                payload, meta["ok"] = [], False
                error = {
                    "type": "SerializationError",
                    "msg": f"the result is {size} bytes, too large for this mesh's limit "
                    f"(max_message_bytes={self.env.max_message_bytes}); keep it on the rank, "
                    "or return a smaller piece",
                    "tb": "",
                }
        if meta.get("ok", True) is False:
            meta["error"] = error
        if self.env.gpu_ipc:  # shares of a result that goes: held until RELEASE
            if payload:
                gpuipc.claim()
            else:  # not sent (unpicklable, too large): nobody will open them
                gpuipc.release_pending()
        threshold = self.env.shm_threshold
        if self.shm_peer is not None and threshold is not None and payload and any(
                memoryview(p).nbytes >= threshold for p in payload):
            notes: list[str] = []  # a fallback's notice goes into this call's output
            payload, desc, seg = shm.pack(payload, self.env.mesh_id, threshold, notes.append)
            if seg is not None and desc is not None:
                self.segments[desc["tok"]] = seg  # closed on the controller's RELEASE
                meta["shm"] = desc
            if notes:
                tail = [*tail, *(["stderr", line + "\n"] for line in notes)]
        if tail:  # output text travels as a JSON frame, never in the header
            meta["o"] = 1
            payload = [payloads.encode_output(tail), *payload]
            if "shm" in meta:  # the frames' positions move one down
                for where in meta["shm"]["at"]:
                    where[0] += 1
        if self.keeper is not None:  # until the controller is done with it
            self.keeper.keep(call, dict(meta), payload, self.keeper.running_what)
        if payload:
            if self.env.curve is not None:  # encrypted: big frames go in pieces
                payload, parts = chunks.split(payload)
                if parts is not None:
                    meta["parts"] = parts
            self._send_main(Kind.RESULT, payload, call=call, meta=meta)
        else:
            self.main.send(self.main_codec.sign(Kind.RESULT, (), call=call, meta=meta))

    def _run_cell(self, code: str, name: str) -> Any:
        if sys.argv is self._cell_argv:  # untouched by the user: name this cell
            self._cell_argv = sys.argv = [name]
        lines = code.splitlines(True)
        linecache.cache[name] = (len(code), None, lines, name)  # tracebacks show cell source
        tree = ast.parse(code, filename=name, mode="exec")
        last = None
        if tree.body and isinstance(tree.body[-1], ast.Expr) and not code.rstrip().endswith(";"):
            expr = tree.body.pop()
            assert isinstance(expr, ast.Expr)  # (checked above; for the type checker)
            last = ast.Expression(expr.value)
        exec(compile(tree, name, "exec"), self.namespace)
        if last is not None:
            return eval(compile(last, name, "eval"), self.namespace)
        return None

    def _describe(self, exc: BaseException) -> dict[str, str]:
        tb = exc.__traceback__
        # Hide the worker's own frames: the user wants their code, not ours.
        while tb is not None and tb.tb_frame.f_code.co_filename in (_WORKER_FILE, serialize.__file__,
                                                                    shm.__file__):
            tb = tb.tb_next
        text = "".join(traceback.format_exception(type(exc), exc, tb))
        name = type(exc).__qualname__
        module = type(exc).__module__
        if module not in ("builtins", "__main__"):
            name = f"{module}.{name}"
        return {"type": name, "msg": str(exc), "tb": text}

    def _on_sigint(self, signum: int, frame: Any) -> None:
        if self.running_call and self.interrupt_call == self.running_call:
            self.interrupt_call = 0
            raise KeyboardInterrupt
        if self.dbg.pausing and self.running_call:  # JupyterLab's pause button
            self.dbg.pause_in(frame)

    def _send_main(self, kind: Kind, payload: list[Any] | None = None, *, call: int = 0,
                   meta: dict[str, Any] | None = None) -> None:
        self.main.send(self.main_codec.sign(kind, payload or [], call=call, meta=meta))

    # -- control thread ------------------------------------------------------------
    def _control_thread(self) -> None:
        """The control loop; should it ever end by an error, the rank exits:
        without it nobody answers heartbeats, interrupts or stacks, and the
        controller could only guess (liveness.py would call it busy)."""
        try:
            self._control_loop()
        except BaseException:
            print(f"monarch_nb rank {self.env.mesh_rank}: the control thread failed, exiting:\n"
                  f"{traceback.format_exc()}", file=sys.__stderr__, flush=True)
            os._exit(4)

    def _control_loop(self) -> None:
        ctl, env = self.ctl, self.env
        self._send_ctl(Kind.HELLO, meta={"pid": os.getpid(), "incarnation": env.incarnation,
                                         "host": os.uname().nodename})
        next_beat = next_metrics = 0.0
        said_loop = False
        health = HealthProbe()
        while True:
            busy = (self.running_call != 0 or self.output.pending or self.metrics.pending
                    or self.dbg.outbox)
            ready = ctl.poll(int(OUTPUT_FLUSH_S * 1000 if busy else HEARTBEAT_S * 500))
            now = time.monotonic()
            if ready:
                while True:
                    try:
                        msg = ctl.recv(self.ctl_codec, self.dropped) if ctl.poll(0) else None
                    except (zmq.ZMQError, EOFError, OSError):
                        return  # the channel is gone (the parent-death signal ends us)
                    if msg is None:
                        break
                    self.last_ping = now
                    try:
                        self._control(msg)
                    except Exception:  # one bad request must not end the control thread
                        print(f"monarch_nb rank {env.mesh_rank}: serving a {msg.kind.value} "
                              f"request failed:\n{traceback.format_exc()}", file=sys.__stderr__)
            # a kept mesh's rank with nobody listening keeps what it would send
            away = self.keeper is not None and kept.detached(now, self.last_ping)
            chunk = self.output.take_chunk()
            if chunk is not None:
                call, n, items = chunk
                if away:
                    assert self.keeper is not None
                    self.keeper.hold_output(call, {"n": -1}, [payloads.encode_output(items)])
                else:
                    self._send_ctl(Kind.OUTPUT, call=call, meta={"n": n},
                                   payload=[payloads.encode_output(items)])
            prompt = self.prompt_out
            if prompt is not None:  # after the output: the listing shows above the box
                self.prompt_out = None
                self._send_ctl(Kind.PROMPT, call=prompt[0], meta={"prompt": prompt[1]})
            outbox = self.dbg.outbox
            while outbox:  # the debugger's answers and events, after the output
                seq, cmd, ok, body, dcall = outbox.popleft()
                self._send_ctl(Kind.DEBUGGER_EVENT, call=dcall, meta={"seq": seq, "cmd": cmd, "ok": ok},
                               payload=[payloads.encode_debugger(body)])
            if now >= next_metrics:
                next_metrics = now + METRICS_FLUSH_S
                batch = self.metrics.take()  # (while away: only into the history)
                if batch is not None and not away:
                    call, n, points = batch
                    self._send_ctl(Kind.METRICS, call=call, meta={"n": n},
                                   payload=[encode_metrics(points)])
            # entering or leaving an mnb.elastic loop is said at once: the
            # controller decides by it whether a peer's death restarts this
            # rank (a script's group restart) or leaves it in place
            in_loop = _context.in_elastic_loop()
            if now >= next_beat or in_loop != said_loop:
                next_beat = now + HEARTBEAT_S
                if not away:
                    said_loop = in_loop
                    self._send_ctl(Kind.HEARTBEAT, meta={"busy": self.running_call,
                                                         "h": health.read(), "el": in_loop})
                # (a ping waiting unread is not silence: after a long GIL
                # hold by the main thread this thread runs on from where it
                # was, and the pings of the hold are still to be read)
                if now - self.last_ping > env.controller_timeout and not ctl.poll(0):
                    print(f"monarch_nb rank {env.mesh_rank}: controller silent for "
                          f"{env.controller_timeout:g} s, exiting", file=sys.__stderr__)
                    os._exit(3)
                if env.parent_pid and os.getppid() != env.parent_pid:
                    os._exit(3)

    def _control(self, msg: Message) -> None:
        if msg.kind == Kind.PING:
            if self.keeper is not None and msg.meta:
                self._kept_ping(dict(meta_of(msg, Kind.PING)))
        elif msg.kind == Kind.INTERRUPT:
            call = msg.call
            if call and meta_of(msg, Kind.INTERRUPT).get("leave"):
                self.leave_after = call  # (before the signal: the main thread reads it then)
            where = ""
            if self.running_call and (call == 0 or call == self.running_call):
                where = self.main_location()
                self.interrupt_call = self.running_call
                signal.pthread_kill(self.main_thread_id, signal.SIGINT)
            elif call and call not in self.finished:
                self.cancelled.add(call)  # not started yet: it will not run
                where = "queued, not started (cancelled)"
            self._send_ctl(Kind.INTERRUPTED, call=call, meta={"where": where})
        elif msg.kind == Kind.STOP:
            self.stopping = True
            if self.running_call:
                self.interrupt_call = self.running_call
                signal.pthread_kill(self.main_thread_id, signal.SIGINT)
            # The main thread leaves at once if idle (it also gets STOP); if it
            # is stuck in C code, do not wait for it.
            threading.Timer(2.0, lambda: self._exit(0)).start()
        elif msg.kind == Kind.STACKS:
            flight = meta_of(msg, Kind.STACKS).get("flight")  # also the recorder's newest records
            self._send_ctl(Kind.STACKS_REPLY, call=msg.call,
                           meta={"threads": debug.snapshot(self.main_thread_id),
                                 "busy": self.running_call},
                           payload=[payloads.encode_flight(flightrec.RECORDER.tail(int(flight)))]
                           if flight else None)
        elif msg.kind == Kind.INPUT:
            self.stdin.answer(str(meta_of(msg, Kind.INPUT).get("text", "")))
        elif msg.kind == Kind.DEBUGGER:
            dmeta = meta_of(msg, Kind.DEBUGGER)
            try:
                args = payloads.decode_debugger(msg.payload[0]) if msg.payload else {}
            except payloads.PayloadError:
                args = {}
            self.dbg.handle(int(dmeta.get("seq", 0)), str(dmeta.get("cmd", "")),
                            str(dmeta.get("thread", "live")), args)
        elif msg.kind == Kind.RELEASE:  # the controller mapped a result's segment
            tok = str(meta_of(msg, Kind.RELEASE).get("tok", ""))
            seg = self.segments.pop(tok, None)
            if seg is not None:
                seg.close()
            elif self.env.gpu_ipc:  # or the controller copied a CUDA result's tensor
                gpuipc.release(tok)

    def _kept_ping(self, meta: dict[str, Any]) -> None:
        """A kept mesh's PING (engine/kept.py): a new controller's first one
        is answered with HELLO (what runs, what was kept); ``resend`` sends
        what was kept; ``low`` / ``done`` let go of what it has."""
        keeper = self.keeper
        assert keeper is not None
        epoch = int(meta.get("ep", keeper.epoch))
        if epoch != keeper.epoch or meta.get("hi"):
            keeper.epoch = epoch
            if self.shm_peer is not None and meta.get("cp"):
                self.shm_peer = int(meta["cp"])  # the new controller's segments
            self._send_ctl(Kind.HELLO, meta={
                "pid": os.getpid(), "incarnation": self.env.incarnation,
                "host": os.uname().nodename, "running": self.running_call,
                "kept": keeper.kept_calls(), "what": keeper.labels(self.running_call)})
        if "low" in meta:
            keeper.done_with(int(meta["low"]), list(meta.get("done") or []))
        if meta.get("resend") and keeper.resent_epoch != epoch:
            keeper.resent_epoch = epoch
            for call, m, payload in keeper.take_outbox():
                self._send_ctl(Kind.OUTPUT, call=call, meta=m, payload=payload)
            for call, m, payload in keeper.take_results():
                self._send_ctl(Kind.RESULT, call=call, meta=m or None, payload=payload)
            history = self.metrics.history
            if history:
                self._send_ctl(Kind.METRICS, meta={"n": -1},
                               payload=[encode_metrics(list(history))])

    def _send_ctl(self, kind: Kind, *, call: int = 0, meta: dict[str, Any] | None = None,
                  payload: list[Any] | None = None) -> None:
        self.ctl.send(self.ctl_codec.sign(kind, payload or [], call=call, meta=meta))

    def main_location(self) -> str:
        frame = sys._current_frames().get(self.main_thread_id)
        return describe_frame(frame)

    def _ask_input(self, prompt: str) -> None:
        """Main thread, in RelayStdin.readline: the control thread sends it."""
        self.prompt_out = (self.running_call, prompt)

    def _exit(self, code: int) -> None:
        hook = getattr(self, "_exit_hook", None)
        if hook is not None and threading.current_thread() is threading.main_thread():
            hook()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code)  # skip atexit: torch.distributed teardown can hang on dead peers




def describe_frame(frame: Any) -> str:
    """Where a thread is, user code first: ``<mnb-cell-3> line 5 in f: time.sleep(9)``."""
    if frame is None:
        return "unknown"
    user = None
    inner = frame
    f = frame
    while f is not None:
        name = f.f_code.co_filename
        if name.startswith("<mnb-cell") and user is None:
            user = f
        f = f.f_back
    parts = []
    for fr in (inner, user) if user is not None and user is not inner else (inner,):
        line = linecache.getline(fr.f_code.co_filename, fr.f_lineno).strip()
        parts.append(f"{fr.f_code.co_filename} line {fr.f_lineno} in {fr.f_code.co_name}"
                     + (f": {line}" if line else ""))
    return " <- ".join(parts)


def _arm_parent_death() -> None:
    _set_parent_death_signal()
    parent = os.environ.get(config.ENV_PARENT_PID)
    if parent and os.getppid() != int(parent):
        os._exit(3)  # the controller died before we could arm the death signal


def main() -> None:
    _arm_parent_death()
    if os.environ.get(config.ENV_WARM):
        warm.serve()  # returns only in a rank it forked, made as a fresh one (warm.py)
        _arm_parent_death()  # a fork's is cleared; its parent is the requester now
    if os.environ.get(config.ENV_SPARE):
        spare.wait_for_assignment()  # torch imported ahead of need (spare.py)
    env = RankEnv.from_environ()
    os.environ.pop(config.ENV_LINK_FD, None)  # the fd is this process's, not its children's
    os.environ.pop(config.ENV_CTL_LINK_FD, None)
    worker = Worker(env)
    worker.start()
    profile_path = os.environ.get("MONARCH_NB_PROFILE")  # developer aid: cProfile the rank
    if profile_path:
        import cProfile

        prof = cProfile.Profile()
        worker._exit_hook = lambda: prof.dump_stats(f"{profile_path}.{env.rank}")  # type: ignore[attr-defined]
        prof.enable()
    worker.serve()


if __name__ == "__main__":
    main()
