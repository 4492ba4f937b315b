"""NUMA: the probe reads each node's CPUs from sysfs; on a machine with several nodes the
cpu plan keeps keel's threads on one node by default (``KEEL_NUMA_PIN``), sizes the thread
count to it and says so; the native pool's workers follow the pin."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from keel import config, load_model
from keel.backends.cpu.backend import CpuBackend
from keel.backends.cpu.planner import numa_pinning
from keel.hardware.cpu import numa_nodes, probe_cpu
from keel.hardware.fakes import fake_machine, fake_profile
from keel.hardware.profile import HardwareProfile
from keel.testing.models import make_inputs, mlp

TWO_SOCKETS = "x86-avx512-server"      # 2x Xeon 8480+: 56 cores, 2 threads each, per socket


@pytest.fixture(autouse=True)
def _defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KEEL_THREADS", raising=False)
    monkeypatch.delenv("KEEL_NUMA_PIN", raising=False)
    config.reload_settings()


def test_the_probe_reads_each_nodes_cpus_from_sysfs() -> None:
    cpu = probe_cpu(fake_machine(TWO_SOCKETS).sources())
    assert cpu.numa_nodes == ("0-55,112-167", "56-111,168-223")
    single = fake_profile("container-2core-1gib").cpu
    assert len(single.numa_nodes) == 1


def test_nodes_survive_a_saved_profile() -> None:
    profile = fake_profile(TWO_SOCKETS)
    again = HardwareProfile.from_yaml(profile.to_yaml())
    assert again.cpu.numa_nodes == profile.cpu.numa_nodes


def test_this_machine_lists_its_nodes_or_none() -> None:
    nodes = numa_nodes()
    if sys.platform.startswith("linux") and Path("/sys/devices/system/node/node0").exists():
        assert nodes and nodes[0]
    else:
        assert nodes == ()


def test_the_rule_pins_the_node_with_most_usable_cpus() -> None:
    nodes = ("0-3", "4-11")
    cpus, why = numa_pinning(nodes)
    assert cpus == frozenset(range(4, 12)) and "node 1's 8 CPUs" in why
    # The affinity mask decides which node has the most usable CPUs.
    cpus, why = numa_pinning(nodes, usable=frozenset({0, 1, 2, 4}))
    assert cpus == frozenset({0, 1, 2}) and "node 0" in why
    assert numa_pinning(nodes, usable=frozenset({5, 6}))[0] is None       # one node usable
    assert numa_pinning(("0-7",))[0] is None
    off, why = numa_pinning(nodes, enabled=False)
    assert off is None and "KEEL_NUMA_PIN=off" in why


def test_a_two_socket_profile_plans_one_nodes_threads_and_says_so() -> None:
    backend = CpuBackend(hardware=fake_profile(TWO_SOCKETS))
    assert backend.threads == 112
    notes = backend.plan_notes()
    assert any("pinned to node 0's 112 CPUs (0-55,112-167)" in n for n in notes)
    assert "one NUMA node" in notes[0]


def test_keel_numa_pin_off_uses_every_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KEEL_NUMA_PIN", "off")
    config.reload_settings()
    backend = CpuBackend(hardware=fake_profile(TWO_SOCKETS))
    assert backend.threads == 224
    assert any("KEEL_NUMA_PIN=off" in n for n in backend.plan_notes())


def test_given_threads_stay_authoritative() -> None:
    backend = CpuBackend(threads=200, hardware=fake_profile(TWO_SOCKETS))
    assert backend.threads == 200
    assert backend.numa[0] == numa_pinning(fake_profile(TWO_SOCKETS).cpu.numa_nodes)[0]


def test_explain_says_where_the_threads_run() -> None:
    proto = mlp(in_features=16, hidden=(32,), classes=4)
    model = load_model(proto.SerializeToString(), hardware=fake_profile(TWO_SOCKETS),
                       backend="cpu")
    model.predict(make_inputs(proto, batch=2))
    text = model.explain()
    assert "NUMA: 2 NUMA nodes: keel's threads pinned to node 0's 112 CPUs" in text
    assert "block sizes: scaled to the profile's Intel(R) Xeon(R) Platinum 8480+: L2 2048 KiB" \
        in text
    # A profile of another machine pins nothing here.
    from keel.native import pool

    pinned = pool.pinned()
    assert pinned is None or pinned <= frozenset(os.sched_getaffinity(0))


# The pin check runs in a process of its own: a test that resets the native tier with a
# cache of its own (native.reset) loads a second threads library into its process, whose
# workers (named keel-worker too) no pin of this one moves.
_PIN_CHECK = """
import json, os
from pathlib import Path

import numpy as np

from keel import load_model, native
from keel.native import pool
from keel.testing.models import make_inputs, mlp


def worker_cpus():
    lists = []
    for task in Path("/proc/self/task").iterdir():
        if (task / "comm").read_text().strip() == "keel-worker":
            status = (task / "status").read_text()
            lists += [line.split(":", 1)[1].strip() for line in status.splitlines()
                      if line.startswith("Cpus_allowed_list")]
    return lists


report = {"available": native.available()}
if report["available"]:
    usable = sorted(os.sched_getaffinity(0))
    proto = mlp(in_features=256, hidden=(256,), classes=4)
    model = load_model(proto.SerializeToString(), backend="cpu", threads=2)
    feeds = make_inputs(proto, batch=64)
    expected = model.predict(feeds)                    # starts the workers
    report.update(usable=usable, workers=pool.workers())
    try:
        report.update(pin=pool.pin({usable[0]}), pinned=sorted(pool.pinned() or ()),
                      pinned_cpus=worker_cpus())
        again = model.predict(feeds)                   # the same results, pinned
        report["same"] = all(np.array_equal(again[k], expected[k]) for k in expected)
    finally:
        report["unpin"] = pool.pin(None)
    report.update(unpinned=pool.pinned() is None, unpinned_cpus=worker_cpus())
print(json.dumps(report))
"""


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or not Path("/proc/self/task").exists(),
                    reason="reads thread affinity from Linux's /proc")
def test_pinning_moves_the_native_workers_and_back() -> None:
    root = Path(__file__).resolve().parents[2]        # this checkout's keel, not another's
    done = subprocess.run([sys.executable, "-c", _PIN_CHECK], cwd=root, capture_output=True,
                          text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    if not report["available"]:
        pytest.skip("native kernels are off or unbuilt (KEEL_NATIVE=off)")
    if report["workers"] == 0:
        pytest.skip("no native worker started (one usable CPU)")
    first = report["usable"][0]
    assert report["pin"] and report["pinned"] == [first]
    # Every worker moved, each one named already (grow names it, not the worker itself).
    assert len(report["pinned_cpus"]) == report["workers"]
    assert set(report["pinned_cpus"]) == {str(first)}
    assert report["same"]
    assert report["unpin"] and report["unpinned"]
    assert len(report["unpinned_cpus"]) == report["workers"]
    if len(report["usable"]) > 1:
        assert str(first) not in report["unpinned_cpus"]
