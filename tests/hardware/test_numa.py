"""NUMA: the probe reads each node's CPUs from sysfs; on a machine with several nodes the
cpu plan keeps keel's threads on one node by default (``KEEL_NUMA_PIN``), sizes the thread
count to it and says so; the native pool's workers follow the pin."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
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


def _worker_cpus() -> list[str]:
    lists = []
    for task in Path(f"/proc/{os.getpid()}/task").iterdir():
        if (task / "comm").read_text().strip() == "keel-worker":
            status = (task / "status").read_text()
            lists += [line.split(":", 1)[1].strip() for line in status.splitlines()
                      if line.startswith("Cpus_allowed_list")]
    return lists


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or not Path("/proc/self/task").exists(),
                    reason="reads thread affinity from Linux's /proc")
def test_pinning_moves_the_native_workers_and_back() -> None:
    from keel import native
    from keel.native import pool

    if not native.available():
        pytest.skip("native kernels are off or unbuilt (KEEL_NATIVE=off)")
    usable = sorted(os.sched_getaffinity(0))
    proto = mlp(in_features=256, hidden=(256,), classes=4)
    model = load_model(proto.SerializeToString(), backend="cpu", threads=2)
    feeds = make_inputs(proto, batch=64)
    expected = model.predict(feeds)                      # starts the workers
    if pool.workers() == 0:
        pytest.skip("no native worker started (one usable CPU)")
    try:
        assert pool.pin({usable[0]})
        assert pool.pinned() == frozenset({usable[0]})
        assert set(_worker_cpus()) == {str(usable[0])}
        again = model.predict(feeds)                     # the same results, pinned
        assert all(np.array_equal(again[k], expected[k]) for k in expected)
    finally:
        assert pool.pin(None)
    assert pool.pinned() is None
    if len(usable) > 1:
        assert str(usable[0]) not in _worker_cpus()
