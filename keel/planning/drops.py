"""Deterministic drop manifests: ``<out>/<profile>/<drop-id>/{flags.txt, manifest.yaml}``.

A drop records what a deployment of one model to one target profile needs:
the profile's flags, feature gates and primary backends, the model's file
name, size and SHA-256, and keel's version. The drop id is the first 16 hex
digits of the SHA-256 of those inputs (canonical JSON), so the same inputs
give the same id and byte-identical files, and nothing time- or host-specific
is written. A drop is written into a temporary directory beside its final
place and renamed into place, so a failure leaves nothing half-written.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from keel.errors import InvalidArgumentError
from keel.planning.targets import TargetProfile, get_target

__all__ = ["DEFAULT_ARTIFACTS_DIR", "DROP_SCHEMA", "Drop", "drop_inputs", "make_drop"]

DEFAULT_ARTIFACTS_DIR = os.path.join("storage", "artifacts")
DROP_SCHEMA = 1
_CHUNK = 1 << 20


@dataclass(frozen=True)
class Drop:
    """A written drop: its id, where it lives, and whether this call created it."""

    drop_id: str
    profile: str
    path: str
    files: tuple[str, ...]
    manifest: dict[str, Any]
    created: bool

    def to_dict(self) -> dict[str, Any]:
        return {"drop_id": self.drop_id, "profile": self.profile, "path": self.path,
                "files": list(self.files), "created": self.created, "manifest": self.manifest}


def _model_facts(model: str | os.PathLike[str]) -> dict[str, Any]:
    path = Path(model)
    if not path.is_file():
        raise InvalidArgumentError(f"model file {str(model)!r} does not exist or is not a file")
    digest = hashlib.sha256()
    size = 0
    try:
        with path.open("rb") as fh:
            while chunk := fh.read(_CHUNK):
                digest.update(chunk)
                size += len(chunk)
    except OSError as exc:
        raise InvalidArgumentError(f"cannot read model file {str(model)!r}: {exc}") from None
    return {"file": path.name, "sha256": digest.hexdigest(), "size_bytes": size}


def drop_inputs(model: str | os.PathLike[str], target: TargetProfile) -> dict[str, Any]:
    """Everything the drop id is derived from (and the manifest records)."""
    from keel import __version__  # the package root: a shared leaf, imported late

    return {
        "schema": DROP_SCHEMA,
        "profile": target.name,
        "description": target.description,
        "primary_backends": list(target.primary_backends),
        "flags": list(target.flags),
        "feature_gates": list(target.feature_gates),
        "model": _model_facts(model),
        "keel_version": __version__,
    }


def _drop_id(inputs: dict[str, Any]) -> str:
    canonical = json.dumps(inputs, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:16]


def _render(inputs: dict[str, Any], drop_id: str) -> dict[str, bytes]:
    manifest = {"drop_id": drop_id, **inputs, "files": ["flags.txt", "manifest.yaml"]}
    return {
        "flags.txt": "".join(f"{flag}\n" for flag in inputs["flags"]).encode("utf-8"),
        "manifest.yaml": yaml.safe_dump(manifest, sort_keys=False).encode("utf-8"),
    }


def make_drop(model: str | os.PathLike[str], profile: str,
              out_dir: str | os.PathLike[str] = DEFAULT_ARTIFACTS_DIR) -> Drop:
    """Write (or find) the drop of ``model`` for target ``profile`` under ``out_dir``."""
    target = get_target(profile)
    inputs = drop_inputs(model, target)
    drop_id = _drop_id(inputs)
    contents = _render(inputs, drop_id)
    final = Path(out_dir) / target.name / drop_id
    manifest = yaml.safe_load(contents["manifest.yaml"])
    result = Drop(drop_id, target.name, str(final), tuple(contents), manifest, created=True)
    if _matches(final, contents):
        return dataclasses.replace(result, created=False)
    try:
        _write_atomically(final, contents)
    except OSError as exc:
        raise InvalidArgumentError(f"cannot write drop under {str(out_dir)!r}: {exc}") from None
    return result


def _matches(final: Path, contents: dict[str, bytes]) -> bool:
    try:
        return sorted(os.listdir(final)) == sorted(contents) and all(
            (final / name).read_bytes() == data for name, data in contents.items())
    except OSError:
        return False


def _write_atomically(final: Path, contents: dict[str, bytes]) -> None:
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent))
    try:
        tmp.chmod(0o755)            # mkdtemp makes 0700; a drop is meant to be shared
        for name, data in contents.items():
            with open(tmp / name, "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
        if final.exists():          # a stale or damaged drop with this id: replace it
            shutil.rmtree(final)
        os.replace(tmp, final)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, OSError) and _matches(final, contents):
            return                  # a concurrent writer finished the same drop first
        raise
