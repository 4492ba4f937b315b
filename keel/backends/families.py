"""Which family module of a kernel table registers which ops, so that a table can import
the modules of the ops a model uses instead of all of them (:meth:`KernelTable.defer`).

A backend's kernel families carry the names of the schema families
(``keel.ops.schemas.FAMILY_OPS``): the ``elementwise`` kernels are those of the
``elementwise`` schemas. A family that registers ops of another names them in the
backend's ``EXTRA_OPS``. :func:`measure` (``python -m keel.backends.families cpu``)
shows what importing each family registers, and ``tests/backends/test_kernel_families.py``
checks that the names above cover it.
"""

from __future__ import annotations

import importlib
import json
import sys
from collections.abc import Mapping, Sequence

from keel.backends.base import KernelVariant
from keel.ops.registry import Op
from keel.ops.schemas import FAMILY_OPS

__all__ = ["deferred_modules", "measure"]


def deferred_modules(package: str, families: Sequence[str],
                     extra: Mapping[str, Sequence[str]] | None = None
                     ) -> dict[Op, tuple[str, ...]]:
    """For each op, the modules of ``package`` to import so that all its variants are
    registered: the families naming it, joined with every family that shares an op with
    them, in ``families`` order (the order a whole load imports them in, so an op's
    variants keep the order they have then)."""
    group = {f: {f} for f in families}
    owner: dict[str, str] = {}
    for family in families:
        for op in (*FAMILY_OPS.get(family, ()), *(extra or {}).get(family, ())):
            first = owner.setdefault(op, family)
            if group[first] is not group[family]:       # join the two groups
                joined = group[first] | group[family]
                for member in joined:
                    group[member] = joined
    order = {f: k for k, f in enumerate(families)}
    names = {f: tuple(f"{package}.{m}" for m in sorted(group[f], key=lambda m: order[m]))
             for f in families}
    by_value = Op._value2member_map_
    return {by_value[op]: names[family] for op, family in owner.items()}  # type: ignore[misc]


def measure(package: str) -> dict[str, list[str]]:
    """Import ``package``'s kernel families one by one and note the ops each registers
    variants of; run in a fresh process (a family imported before has registered)."""
    kernels = importlib.import_module(f"{package}.kernels")
    table, families = kernels.TABLE, kernels.FAMILIES
    if any(f"{package}.{family}" in sys.modules for family in families):
        raise RuntimeError(f"{package}'s families are imported already: measure in a "
                           "fresh process")
    found: dict[str, list[str]] = {}
    register = table.register
    current = ""

    def noting(variant: KernelVariant) -> KernelVariant:
        op = variant.op.value
        if op not in found.setdefault(current, []):
            found[current].append(op)
        return register(variant)

    table.register = noting
    try:
        for family in families:
            current = family
            importlib.import_module(f"{package}.{family}")
    finally:
        del table.register
    return {family: sorted(found.get(family, ())) for family in families}


if __name__ == "__main__":
    backend = sys.argv[1] if len(sys.argv) > 1 else "cpu"
    print(json.dumps(measure(f"keel.backends.{backend}"), indent=4))
