"""Deterministic drops: ``<out>/<profile>/<drop-id>/`` with a model, its plan and a manifest.

A drop carries what a deployment of one model to one target needs: the
converted model, its plan for the target hardware (``plan.json``), the flags
(``flags.txt``) and ``manifest.yaml``, which records the inputs the drop was
made from (the profile's flags, feature gates and primary backends, the source
model's name, size and SHA-256, the quantization, the policy, keel's version
and the hardware fingerprint) and the size and SHA-256 of every other file.

The drop id is the first 16 hex digits of the SHA-256 of those inputs
(canonical JSON), so the same inputs give the same id and byte-identical
files; nothing time-specific is written. A drop is written into a temporary
directory beside its final place and renamed into place, so a failure leaves
nothing half-written. :func:`verify_drop` refuses a drop whose files do not
match the manifest with :class:`~keel.errors.DropIntegrityError`.

This module holds the format (ids, manifest, atomic writing, verification);
``keel drop`` (:mod:`keel.cli.drop`) converts and plans the model that goes in.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from keel.errors import DropIntegrityError, InvalidArgumentError
from keel.hardware.profile import HardwareProfile
from keel.planning.targets import TargetProfile

__all__ = ["DEFAULT_ARTIFACTS_DIR", "DROP_SCHEMA", "MANIFEST", "Drop", "drop_id", "drop_inputs",
           "drop_model_path", "file_facts", "hardware_fingerprint", "is_drop_dir",
           "stable_profile", "verify_drop", "write_drop"]

DEFAULT_ARTIFACTS_DIR = os.path.join("storage", "artifacts")
DROP_SCHEMA = 2
MANIFEST = "manifest.yaml"
_CHUNK = 1 << 20

#: what a drop's file comes from: its bytes, or a file copied in as it is
Source = bytes | Path


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


def file_facts(path: str | os.PathLike[str]) -> dict[str, Any]:
    """``{"size_bytes", "sha256"}`` of one file, read in chunks."""
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return {"size_bytes": size, "sha256": digest.hexdigest()}


def _model_facts(model: str | os.PathLike[str]) -> dict[str, Any]:
    path = Path(model)
    if not path.is_file():
        raise InvalidArgumentError(f"model file {str(model)!r} does not exist or is not a file")
    try:
        facts = file_facts(path)
    except OSError as exc:
        raise InvalidArgumentError(f"cannot read model file {str(model)!r}: {exc}") from None
    return {"file": path.name, "sha256": facts["sha256"], "size_bytes": facts["size_bytes"]}


def stable_profile(profile: HardwareProfile) -> HardwareProfile:
    """``profile`` without the readings that change from one probe to the next (available
    memory, free GPU memory, current clock, temperatures, probe time): what a drop made on
    this machine plans for, so that the same machine gives the same drop."""
    memory = dataclasses.replace(profile.memory, available_bytes=None,
                                 effective_available_bytes=None)
    cpu = dataclasses.replace(profile.cpu, current_frequency_mhz=None)
    gpus = tuple(dataclasses.replace(g, free_memory_bytes=None) for g in profile.gpus)
    return dataclasses.replace(profile, memory=memory, cpu=cpu, gpus=gpus, probe_seconds=None,
                               thermal=())


def hardware_fingerprint(profile: HardwareProfile) -> str:
    """The first 16 hex digits of the SHA-256 of the profile's canonical JSON."""
    return _digest(profile.to_dict())


def _digest(data: Any) -> str:
    canonical = json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:16]


def drop_inputs(model: str | os.PathLike[str], target: TargetProfile,
                extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Everything the drop id is derived from (and the manifest records); ``extra`` adds
    the inputs of the conversion and the plan (quantization, policy, hardware)."""
    from keel import __version__  # the package root: a shared leaf, imported late

    return {
        "schema": DROP_SCHEMA,
        "profile": target.name,
        "description": target.description,
        "primary_backends": list(target.primary_backends),
        "flags": list(target.flags),
        "feature_gates": list(target.feature_gates),
        "model": _model_facts(model),
        **dict(extra or {}),
        "keel_version": __version__,
    }


def drop_id(inputs: Mapping[str, Any]) -> str:
    """The id of the drop made from ``inputs``."""
    return _digest(dict(inputs))


def write_drop(out_dir: str | os.PathLike[str], inputs: Mapping[str, Any],
               files: Mapping[str, Source]) -> Drop:
    """Write (or find) the drop made from ``inputs`` holding ``files`` under
    ``out_dir/<profile>/<drop-id>/``; ``manifest.yaml`` is added, listing each file's size
    and SHA-256. An identical drop already there is left as it is."""
    ident = drop_id(inputs)
    final = Path(out_dir) / str(inputs["profile"]) / ident
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{ident}.", suffix=".tmp", dir=final.parent))
    except OSError as exc:
        raise InvalidArgumentError(f"cannot write drop under {str(out_dir)!r}: {exc}") from None
    try:
        manifest = _stage(tmp, ident, inputs, files)
        names = (*sorted(files), MANIFEST)
        result = Drop(ident, str(inputs["profile"]), str(final), names, manifest, created=True)
        if _same_drop(final, tmp):
            return dataclasses.replace(result, created=False)
        _move_into_place(tmp, final)
        return result
    except OSError as exc:
        raise InvalidArgumentError(f"cannot write drop under {str(out_dir)!r}: {exc}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _stage(tmp: Path, ident: str, inputs: Mapping[str, Any],
           files: Mapping[str, Source]) -> dict[str, Any]:
    """Write ``files`` and the manifest into ``tmp``; returns the manifest."""
    tmp.chmod(0o755)            # mkdtemp makes 0700; a drop is meant to be shared
    for name in sorted(files):
        source = files[name]
        if isinstance(source, Path):
            shutil.copyfile(source, tmp / name)
        else:
            _write_file(tmp / name, source)
    listed = {name: file_facts(tmp / name) for name in sorted(files)}
    manifest = {"drop_id": ident, **inputs, "files": listed}
    _write_file(tmp / MANIFEST, yaml.safe_dump(manifest, sort_keys=False).encode("utf-8"))
    return manifest


def _write_file(path: Path, data: bytes) -> None:
    with open(path, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())


def _same_drop(final: Path, staged: Path) -> bool:
    """Whether ``final`` already holds the staged drop, unchanged."""
    try:
        same_manifest = (final / MANIFEST).read_bytes() == (staged / MANIFEST).read_bytes()
    except OSError:
        return False
    if not same_manifest:
        return False
    try:
        verify_drop(final)
    except DropIntegrityError:
        return False
    return True


def _move_into_place(tmp: Path, final: Path) -> None:
    if final.exists():          # a stale or damaged drop with this id: replace it
        shutil.rmtree(final)
    try:
        os.replace(tmp, final)
    except OSError:
        if _same_drop(final, tmp):
            return              # a concurrent writer finished the same drop first
        raise


def is_drop_dir(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a directory holding a drop manifest."""
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, MANIFEST))


def verify_drop(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The manifest of the drop at ``path`` once every file matches its recorded size and
    SHA-256 and no file is missing or extra; :class:`DropIntegrityError` otherwise."""
    root = Path(path)
    manifest = _read_manifest(root)
    listed = manifest["files"]
    present = sorted(p.name for p in root.iterdir())
    extra = [name for name in present if name not in listed and name != MANIFEST]
    if extra:
        raise DropIntegrityError(f"drop {str(root)!r} holds files its manifest does not list: "
                                 f"{', '.join(extra)}")
    for name, recorded in listed.items():
        _check_file(root, name, recorded)
    return manifest


def _read_manifest(root: Path) -> dict[str, Any]:
    try:
        manifest = yaml.safe_load((root / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise DropIntegrityError(f"drop {str(root)!r}: cannot read {MANIFEST}: {exc}") from None
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict) or not all(
            isinstance(v, dict) and {"size_bytes", "sha256"} <= set(v) for v in files.values()):
        raise DropIntegrityError(f"drop {str(root)!r}: {MANIFEST} does not list its files "
                                 "with their sizes and SHA-256")
    if any(not isinstance(name, str) or os.path.basename(name) != name or name in ("", ".", "..")
           for name in files):
        raise DropIntegrityError(f"drop {str(root)!r}: {MANIFEST} names a file outside the drop")
    return manifest


def _check_file(root: Path, name: str, recorded: Mapping[str, Any]) -> None:
    try:
        found = file_facts(root / name)
    except OSError as exc:
        raise DropIntegrityError(f"drop {str(root)!r}: {name} is missing or unreadable "
                                 f"({exc.strerror or exc})") from None
    if found["size_bytes"] != recorded["size_bytes"]:
        raise DropIntegrityError(
            f"drop {str(root)!r}: {name} is {found['size_bytes']} bytes, the manifest records "
            f"{recorded['size_bytes']}")
    if found["sha256"] != recorded["sha256"]:
        raise DropIntegrityError(
            f"drop {str(root)!r}: {name} has SHA-256 {found['sha256'][:16]}…, the manifest "
            f"records {str(recorded['sha256'])[:16]}…; the drop was changed after it was made")


def drop_model_path(path: str | os.PathLike[str]) -> str:
    """The model file of the verified drop at ``path`` (what ``keel run DROP`` loads)."""
    manifest = verify_drop(path)
    name = manifest.get("model_file")
    if not isinstance(name, str) or name not in manifest["files"]:
        raise DropIntegrityError(f"drop {os.fspath(path)!r}: {MANIFEST} names no model file")
    return os.path.join(os.fspath(path), name)
