"""``keel serve`` as users start it: a process that says where it listens and drains on
SIGTERM."""

from __future__ import annotations

import concurrent.futures
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import keel

from .conftest import (
    as_served,
    free_port,
    infer_grpc,
    infer_http,
    make_repository,
    pixels,
    same_answer,
)

ROOT = Path(__file__).resolve().parents[2]


class _Ports:
    def __init__(self, http: int, grpc: int) -> None:
        self.http_port, self.grpc_port = http, grpc


def _start(args: list[str]) -> tuple[subprocess.Popen[str], _Ports, list[str]]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "keel", "serve", *args, "--http-port", "0",
                             "--grpc-port", "0"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)
    lines: list[str] = []
    deadline = time.monotonic() + 120
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line.rstrip())
        if "gRPC" in line:
            break
    text = "\n".join(lines)
    http = re.search(r"HTTP  http://127\.0\.0\.1:(\d+)", text)
    grpc = re.search(r"gRPC  127\.0\.0\.1:(\d+)", text)
    assert http and grpc, text
    for _ in range(2):                              # the plan summaries of both models
        lines.append(proc.stdout.readline().rstrip())
    return proc, _Ports(int(http.group(1)), int(grpc.group(1))), lines


def test_serve_prints_where_it_listens_and_drains_on_sigterm(tmp_path: Path) -> None:
    repo = make_repository(tmp_path / "repo")
    proc, ports, lines = _start([str(repo), "--max-batch-size", "64",
                                 "--max-queue-delay-ms", "1500"])
    try:
        summary = r"model digits v1: \d+ nodes on .*dynamic batching (up|padded) to 64 rows"
        assert any(re.search(summary, ln) for ln in lines), lines
        x = pixels(2, seed=3)
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            waiting = [pool.submit(infer_http, ports, x) for _ in range(3)] + \
                      [pool.submit(infer_grpc, ports, x) for _ in range(3)]
            time.sleep(0.6)                          # queued, waiting for their batch
            proc.send_signal(signal.SIGTERM)
            answers = [f.result(timeout=60) for f in waiting]
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    expected = as_served(keel.load_model(str(repo / "digits.onnx")), x, 64)
    assert all(same_answer(a, expected["probabilities"]) for a in answers)
    rest = proc.stdout.read() if proc.stdout else ""
    assert "draining requests in flight" in rest


def test_serve_refuses_a_missing_repository(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-m", "keel", "serve", str(tmp_path / "none")],
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 2
    assert "does not exist" in out.stderr




def test_workers_share_the_ports_and_stop_together(tmp_path: Path) -> None:
    repo = make_repository(tmp_path / "repo")
    ports = _Ports(free_port(), free_port())
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "keel", "serve", str(repo), "--workers", "2",
                             "--http-port", str(ports.http_port), "--grpc-port",
                             str(ports.grpc_port)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)
    try:
        assert proc.stdout is not None
        seen = 0
        deadline = time.monotonic() + 180
        while seen < 2 and time.monotonic() < deadline:      # each worker announces itself
            line = proc.stdout.readline()
            assert line, "the server exited early"
            seen += "gRPC" in line
        x = pixels(1, seed=4)
        expected = as_served(keel.load_model(str(repo / "digits.onnx")), x)
        for _ in range(4):
            assert same_answer(infer_http(ports, x), expected["probabilities"])
            assert same_answer(infer_grpc(ports, x), expected["probabilities"])
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    with pytest.raises(ConnectionError):
        infer_http(ports, pixels(1))


def test_serve_without_the_serve_extra_says_what_to_install(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    code = ("import sys; sys.modules['grpc'] = None; sys.modules['uvicorn'] = None\n"
            "from keel.cli import main\n"
            f"main(['serve', {str(make_repository(tmp_path / 'r'))!r}])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, timeout=120)
    assert out.returncode == 2
    assert 'pip install "keel-runtime[serve]" (missing: grpcio, uvicorn)' in out.stderr
