"""Small GGUF files for tests, written with the ``gguf`` package's writer (imported when
called): a llama-shaped model whose sizes are parameters, zero weights.

Each block ``blk.N`` holds ``attn_norm`` (float32), ``attn_q``, ``attn_k``,
``attn_v``, ``attn_output``, ``ffn_up`` and ``ffn_down`` (``dtype``); outside
the blocks are ``token_embd``, ``output_norm`` and ``output``.
:func:`block_bytes` is the bytes of one block, as a planner should count them.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

__all__ = ["block_bytes", "write_gguf"]


def _block(embedding: int, heads: int, kv_heads: int, ffn: int,
           dtype: type[np.generic]) -> dict[str, np.ndarray]:
    kv_dim = embedding // heads * kv_heads
    return {
        "attn_norm.weight": np.ones(embedding, np.float32),
        "attn_q.weight": np.zeros((embedding, embedding), dtype),
        "attn_k.weight": np.zeros((kv_dim, embedding), dtype),
        "attn_v.weight": np.zeros((kv_dim, embedding), dtype),
        "attn_output.weight": np.zeros((embedding, embedding), dtype),
        "ffn_up.weight": np.zeros((ffn, embedding), dtype),
        "ffn_down.weight": np.zeros((embedding, ffn), dtype),
    }


def block_bytes(embedding: int = 64, heads: int = 8, kv_heads: int = 2, ffn: int = 128,
                dtype: type[np.generic] = np.float16) -> int:
    """The tensor bytes of one block of :func:`write_gguf`'s model."""
    return sum(int(a.nbytes) for a in _block(embedding, heads, kv_heads, ffn, dtype).values())


def write_gguf(path: str | os.PathLike[str], layers: int = 4, context: int = 4096,
               embedding: int = 64, heads: int = 8, kv_heads: int = 2, ffn: int = 128,
               vocab: int = 100, dtype: type[np.generic] = np.float16,
               arch: str = "llama") -> Path:
    """Write the model to ``path``; returns the path."""
    from gguf import GGUFWriter, LlamaFileType

    writer = GGUFWriter(os.fspath(path), arch)
    writer.add_block_count(layers)
    writer.add_context_length(context)
    writer.add_embedding_length(embedding)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_file_type(LlamaFileType.MOSTLY_F16 if dtype is np.float16
                         else LlamaFileType.ALL_F32)
    writer.add_tensor("token_embd.weight", np.zeros((vocab, embedding), dtype))
    for i in range(layers):
        for name, array in _block(embedding, heads, kv_heads, ffn, dtype).items():
            writer.add_tensor(f"blk.{i}.{name}", array)
    writer.add_tensor("output_norm.weight", np.ones(embedding, np.float32))
    writer.add_tensor("output.weight", np.zeros((vocab, embedding), dtype))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)
