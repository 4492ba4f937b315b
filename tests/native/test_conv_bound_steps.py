"""A model's depthwise and Winograd conv nodes run as bound program steps (their native
calls, bound once); later runs stay exact, and a form the step cannot bind runs as before."""

from __future__ import annotations

import numpy as np
import pytest

from keel import load_model
from keel.backends.bound import BoundCall
from keel.backends.cpu import native_window
from keel.execution import program as program_module
from keel.testing.models import mobilenet_block, resnet_block, resnet_stages

pytestmark = pytest.mark.usefixtures("native_tier")


def _kinds(model: object, feeds: dict[str, np.ndarray], variant: str = "depthwise"
           ) -> list[int]:
    """How the program runs each conv step of ``variant`` (program._BOUND: its bound call)."""
    fast = model._fast_path(feeds)            # type: ignore[attr-defined]
    assert fast is not None
    program = fast[0][1]
    return [hot[0] for step, hot in zip(program._steps, program._hot, strict=True)
            if step.variant is not None and step.variant.name == variant]


def _feeds(model: object, count: int) -> list[dict[str, np.ndarray]]:
    info = model.inputs[0]                    # type: ignore[attr-defined]
    shape = [d if isinstance(d, int) else 1 for d in info.shape]
    rng = np.random.default_rng(0)
    return [{info.name: rng.standard_normal(shape).astype(np.float32)} for _ in range(count)]


# (model, its conv variant that binds, how many of its convs run that variant)
_BOUND_CASES = {
    "depthwise": (lambda: mobilenet_block(size=16, blocks=2), 2),
    # 64 channels on 32 x 32: the Winograd convs run as the per-thread pipeline
    "winograd": (lambda: resnet_block(channels=64, size=32), 2),
}


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("variant", sorted(_BOUND_CASES))
def test_bound_conv_steps_match_the_kernel_and_the_reference(variant: str, threads: int
                                                             ) -> None:
    make, count = _BOUND_CASES[variant]
    proto = make()
    steady = load_model(proto, backend="cpu", threads=threads)
    reference = load_model(proto, backend="reference")
    feeds = _feeds(steady, 4)
    steady.predict(feeds[0])                              # binds the steps
    kinds = _kinds(steady, feeds[0], variant)
    assert len(kinds) == count and set(kinds) == {program_module._BOUND}
    for x in feeds[1:]:
        got = steady.predict(x)
        kernel = steady.intermediates(x)                  # the kernels, nothing bound
        want = reference.predict(x)
        for key in want:
            assert got[key].tobytes() == kernel[key].tobytes()
            np.testing.assert_allclose(got[key], want[key], rtol=1e-3, atol=1e-3)


def test_bound_depthwise_steps_give_the_same_bits_on_every_thread_count() -> None:
    proto = mobilenet_block(size=20, blocks=2, channels=24)
    x = _feeds(load_model(proto, backend="cpu", threads=1), 1)[0]
    outs = []
    for threads in (1, 2, 3, 16):
        model = load_model(proto, backend="cpu", threads=threads)
        model.predict(x)
        assert set(_kinds(model, x)) == {program_module._BOUND}
        outs.append(model.predict(x)["logits"].tobytes())
    assert len(set(outs)) == 1


def test_a_depthwise_conv_whose_activation_needs_its_own_pass_is_not_bound() -> None:
    """HardSwish is applied after the kernel, in a pass of its own: the step keeps the
    general path, and computes what the reference does."""
    proto = mobilenet_block(size=16, activation="hardswish")
    model = load_model(proto, backend="cpu", threads=1)
    x = _feeds(model, 1)[0]
    model.predict(x)
    kinds = _kinds(model, x)
    assert kinds and program_module._BOUND not in kinds
    want = load_model(proto, backend="reference").predict(x)
    np.testing.assert_allclose(model.predict(x)["logits"], want["logits"], rtol=1e-4, atol=1e-4)


def test_bound_winograd_steps_give_the_same_bits_on_every_thread_count() -> None:
    """256 channels on 14 x 14 run pass by pass on two threads or more (unbound there)
    and as the bound pipeline on one: the same bits either way."""
    outs = {}
    for channels, size in ((64, 32), (256, 14)):
        proto = resnet_block(channels=channels, size=size)
        x = _feeds(load_model(proto, backend="cpu", threads=1), 1)[0]
        for threads in (1, 2, 3, 16):
            model = load_model(proto, backend="cpu", threads=threads)
            model.predict(x)
            kinds = _kinds(model, x, "winograd")
            assert len(kinds) == 2
            if threads == 1:
                assert set(kinds) == {program_module._BOUND}
            outs.setdefault(channels, set()).add(model.predict(x)["logits"].tobytes())
    assert all(len(bits) == 1 for bits in outs.values())


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_a_conv_copying_phases_in_the_window_kernels_is_a_native_step(threads: int) -> None:
    """A 7-wide stride-2 conv and its 1x1 shortcut copy X into a phase image first; where
    the window kernels make that copy, the bound step is the copy then the GEMM, C code
    only, marked ``native``, and computes the kernels' bits."""
    proto = resnet_stages(channels=128, size=14)
    model = load_model(proto, backend="cpu", threads=threads)
    feeds = _feeds(model, 3)
    model.predict(feeds[0])
    program = model._fast_path(feeds[0])[0][1]     # type: ignore[attr-defined,index]
    phased = [hot[1] for step, hot in zip(program._steps, program._hot, strict=True)
              if step.op == "conv"
              and any(isinstance(k, native_window.Bound) for k in getattr(hot[1], "keep", ()))]
    assert len(phased) == 2
    assert all(isinstance(c, BoundCall) and c.native for c in phased)
    for x in feeds[1:]:
        got, kernel = model.predict(x), model.intermediates(x)
        for key in got:
            assert got[key].tobytes() == kernel[key].tobytes()
