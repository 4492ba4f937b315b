"""Schemas are registered when their op is first asked for: ``get_schema`` imports the
family module that ``keel.ops.schemas.FAMILY_OPS`` names, which must be the module that
registers it."""

from __future__ import annotations

import json
import subprocess
import sys

from keel.ops.registry import Op
from keel.ops.schema import all_schemas
from keel.ops.schemas import FAMILIES, FAMILY_OPS


def _fresh(code: str) -> object:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_family_ops_are_what_each_family_registers() -> None:
    measured = _fresh("import json; from keel.ops.schemas import measure; "
                      "print(json.dumps(measure()))")
    written = {family: sorted(ops) for family, ops in FAMILY_OPS.items()}
    assert written == measured, ("keel.ops.schemas.FAMILY_OPS is stale; write what "
                                 "keel.ops.schemas.measure() gives in a fresh process")


def test_every_op_with_a_schema_is_named_once() -> None:
    named = [op for family in FAMILIES for op in FAMILY_OPS[family]]
    assert len(named) == len(set(named))
    assert set(named) == {op.value for op in all_schemas()}


def test_asking_for_one_schema_imports_its_family_only() -> None:
    code = ("import json, sys\n"
            "from keel.ops.registry import Op\n"
            "from keel.ops.schema import get_schema\n"
            "assert get_schema(Op.MAX_POOL).op is Op.MAX_POOL\n"
            "print(json.dumps(sorted(m for m in sys.modules "
            "if m.startswith('keel.ops.schemas.'))))")
    loaded = set(_fresh(code))                  # type: ignore[call-overload]
    assert "keel.ops.schemas.pooling" in loaded
    assert not loaded & {"keel.ops.schemas.trees", "keel.ops.schemas.strings",
                         "keel.ops.schemas.recurrent", "keel.ops.schemas.signal"}
    assert Op.MAX_POOL.value in FAMILY_OPS["pooling"]
