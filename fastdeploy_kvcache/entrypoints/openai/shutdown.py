"""Graceful shutdown on SIGTERM and SIGINT, whatever the dependencies do to signal handlers.

Process managers (systemd, Kubernetes, docker) stop a service with SIGTERM and a person at
a terminal sends SIGINT; both get the same treatment here:

1. The listening socket closes at once (new connections are refused) and idle keep-alive
   connections are closed (uvicorn's own shutdown does both).
2. In-flight requests, streamed or not, queued in the engine or running, may finish for
   ``REQUEST_SHARE`` of the grace period (``--graceful-shutdown-timeout``).  Those still
   running then are aborted in the engine: a stream ends with ``finish_reason: "abort"``
   and ``data: [DONE]``, a non-streamed request answers with what it has.  A second
   signal aborts them at once.
3. The engine shuts down with whatever is left of the grace period (at least
   ``ENGINE_MIN_S``): it aborts what is left, finishes its copies and lets the storage tier
   write what it owes.
4. The process exits 0 (uvicorn would re-raise the signal and exit -15 or with a
   KeyboardInterrupt trace; a stop that was asked for and done is a success), through
   :func:`exit_process`: once everything is closed, the interpreter's teardown of the
   native libraries (the KV pools, the model) only costs time.

Why the handlers need guarding: ``import paddleformers`` calls
``paddle.disable_signal_handler()``, which resets SIGTERM to the default action *in C*,
after uvicorn installed its handler (the engine, hence paddleformers, is imported in the
app's lifespan).  Python's ``signal.getsignal`` still reports the old handler then, so
:class:`SignalGuard` reads the kernel's disposition (``sigaction``) and reinstalls the
handler whenever something (that import, or any other library) replaced it, logging once per
signal what the replacement was: a Python function, a disposition, or the shared library
whose C function it is.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import ctypes
import ctypes.util
import logging
import os
import signal
import sys
import threading
import time
from typing import Any, Callable, Generator, NoReturn, Optional

import uvicorn

logger = logging.getLogger(__name__)

DEFAULT_GRACE_S = 20.0
# Share of the grace period that in-flight requests may use; the engine gets the rest.
REQUEST_SHARE = 0.75
# The engine's shutdown gets at least this long, even when the requests used everything.
ENGINE_MIN_S = 1.0
# After the in-flight requests are aborted, how long their responses have to send their
# last chunk before uvicorn cancels what is left.
SETTLE_S = 2.0
# How often the guard checks the handlers (a dependency's reset is undone within this).
GUARD_INTERVAL_S = 0.1

HANDLED_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class ShutdownPlan:
    """The grace period's clock, shared by the server (signals, draining) and the app (engine).

    Args:
        grace_s: the whole shutdown's budget, from the first signal to the engine's end.
        clock: monotonic seconds (a parameter so the arithmetic can be tested alone).
    """

    def __init__(self, grace_s: float = DEFAULT_GRACE_S, clock: Callable[[], float] = time.monotonic) -> None:
        if not grace_s >= 0:
            raise ValueError(f"--graceful-shutdown-timeout: must be >= 0 seconds, got {grace_s!r}")
        self.grace_s = float(grace_s)
        self.clock = clock
        self.started_at: Optional[float] = None
        self.reason = "shutdown"
        self._abort_hooks: list[Callable[[], int]] = []

    def begin(self, reason: str = "shutdown") -> bool:
        """Start the clock (first call only); True if this call started it."""
        if self.started_at is not None:
            return False
        self.started_at = self.clock()
        self.reason = reason
        return True

    @property
    def abort_at(self) -> float:
        """When in-flight requests still running are aborted."""
        start = self.clock() if self.started_at is None else self.started_at
        return start + REQUEST_SHARE * self.grace_s

    @property
    def deadline(self) -> float:
        start = self.clock() if self.started_at is None else self.started_at
        return start + self.grace_s

    def engine_budget(self) -> float:
        """Seconds the engine's shutdown may take: what is left of the grace period."""
        return max(ENGINE_MIN_S, self.deadline - self.clock())

    def on_abort(self, hook: Callable[[], int]) -> None:
        """``hook()`` aborts the in-flight requests and returns how many it aborted."""
        self._abort_hooks.append(hook)

    def abort_inflight(self) -> int:
        total = 0
        for hook in self._abort_hooks:
            try:
                total += int(hook())
            except Exception:  # noqa: BLE001 - shutting down anyway
                logger.exception("aborting the in-flight requests failed")
        return total


# ---------------------------------------------------------------------- signal guard
class _Sigaction(ctypes.Structure):
    # Only the handler (the first member of struct sigaction on Linux) is read; the buffer
    # is larger than any libc's struct.
    _fields_ = [("handler", ctypes.c_void_p), ("rest", ctypes.c_byte * 256)]


def _libc_sigaction() -> Optional[Any]:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.sigaction
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.POINTER(_Sigaction)]
    fn.restype = ctypes.c_int
    return fn


class _DlInfo(ctypes.Structure):
    _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p),
                ("dli_sname", ctypes.c_char_p), ("dli_saddr", ctypes.c_void_p)]


def _code_at(address: int) -> Optional[str]:
    """``libfoo.so (symbol)``: the shared object (and symbol, when exported) holding
    ``address``, from ``dladdr``; None where it cannot say."""
    try:
        dladdr = ctypes.CDLL(None).dladdr
    except (OSError, AttributeError):
        return None
    dladdr.argtypes = [ctypes.c_void_p, ctypes.POINTER(_DlInfo)]
    dladdr.restype = ctypes.c_int
    info = _DlInfo()
    if not dladdr(address, ctypes.byref(info)) or not info.dli_fname:
        return None
    where = os.path.basename(info.dli_fname.decode(errors="replace")) or "the main program"
    return f"{where} ({info.dli_sname.decode(errors='replace')})" if info.dli_sname else where


def describe_kernel_handler(address: Optional[int]) -> str:
    """What a disposition set outside Python is, for the log: the default action, ignore, or
    the C function (and the library it is in) that now handles the signal."""
    if address is None:
        return "an unknown handler (sigaction cannot be read here)"
    if address == int(signal.SIG_DFL):
        return "the default action (SIG_DFL), set from C outside Python"
    if address == int(signal.SIG_IGN):
        return "ignore (SIG_IGN), set from C outside Python"
    where = _code_at(address)
    return f"a C handler in {where}" if where else f"a C handler at {address:#x} (in no loaded library)"


def describe_python_handler(handler: Any) -> str:
    """What ``signal.getsignal`` returned, for the log: a function by module and name, or a
    disposition."""
    if handler is None:
        return "a handler installed outside Python"
    if handler == signal.SIG_DFL:
        return "the default action (SIG_DFL), set through Python's signal module"
    if handler == signal.SIG_IGN:
        return "ignore (SIG_IGN), set through Python's signal module"
    func = getattr(handler, "__func__", handler)
    module = getattr(func, "__module__", None) or "?"
    name = getattr(func, "__qualname__", None) or repr(handler)
    return f"Python's {module}.{name}"


class SignalGuard:
    """Keeps ``handler`` installed for SIGINT and SIGTERM while the server runs.

    Reads the kernel's handler of each signal every ``GUARD_INTERVAL_S`` and reinstalls
    ours when it changed (a C library can reset it without Python noticing), logging what
    had replaced it.  Where
    ``sigaction`` cannot be called, reinstalls unconditionally at the same rate.
    """

    def __init__(self, handler: Callable[[int, Any], None],
                 started: Callable[[], bool] = lambda: True) -> None:
        self.handler = handler
        # NOTE: a reset while the server starts is expected (the engine and its libraries are
        # imported in the lifespan; paddleformers' import resets SIGTERM): logged at DEBUG, so a
        # clean start-up stays quiet. One after start-up is a surprise, and a WARNING. Either
        # names what replaced the handler (a Python function, a disposition, or the C library
        # whose function it is), never a guess at who did it.
        self._started = started
        self._sigaction = _libc_sigaction()
        self._kernel_handler: dict[int, Optional[int]] = {}
        self._warned: set[int] = set()

    def _kernel(self, sig: int) -> Optional[int]:
        if self._sigaction is None:
            return None
        old = _Sigaction()
        if self._sigaction(int(sig), None, ctypes.byref(old)) != 0:
            return None
        return int(old.handler or 0)

    def install(self) -> dict[int, Any]:
        """Install the handler; returns the previous Python-level handlers."""
        previous = {sig: signal.signal(sig, self.handler) for sig in HANDLED_SIGNALS}
        self._kernel_handler = {sig: self._kernel(sig) for sig in HANDLED_SIGNALS}
        return previous

    def check(self) -> None:
        """Reinstall the handler of any signal whose handler something replaced."""
        for sig in HANDLED_SIGNALS:
            expected = self._kernel_handler.get(sig)
            current = self._kernel(sig)
            python_handler = signal.getsignal(sig)
            replaced = python_handler != self.handler or expected is None or current != expected
            if not replaced:
                continue
            if python_handler != self.handler:
                by = describe_python_handler(python_handler)
            else:
                by = describe_kernel_handler(current)
            signal.signal(sig, self.handler)
            self._kernel_handler[sig] = self._kernel(sig)
            if expected is not None and sig not in self._warned:
                started = self._started()
                if started:
                    self._warned.add(sig)
                logger.log(logging.WARNING if started else logging.DEBUG,
                           "%s's handler was replaced by %s; the graceful-shutdown handler is installed again",
                           signal.Signals(sig).name, by)

    async def run(self) -> None:
        while True:
            self.check()
            await asyncio.sleep(GUARD_INTERVAL_S)


def exit_process(status: int) -> NoReturn:
    """Leave the process now with ``status``: the ``atexit`` handlers run, the log and the
    standard streams are flushed, then ``os._exit``.

    For the end of a server's or router's ``main``, once its stop closed everything it owns
    (engine, storage tier, sockets).  What it skips is the interpreter's final teardown:
    garbage-collecting every module, which frees the KV pools and the weights tensor by
    tensor (with a host tier that Paddle pinned page by page this was most of an idle
    server's stop) and unloads native libraries whose own threads may still run.
    """
    try:
        atexit._run_exitfuncs()
        logging.shutdown()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 - a closed stream: nothing left to flush
                pass
        os._exit(status)


# ---------------------------------------------------------------------- server
class GracefulServer(uvicorn.Server):
    """uvicorn's server with the shutdown described in the module docstring."""

    def __init__(self, config: uvicorn.Config, plan: ShutdownPlan, then: str = "the engine shuts down",
                 on_serving: Optional[Callable[[], None]] = None) -> None:
        super().__init__(config)
        self.plan = plan
        self.then = then  # what follows the drain, for the log line
        self.on_serving = on_serving  # called once the port is bound (the "serving on" line)
        self.signals_received: list[int] = []

    async def startup(self, sockets: Optional[list[Any]] = None) -> None:
        await super().startup(sockets)
        if self.started and self.on_serving is not None:
            self.on_serving()

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        # Signals can only be handled on the main thread (tests may serve from another).
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        guard = SignalGuard(self.handle_exit, started=lambda: self.started)
        previous = guard.install()
        task = asyncio.get_running_loop().create_task(guard.run())
        try:
            yield
        finally:
            task.cancel()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        # Unlike uvicorn, no re-raise of the signal: the stop it asked for is done.

    def handle_exit(self, sig: int, frame: Any) -> None:
        # A signal handler: set flags only (logging or locks here could deadlock).
        self.signals_received.append(int(sig))
        self.should_exit = True

    async def shutdown(self, sockets: Optional[list[Any]] = None) -> None:
        names = [signal.Signals(s).name for s in self.signals_received]
        self.plan.begin(names[0] if names else "shutdown")
        logger.info("%s: refusing new connections; in-flight requests may finish for %.1f s "
                    "(--graceful-shutdown-timeout %.1f s; a second signal ends them now), then %s",
                    self.plan.reason, max(0.0, self.plan.abort_at - time.monotonic()), self.plan.grace_s, self.then)
        # uvicorn waits for the connections this long, then cancels their tasks.
        self.config.timeout_graceful_shutdown = max(0.0, self.plan.abort_at - time.monotonic()) + SETTLE_S
        ender = asyncio.ensure_future(self._end_inflight_when_due())
        try:
            await super().shutdown(sockets)
        finally:
            ender.cancel()

    async def _end_inflight_when_due(self) -> None:
        first_signals = len(self.signals_received)
        while time.monotonic() < self.plan.abort_at and len(self.signals_received) <= first_signals:
            await asyncio.sleep(0.05)
        why = ("grace period spent" if time.monotonic() >= self.plan.abort_at
               else f"{signal.Signals(self.signals_received[-1]).name} again")
        n = self.plan.abort_inflight()
        if n:
            logger.warning("%s: ending %d in-flight request(s) (they finish with reason 'abort')", why, n)


async def run_bounded(fn: Callable[[float], None], budget_s: float, what: str) -> bool:
    """Run ``fn(budget_s)`` on a daemon thread and wait for it up to ``budget_s`` (+1 s).

    A daemon thread, not the default executor: a shutdown stuck past its budget must not
    hold the process at exit (the executor's threads are joined then).  True if it ended.
    """
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()

    def settle(error: Optional[BaseException]) -> None:
        if not done.done():
            done.set_result(None) if error is None else done.set_exception(error)

    def target() -> None:
        error: Optional[BaseException] = None
        try:
            fn(budget_s)
        except BaseException as exc:  # noqa: BLE001 - reported on the loop
            error = exc
        try:
            loop.call_soon_threadsafe(settle, error)
        except RuntimeError:  # the loop is closed: nobody waits for it any more
            pass

    threading.Thread(target=target, name=f"fdkv-{what.replace(' ', '-')}", daemon=True).start()
    try:
        await asyncio.wait_for(asyncio.shield(done), budget_s + 1.0)
        return True
    except asyncio.TimeoutError:
        logger.error("%s did not finish within %.1f s; exiting without it", what, budget_s)
    except Exception:  # noqa: BLE001 - shutting down anyway
        logger.exception("%s failed", what)
    return False
