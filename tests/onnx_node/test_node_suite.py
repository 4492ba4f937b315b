"""onnx's node test cases through ``keel.onnx_backend`` on the cpu backend.

Every case of the installed onnx package runs; the ones listed in
``known_failures.txt`` must fail (``xfail(strict=True)``), so a listed case
that starts passing fails the suite until it is taken off the list.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import pytest

from tests.onnx_node.suite import PLACEHOLDER, load_known_failures, node_cases, run_case

KNOWN = load_known_failures()
CASES = node_cases()


def _params() -> list[Any]:
    params = []
    for case in CASES:
        marks: list[Any] = []
        if case.name in KNOWN:
            marks.append(pytest.mark.xfail(strict=True, reason=KNOWN[case.name]))
        params.append(pytest.param(case, id=case.name, marks=marks))
    return params


@pytest.mark.parametrize("case", _params())
def test_node_case(case: Any) -> None:
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run_case(case)


def test_known_failures_name_real_cases() -> None:
    names = {c.name for c in CASES}
    stale = sorted(set(KNOWN) - names)
    assert not stale, f"known_failures.txt lists cases onnx does not have: {stale[:5]}"


def test_every_known_failure_has_a_reason() -> None:
    assert all(len(reason) > 10 for reason in KNOWN.values())
    unexplained = sorted(n for n, r in KNOWN.items() if r.startswith(PLACEHOLDER))
    assert not unexplained, (f"known_failures.txt: write why these cases fail in place of "
                             f"{PLACEHOLDER}: {unexplained[:5]}")


def test_the_suite_is_the_whole_onnx_node_suite() -> None:
    # onnx 1.23 ships 1884 node cases; a newer onnx may add some, never drop to few.
    assert len(CASES) >= 1800
