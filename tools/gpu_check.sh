#!/usr/bin/env bash
# The one-command GPU check: keel's gpu backend on a real NVIDIA GPU.
#
#   tools/gpu_check.sh OUTDIR [--cpu-scaling]
#
# 1. the gpu benchmark: six models at batch 1 and 32 against torch on the same GPU
#    (python -m benchmarks.gpu), with correctness against torch fp32;
# 2. every benchmark model on the gpu against onnxruntime, fp32, fp16 and bf16
#    (tests/backends/test_gpu_models.py);
# 3. the gpu conformance suite (every op against the reference backend);
# 4. with --cpu-scaling: keel's cpu backend against onnxruntime at 1, 4 and 16 threads;
# 5. where wgpu imports: the webgpu backend (Vulkan) on ResNet-18 and BERT-mini at batch 32.
# Steps run in that order, the most needed first.
#
# Needs only what a GPU machine with torch, CuPy, onnx and onnxruntime has: nothing is
# downloaded; keel runs from this source tree. Each step's log and rc land in OUTDIR,
# with summary.txt listing them; one failing step does not stop the others. Each step has
# a time limit (seconds; rc 124 when it ran out), so the whole check ends in under 10
# minutes: T_BENCH (180), T_MODELS (90), T_CONFORMANCE (120), T_CPU (150), T_WEBGPU (90).
set -u
out=${1:?usage: tools/gpu_check.sh OUTDIR [--cpu-scaling]}
scaling=${2:-}
# shellcheck source=tools/check_steps.sh
. "$(dirname "$0")/check_steps.sh"
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  nproc; } >>"$out/summary.txt" 2>&1
step probe 60 "$py" -m keel probe --json
# cuDNN for convolutions comes from nvidia-cudnn-frontend (not on a bare torch image: carry
# its wheel onto PYTHONPATH); without it convs run on im2col, and this line says why.
"$py" -c "from keel.backends.gpu.cudnn_lib import LIBRARY; print('cudnn:', LIBRARY.availability().reason)" \
    >>"$out/summary.txt" 2>&1
step bench_gpu "${T_BENCH:-180}" "$py" -m benchmarks.gpu --profile --placement --out "$out"
step models "${T_MODELS:-110}" "$py" -m pytest -q -p no:cacheprovider -m gpu tests/backends/test_gpu_models.py \
    tests/backends/test_gpu_io.py
step conformance "${T_CONFORMANCE:-120}" "$py" -m pytest -q -p no:cacheprovider -m gpu -n 8 tests/conformance \
    --junitxml "$out/conformance.xml"
if [ "$scaling" = "--cpu-scaling" ]; then
    step bench_cpu "${T_CPU:-150}" "$py" -m benchmarks.run --threads 1,4,16 --batches 1,32 --passes 2 \
        --models resnet18,bert_mini,mobilenetv2,resnet20,mlp --no-rss --out "$out"
fi
# The webgpu backend on this GPU through Vulkan, where wgpu (and a Vulkan loader) is here:
# keel's webgpu time at batch 32, to set beside keel's CUDA backend in bench_gpu.
if "$py" -c "import wgpu" >/dev/null 2>&1; then
    step webgpu "${T_WEBGPU:-90}" "$py" -m benchmarks.run --backend webgpu --models resnet18,bert_mini \
        --batches 32 --threads 16 --passes 1 --no-rss --out "$out"
else
    echo "webgpu: skipped, wgpu is not installed" | tee -a "$out/summary.txt"
fi
tail -n 3 "$out"/*.log >>"$out/summary.txt" 2>/dev/null
cat "$out/summary.txt"
