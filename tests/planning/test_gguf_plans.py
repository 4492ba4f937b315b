"""llama.cpp planned from GGUF metadata: the facts read, the offload arithmetic, the flags."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from keel.cli import app
from keel.errors import InvalidArgumentError, ModelFormatError
from keel.hardware.fakes import fake_profile
from keel.hardware.profile import HardwareProfile
from keel.planning.gguf import (
    GPU_RESERVE_BYTES,
    MLOCK_SHARE,
    is_gguf_file,
    plan_llama_cpp,
    read_gguf,
)
from keel.planning.policy import RuntimePolicy
from keel.testing.cli import printed_json
from keel.testing.gguf_files import block_bytes, write_gguf

pytest.importorskip("gguf", reason="the gguf package (keel-runtime[gguf]) reads GGUF files")

LAYERS = 6
BLOCK = block_bytes()
# 2 (K, V) x context x kv_heads 2 x head_dim 64/8 x 2 bytes
KV_4096 = 2 * 4096 * 2 * 8 * 2


@pytest.fixture
def gguf_file(tmp_path: Path) -> Path:
    return write_gguf(tmp_path / "tiny.gguf", layers=LAYERS)


def _with_gpu_free(free: int | None, total: int = 80 << 30) -> HardwareProfile:
    """The H100 server's profile with one GPU whose free memory is ``free``."""
    profile = fake_profile("nvidia-h100-nvml")
    gpu = dataclasses.replace(profile.gpus[0], free_memory_bytes=free, total_memory_bytes=total)
    return dataclasses.replace(profile, gpus=(gpu,), thermal=())


def test_the_metadata_is_read(gguf_file: Path) -> None:
    model = read_gguf(gguf_file)
    assert (model.architecture, model.layers, model.context_length) == ("llama", LAYERS, 4096)
    assert (model.embedding, model.heads, model.kv_heads, model.head_dim) == (64, 8, 2, 8)
    assert model.quantization == "MOSTLY_F16"
    assert model.layer_bytes == (BLOCK,) * LAYERS
    vocab_f16 = 100 * 64 * 2
    assert model.output_bytes == vocab_f16
    assert model.other_bytes == 2 * vocab_f16 + 64 * 4       # embeddings, output, norm
    assert model.kv_bytes_per_layer(4096) == KV_4096
    assert is_gguf_file(gguf_file) and not is_gguf_file(Path(__file__))


def test_layers_are_offloaded_while_they_fit(gguf_file: Path) -> None:
    model = read_gguf(gguf_file)
    per_layer = BLOCK + KV_4096
    free = GPU_RESERVE_BYTES + 3 * per_layer + per_layer // 2          # room for 3.5 layers
    plan = plan_llama_cpp(model, _with_gpu_free(free))
    assert (plan.device, plan.gpu, plan.gpu_layers) == ("gpu", 0, 3)
    assert plan.flags[:4] == ("-ngl", "3", "-c", "4096")
    assert plan.reasons[0].startswith("-ngl 3: GPU 0")
    assert plan.selection().detail == f"3 of {LAYERS} layers on GPU 0"
    assert f"3 of {LAYERS} layers fit" in plan.reasons[0]
    assert "the profile's free memory" in plan.reasons[0]
    assert any(r.startswith("KV cache: 2 x 4096 tokens x 2 KV heads x 8 head dim x 2 bytes")
               for r in plan.reasons)


def test_a_smaller_context_lets_more_layers_fit(gguf_file: Path) -> None:
    model = read_gguf(gguf_file)
    free = GPU_RESERVE_BYTES + 3 * (BLOCK + KV_4096)
    full = plan_llama_cpp(model, _with_gpu_free(free))
    short = plan_llama_cpp(model, _with_gpu_free(free), context=512)
    assert full.gpu_layers == 3 and short.gpu_layers > full.gpu_layers
    assert short.context == 512 and "-c" in short.flags and "512" in short.flags
    with pytest.raises(InvalidArgumentError, match="--context must be a positive"):
        plan_llama_cpp(model, _with_gpu_free(free), context=0)
    longer = plan_llama_cpp(model, _with_gpu_free(free), context=8192)
    assert any("beyond the trained context 4096" in r for r in longer.reasons)


def test_everything_fitting_offloads_the_output_layer_too(gguf_file: Path) -> None:
    plan = plan_llama_cpp(read_gguf(gguf_file), fake_profile("nvidia-h100-nvml"))
    assert plan.gpu_layers == LAYERS + 1 and plan.batch == 2048
    assert "the output layer" in plan.reasons[0] and "fits too" in plan.reasons[0]
    assert plan.command("m.gguf").startswith(f"llama-cli -m m.gguf -ngl {LAYERS + 1} -c 4096")


def test_no_gpu_or_no_room_gives_a_cpu_plan_that_says_so(gguf_file: Path) -> None:
    model = read_gguf(gguf_file)
    board = plan_llama_cpp(model, fake_profile("edge-arm-board"))
    assert (board.device, board.gpu_layers, board.batch) == ("cpu", 0, 512)
    assert board.reasons[0] == "CPU plan (-ngl 0): no GPU detected"
    tight = plan_llama_cpp(model, _with_gpu_free(GPU_RESERVE_BYTES + BLOCK))
    assert tight.device == "cpu" and tight.flags[:2] == ("-ngl", "0")
    assert "one layer needs" in tight.reasons[0]
    unknown = plan_llama_cpp(model, _with_gpu_free(None, total=None))  # type: ignore[arg-type]
    assert "its memory is unknown" in unknown.reasons[0]
    off = plan_llama_cpp(model, fake_profile("nvidia-h100-nvml"),
                         RuntimePolicy(prefer_gpu=False))
    assert off.device == "cpu" and "prefer_gpu is false" in off.reasons[0]


def test_a_hot_gpu_is_kept_out_of_the_plan(gguf_file: Path) -> None:
    plan = plan_llama_cpp(read_gguf(gguf_file), fake_profile("nvidia-h100-hot"))
    assert plan.device == "cpu" and plan.gpu_layers == 0
    assert "within 5 C of its slowdown temperature 87 C" in plan.reasons[0]


def test_telemetry_free_memory_wins_over_the_profile(gguf_file: Path) -> None:
    class Snapshot:
        source = "nvml"

        def available_bytes(self, device: str) -> int | None:
            return GPU_RESERVE_BYTES + 2 * (BLOCK + KV_4096) if device == "gpu:0" else None

    plan = plan_llama_cpp(read_gguf(gguf_file), _with_gpu_free(80 << 30), telemetry=Snapshot())
    assert plan.gpu_layers == 2 and "free memory read by nvml" in plan.reasons[0]


def test_threads_and_mlock_follow_the_machine(gguf_file: Path) -> None:
    model = read_gguf(gguf_file)
    server = plan_llama_cpp(model, fake_profile("x86-avx512-server"))
    assert server.threads == 112 and "physical cores" in " ".join(server.reasons)
    assert server.mlock and server.flags[-1] == "--mlock"
    assert any(f"locking needs at most {MLOCK_SHARE:.0%}" in r for r in server.reasons)
    hot = plan_llama_cpp(model, fake_profile("edge-arm-board-hot"))
    assert hot.threads == 4 and any("86.5 C" in r for r in hot.reasons)
    assert not hot.mlock and any("no --mlock: low-memory mode" in r for r in hot.reasons)
    profile = fake_profile("x86-avx512-server")
    small = dataclasses.replace(profile, memory=dataclasses.replace(
        profile.memory, effective_available_bytes=model.weight_bytes))
    assert not plan_llama_cpp(model, small, RuntimePolicy(
        lightweight_memory_threshold_gb=0.0)).mlock


def test_bad_files_are_typed_errors(gguf_file: Path, tmp_path: Path) -> None:
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(gguf_file.read_bytes()[:-BLOCK])
    with pytest.raises(ModelFormatError, match="truncated"):
        read_gguf(truncated)
    header_only = tmp_path / "header.gguf"
    header_only.write_bytes(gguf_file.read_bytes()[:40])
    with pytest.raises(ModelFormatError, match="cannot read GGUF file"):
        read_gguf(header_only)
    other = tmp_path / "other.gguf"
    other.write_bytes(b"ONNX" + bytes(100))
    with pytest.raises(ModelFormatError, match="not a GGUF file"):
        read_gguf(other)
    with pytest.raises(InvalidArgumentError, match="does not exist"):
        read_gguf(tmp_path / "missing.gguf")


def test_a_file_without_the_needed_keys_is_refused(tmp_path: Path) -> None:
    from gguf import GGUFWriter

    writer = GGUFWriter(str(tmp_path / "bare.gguf"), "llama")
    writer.add_block_count(2)
    writer.add_tensor("blk.0.attn_q.weight", np.zeros((4, 4), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelFormatError, match=r"lacks llama\.embedding_length"):
        read_gguf(tmp_path / "bare.gguf")


def test_keel_plan_on_a_gguf_prints_the_flags_and_the_runtime_row(gguf_file: Path,
                                                                  tmp_path: Path) -> None:
    hardware = tmp_path / "h100.json"
    hardware.write_text(fake_profile("nvidia-h100-nvml").to_json())
    runner = CliRunner()
    result = runner.invoke(app, ["plan", str(gguf_file), "--hardware", str(hardware),
                                 "--context", "1024", "--json"])
    assert result.exit_code == 0, result.output
    data = printed_json(result)
    assert data["llama_cpp"]["flags"][:4] == ["-ngl", str(LAYERS + 1), "-c", "1024"]
    row = data["runtime"]["llama_cpp"]
    assert row["choice"] == "gpu" and row["reason"].startswith(f"-ngl {LAYERS + 1} -c 1024")
    assert row["detail"] == f"all {LAYERS} layers and the output layer on GPU 0"
    text = runner.invoke(app, ["plan", str(gguf_file), "--hardware", str(hardware)])
    assert text.exit_code == 0 and f"-ngl {LAYERS + 1} -c 4096" in text.output
    assert "KV cache:" in text.output
    onnx_context = runner.invoke(app, ["plan", "--context", "10"])
    assert isinstance(onnx_context.exception, InvalidArgumentError)
    assert "--context applies to GGUF models" in str(onnx_context.exception)
