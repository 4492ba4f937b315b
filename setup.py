"""keel's build: the package, plus its C kernels compiled for the installing machine.

``pip install .`` compiles ``keel/native/src/*.c`` into ``keel/native/prebuilt/``
with the flags keel uses at run time, recording the CPU they were built for.
keel loads one of these only on a CPU with the same instruction set (else it
builds into its cache at first use). Without a working compiler the install
still succeeds and keel builds at first use. Editable installs skip the step.
"""

from __future__ import annotations

import importlib
import shutil
import sys
import types
from pathlib import Path
from typing import Any

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent


def _builder() -> Any:
    """``keel.native.build`` from this source tree, without running ``keel/__init__.py``
    (whose dependencies the isolated build environment lacks)."""
    for name in ("keel", "keel.native"):
        if name not in sys.modules:
            package = types.ModuleType(name)
            package.__path__ = [str(HERE.joinpath(*name.split(".")))]
            sys.modules[name] = package
    return importlib.import_module("keel.native.build")


class BuildPyWithKernels(build_py):
    """build_py, then the native kernels into the package (never failing the install)."""

    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            return
        target = Path(self.build_lib) / "keel" / "native" / "prebuilt"
        shutil.rmtree(target, ignore_errors=True)   # no stale builds from an earlier run
        try:
            report = _builder().prebuild(target)
        except Exception as exc:  # the install goes on: keel builds at first use
            print(f"keel: native kernels not built at install ({exc}); "
                  "they build at first use", file=sys.stderr)
            return
        for entry in report:
            print(f"keel: {entry['library']}: {entry['state']} in {entry['seconds']:.1f} s"
                  f"{'' if not entry['reason'] else ' (' + entry['reason'] + ')'}",
                  file=sys.stderr)


setup(cmdclass={"build_py": BuildPyWithKernels})
