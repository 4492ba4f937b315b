#!/usr/bin/env bash
# The one-command CPU scaling check: keel's cpu backend against onnxruntime on a
# many-core machine (issue 11's table), and where the time goes node by node.
#
#   tools/cpu_scaling.sh OUTDIR
#
# 1. the machine: cores, caches, NUMA, cgroup quota, onnxruntime and BLAS;
# 2. keel's native kernels built, its probe and its measured thread costs (the planner
#    reads them on a machine of more than 2 cores);
# 3. the benchmark suite at 1, 4 and 16 threads, batches 1 and 32, five models;
# 4. per node at 16 threads against onnxruntime's own profile (benchmarks.pernode):
#    ResNet-18, BERT-mini and MobileNetV2 at batch 32 and batch 1;
# 5. keel alone, then onnxruntime alone (benchmarks.alone): the cells the suite resolves
#    least well on a shared host (MobileNetV2 and ResNet-18 at batch 1 on 16 threads,
#    ResNet-18 and BERT-mini at batch 32 on 4).
# Steps run in that order, the most needed first. Each step's log and rc land in
# OUTDIR, summary.txt lists them; a failing step does not stop the others. Each step has
# a time limit (seconds; rc 124 when it ran out), so the whole check ends in under 9
# minutes: T_BENCH (200), T_PERNODE (45 each), T_ALONE (40 each). THREADS (1,4,16) and PN_THREADS (16) set
# the thread counts, for a trial on a smaller machine.
set -u
out=${1:?usage: tools/cpu_scaling.sh OUTDIR}
# shellcheck source=tools/check_steps.sh
. "$(dirname "$0")/check_steps.sh"
{ git -C "$root" rev-parse --short HEAD 2>/dev/null; nproc
  lscpu | grep -E '^(Model name|Socket|Core|Thread|NUMA node|L1d|L2|L3)'
  cat /sys/fs/cgroup/cpu.max 2>/dev/null
  "$py" -c "import onnxruntime, numpy; print('onnxruntime', onnxruntime.__version__, 'numpy', numpy.__version__)"
  "$py" -c "import threadpoolctl, numpy; [print(i['internal_api'], i['version'], i['num_threads']) for i in threadpoolctl.threadpool_info()]"
} >>"$out/summary.txt" 2>&1
step build 60 "$py" -m keel build
step probe 30 "$py" -m keel probe --json
cp "$out/probe.log" "$out/probe.json"
step thread_costs 40 "$py" -m keel probe --thread-costs --json
step bench "${T_BENCH:-200}" "$py" -m benchmarks.run --threads "${THREADS:-1,4,16}" --batches 1,32 --passes 2 \
    --models resnet18,bert_mini,mobilenetv2,resnet20,mlp --no-rss --out "$out"
tp=${T_PERNODE:-45}
for spec in resnet18:32:3 bert_mini:32:3 mobilenetv2:32:3 resnet18:1:10 mobilenetv2:1:10 bert_mini:1:10; do
    IFS=: read -r model batch passes <<<"$spec"
    step "pernode_${model}_b$batch" "$tp" "$py" -m benchmarks.pernode --model "$model" \
        --batch "$batch" --threads "${PN_THREADS:-16}" --passes "$passes" --json
done
ta=${T_ALONE:-40}
many=${PN_THREADS:-16}
for spec in mobilenetv2:1:$many:100 resnet18:1:$many:60 resnet18:32:4:8 bert_mini:32:4:10; do
    IFS=: read -r model batch threads runs <<<"$spec"
    step "alone_${model}_b${batch}_t$threads" "$ta" "$py" -m benchmarks.alone --model "$model" \
        --batch "$batch" --threads "$threads" --runs "$runs" --json
done
tail -n 12 "$out/bench.log" >>"$out/summary.txt" 2>/dev/null
cat "$out/summary.txt"
