"""Regenerating known_failures.txt keeps the written reasons and marks new failures."""

from __future__ import annotations

from pathlib import Path

from tests.onnx_node.suite import (
    KNOWN_FAILURES,
    PLACEHOLDER,
    load_known_failures,
    merge_failures,
    node_cases,
    write_known_failures,
)


def test_regeneration_keeps_reasons_drops_passing_cases_and_marks_new_ones(
        tmp_path: Path) -> None:
    known = load_known_failures()
    still, fixed = sorted(known)[:2]
    new = next(c.name for c in node_cases() if c.name not in known)
    this_run = {still: "TypeError: a different message this time", new: "ValueError: boom"}
    merged = merge_failures(known, this_run)
    assert merged == {still: known[still], new: f"{PLACEHOLDER}: ValueError: boom"}
    assert fixed not in merged

    path = tmp_path / KNOWN_FAILURES.name
    write_known_failures(merged, len(node_cases()), "cpu", path)
    assert load_known_failures(path) == merged
    # a placeholder is refreshed with the latest error, a written reason is not
    again = merge_failures(load_known_failures(path),
                           {still: "other", new: "KeyError: later"})
    assert again == {still: known[still], new: f"{PLACEHOLDER}: KeyError: later"}
