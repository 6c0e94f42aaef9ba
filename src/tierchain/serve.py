"""``tierchain serve``: the gateway the ``TIERCHAIN_*`` variables describe, under uvicorn.

Needs the ``serve`` extra (``pip install 'tierchain[serve]'``: uvicorn). What
it does, in order:

1. reads the configuration (:func:`~tierchain.config.from_env`); a problem
   is printed and the exit status is 2;
2. configures logging, and only here (the library itself configures none):
   one line per event on stderr, text or JSON (``TIERCHAIN_LOG_FORMAT``),
   with httpx's and httpcore's own request lines (which carry full backend
   URLs) held at WARNING;
3. logs each configuration warning (``serve.config_warning``: what
   ``tierchain check-config`` warns about);
4. builds the whole stack (:func:`~tierchain.stack.build_stack`) around a
   Forwarder and binds the listening sockets: an address it cannot have (a
   port in use) is one ``serve.bind_failed`` line and exit status 1, before
   anything else is written; then serves it: lifespan start-up writes the
   ``tierchain.started`` identity line, then ``serve.listening`` says where;
5. on SIGTERM or SIGINT stops accepting connections, lets the requests in
   flight (streams included) finish for up to ``TIERCHAIN_DRAIN_TIMEOUT``
   seconds, then ends what is left (:class:`Drain`), closes the Forwarder
   (lifespan shut-down) and exits 0. A second SIGINT stops at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import logging.config
import math
import os
import signal
import socket
import sys
import threading
import traceback
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from types import FrameType
from typing import Any, TextIO

import uvicorn

from . import formats
from ._responses import send_json_error
from ._runtime import clock, deadlines
from ._types import ASGIApp, Message, Receive, Scope, Send
from .config import ConfigError, Settings, config_warnings, from_env
from .errors import CallerStalled
from .logs import mark_logged
from .request import TierRequest
from .sse import EVENT_STREAM, NDJSON_LINES, framing
from .stack import build_stack
from .telemetry import VERSION, log_event
from .wire import NDJSON, SSE, error_format, recognise

__all__ = ["Drain", "ServeOptions", "bind", "configure_logging", "run"]

_BACKSTOP = 2  # seconds past the drain deadline before uvicorn cancels what is left
_SHUTTING_DOWN = "the gateway is shutting down and could not finish this request in time"


@dataclass(frozen=True, slots=True)
class ServeOptions:
    """What ``tierchain serve`` reads from the ``TIERCHAIN_*`` serve variables."""

    host: str = "127.0.0.1"
    port: int = 8080
    drain_timeout: float = 25.0
    log_format: str = "text"
    log_level: str = "info"
    access_log: bool = False

    @classmethod
    def from_settings(cls, settings: Settings, **overrides: Any) -> ServeOptions:
        """The serve options in ``settings``; ``overrides`` that are not None win."""
        values = dict(settings.layers["serve"].options)
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)


def configure_logging(log_format: str = "text", level: str = "info") -> None:
    """One line per event on stderr, for tierchain, uvicorn and anything that warns.

    ``tierchain`` logs at ``level``; ``uvicorn.error`` and ``uvicorn.access`` at
    INFO (or ``level``, when higher); ``httpx`` and ``httpcore`` at WARNING, so
    their request lines, which print whole backend URLs, stay out; the root
    logger at WARNING. The access log's request targets are masked (``?key=***``:
    :class:`tierchain.logs.MaskAccessLog`).
    """
    formatter = f"tierchain.logs.{'Json' if log_format == 'json' else 'Text'}Formatter"
    level_name = level.upper()
    server_level = max(logging.INFO, logging.getLevelName(level_name))
    logging.config.dictConfig(
        {
            "version": 1,
            "disable_existing_loggers": False,
            "formatters": {"line": {"()": formatter}},
            "filters": {
                "mask": {"()": "tierchain.logs.MaskAccessLog"},
                "logged": {"()": "tierchain.logs.DropLoggedErrors"},
            },
            "handlers": {
                "stderr": {
                    "class": "logging.StreamHandler",
                    "formatter": "line",
                    "stream": "ext://sys.stderr",
                }
            },
            "loggers": {
                "tierchain": {"level": level_name},
                "uvicorn": {"level": server_level},
                "uvicorn.error": {"level": server_level, "filters": ["logged"]},
                "uvicorn.access": {"level": server_level, "filters": ["mask"]},
                "httpx": {"level": "WARNING"},
                "httpcore": {"level": "WARNING"},
            },
            "root": {"level": "WARNING", "handlers": ["stderr"]},
        }
    )


class Drain:
    """Track the requests in flight, and end each one cleanly when the drain deadline passes.

    Until :meth:`start` is called nothing changes. After it, a request still
    running at the deadline is cancelled inside and answered the way clients
    understand: a 503 JSON error when nothing was sent yet, an error event
    (``data: {"error": {...}}``) after the last whole event of a stream that
    had started. A started response that is not a stream can only be cut.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self._running: set[asyncio.Timeout] = set()
        self._deadline: float | None = None

    @property
    def in_flight(self) -> int:
        """The HTTP requests running now."""
        return len(self._running)

    def start(self, seconds: float) -> None:
        """From now on, every request (running or new) ends at most ``seconds`` from now."""
        self._deadline = asyncio.get_running_loop().time() + seconds
        for timeout in self._running:
            timeout.reschedule(self._deadline)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = ended = False
        stream = 0

        async def watched(message: Message) -> None:
            nonlocal started, stream, ended
            if message["type"] == "http.response.start":
                started = True
                headers = message.get("headers", ())
                kind = framing(headers)
                stream = SSE if kind == EVENT_STREAM else NDJSON if kind == NDJSON_LINES else 0
            elif message["type"] == "http.response.body" and not message.get("more_body"):
                ended = True
            await send(message)

        timeout = asyncio.timeout(self._deadline)
        self._running.add(timeout)
        try:
            async with timeout:
                await self.app(scope, receive, watched)
        except TimeoutError as exc:
            if not timeout.expired():
                return await self._failed(scope, send, exc, started)  # the app's own
            log_event(
                "serve.request_cut",
                logging.WARNING,
                path=scope["path"][:200],
                started=started,
                stream=bool(stream),
            )
            if ended:
                return
            if not started:
                await send_json_error(
                    send,
                    503,
                    _SHUTTING_DOWN,
                    "server_error",
                    "shutting_down",
                    headers=[(b"connection", b"close")],
                    wire=error_format(scope["path"]),
                )
            elif stream:  # the error in the request's own wire format
                req = TierRequest.find(scope)
                wire = (req.wire if req is not None else None) or recognise(scope["path"])
                fmt = formats.of(wire)
                body = fmt.error_bytes(stream, _SHUTTING_DOWN, "server_error", "shutting_down")
                await send({"type": "http.response.body", "body": body, "more_body": False})
            else:
                mark_logged(exc)  # (serve.request_cut said it; the server drops the connection)
                raise
        except Exception as exc:
            await self._failed(scope, send, exc, started)
        finally:
            self._running.discard(timeout)

    @staticmethod
    async def _failed(scope: Scope, send: Send, exc: Exception, started: bool) -> None:
        """An unexpected exception (or a caller cut for not reading): one tierchain event,
        never the server's own traceback (its record is dropped by
        :class:`tierchain.logs.DropLoggedErrors`: the exception is marked logged)."""
        if not isinstance(exc, CallerStalled):  # (counted and logged where it was cut)
            log_event(
                "serve.app_error",
                logging.ERROR,
                path=scope["path"][:200],
                error=repr(exc)[:500],
                started=started,
                traceback="".join(traceback.format_exception(exc))[-8000:],
            )
        mark_logged(exc)
        if started:
            raise exc  # the server drops the connection: the only end a started answer has
        await send_json_error(
            send,
            500,
            "the gateway failed to answer this request",
            "server_error",
            "internal_error",
            headers=[(b"connection", b"close")],
            wire=error_format(scope["path"]),
        )


_TICK = 1.0
"""Seconds between the server's own checks (uvicorn's ``Date`` header, its request limit):
uvicorn makes them ten times a second, which is most of what an idle gateway holding
parked streams costs; its ``Date`` header changes once a second anyway."""


# Overrides uvicorn.Server methods that are public but undocumented (capture_signals,
# handle_exit, startup, shutdown, main_loop, should_exit): a deliberate divergence, see
# docs/internals.md; tests/test_dependency_internals.py fails if they move.
class _Server(uvicorn.Server):
    """uvicorn's server, with tierchain's start and stop events, a clean exit on a signal,
    and one wake a second for its own checks instead of ten.

    It overrides uvicorn's ``main_loop`` and ``should_exit`` (public attributes of
    ``uvicorn.Server``, not documented API; tests/test_serve.py and
    tests/test_dependency_internals.py hold them to it): the loop
    waits a second between ``on_tick`` calls, and setting ``should_exit`` (a signal, the
    lifespan, a test) wakes it at once, so a stop is as prompt as uvicorn's own.
    """

    def __init__(
        self, config: uvicorn.Config, *, drain: Drain, drain_timeout: float, keys_on: bool = True
    ) -> None:
        self._exit = False
        self._tick_loop: asyncio.AbstractEventLoop | None = None
        self._tick: asyncio.Future[None] | None = None
        super().__init__(config)
        self.drain = drain
        self.drain_timeout = drain_timeout
        self.keys_on = keys_on
        self.signal_name: str | None = None

    @property
    def should_exit(self) -> bool:
        return self._exit

    @should_exit.setter
    def should_exit(self, value: bool) -> None:
        self._exit = value
        loop = self._tick_loop
        if value and loop is not None:
            with contextlib.suppress(RuntimeError):  # (a loop already closed: nothing waits)
                loop.call_soon_threadsafe(self._end_tick)

    def _end_tick(self) -> None:
        tick = self._tick
        if tick is not None and not tick.done():
            tick.set_result(None)

    async def main_loop(self) -> None:
        loop = asyncio.get_running_loop()
        self._tick_loop = loop
        counter = 0  # (uvicorn refreshes its Date header when the counter is a multiple of 10)
        try:
            while not await self.on_tick(counter):
                counter = (counter + 10) % 864000
                self._tick = tick = loop.create_future()
                timer = deadlines.schedule(_TICK, self._end_tick)  # (the package's one timer)
                try:
                    await tick
                finally:
                    deadlines.cancel(timer)
                    self._tick = None
        finally:
            self._tick_loop = None

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # uvicorn's own version raises the signal again once it has shut down,
        # so the process dies of it; a gateway that drained cleanly exits 0.
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        handled = (signal.SIGINT, signal.SIGTERM)
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.signal_name is None:
            self.signal_name = signal.Signals(sig).name
        super().handle_exit(sig, frame)

    async def startup(self, sockets: Any = None) -> None:
        await super().startup(sockets=sockets)
        if not self.started:
            return
        addresses = [
            _address(sock.getsockname()) for server in self.servers for sock in server.sockets
        ]
        log_event(
            "serve.listening",
            logging.INFO,
            addresses=addresses,
            pid=os.getpid(),
            drain_timeout_s=self.drain_timeout,
        )
        if not self.keys_on:  # once it listens: a gateway that never ran is open to nobody
            log_event(
                "serve.keys_off",
                logging.WARNING,
                warning="no caller keys are set: anyone who can reach "
                + ", ".join(addresses)
                + " may use every route; set TIERCHAIN_API_KEYS or TIERCHAIN_API_KEYS_FILE",
            )

    async def shutdown(self, sockets: Any = None) -> None:
        for server in self.servers:
            server.close()  # stop accepting before saying so (uvicorn closes them again)
        log_event(
            "serve.draining",
            logging.INFO,
            signal=self.signal_name,
            in_flight=self.drain.in_flight,
            drain_timeout_s=self.drain_timeout,
        )
        self.drain.start(self.drain_timeout)
        started = clock.now()
        await super().shutdown(sockets=sockets)
        log_event("serve.stopped", logging.INFO, took_s=round(clock.now() - started, 3))


def _address(name: Any) -> str:
    if isinstance(name, tuple):
        host, port = name[0], name[1]
        return f"[{host}]:{port}" if ":" in str(host) else f"{host}:{port}"
    return str(name)


def run(
    *,
    host: str | None = None,
    port: int | None = None,
    environ: Mapping[str, str] | None = None,
    err: TextIO | None = None,
) -> int:
    """Serve the configured gateway until SIGTERM or SIGINT; return the exit status.

    ``host`` and ``port`` override ``TIERCHAIN_HOST`` and ``TIERCHAIN_PORT``.
    0: stopped by a signal; 1: it could not start; 2: a configuration problem.
    """
    err = sys.stderr if err is None else err
    try:
        settings = from_env(os.environ if environ is None else environ)
        options = ServeOptions.from_settings(settings, host=host, port=port)
    except ConfigError as exc:
        _print_problems(exc, err)
        return 2
    configure_logging(options.log_format, options.log_level)
    for warning in config_warnings(settings):
        log_event("serve.config_warning", logging.WARNING, warning=warning)
    try:
        drain = Drain(build_stack(None, settings))
    except ConfigError as exc:
        _print_problems(exc, err)
        return 2
    try:
        sockets = bind(options.host, options.port)
    except OSError as exc:
        log_event(
            "serve.bind_failed",
            logging.ERROR,
            address=_address((options.host, options.port)),
            error=str(exc),
        )
        return 1
    config = uvicorn.Config(
        drain,
        host=options.host,
        port=options.port,
        lifespan="on",
        log_config=None,
        access_log=options.access_log,
        # Drain ends every request at the deadline; uvicorn's own cut is the backstop.
        timeout_graceful_shutdown=math.ceil(options.drain_timeout) + _BACKSTOP,
        http=_http_protocol(),
    )
    server = _Server(
        config, drain=drain, drain_timeout=options.drain_timeout, keys_on=settings.keys_on
    )
    try:
        server.run(sockets=sockets)
    except SystemExit as exc:  # uvicorn exits when the app fails to start
        return 1 if exc.code else 0
    finally:
        for sock in sockets:
            sock.close()
    return 0 if server.started else 1


def bind(host: str, port: int) -> list[socket.socket]:
    """Bound (not yet listening) sockets for every address ``host`` resolves to, as
    asyncio's ``create_server(host=..., port=...)`` would bind them; OSError if any fails.

    Binding comes before the app's lifespan start-up, so that a port in use is
    one clear error and no ``tierchain.started`` line for a gateway that never ran.
    """
    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in dict.fromkeys(infos):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
            sock.set_inheritable(True)
    except OSError:
        for sock in sockets:
            sock.close()
        raise
    return sockets


def _http_protocol() -> Any:
    """httptools without trailer fields when it is installed (as uvicorn's ``auto``), else h11."""
    try:
        from .httptools_protocol import HttpToolsWithoutTrailers
    except ImportError:
        return "h11"
    return HttpToolsWithoutTrailers


def _print_problems(exc: ConfigError, err: TextIO) -> None:
    print(f"tierchain {VERSION}: {len(exc.problems)} configuration problem(s):", file=err)
    for problem in exc.problems:
        print(f"  - {problem}", file=err)
