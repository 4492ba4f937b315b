# Sourced by tools/gpu_check.sh and tools/cpu_scaling.sh, `out` set to their OUTDIR: the
# checkout's root as the working folder and on PYTHONPATH, OUTDIR made absolute with its
# summary.txt begun, `py` the Python to run, and
#   step NAME LIMIT CMD...
# which runs CMD with its output in OUTDIR/NAME.log under a time limit of LIMIT seconds
# (rc 124 when it ran out) and adds its rc and seconds to summary.txt.
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
mkdir -p "$out"
out=$(cd "$out" && pwd)
cd "$root" || exit 2
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
py=${PYTHON:-python3}

step() {
    local name=$1 limit=$2 start rc
    shift 2
    start=$(date +%s)
    timeout -k 10 "$limit" "$@" >"$out/$name.log" 2>&1
    rc=$?
    echo "$name: rc=$rc, $(( $(date +%s) - start )) s" | tee -a "$out/summary.txt"
}

: >"$out/summary.txt"
