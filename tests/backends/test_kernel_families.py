"""The cpu and reference kernel tables import a family module when one of its ops is first
asked for (``KernelTable.defer``): the families named for each op must cover what
importing them registers, and a table loaded op by op must hold the variants, in the
same order, that a table loaded whole holds."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest

from keel.backends.families import deferred_modules
from keel.ops.registry import Op

BACKENDS = ("cpu", "reference")


def _fresh(code: str) -> Any:
    """The JSON a fresh interpreter prints last for ``code``."""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_families_named_for_an_op_register_its_variants(backend: str) -> None:
    """Every family registering variants of an op is among the modules its table imports
    for that op (schema families by name, and the backend's ``EXTRA_OPS``)."""
    package = f"keel.backends.{backend}"
    measured = _fresh("import json; from keel.backends.families import measure; "
                      f"print(json.dumps(measure({package!r})))")
    kernels = __import__(f"{package}.kernels", fromlist=["FAMILIES"])
    modules = deferred_modules(package, kernels.FAMILIES, getattr(kernels, "EXTRA_OPS", None))
    missing = sorted(f"{family}: {op}" for family, ops in measured.items() for op in ops
                     if f"{package}.{family}" not in modules.get(Op(op), ()))
    assert not missing, (f"{package} families register ops their schema family does not "
                         f"name; list them in {package}.kernels.EXTRA_OPS: {missing}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_table_loaded_op_by_op_equals_one_loaded_whole(backend: str) -> None:
    """Asked in reverse order (families imported out of their usual order), every op has
    the variants, in the order, that a whole load gives it."""
    probe = ("import json\n"
             f"from keel.backends.{backend} import kernels\n"
             "from keel.ops.registry import Op\n"
             "table = kernels.load()\n"
             "WHOLE"
             "print(json.dumps({op.value: list(table.variants(op)) "
             "for op in reversed(list(Op))}))\n")
    lazy = _fresh(probe.replace("WHOLE", ""))
    whole = _fresh(probe.replace("WHOLE", "kernels.load_all()\n"))
    assert lazy == whole


def test_a_lazy_table_imports_only_what_is_asked() -> None:
    code = ("import json, sys\n"
            "from keel.backends.cpu import kernels\n"
            "from keel.ops.registry import Op\n"
            "table = kernels.load()\n"
            "assert Op.MAX_POOL in table and table.get(Op.MAX_POOL).op is Op.MAX_POOL\n"
            "print(json.dumps(sorted(m for m in sys.modules "
            "if m.startswith('keel.backends.cpu.'))))")
    loaded = set(_fresh(code))
    assert "keel.backends.cpu.pooling" in loaded
    assert not loaded & {"keel.backends.cpu.trees", "keel.backends.cpu.strings",
                         "keel.backends.cpu.recurrent", "keel.backends.cpu.elementwise"}


def test_ops_sharing_families_load_together() -> None:
    """A family registering an op of another joins it: asking for any op of either
    imports both, in family order."""
    modules = deferred_modules("pkg", ("elementwise", "memory", "quantization", "qlinear"),
                               {"qlinear": ("qgemm",)})
    assert modules[Op.ADD] == ("pkg.elementwise",)
    assert modules[Op.CAST] == ("pkg.memory",)
    assert modules[Op.QGEMM] == modules[Op.QUANTIZE_LINEAR] == ("pkg.quantization",
                                                                 "pkg.qlinear")
    assert Op.CONV not in modules                   # no family named: the table loads all


def test_threads_loading_one_table_see_every_variant() -> None:
    """Threads asking a fresh table for ops at once: each waits for a family another
    thread is importing instead of finding it half registered."""
    code = ("import json, random, threading\n"
            "from keel.backends.cpu import kernels\n"
            "from keel.ops.registry import Op\n"
            "table = kernels.load()\n"
            "seen = []\n"
            "def ask(seed):\n"
            "    ops = list(Op)\n"
            "    random.Random(seed).shuffle(ops)\n"
            "    seen.append({op.value: sorted(table.variants(op)) for op in ops})\n"
            "threads = [threading.Thread(target=ask, args=(k,)) for k in range(6)]\n"
            "for t in threads: t.start()\n"
            "for t in threads: t.join()\n"
            "kernels.load_all()\n"
            "whole = {op.value: sorted(table.variants(op)) for op in Op}\n"
            "print(json.dumps([s == whole for s in seen]))")
    assert _fresh(code) == [True] * 6
