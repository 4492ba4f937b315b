"""``keel serve MODEL_OR_REPOSITORY``: the Open Inference Protocol over REST and gRPC."""

from __future__ import annotations

import signal
import subprocess
import sys
from types import FrameType

import typer

from keel.errors import InvalidArgumentError

__all__ = ["register", "serve_command"]


def register(app: typer.Typer) -> None:
    app.command("serve")(serve_command)


def serve_command(
    repository: str = typer.Argument(..., metavar="MODEL_OR_REPOSITORY",
                                      help="A model file, or a folder of models."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on."),
    http_port: int = typer.Option(8000, "--http-port", min=0, help="REST port (0: any free)."),
    grpc_port: int = typer.Option(8001, "--grpc-port", min=0, help="gRPC port (0: any free)."),
    max_batch_size: int = typer.Option(
        8, "--max-batch-size", min=1,
        help="Most rows dynamic batching puts in one batch (1: each request runs alone)."),
    max_queue_delay_ms: float = typer.Option(
        2.0, "--max-queue-delay-ms", min=0.0,
        help="Longest a request waits for others to fill its batch."),
    auth_token_file: str | None = typer.Option(
        None, "--auth-token-file", help="A file holding the bearer token clients must send."),
    workers: int = typer.Option(1, "--workers", min=1,
                                help="Server processes sharing the ports (fixed ports only)."),
    backend: str = typer.Option("auto", "--backend", help="Backend the models run on."),
    hint: str = typer.Option("none", "--hint",
                             help="Performance hint the models are planned with "
                                  "(none, latency or throughput): how a batch is split."),
    max_body_bytes: int = typer.Option(64 * 1024 * 1024, "--max-body-bytes", min=1,
                                       help="Largest request body accepted."),
    max_tensor_elements: int = typer.Option(16 * 1024 * 1024, "--max-tensor-elements", min=1,
                                            help="Most elements one tensor may hold."),
    request_timeout_s: float = typer.Option(60.0, "--request-timeout-s", min=0.001,
                                            help="Longest one request may take."),
    reuse_port: bool = typer.Option(False, "--reuse-port", hidden=True),
) -> None:
    """Serve MODEL_OR_REPOSITORY over the Open Inference Protocol (KServe v2)."""
    from keel.serving import require_serve_packages

    require_serve_packages()
    if workers > 1:
        _run_workers(workers, http_port, grpc_port)
        return
    from keel.inference_protocol import Limits
    from keel.serving.repository import ModelOptions
    from keel.serving.server import Server, ServerConfig

    config = ServerConfig(
        repository, host=host, http_port=http_port, grpc_port=grpc_port,
        options=ModelOptions(backend=backend, max_batch_size=max_batch_size,
                             max_queue_delay_s=max_queue_delay_ms / 1000.0, hint=hint),
        limits=Limits(max_body_bytes, max_tensor_elements, request_timeout_s),
        auth_token=None if auth_token_file is None else ServerConfig.read_token(auth_token_file),
        reuse_port=reuse_port)
    Server(config, log=lambda line: typer.echo(line)).run()


def _run_workers(workers: int, http_port: int, grpc_port: int) -> None:
    """Start ``workers`` server processes on the same ports; forward SIGTERM and SIGINT."""
    if http_port == 0 or grpc_port == 0:
        raise InvalidArgumentError("--workers above 1 needs fixed --http-port and --grpc-port: "
                                   "every worker listens on the same ports")
    args: list[str] = []
    skip = False
    for arg in sys.argv[1:]:
        if not skip and not arg.startswith("--workers"):
            args.append(arg)
        skip = arg == "--workers"
    children = [subprocess.Popen([sys.executable, "-m", "keel", *args, "--reuse-port"])
                for _ in range(workers)]

    def forward(signum: int, _frame: FrameType | None) -> None:
        for child in children:
            child.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    codes = [child.wait() for child in children]
    if any(codes):
        raise typer.Exit(max(codes))
