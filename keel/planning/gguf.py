"""llama.cpp planned from a GGUF file: how many layers go to the GPU, and the flags.

:func:`read_gguf` reads a GGUF file's metadata with the ``gguf`` package
(``pip install keel-runtime[gguf]``, imported when called): the architecture,
the layer count, each layer's tensor bytes, the trained context length, the
embedding size, the attention and KV head counts and the quantization type.

:func:`plan_llama_cpp` turns that and a hardware profile into a
:class:`LlamaCppPlan`. The KV cache of the requested context costs, per layer,
``2 (K and V) x context x kv_heads x head_dim x 2 bytes`` (llama.cpp's default
f16 cache). Layers go to the GPU while their weights and KV cache fit the GPU's
free memory (NVML's reading for this machine, the profile's free, else total,
memory for another) less :data:`GPU_RESERVE_BYTES` for the CUDA context and
compute buffers; when every layer fits with room for the output layer too,
``-ngl`` is the layer count plus one. No usable GPU, or no room for one layer,
gives a CPU plan that says so. ``-t`` is the planned thread count (physical
cores, fewer while the CPU throttles), ``-b`` the prompt batch, ``--mlock`` is
added when what stays in host memory takes at most :data:`MLOCK_SHARE` of it
and the machine is not in low-memory mode. Every number is in the reasons.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from keel.config import format_bytes
from keel.errors import InvalidArgumentError, KeelError, ModelFormatError
from keel.hardware.profile import GpuInfo, HardwareProfile
from keel.hardware.thermal import hot_gpus
from keel.planning.policy import RuntimePolicy
from keel.planning.runtime_plan import Selection, low_memory_reason, select_threads

__all__ = ["GPU_RESERVE_BYTES", "KV_BYTES_PER_ELEMENT", "MLOCK_SHARE", "GgufModel",
           "LlamaCppPlan", "is_gguf_file", "plan_llama_cpp", "read_gguf"]

GGUF_MAGIC = b"GGUF"
#: GPU memory kept free for the CUDA/Metal context and llama.cpp's compute buffers
GPU_RESERVE_BYTES = 512 * 1024**2
#: bytes per element of llama.cpp's default KV cache (f16)
KV_BYTES_PER_ELEMENT = 2
#: --mlock only while what stays in host memory takes at most this share of it
MLOCK_SHARE = 0.5
#: prompt batch (-b) with layers on the GPU and on the CPU only (llama.cpp's default 2048;
#: a CPU plan keeps the compute buffer small)
GPU_BATCH, CPU_BATCH = 2048, 512
# llama.cpp builds that can offload to each GPU vendor
_OFFLOADING_VENDORS = ("nvidia", "amd", "apple", "intel")


@dataclass(frozen=True)
class GgufModel:
    """What planning reads from a GGUF file."""

    file: str
    architecture: str
    layers: int
    context_length: int
    embedding: int
    heads: int
    kv_heads: int
    head_dim: int
    quantization: str                 # the file type, else the layers' main tensor type
    layer_bytes: tuple[int, ...]      # tensor bytes of each block
    other_bytes: int                  # token embedding, output layer, norms
    output_bytes: int                 # the output layer (offloaded with -ngl layers+1)

    @property
    def weight_bytes(self) -> int:
        return sum(self.layer_bytes) + self.other_bytes

    def kv_bytes_per_layer(self, context: int) -> int:
        """KV cache bytes of one layer for ``context`` tokens (f16 K and V)."""
        return 2 * context * self.kv_heads * self.head_dim * KV_BYTES_PER_ELEMENT

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["layer_bytes"] = list(self.layer_bytes)
        return data


@dataclass(frozen=True)
class LlamaCppPlan:
    """llama.cpp's flags for one model on one machine, with the arithmetic behind them."""

    model: GgufModel
    device: str                       # gpu | cpu
    gpu: int | None
    gpu_layers: int
    context: int
    threads: int | None
    batch: int
    mlock: bool
    reasons: tuple[str, ...]

    @property
    def flags(self) -> tuple[str, ...]:
        flags = ["-ngl", str(self.gpu_layers), "-c", str(self.context)]
        if self.threads is not None:
            flags += ["-t", str(self.threads)]
        flags += ["-b", str(self.batch)]
        if self.mlock:
            flags.append("--mlock")
        return tuple(flags)

    def command(self, model_path: str = "") -> str:
        """A llama.cpp command line for the model at ``model_path`` (else its file name)."""
        return " ".join(("llama-cli", "-m", model_path or self.model.file, *self.flags))

    def selection(self) -> Selection:
        """The runtime plan's llama.cpp row for this model."""
        layers = self.model.layers
        where = ("every layer on the CPU" if self.device == "cpu" else
                 f"all {layers} layers and the output layer on GPU {self.gpu}"
                 if self.gpu_layers > layers else
                 f"{self.gpu_layers} of {layers} layers on GPU {self.gpu}")
        return Selection("llama.cpp", self.device, f"{' '.join(self.flags)}: {self.reasons[0]}",
                         ("cpu",), detail=where)

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model.to_dict(), "device": self.device, "gpu": self.gpu,
                "gpu_layers": self.gpu_layers, "context": self.context,
                "threads": self.threads, "batch": self.batch, "mlock": self.mlock,
                "flags": list(self.flags), "command": self.command(),
                "reasons": list(self.reasons)}


# --- reading --------------------------------------------------------------------------


def is_gguf_file(path: str | os.PathLike[str]) -> bool:
    """Whether the file at ``path`` starts with the GGUF magic."""
    try:
        with open(path, "rb") as fh:
            return fh.read(4) == GGUF_MAGIC
    except OSError:
        return False


def read_gguf(path: str | os.PathLike[str]) -> GgufModel:
    """The planning facts of the GGUF file at ``path``; :class:`ModelFormatError` for a file
    that is not GGUF, is truncated or lacks what planning needs."""
    try:
        from gguf import GGUFReader
    except ImportError:
        raise KeelError("reading GGUF files needs the gguf package "
                        "(pip install keel-runtime[gguf])") from None
    name = os.fspath(path)
    if not os.path.isfile(name):
        raise InvalidArgumentError(f"model file {name!r} does not exist or is not a file")
    if not is_gguf_file(name):
        raise ModelFormatError(f"{name!r} is not a GGUF file (no GGUF magic)")
    try:
        reader = GGUFReader(name)
        fields = {key: _value(f) for key, f in reader.fields.items()}
        tensors = [(t.name, int(t.n_bytes), int(t.data.nbytes), int(t.tensor_type))
                   for t in reader.tensors]
    except (ValueError, OSError, KeyError, IndexError, TypeError, EOFError, OverflowError,
            UnicodeDecodeError) as exc:
        raise ModelFormatError(f"cannot read GGUF file {name!r} (truncated or corrupt?): "
                               f"{type(exc).__name__}: {exc}") from None
    short = [t for t, want, have, _ in tensors if have < want]
    if short:
        raise ModelFormatError(f"GGUF file {name!r} is truncated: tensor {short[0]!r} "
                               "runs past the end of the file")
    return _model(os.path.basename(name), fields, tensors)


def _value(field: Any) -> Any:
    try:
        return field.contents()
    except AttributeError:          # gguf before contents(): the last part holds the value
        return field.parts[field.data[0]].tolist()[0] if field.data else None


def _model(file: str, fields: Mapping[str, Any],
           tensors: Sequence[tuple[str, int, int, int]]) -> GgufModel:
    arch = fields.get("general.architecture")
    if not isinstance(arch, str) or not arch:
        raise ModelFormatError(f"GGUF file {file!r} names no general.architecture")

    def need(key: str) -> int:
        value = fields.get(f"{arch}.{key}")
        if isinstance(value, list):             # per-layer values: the largest
            value = max(value) if value else None
        if not isinstance(value, int) or value <= 0:
            raise ModelFormatError(f"GGUF file {file!r} lacks {arch}.{key} (a positive "
                                   "integer), which planning needs")
        return value

    layers, embedding, heads = need("block_count"), need("embedding_length"), need(
        "attention.head_count")
    kv_heads = need("attention.head_count_kv") if f"{arch}.attention.head_count_kv" in fields \
        else heads
    head_dim = need("attention.key_length") if f"{arch}.attention.key_length" in fields \
        else embedding // heads
    per_layer = [0] * layers
    other = output = 0
    types: dict[int, int] = {}
    for tname, nbytes, _, ttype in tensors:
        block = _block_index(tname)
        if block is None or block >= layers:
            other += nbytes
            output += nbytes if tname.startswith("output.") else 0
            continue
        per_layer[block] += nbytes
        types[ttype] = types.get(ttype, 0) + nbytes
    return GgufModel(file=file, architecture=arch, layers=layers,
                     context_length=need("context_length"), embedding=embedding, heads=heads,
                     kv_heads=kv_heads, head_dim=head_dim,
                     quantization=_quantization(fields.get("general.file_type"), types),
                     layer_bytes=tuple(per_layer), other_bytes=other, output_bytes=output)


def _block_index(name: str) -> int | None:
    head, _, rest = name.partition(".")
    index = rest.partition(".")[0]
    return int(index) if head == "blk" and index.isdigit() else None


def _quantization(file_type: Any, types: Mapping[int, int]) -> str:
    from gguf import GGMLQuantizationType, LlamaFileType

    if isinstance(file_type, int):
        try:
            return str(LlamaFileType(file_type).name)
        except ValueError:
            pass
    if not types:
        return "unknown"
    main = max(types, key=lambda t: types[t])
    try:
        return str(GGMLQuantizationType(main).name)
    except ValueError:
        return f"type {main}"


# --- planning -------------------------------------------------------------------------


def plan_llama_cpp(model: GgufModel, profile: HardwareProfile,
                   policy: RuntimePolicy | None = None, *, context: int | None = None,
                   telemetry: Any = None) -> LlamaCppPlan:
    """llama.cpp's plan for ``model`` on ``profile``: ``context`` tokens (else the trained
    length); ``telemetry`` (a snapshot with ``available_bytes("gpu:N")``, NVML on this
    machine) gives the GPUs' free memory, else the profile does."""
    policy = RuntimePolicy() if policy is None else policy
    ctx = model.context_length if context is None else context
    if isinstance(ctx, bool) or not isinstance(ctx, int) or ctx < 1:
        raise InvalidArgumentError(f"--context must be a positive number of tokens, got {ctx!r}")
    kv = model.kv_bytes_per_layer(ctx)
    reasons = [_kv_reason(model, ctx, kv)]
    if ctx > model.context_length:
        reasons.append(f"-c {ctx} is beyond the trained context {model.context_length}: "
                       "llama.cpp needs RoPE scaling to use it well")
    gpu, gpu_layers, why = _offload(model, profile, policy, kv, telemetry)
    threads = select_threads(profile)
    thread_count = int(threads.choice) if threads.choice.isdigit() else None
    physical = profile.cpu.physical_cores
    if thread_count is not None and physical and physical < thread_count:
        thread_count = physical
        threads_why = f"-t {physical}: the physical cores ({threads.reason})"
    else:
        threads_why = f"-t {threads.choice}: {threads.reason}"
    device = "cpu" if gpu is None or gpu_layers == 0 else "gpu"
    batch = min(GPU_BATCH if device == "gpu" else CPU_BATCH, ctx)
    mlock, mlock_why = _mlock(model, profile, policy, gpu_layers, kv)
    reasons = [why, *reasons, threads_why,
               f"-b {batch}: the prompt batch for a {device} plan, at most -c", mlock_why]
    return LlamaCppPlan(model=model, device=device, gpu=None if device == "cpu" else gpu,
                        gpu_layers=gpu_layers if device == "gpu" else 0, context=ctx,
                        threads=thread_count, batch=batch, mlock=mlock, reasons=tuple(reasons))


def _kv_reason(model: GgufModel, ctx: int, kv: int) -> str:
    return (f"KV cache: 2 x {ctx} tokens x {model.kv_heads} KV heads x {model.head_dim} "
            f"head dim x {KV_BYTES_PER_ELEMENT} bytes = {format_bytes(kv)} per layer, "
            f"{format_bytes(kv * model.layers)} for {model.layers} layers")


def _offload(model: GgufModel, profile: HardwareProfile, policy: RuntimePolicy, kv: int,
             telemetry: Any) -> tuple[int | None, int, str]:
    """(GPU index or None, layers to offload, the arithmetic)."""
    if not policy.prefer_gpu:
        return None, 0, "CPU plan (-ngl 0): policy prefer_gpu is false"
    gpu, free, why = _pick_gpu(profile, telemetry)
    if gpu is None or free is None:
        return None, 0, f"CPU plan (-ngl 0): {why}"
    budget = free - GPU_RESERVE_BYTES
    fitted, used = 0, 0
    for size in model.layer_bytes:
        if used + size + kv > budget:
            break
        fitted, used = fitted + 1, used + size + kv
    head = (f"GPU {gpu.index} ({gpu.name or gpu.vendor}): {format_bytes(free)} free ({why}) "
            f"- {format_bytes(GPU_RESERVE_BYTES)} reserve = {format_bytes(max(budget, 0))}")
    largest = max(model.layer_bytes, default=0)
    if fitted == 0:
        return None, 0, (f"CPU plan (-ngl 0): {head}; one layer needs "
                         f"{format_bytes(largest)} weights + {format_bytes(kv)} KV cache, "
                         "more than that")
    if fitted == model.layers and used + model.output_bytes <= budget:
        return gpu.index, fitted + 1, (
            f"-ngl {fitted + 1}: {head}; all {fitted} layers take {format_bytes(used)} "
            f"(weights + KV cache) and the output layer {format_bytes(model.output_bytes)} "
            "fits too")
    return gpu.index, fitted, (
        f"-ngl {fitted}: {head}; {fitted} of {model.layers} layers fit at up to "
        f"{format_bytes(largest)} weights + {format_bytes(kv)} KV cache each "
        f"({format_bytes(used)} in all); the rest run on the CPU")


def _pick_gpu(profile: HardwareProfile, telemetry: Any) -> tuple[GpuInfo | None, int | None,
                                                                 str]:
    """The coolest-enough GPU with the most free memory, its free bytes and their source."""
    if not profile.gpus:
        return None, None, "no GPU detected"
    hot = hot_gpus(profile)
    rejected, candidates = [], []
    for gpu in profile.gpus:
        free, source = _free_memory(gpu, telemetry)
        if gpu.vendor not in _OFFLOADING_VENDORS:
            rejected.append(f"GPU {gpu.index}: no llama.cpp build offloads to {gpu.vendor}")
        elif gpu.index in hot:
            rejected.append(f"kept off for heat: {hot[gpu.index]}")
        elif free is None:
            rejected.append(f"GPU {gpu.index}: its memory is unknown")
        else:
            candidates.append((free, gpu, source))
    if not candidates:
        return None, None, "; ".join(rejected)
    free, best, source = max(candidates, key=lambda c: (c[0], -c[1].index))
    return best, free, source


def _free_memory(gpu: GpuInfo, telemetry: Any) -> tuple[int | None, str]:
    if telemetry is not None:
        seen = telemetry.available_bytes(f"gpu:{gpu.index}")
        if seen is not None:
            return int(seen), f"free memory read by {getattr(telemetry, 'source', 'telemetry')}"
    if gpu.free_memory_bytes is not None:
        return gpu.free_memory_bytes, "the profile's free memory"
    if gpu.total_memory_bytes is not None:
        return gpu.total_memory_bytes, "the profile's total memory: no free reading"
    return None, "unknown"


def _mlock(model: GgufModel, profile: HardwareProfile, policy: RuntimePolicy,
           gpu_layers: int, kv: int) -> tuple[bool, str]:
    on_cpu = max(model.layers - gpu_layers, 0)
    host = model.other_bytes + sum(model.layer_bytes[gpu_layers:]) + on_cpu * kv
    if gpu_layers > model.layers:                     # the output layer went too
        host -= model.output_bytes
    low = low_memory_reason(profile, policy)
    if low:
        return False, (f"no --mlock: low-memory mode ({low}); llama.cpp keeps the weights "
                       "memory-mapped and the system may page them")
    memory = profile.memory.effective_available_bytes or profile.memory.effective_limit_bytes
    if memory is None:
        return False, "no --mlock: host memory is unknown"
    share = host / memory
    verdict = "--mlock" if share <= MLOCK_SHARE else "no --mlock"
    return share <= MLOCK_SHARE, (
        f"{verdict}: {format_bytes(host)} stays in host memory ({on_cpu} layers with their "
        f"KV cache, embeddings and the rest), {share:.0%} of {format_bytes(memory)}; "
        f"locking needs at most {MLOCK_SHARE:.0%}")
