"""The WebGPU part of the probe: asked for, recorded with its fields, or a note saying why."""

from __future__ import annotations

import pytest

from keel.hardware import HardwareProfile, probe
from keel.hardware.fakes import FAKE_MACHINES, fake_machine


def test_not_probed_unless_asked_and_the_note_says_so() -> None:
    profile = fake_machine(next(iter(FAKE_MACHINES))).profile()
    assert profile.webgpu_adapters == ()
    assert any(n.startswith("webgpu_adapters: not probed") for n in profile.notes)


def test_without_wgpu_the_note_says_how_to_install_it() -> None:
    machine = fake_machine(next(iter(FAKE_MACHINES)))
    profile = probe(machine.sources(), webgpu=True)
    assert profile.webgpu_adapters == ()
    note = next(n for n in profile.notes if n.startswith("webgpu_adapters:"))
    assert "keel-runtime[webgpu]" in note


def test_this_machine_lists_its_adapters_with_their_fields() -> None:
    pytest.importorskip("wgpu", reason="the webgpu extra is not installed here")
    profile = probe(webgpu=True)
    if not profile.webgpu_adapters:
        note = next(n for n in profile.notes if n.startswith("webgpu_adapters:"))
        pytest.skip(f"no WebGPU adapter here: {note}")
    for adapter in profile.webgpu_adapters:
        assert adapter.backend_type in ("Vulkan", "Metal", "D3D12")
        assert adapter.adapter_type in ("DiscreteGPU", "IntegratedGPU", "CPU", "Unknown")
        assert adapter.limits["max-storage-buffer-binding-size"] > 0
    again = HardwareProfile.from_json(profile.to_json())
    assert again.webgpu_adapters == profile.webgpu_adapters
