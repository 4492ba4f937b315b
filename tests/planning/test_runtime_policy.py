"""RuntimePolicy: seed 000's fields and defaults, YAML/kwargs/env loading, typed errors."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from keel.errors import InvalidArgumentError
from keel.planning.policy import SEED_FIELDS, RuntimePolicy

# The defaults block of seed 000, verbatim.
SEED_DEFAULTS_YAML = """
prefer_gpu: true
min_gpu_memory_gb: 8.0
prefer_lightweight_python_on_low_memory: true
lightweight_memory_threshold_gb: 6.0
allow_accelerator_experiments: true
"""


def test_fields_and_defaults_are_exactly_the_seeds() -> None:
    seed = yaml.safe_load(SEED_DEFAULTS_YAML)
    policy = RuntimePolicy()
    names = [f.name for f in dataclasses.fields(RuntimePolicy)]
    assert tuple(names[: len(SEED_FIELDS)]) == SEED_FIELDS == tuple(seed)
    assert {k: getattr(policy, k) for k in SEED_FIELDS} == seed
    assert names[len(SEED_FIELDS):] == ["backend", "precision", "hint"]   # keel's pins, hint
    assert (policy.backend, policy.precision, policy.pinned_backend) == ("auto", "auto", None)
    assert RuntimePolicy.from_yaml(SEED_DEFAULTS_YAML) == policy


def test_load_from_a_yaml_file(tmp_path: Path) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text("prefer_gpu: false\nmin_gpu_memory_gb: 24\nbackend: CPU\n")
    policy = RuntimePolicy.load(path)
    assert policy.prefer_gpu is False and policy.min_gpu_memory_gb == 24.0
    assert isinstance(policy.min_gpu_memory_gb, float) and policy.backend == "cpu"
    assert RuntimePolicy.load(tmp_path / "policy.yaml").allow_accelerator_experiments is True


def test_an_empty_file_gives_the_defaults(tmp_path: Path) -> None:
    path = tmp_path / "empty.yaml"
    path.write_text("")
    assert RuntimePolicy.load(path) == RuntimePolicy()


def test_unknown_keys_are_named() -> None:
    with pytest.raises(InvalidArgumentError, match="unknown key 'prefer_gpus' in policy YAML"):
        RuntimePolicy.from_yaml("prefer_gpus: true\n")
    with pytest.raises(InvalidArgumentError, match="unknown key 'turbo' in keyword arguments"):
        RuntimePolicy.from_kwargs(turbo=True)


@pytest.mark.parametrize(("key", "value", "message"), [
    ("prefer_gpu", "yes", "'prefer_gpu' must be true or false, got 'yes'"),
    ("prefer_gpu", 1, "'prefer_gpu' must be true or false, got 1"),
    ("min_gpu_memory_gb", "8GB", "'min_gpu_memory_gb' must be a number of GiB, got '8GB'"),
    ("min_gpu_memory_gb", True, "'min_gpu_memory_gb' must be a number of GiB, got True"),
    ("lightweight_memory_threshold_gb", -1, "must be a finite number >= 0, got -1"),
    ("allow_accelerator_experiments", None, "'allow_accelerator_experiments' must be true"),
    ("prefer_lightweight_python_on_low_memory", [], "must be true or false"),
    ("backend", "tpu", "'backend' must be one of auto, gpu, cpu, reference, webgpu, got 'tpu'"),
    ("precision", 16, "'precision' must be one of auto, fp32"),
])
def test_wrong_types_name_the_key(key: str, value: object, message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=message.replace("(", r"\(")):
        RuntimePolicy.from_mapping({key: value})
    with pytest.raises(InvalidArgumentError, match=key):
        RuntimePolicy(**{key: value})  # type: ignore[arg-type]


def test_bad_yaml_and_unreadable_files_are_typed_errors(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match="not valid YAML"):
        RuntimePolicy.from_yaml("prefer_gpu: [\n")
    with pytest.raises(InvalidArgumentError, match="must be a mapping of policy keys, got list"):
        RuntimePolicy.from_yaml("- prefer_gpu\n")
    with pytest.raises(InvalidArgumentError, match="cannot read policy file"):
        RuntimePolicy.load(tmp_path / "missing.yaml")


def test_from_env_reads_keel_variables() -> None:
    env = {"KEEL_PREFER_GPU": "off", "KEEL_MIN_GPU_MEMORY_GB": "16.5",
           "KEEL_ALLOW_ACCELERATOR_EXPERIMENTS": "0", "KEEL_BACKEND": "Reference",
           "KEEL_PRECISION": "fp16", "UNRELATED": "x"}
    policy = RuntimePolicy.from_env(env)
    assert policy.prefer_gpu is False and policy.min_gpu_memory_gb == 16.5
    assert policy.allow_accelerator_experiments is False
    assert (policy.backend, policy.precision) == ("reference", "fp16")
    assert policy.prefer_lightweight_python_on_low_memory is True       # untouched default


@pytest.mark.parametrize(("var", "value", "message"), [
    ("KEEL_PREFER_GPU", "maybe", "KEEL_PREFER_GPU='maybe' must be one of 1/0"),
    ("KEEL_MIN_GPU_MEMORY_GB", "lots", "KEEL_MIN_GPU_MEMORY_GB='lots' must be a number"),
    ("KEEL_BACKEND", "tpu", "KEEL_BACKEND='tpu' is not allowed"),
])
def test_bad_env_values_name_the_variable(var: str, value: str, message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        RuntimePolicy.from_env({var: value})


def test_resolve_layers_defaults_file_env_kwargs(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text("min_gpu_memory_gb: 12\nlightweight_memory_threshold_gb: 3\nbackend: cpu\n")
    env = {"KEEL_MIN_GPU_MEMORY_GB": "20", "KEEL_BACKEND": "reference"}
    policy = RuntimePolicy.resolve(path, env=env, backend="auto")
    assert policy.lightweight_memory_threshold_gb == 3.0    # file over default
    assert policy.min_gpu_memory_gb == 20.0                 # env over file
    assert policy.backend == "auto"                         # kwargs over env
    with pytest.raises(InvalidArgumentError, match="unknown key 'gpu_first'"):
        RuntimePolicy.resolve(env={}, gpu_first=True)


def test_policy_serialises() -> None:
    policy = RuntimePolicy(prefer_gpu=False)
    assert RuntimePolicy.from_yaml(policy.to_yaml()) == policy
    assert RuntimePolicy.from_yaml(policy.to_json()) == policy     # YAML reads JSON


def test_load_rejects_a_file_that_is_not_text(tmp_path: Path) -> None:
    path = tmp_path / "policy.yaml"
    path.write_bytes(b"\xff\xfe\x00\x01")
    with pytest.raises(InvalidArgumentError, match=r"cannot read policy file .*utf-8"):
        RuntimePolicy.load(path)
