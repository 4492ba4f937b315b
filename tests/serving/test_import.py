"""``import keel`` and the CLI import none of the serving or Ray packages."""

from __future__ import annotations

import json
import subprocess
import sys

SERVING = ("grpc", "starlette", "uvicorn", "prometheus_client", "ray", "tritonclient",
           "pandas", "pyarrow")


def test_keel_and_its_cli_import_no_serving_package() -> None:
    code = ("import keel, keel.cli, keel.integrations, keel.serving, json, sys\n"
            f"print(json.dumps(sorted(m for m in {SERVING!r} if m in sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []
