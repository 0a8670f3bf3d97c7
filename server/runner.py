"""Running the app under Hypercorn from Python: in the foreground until a signal, or in a thread for tests.

Hypercorn speaks HTTP/1.1 and h2c (HTTP/2 over plain TCP, by prior knowledge or by upgrade). The
listening socket is bound here, so port 0 gives a free port whose number is known before serving.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import threading
from collections.abc import Callable
from typing import Any

from hypercorn.asyncio import serve as hypercorn_serve
from hypercorn.config import Config as HypercornConfig

from server.app import build_app
from server.config import ServerConfig
from server.state import ServerState

logger = logging.getLogger("jaxserve.server")
# Seconds Hypercorn gives open connections once the server itself has drained (or given up).
_GRACE_S = 2.0


def bind_socket(host: str, port: int) -> socket.socket:
    """A bound TCP socket (port 0 = any free port), ready to hand to Hypercorn."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind((host, port))
    return sock


def hypercorn_config(sock: socket.socket, config: ServerConfig | None = None) -> HypercornConfig:
    """Hypercorn's config over `sock` (whose file descriptor Hypercorn takes over): HTTPS and the root path as
    `config` says."""
    cfg = HypercornConfig()
    cfg.bind = [f"fd://{sock.detach()}"]
    if config is not None:
        cfg.certfile, cfg.keyfile, cfg.ca_certs = config.ssl_certfile, config.ssl_keyfile, config.ssl_ca_certs
        cfg.root_path = config.root_path
    cfg.accesslog = None  # the API middleware writes the access log
    cfg.errorlog = logging.getLogger("hypercorn.error")
    cfg.graceful_timeout = _GRACE_S
    cfg.include_server_header = False
    return cfg


class ServerThread:
    """Hypercorn serving `app` on 127.0.0.1 (or `host`) in a background thread with its own event loop."""

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0):
        self.app = app
        self._sock = bind_socket(host, port)
        self.host = host
        self.port = self._sock.getsockname()[1]
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, name="jaxserve-http", daemon=True)
        self._error: BaseException | None = None

    @property
    def url(self) -> str:
        """`http://host:port` (https with a certificate)."""
        return f"{scheme(self.config)}://{self.host}:{self.port}"

    @property
    def config(self) -> ServerConfig | None:
        """The server's config (HTTPS, root path), for jaxserve's app; None for another app (a router's)."""
        return getattr(getattr(getattr(self.app, "state", None), "server", None), "config", None)

    @property
    def state(self) -> ServerState:
        """The app's server state."""
        return self.app.state.server

    def _run(self) -> None:
        async def main() -> None:
            self._loop = asyncio.get_running_loop()
            self._stop = asyncio.Event()
            self._started.set()
            await hypercorn_serve(self.app, hypercorn_config(self._sock, self.config),
                                  shutdown_trigger=self._stop.wait)

        try:
            asyncio.run(main())
        except BaseException as e:
            self._error = e
            self._started.set()

    def start(self) -> ServerThread:
        """Start serving; returns once the loop runs (connections queue on the socket until accepted)."""
        self._sock.listen(512)
        self._thread.start()
        self._started.wait(10)
        if self._error is not None:
            raise RuntimeError("the HTTP server failed to start") from self._error
        return self

    def call(self, coro_fn: Callable[[], Any], timeout: float = 30.0) -> Any:
        """Run `coro_fn()` on the server's loop and return its result (e.g. `state.drain`)."""
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(coro_fn(), self._loop).result(timeout)

    def stop(self) -> None:
        """Shut Hypercorn down and join the thread."""
        if self._loop is not None and self._stop is not None and not self._loop.is_closed():
            try:
                self._loop.call_soon_threadsafe(self._stop.set)
            except RuntimeError:
                pass
        self._thread.join(timeout=10)

    def __enter__(self) -> ServerThread:
        return self.start() if not self._thread.is_alive() else self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def serve_in_thread(engine: Any, config: ServerConfig | None = None) -> ServerThread:
    """A started `ServerThread` over `engine` on a free port; use it as a context manager to stop it."""
    config = config or ServerConfig(port=0)
    return ServerThread(build_app(engine, config), config.host, config.port).start()


def run_server(config: ServerConfig, load_engine: Callable[[], Any], placeholder: Any) -> int:
    """Serve until SIGTERM/SIGINT, loading the engine in the background; the process exit code.

    `/health` answers at once; `/ready` and the API answer 503 until `load_engine()` returns. On the
    first signal the server stops admitting (503), waits up to `config.shutdown_timeout` for requests
    in flight, then stops; a second signal stops it at once.
    """
    state = ServerState(placeholder, config)
    app = build_app(placeholder, config, state=state)
    sock = bind_socket(config.host, config.port)
    sock.listen(2048)
    host, port = sock.getsockname()[:2]
    return asyncio.run(_serve(app, state, config, sock, load_engine, f"{scheme(config)}://{host}:{port}"))


def scheme(config: ServerConfig | None) -> str:
    return "https" if config is not None and config.ssl_certfile else "http"


async def _serve(app: Any, state: ServerState, config: ServerConfig, sock: socket.socket,
                 load_engine: Callable[[], Any], url: str) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    exit_code = 0

    async def drain_then_stop() -> None:
        logger.info("shutting down: draining %d request(s) for up to %.1f s", len(state.active),
                    config.shutdown_timeout)
        if not await state.drain(config.shutdown_timeout):
            logger.warning("shutdown timeout reached with %d request(s) in flight; aborting them",
                           len(state.active))
        stop.set()

    def on_signal() -> None:
        if state.draining:
            stop.set()
        else:
            asyncio.ensure_future(drain_then_stop())

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)

    def loaded(engine: Any, error: BaseException | None) -> None:
        nonlocal exit_code
        if error is not None:
            logger.error("loading the engine failed: %s", error, exc_info=error)
            exit_code = 1
            stop.set()
        elif stop.is_set() or state.draining:
            engine.shutdown()
        else:
            state.set_engine(engine)
            logger.info("ready: serving %s as %s", engine.model_name, ", ".join(state.served_names))

    def load() -> None:
        try:
            engine, error = load_engine(), None
        except BaseException as e:
            engine, error = None, e
        loop.call_soon_threadsafe(loaded, engine, error)

    # A daemon thread: a signal during a long load must not wait for it to finish.
    threading.Thread(target=load, name="jaxserve-load", daemon=True).start()
    logger.info("listening on %s", url)
    try:
        await hypercorn_serve(app, hypercorn_config(sock, config), shutdown_trigger=stop.wait)
    finally:
        state.engine.shutdown()
    logger.info("stopped")
    return exit_code
