"""A feed that only bound native products read is read where the caller's array lies
(from the cpu planner's FEED_IN_PLACE_BYTES), not copied into the program's own buffer: bitwise the
staged form's results, and no call keeps the caller's address past its run."""

from __future__ import annotations

import gc
import struct

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from keel.backends.cpu import planner
from keel.errors import InvalidArgumentError
from keel.execution.model import Model, load_model
from tests.execution.test_bound_steps import unbound

ROWS, WIDTH, HIDDEN = 32, 512, 256     # a 64 KiB feed: read in place as planned


def two_layers(rows: int | str = ROWS) -> bytes:
    """Gemm + bias + ReLU, then MatMul: the MLP's first layer reads the feed."""
    rng = np.random.default_rng(5)
    n = helper.make_node
    graph = helper.make_graph(
        [n("Gemm", ["x", "w1", "b1"], ["h0"]), n("Relu", ["h0"], ["h"]),
         n("MatMul", ["h", "w2"], ["y"])],
        "two_layers", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [rows, WIDTH])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [rows, WIDTH])],
        [numpy_helper.from_array((rng.standard_normal((WIDTH, HIDDEN)) / 14).astype(np.float32),
                                 "w1"),
         numpy_helper.from_array(rng.standard_normal(HIDDEN).astype(np.float32), "b1"),
         numpy_helper.from_array((rng.standard_normal((HIDDEN, WIDTH)) / 16).astype(np.float32),
                                 "w2")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]
                             ).SerializeToString()


def _loaded(onnx_model: bytes, threads: int, in_place: bool,
            monkeypatch: pytest.MonkeyPatch) -> Model:
    """A model whose program read its feed in place from 0 bytes, or never (the staged
    form), as the program decides at its first runs."""
    monkeypatch.setattr(planner, "FEED_IN_PLACE_BYTES",   # past every staged feed: none
                        0 if in_place else planner.STAGE_FEED_BYTES + 1)
    model = load_model(onnx_model, backend="cpu", threads=threads)
    warm = np.zeros((ROWS, WIDTH), np.float32)
    for _ in range(2):
        model.predict({"x": warm})
    return model


def _program(model: Model, x: np.ndarray) -> object:
    fast = model._fast_path({"x": x})
    assert fast is not None
    return fast[0][1]


def _native() -> bool:
    from keel import native

    return native.available()


def test_the_feed_is_read_in_place_bitwise_the_staged_form_on_every_thread_count(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """On 1, 2, 3 and 16 threads the in-place program gives bitwise the staged one's and
    the unbound kernels' results, and the same bits on every thread count."""
    onnx_model = two_layers()
    rng = np.random.default_rng(1)
    xs = [rng.standard_normal((ROWS, WIDTH)).astype(np.float32) for _ in range(3)]
    results = []
    for threads in (1, 2, 3, 16):
        staged = _loaded(onnx_model, threads, False, monkeypatch)
        fed = _loaded(onnx_model, threads, True, monkeypatch)
        assert _program(staged, xs[0]).feeds_in_place == ()  # type: ignore[attr-defined]
        assert _program(fed, xs[0]).feeds_in_place == (  # type: ignore[attr-defined]
            ("x",) if _native() else ())
        got = [fed.predict({"x": x})["y"] for x in xs]
        for x, y in zip(xs, got, strict=True):
            np.testing.assert_array_equal(y, staged.predict({"x": x})["y"])
            np.testing.assert_array_equal(y, unbound(fed, {"x": x})["y"])
        results.append(got)
    for got in results[1:]:
        for a, b in zip(results[0], got, strict=True):
            np.testing.assert_array_equal(a, b)


def _odd_feeds(rng: np.random.Generator) -> list[np.ndarray]:
    """Feeds of the planned shape the program may not point its calls at, or may."""
    wide = rng.standard_normal((ROWS, 2 * WIDTH)).astype(np.float32)
    flat = rng.standard_normal(ROWS * WIDTH + 1).astype(np.float32)
    return [
        wide[:, ::2],                                       # strided
        np.asfortranarray(rng.standard_normal((ROWS, WIDTH)).astype(np.float32)),
        flat[1:].reshape(ROWS, WIDTH),                      # contiguous, off by 4 bytes
        np.frombuffer(bytearray(4 * ROWS * WIDTH + 2), np.float32, ROWS * WIDTH,
                      0).reshape(ROWS, WIDTH) + 1,          # a plain copy (aligned)
    ]


@pytest.mark.parametrize("threads", [1, 2])
def test_feeds_it_cannot_point_at_are_copied_and_every_result_is_right(
        threads: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Strided, Fortran-ordered and misaligned-to-the-line feeds, in turn with plain ones:
    each result is bitwise the staged program's (which copies every feed); a float64 feed
    is refused with a typed error, and the next run is right."""
    onnx_model = two_layers()
    staged = _loaded(onnx_model, threads, False, monkeypatch)
    fed = _loaded(onnx_model, threads, True, monkeypatch)
    rng = np.random.default_rng(2)
    for x in _odd_feeds(rng):
        plain = rng.standard_normal((ROWS, WIDTH)).astype(np.float32)
        for feed in (x, plain, x):
            np.testing.assert_array_equal(fed.predict({"x": feed})["y"],
                                          staged.predict({"x": feed})["y"])
    plain = rng.standard_normal((ROWS, WIDTH))
    with pytest.raises(InvalidArgumentError):
        fed.predict({"x": plain})
    np.testing.assert_array_equal(fed.predict({"x": plain.astype(np.float32)})["y"],
                                  staged.predict({"x": plain.astype(np.float32)})["y"])


def test_a_feed_of_another_shape_each_call_is_right(monkeypatch: pytest.MonkeyPatch) -> None:
    """With a symbolic batch, each shape runs its own program: alternating shapes, each
    result is the unbound kernels'."""
    onnx_model = two_layers("n")
    monkeypatch.setattr(planner, "FEED_IN_PLACE_BYTES", 0)
    model = load_model(onnx_model, backend="cpu", threads=1)
    rng = np.random.default_rng(3)
    for rows in (32, 8, 32, 1, 8, 32):
        x = rng.standard_normal((rows, WIDTH)).astype(np.float32)
        np.testing.assert_array_equal(model.predict({"x": x})["y"],
                                      unbound(model, {"x": x})["y"])


def _a_address(call: object) -> int:
    """The address a bound product's argument block holds for A now."""
    fed = call.fed  # type: ignore[attr-defined]
    return int(struct.unpack_from("<q", fed._args, 24)[0])


def test_no_call_keeps_the_callers_array_past_its_run(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The caller mutating its array between calls, or freeing it and the next array
    landing elsewhere, is never read stale: after each run the product's call reads the
    program's own buffer again, not the caller's array."""
    if not _native():
        pytest.skip("the native tier is unavailable")
    onnx_model = two_layers()
    model = _loaded(onnx_model, 1, True, monkeypatch)
    x = np.random.default_rng(4).standard_normal((ROWS, WIDTH)).astype(np.float32)
    program = _program(model, x)
    call = program._hot[0][1]           # type: ignore[attr-defined]   # the first Gemm
    home = call.fed.reads
    first = model.predict({"x": x})["y"]
    assert _a_address(call) == home != x.__array_interface__["data"][0]
    x *= -1.0                                           # mutated in place
    np.testing.assert_array_equal(model.predict({"x": x})["y"], unbound(model, {"x": x})["y"])
    assert not np.array_equal(model.predict({"x": x})["y"], first)
    for seed in range(5):                              # freed, a new array in its stead
        del x
        gc.collect()
        x = np.random.default_rng(seed).standard_normal((ROWS, WIDTH)).astype(np.float32)
        np.testing.assert_array_equal(model.predict({"x": x})["y"],
                                      unbound(model, {"x": x})["y"])
        assert _a_address(call) == home


@pytest.mark.parametrize("rows", [ROWS, 8])
def test_the_planner_reads_in_place_only_feeds_worth_it(rows: int) -> None:
    """As planned, a 64 KiB feed is read in place, a 16 KiB one copied (its copy costs
    less than pointing the call); both give the unbound kernels' results."""
    onnx_model = two_layers(rows)
    model = load_model(onnx_model, backend="cpu", threads=1)
    x = np.random.default_rng(rows).standard_normal((rows, WIDTH)).astype(np.float32)
    for _ in range(2):
        model.predict({"x": x})
    in_place = _native() and rows * WIDTH * 4 >= planner.FEED_IN_PLACE_BYTES
    assert _program(model, x).feeds_in_place == (  # type: ignore[attr-defined]
        ("x",) if in_place else ())
    np.testing.assert_array_equal(model.predict({"x": x})["y"], unbound(model, {"x": x})["y"])
