"""No pickle anywhere a request's bytes go: the server, the protocol, the remote backend and
the Ray integration never import a module that unpickles, nor let NumPy do it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

KEEL = Path(__file__).resolve().parents[2] / "keel"
FILES = sorted([*(KEEL / "serving").glob("*.py"), KEEL / "inference_protocol.py",
                KEEL / "backends" / "remote.py", *(KEEL / "integrations").glob("*.py")])
UNPICKLERS = {"pickle", "_pickle", "cPickle", "dill", "cloudpickle", "joblib", "shelve",
              "marshal", "copyreg"}


def _unsafe(tree: ast.AST) -> list[str]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.split(".")[0] in UNPICKLERS]
        elif isinstance(node, ast.ImportFrom) and node.module:
            found += [node.module] * (node.module.split(".")[0] in UNPICKLERS)
        elif isinstance(node, ast.keyword) and node.arg == "allow_pickle":
            found.append("allow_pickle=")
        elif isinstance(node, ast.Attribute) and node.attr in ("load", "loads") and \
                isinstance(node.value, ast.Name) and node.value.id in ("np", "numpy"):
            found.append(f"{node.value.id}.{node.attr}")
    return found


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(KEEL)))
def test_no_unpickling(path: Path) -> None:
    assert _unsafe(ast.parse(path.read_text(), str(path))) == []


def test_the_check_finds_unpickling() -> None:
    bad = "import pickle\nfrom dill import loads\nimport numpy as np\nnp.load(f, allow_pickle=True)"
    assert sorted(_unsafe(ast.parse(bad))) == ["allow_pickle=", "dill", "np.load", "pickle"]
