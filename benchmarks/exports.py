"""Real exports: random-initialized ``transformers`` models exported with torch.

Each builder writes an ONNX file exported by ``torch.onnx.export`` (the
TorchScript exporter, opset 17, dynamic batch and sequence axes) from a
small random-initialized ``transformers`` config; nothing is downloaded.
The tests in ``tests/zoo`` run them through keel against onnxruntime, and
``benchmarks/run.py`` times the GPT-2 decode step.

    gpt2_decoder      GPT-2 language model with past_key_values: inputs input_ids,
                      attention_mask, past_key_values.{i}.key/value; outputs logits,
                      present.{i}.key/value
    distilbert        DistilBERT encoder (last hidden state)
    vit               ViT encoder on 32x32 images (last hidden state)
    whisper_encoder   Whisper's audio encoder on log-mel features (last hidden state)

torch and transformers are optional: importing this module needs neither;
calling a builder does (``pip install 'keel-runtime[zoo]'``).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["EXPORTS", "GPT2Shape", "decode_feeds", "gpt2_decoder", "greedy_generate",
           "missing_packages"]

OPSET = 17


def missing_packages() -> str | None:
    """Why the exports cannot be built here (a missing package), or None."""
    import importlib.util

    for name in ("torch", "transformers"):
        if importlib.util.find_spec(name) is None:
            return f"{name} is not installed (pip install 'keel-runtime[zoo]')"
    return None


def _export(module: Any, args: tuple[Any, ...], path: Path, inputs: list[str],
            outputs: list[str], axes: dict[str, dict[int, str]]) -> Path:
    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")       # the tracer's notes on Python control flow
        torch.onnx.export(module, args, str(path), input_names=inputs, output_names=outputs,
                          dynamic_axes=axes, opset_version=OPSET, dynamo=False)
    return path


def _hidden_state(model: Any) -> Any:
    """A module returning ``model(...).last_hidden_state`` alone."""
    import torch

    class LastHidden(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, *args: Any) -> Any:
            return self.model(*args).last_hidden_state

    return LastHidden().eval()


@dataclass(frozen=True)
class GPT2Shape:
    """A GPT-2 config's sizes: what the decode step's cache tensors look like."""

    layers: int = 2
    hidden: int = 64
    heads: int = 4
    vocab: int = 512
    positions: int = 128

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def past_names(self) -> list[str]:
        return [f"past_key_values.{i}.{kv}" for i in range(self.layers)
                for kv in ("key", "value")]

    def present_names(self) -> list[str]:
        return [f"present.{i}.{kv}" for i in range(self.layers) for kv in ("key", "value")]


def gpt2_decoder(path: Path, shape: GPT2Shape = GPT2Shape(), seed: int = 0) -> Path:
    """GPT-2 with its key/value cache as inputs and outputs, as a decode loop runs it."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.cache_utils import DynamicCache

    torch.manual_seed(seed)
    # A wide initialization spreads the logits, so greedy tokens are not near-ties.
    config = GPT2Config(vocab_size=shape.vocab, n_positions=shape.positions,
                        n_embd=shape.hidden, n_layer=shape.layers, n_head=shape.heads,
                        initializer_range=0.2, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config).eval()

    class Step(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, input_ids: Any, attention_mask: Any, *past: Any) -> tuple[Any, ...]:
            cache = DynamicCache(config=config)
            for i in range(shape.layers):
                cache.update(past[2 * i], past[2 * i + 1], i)
            out = self.model(input_ids=input_ids, attention_mask=attention_mask,
                             past_key_values=cache, use_cache=True)
            present = [t for layer in out.past_key_values.layers
                       for t in (layer.keys, layer.values)]
            return (out.logits, *present)

    past = [torch.randn(1, shape.heads, 5, shape.head_dim) for _ in shape.past_names()]
    args = (torch.randint(0, shape.vocab, (1, 3)), torch.ones(1, 8, dtype=torch.int64), *past)
    axes = {"input_ids": {0: "batch", 1: "sequence"},
            "attention_mask": {0: "batch", 1: "total"},
            "logits": {0: "batch", 1: "sequence"},
            **{n: {0: "batch", 2: "past"} for n in shape.past_names()},
            **{n: {0: "batch", 2: "total"} for n in shape.present_names()}}
    return _export(Step().eval(), args, path, ["input_ids", "attention_mask",
                                               *shape.past_names()],
                   ["logits", *shape.present_names()], axes)


def decode_feeds(shape: GPT2Shape, ids: np.ndarray, past: list[np.ndarray] | None = None,
                 mask: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """The decoder's feeds for new tokens ``ids`` after the cache ``past`` (None: empty)."""
    batch = ids.shape[0]
    if past is None:
        past = [np.zeros((batch, shape.heads, 0, shape.head_dim), np.float32)
                for _ in shape.past_names()]
    total = past[0].shape[2] + ids.shape[1]
    if mask is None:
        mask = np.ones((batch, total), np.int64)
    return {"input_ids": ids, "attention_mask": mask, **dict(zip(shape.past_names(), past,
                                                                 strict=True))}


Runner = Callable[[dict[str, np.ndarray]], list[np.ndarray]]


def greedy_generate(run: Runner, shape: GPT2Shape, prompt: np.ndarray,
                    steps: int = 32) -> tuple[list[int], list[np.ndarray]]:
    """Greedy decoding of one sequence: the tokens, and each step's last-position logits.

    ``run(feeds)`` returns the decoder's outputs in order (logits, then the presents).
    The prompt runs as one step with an empty cache, then one token per step.
    """
    tokens: list[int] = []
    logits: list[np.ndarray] = []
    ids, past = prompt, None
    for _ in range(steps):
        out = run(decode_feeds(shape, ids, past))
        last = out[0][0, -1]
        logits.append(last)
        tokens.append(int(last.argmax()))
        ids, past = np.array([[tokens[-1]]], np.int64), out[1:]
    return tokens, logits


def distilbert(path: Path, seed: int = 0) -> Path:
    import torch
    from transformers import DistilBertConfig, DistilBertModel

    torch.manual_seed(seed)
    config = DistilBertConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, hidden_dim=128,
                              max_position_embeddings=64)
    model = _hidden_state(DistilBertModel(config).eval())
    args = (torch.randint(0, 256, (2, 7)), torch.ones(2, 7, dtype=torch.int64))
    axes = {n: {0: "batch", 1: "sequence"}
            for n in ("input_ids", "attention_mask", "last_hidden_state")}
    return _export(model, args, path, ["input_ids", "attention_mask"], ["last_hidden_state"],
                   axes)


def vit(path: Path, seed: int = 0) -> Path:
    import torch
    from transformers import ViTConfig, ViTModel

    torch.manual_seed(seed)
    config = ViTConfig(image_size=32, patch_size=8, hidden_size=64, num_hidden_layers=2,
                       num_attention_heads=4, intermediate_size=128)
    model = _hidden_state(ViTModel(config, add_pooling_layer=False).eval())
    axes = {n: {0: "batch"} for n in ("pixel_values", "last_hidden_state")}
    return _export(model, (torch.randn(2, 3, 32, 32),), path, ["pixel_values"],
                   ["last_hidden_state"], axes)


WHISPER_MELS, WHISPER_FRAMES = 16, 100


def whisper_encoder(path: Path, seed: int = 0) -> Path:
    import torch
    from transformers import WhisperConfig
    from transformers.models.whisper.modeling_whisper import WhisperEncoder

    torch.manual_seed(seed)
    config = WhisperConfig(vocab_size=128, num_mel_bins=WHISPER_MELS, d_model=64,
                           encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=128,
                           decoder_layers=1, decoder_attention_heads=4, decoder_ffn_dim=128,
                           max_source_positions=WHISPER_FRAMES // 2)
    model = _hidden_state(WhisperEncoder(config).eval())
    axes = {n: {0: "batch"} for n in ("input_features", "last_hidden_state")}
    return _export(model, (torch.randn(2, WHISPER_MELS, WHISPER_FRAMES),), path,
                   ["input_features"], ["last_hidden_state"], axes)


EXPORTS: dict[str, Callable[[Path], Path]] = {
    "gpt2_decoder": gpt2_decoder,
    "distilbert": distilbert,
    "vit": vit,
    "whisper_encoder": whisper_encoder,
}
