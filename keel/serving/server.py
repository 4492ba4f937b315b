"""``keel serve``: REST and gRPC on one event loop over one model repository.

:class:`Server` loads the repository, listens (ports 0 pick free ones), and on
SIGTERM or :meth:`Server.stop` stops taking requests, lets the ones in flight
finish, then exits. Metrics are Prometheus text at ``/metrics``.
"""

from __future__ import annotations

import asyncio
import hmac
import signal
import socket
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from keel.errors import InvalidArgumentError
from keel.inference_protocol import Limits
from keel.serving.repository import ModelOptions, Repository

__all__ = ["Server", "ServerConfig", "ServerState"]

EXTENSIONS = ["binary_tensor_data", "model_repository", "metrics"]


@dataclass(frozen=True)
class ServerConfig:
    """Where the server listens, what it serves and what it allows."""

    repository: str
    host: str = "127.0.0.1"
    http_port: int = 8000
    grpc_port: int = 8001
    options: ModelOptions = field(default_factory=ModelOptions)
    limits: Limits = field(default_factory=Limits)
    auth_token: str | None = None
    drain_timeout_s: float = 30.0
    reuse_port: bool = False            # several worker processes share the ports

    @staticmethod
    def read_token(path: str | Path) -> str:
        try:
            token = Path(path).read_text().strip()
        except OSError as exc:
            raise InvalidArgumentError(f"cannot read the auth token file {str(path)!r}: "
                                       f"{exc.strerror}") from None
        if not token:
            raise InvalidArgumentError(f"the auth token file {str(path)!r} is empty")
        return token


class ServerState:
    """What both protocols share: the repository, the limits, auth and metrics."""

    def __init__(self, config: ServerConfig) -> None:
        from keel.serving.metrics import Metrics

        self.config = config
        self.limits = config.limits
        self.metrics = Metrics()
        self.repo = Repository(config.repository, config.options, self.metrics.observe_batch)
        self.ready = False

    def authorized(self, header: str | None) -> bool:
        token = self.config.auth_token
        if token is None:
            return True
        expected = f"Bearer {token}".encode()
        return header is not None and hmac.compare_digest(header.encode(), expected)

    def server_metadata(self) -> dict[str, Any]:
        from keel import __version__

        return {"name": "keel", "version": __version__, "extensions": list(EXTENSIONS)}

    def observe_request(self, model: str, protocol: str, seconds: float) -> None:
        self.metrics.observe_request(model, protocol, seconds)

    def count_failure(self, model: str, protocol: str, reason: str) -> None:
        # Only served names become labels: a client cannot grow the metrics with made-up ones.
        known = model if any(m.name == model for m in self.repo.models) else ""
        self.metrics.count_failure(known, protocol, reason)

    def metrics_text(self) -> tuple[bytes, str]:
        return self.metrics.render()


class Server:
    """One serving process. ``run()`` blocks; ``start_in_thread()`` serves in the background."""

    def __init__(self, config: ServerConfig, log: Any = print) -> None:
        self.config = config
        self.state = ServerState(config)
        self.http_port: int | None = None
        self.grpc_port: int | None = None
        self._log = log
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._started = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    # ---- running -----------------------------------------------------------
    def run(self, handle_signals: bool = True) -> None:
        asyncio.run(self.serve(handle_signals))

    def start_in_thread(self, timeout_s: float = 120.0) -> Server:
        self._thread = threading.Thread(target=self._run_thread, name="keel-serve",
                                        daemon=True)
        self._thread.start()
        if not self._started.wait(timeout_s) or self._error is not None:
            raise self._error or RuntimeError("the server did not start in time")
        return self

    def _run_thread(self) -> None:
        try:
            asyncio.run(self.serve(handle_signals=False))
        except BaseException as exc:
            self._error = exc
            self._started.set()

    def stop(self) -> None:
        """Stop taking requests, finish those in flight, then return."""
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        if self._thread is not None:
            self._thread.join(self.config.drain_timeout_s + 10)

    async def serve(self, handle_signals: bool = True) -> None:
        import grpc

        from keel.serving.grpc_service import add_service
        from keel.serving.http import build_app

        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        state = self.state
        await state.repo.load_all()
        sock = _listen(self.config.host, self.config.http_port, self.config.reuse_port)
        self.http_port = sock.getsockname()[1]
        limit = self.config.limits.max_body_bytes
        grpc_server = grpc.aio.server(options=[("grpc.max_receive_message_length", limit),
                                               ("grpc.max_send_message_length", -1),
                                               ("grpc.so_reuseport", int(self.config.reuse_port))])
        add_service(grpc_server, state)
        self.grpc_port = grpc_server.add_insecure_port(f"{self.config.host}:"
                                                       f"{self.config.grpc_port}")
        await grpc_server.start()
        http = _uvicorn_server(build_app(state))
        http_task = asyncio.create_task(http.serve(sockets=[sock]))
        while not http.started and not http_task.done():
            await asyncio.sleep(0.01)
        if handle_signals:
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._loop.add_signal_handler(sig, self._stop.set)
        state.ready = True
        self._announce()
        self._started.set()
        await self._stop.wait()
        self._log("keel serve: draining requests in flight, then exiting")
        state.ready = False
        http.should_exit = True
        await asyncio.gather(grpc_server.stop(self.config.drain_timeout_s), http_task)
        await state.repo.close()
        sock.close()

    def _announce(self) -> None:
        host = self.config.host
        self._log(f"keel serve: HTTP  http://{host}:{self.http_port}  (Open Inference "
                  f"Protocol v2, metrics at /metrics)")
        self._log(f"keel serve: gRPC  {host}:{self.grpc_port}")
        for served in self.state.repo.models:
            self._log(f"keel serve: model {served.plan_summary()}")
        if self.config.auth_token is not None:
            self._log("keel serve: bearer-token auth on (health checks stay open)")


def _uvicorn_server(app: Any) -> Any:
    """uvicorn's server for ``app``, without uvicorn's own signal handling (ours runs the
    drain)."""
    import contextlib

    import uvicorn

    class Quiet(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Any:
            yield

    return Quiet(uvicorn.Config(app, log_level="warning", lifespan="off",
                                timeout_graceful_shutdown=None))


def _listen(host: str, port: int, reuse_port: bool) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port and hasattr(socket, "SO_REUSEPORT"):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise InvalidArgumentError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    sock.listen(1024)
    sock.setblocking(False)
    return sock
