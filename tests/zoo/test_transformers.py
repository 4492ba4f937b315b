"""Real exports of random-initialized ``transformers`` models, run by keel and by
onnxruntime: every output within 1e-4 relative L2, greedy tokens exactly the same."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

import keel
from benchmarks.exports import (
    WHISPER_FRAMES,
    WHISPER_MELS,
    GPT2Shape,
    decode_feeds,
    greedy_generate,
)
from tests.graph.models import rel_l2

ort = pytest.importorskip("onnxruntime", reason="the zoo is checked against onnxruntime")

TOLERANCE = 1e-4
Zoo = Callable[[str], Path]


def _sessions(path: Path) -> tuple[keel.Model, object]:
    model = keel.load_model(str(path))
    return model, ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def _assert_close(got: list[np.ndarray], want: list[np.ndarray]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype
        assert rel_l2(g, w) <= TOLERANCE


def test_gpt2_greedy_generation_gives_onnxruntimes_tokens(zoo: Zoo) -> None:
    model, session = _sessions(zoo("gpt2_decoder"))
    shape = GPT2Shape()
    prompt = np.array([[7, 3, 99, 12, 5]], np.int64)
    tokens, logits = greedy_generate(lambda f: model.run(None, f), shape, prompt)
    want_tokens, want_logits = greedy_generate(lambda f: session.run(None, f), shape, prompt)
    assert len(tokens) == 32
    assert tokens == want_tokens
    assert len(set(tokens)) > 1               # the loop really follows the cache
    for got, want in zip(logits, want_logits, strict=True):
        assert rel_l2(got, want) <= TOLERANCE


def test_gpt2_step_with_a_padded_batch_and_a_cache(zoo: Zoo) -> None:
    model, session = _sessions(zoo("gpt2_decoder"))
    shape = GPT2Shape()
    rng = np.random.default_rng(0)
    past = [rng.standard_normal((2, shape.heads, 6, shape.head_dim)).astype(np.float32)
            for _ in shape.past_names()]
    mask = np.ones((2, 8), np.int64)
    mask[1, :3] = 0                             # the second sequence is left-padded
    feeds = decode_feeds(shape, rng.integers(0, shape.vocab, (2, 2)), past, mask)
    _assert_close(model.run(None, feeds), session.run(None, feeds))


def _encoder_feeds(name: str, batch: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(batch)
    if name == "distilbert":
        mask = np.ones((batch, 11), np.int64)
        mask[1:, 7:] = 0                        # padding past the seventh token
        return {"input_ids": rng.integers(0, 256, (batch, 11)), "attention_mask": mask}
    if name == "vit":
        return {"pixel_values": rng.standard_normal((batch, 3, 32, 32)).astype(np.float32)}
    features = rng.standard_normal((batch, WHISPER_MELS, WHISPER_FRAMES))
    return {"input_features": features.astype(np.float32)}


@pytest.mark.parametrize("name", ["distilbert", "vit", "whisper_encoder"])
def test_encoder_matches_onnxruntime(zoo: Zoo, name: str) -> None:
    model, session = _sessions(zoo(name))
    for batch in (1, 3):                        # a second shape through the same model
        feeds = _encoder_feeds(name, batch)
        _assert_close(model.run(None, feeds), session.run(None, feeds))
