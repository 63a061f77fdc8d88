#!/usr/bin/env bash
# The GPU check: raytrain with Ray on the GPU machine's own Python and torch, installed from the
# carried .whl/ without a network. Prepare .whl/ here first (bash scripts/gpu_wheels.sh, about
# 43 MiB with the working tree), then make the device call, exactly:
#
#     {"command": "bash benchmarks/gpu_check.sh", "carry": [".whl"], "timeout_s": 420}
#
# It takes at most GPU_CHECK_BUDGET_S (360 s) from its start, install included: each stage runs
# under `timeout` for its own budget or what is left, whichever is less, and is skipped with a
# line when too little is left. One stage failing does not stop the others. The plan for one
# 15-minute lease: the machine's start (about 130 s on the H200, RESULTS §28), this call (at
# most 360 s), then one rerun at once while the machine is warm, of the whole check or of the
# stages that failed (GPU_CHECK_STAGES, below): 130 + 2 x 360 = 850 s. Stages, most valuable
# first (§28 measured b, e and p on the H200; f never ran and d failed there):
#   a  torch, CUDA, the GPU, bf16, NCCL; no CUDA device: a "no CUDA device" line and exit 3
#   b  python benchmarks/gpu_check.py $OUT (raytrain's step without Ray), where that file exists
#   c  import ray and ray.init(include_dashboard=True) (as raytrain starts it), then `raytrain doctor`
#   f  raytrain bench digits --repeat 1 --baseline plain: raytrain against the plain loop (>= 0.97)
#   d  python -m pytest -m gpu tests/test_gpu.py (the CLI on one GPU: bf16/fp16, resume, export)
#   e  raytrain train charlm: bf16, --strategy fsdp --compile --activation-checkpointing; its
#      steady samples/s, MFU and the GPU's peak memory (nvidia-smi, sampled)
#   p  the data wait per step with --prefetch off and on (raytrain bench benchmarks.overhead:ImageCNN)
#   g  2+ GPUs only: DDP, fsdp and `raytrain check` across them (skipped with a line on one GPU)
# Each prints "gpu-check: ..." lines with its time. Files in $OUT (./gpu-check-out outside the
# device call; at most 8 come back): gpu-check.log (all of it), stages.json (each stage's status,
# seconds and figures), gpu_check.json and gpu_check.log (stage b's), train-summary.json (e),
# bench.json and bench.md (f).
#
# A short rerun of some stages: GPU_CHECK_STAGES="d f" (and GPU_CHECK_TESTS, stage d's -k).
# GPU_CHECK_ON_CPU=1 goes on past stage a without a GPU (--no-gpu, small sizes): a rehearsal of
# the install and the Ray stages on a CPU machine. GPU_PYTHON names the Python (default python3).
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
OUT=${OUT:-$REPO/gpu-check-out}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/gpu-check.log") 2>&1
export PYTHONUNBUFFERED=1 RAY_USAGE_STATS_ENABLED=0
START=$(date +%s)
BUDGET=${GPU_CHECK_BUDGET_S:-360}
ON_CPU=${GPU_CHECK_ON_CPU:-0}
PY0=${GPU_PYTHON:-python3}
WHEELS=${GPU_WHEELS:-$REPO/.whl}
ENV_DIR=${GPU_CHECK_ENV:-/tmp/rtenv}
RUNS=${GPU_CHECK_RUNS:-/tmp/gpu-check-runs}
STAGES=$(mktemp)
say() { echo "gpu-check: $*"; }
elapsed() { echo $(($(date +%s) - START)); }
record() { printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "${4:-}" >> "$STAGES"; }  # stage status seconds note
export OUT REPO RUNS ON_CPU
rm -rf "$RUNS"

write_stages() {
    "${PY:-$PY0}" - "$STAGES" "$OUT/stages.json" "$(elapsed)" <<'EOF' || true
import json, sys
stages = []
for line in open(sys.argv[1]):
    name, status, seconds, note = (line.rstrip("\n").split("\t") + [""])[:4]
    stages.append({"stage": name, "status": status, "seconds": int(seconds), "note": note})
figures = {}
try:
    figures = json.load(open(sys.argv[2])).get("figures", {})
except (OSError, ValueError):
    pass
json.dump({"total_seconds": int(sys.argv[3]), "stages": stages, "figures": figures}, open(sys.argv[2], "w"), indent=1)
EOF
}
figure() {  # figure KEY JSON-VALUE: kept in stages.json's "figures"
    "$PY" - "$OUT/stages.json" "$1" "$2" <<'EOF' || true
import json, sys
try:
    data = json.load(open(sys.argv[1]))
except (OSError, ValueError):
    data = {}
data.setdefault("figures", {})[sys.argv[2]] = json.loads(sys.argv[3])
json.dump(data, open(sys.argv[1], "w"), indent=1)
EOF
}

# stage NAME BUDGET_S FUNCTION: run FUNCTION under timeout (its budget or what is left), one line.
stage() {
    local name=$1 budget=$2 fn=$3 left t0 rc dt
    left=$((BUDGET - $(elapsed) - 5))
    [ "$left" -lt "$budget" ] && budget=$left
    if [ "$budget" -lt 20 ]; then
        say "$name: skipped (${left} s left of the check's ${BUDGET} s)"
        record "$name" skipped 0 "out of time"
        return
    fi
    say "$name: start (budget ${budget} s)"
    t0=$(date +%s)
    timeout -k 10 "$budget" bash -c "$fn"
    rc=$?
    dt=$(($(date +%s) - t0))
    case $rc in
        0) say "$name: passed in ${dt} s"; record "$name" passed "$dt" ;;
        124 | 137) say "$name: TIMED OUT after ${dt} s"; record "$name" timeout "$dt" ;;
        *) say "$name: FAILED (exit $rc) in ${dt} s"; record "$name" "failed ($rc)" "$dt" ;;
    esac
}

say "start $(date -u +%FT%TZ) on $(hostname), $(nproc) cores; budget ${BUDGET} s; out $OUT"

# --- install: a venv over the machine's Python (its torch and packages seen), then what it lacks.
t0=$(date +%s)
rm -rf "$ENV_DIR"
if "$PY0" -m venv --without-pip --system-site-packages "$ENV_DIR" 2>/dev/null; then
    PY=$ENV_DIR/bin/python
    SITE=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    # The machine's python3 may itself be a venv (/opt/torch/.venv): its site-packages, .pth files too.
    "$PY0" -c 'import site; [print(f"import site; site.addsitedir({d!r})") for d in site.getsitepackages()]' \
        > "$SITE/_machine_site.pth"
    export PYTHONPATH=$REPO
else
    say "install: $PY0 -m venv failed; installing into /tmp/site on PYTHONPATH instead"
    PY=$(command -v "$PY0")
    SITE=/tmp/site
    mkdir -p "$ENV_DIR/bin"
    export PYTHONPATH=$SITE:$REPO
fi
export PY PATH=$ENV_DIR/bin:$PATH
for script in raytrain:raytrain.cli ray:ray.scripts.scripts; do
    printf '#!%s\nimport sys\nfrom %s import main\nsys.exit(main())\n' "$PY" "${script#*:}" > "$ENV_DIR/bin/${script%%:*}"
    chmod +x "$ENV_DIR/bin/${script%%:*}"
done
[ -x "$ENV_DIR/bin/python" ] || ln -s "$PY" "$ENV_DIR/bin/python"
if [ -d "$WHEELS" ]; then
    "$PY" benchmarks/gpu_site.py "$WHEELS" "$SITE"
    rc=$?
else
    say "install: no $WHEELS (run scripts/gpu_wheels.sh and carry .whl)"
    rc=1
fi
dt=$(($(date +%s) - t0))
if [ $rc -eq 0 ]; then say "install: done in ${dt} s"; record install passed "$dt"; else
    say "install: INCOMPLETE in ${dt} s (the stages go on)"; record install "failed ($rc)" "$dt"; fi

# --- a: the device.
stage_a() {
    "$PY" - <<'EOF'
import os, sys
import torch
import torch.distributed as dist
if not torch.cuda.is_available():
    why = "torch built without CUDA" if torch.version.cuda is None else f"CUDA {torch.version.cuda} sees no device"
    print(f"gpu-check: no CUDA device ({why}; torch {torch.__version__}, Python {sys.version.split()[0]}); stopping")
    sys.exit(3)
p = torch.cuda.get_device_properties(0)
nccl = ".".join(map(str, torch.cuda.nccl.version())) if dist.is_nccl_available() else "none"
print(f"gpu-check: a: torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.device_count()} x {p.name} "
      f"({p.total_memory / 2**30:.0f} GiB, sm_{p.major}{p.minor}), bf16 {torch.cuda.is_bf16_supported()}, NCCL {nccl}, "
      f"Python {sys.version.split()[0]}")
EOF
}
export -f stage_a say
t0=$(date +%s)
timeout -k 5 60 bash -c stage_a
rc=$?
if [ $rc -eq 3 ] && [ "$ON_CPU" != 1 ]; then
    record a "no CUDA device" $(($(date +%s) - t0))
    write_stages
    say "stopped at stage a after $(elapsed) s (no CUDA device)"
    exit 3
elif [ $rc -ne 0 ] && [ $rc -ne 3 ]; then
    say "a: FAILED (exit $rc): torch does not import or answer; stopping"
    record a "failed ($rc)" $(($(date +%s) - t0))
    write_stages
    exit 1
fi
record a "$([ $rc -eq 0 ] && echo passed || echo 'no CUDA device (going on: GPU_CHECK_ON_CPU=1)')" $(($(date +%s) - t0))
GPUS=$("$PY" -c 'import torch; print(torch.cuda.device_count())')
if [ "$ON_CPU" = 1 ] && [ "$GPUS" = 0 ]; then DEV=--no-gpu; else DEV=--gpu; fi
export DEV GPUS
write_stages

# --- b: raytrain's step without Ray (benchmarks/gpu_check.py, by its own author).
stage_b() {
    if [ ! -f benchmarks/gpu_check.py ]; then say "b: benchmarks/gpu_check.py is not in this tree"; return 0; fi
    if [ "$DEV" = --no-gpu ]; then "$PY" benchmarks/gpu_check.py "$OUT" --device cpu --tiny
    else "$PY" benchmarks/gpu_check.py "$OUT"; fi
}

# --- c: Ray starts here, and raytrain's doctor.
stage_c() {
    "$PY" - <<'EOF' || return 1
import time
t = time.time()
import ray
ray.init(include_dashboard=True)  # as raytrain starts it: the dashboard needs ray[default]'s packages
res = ray.cluster_resources()
print(f"gpu-check: c: ray {ray.__version__} from {ray.__file__.rsplit('/', 2)[0]}: init in {time.time() - t:.1f} s; "
      f"{res.get('CPU', 0):g} CPUs, {res.get('GPU', 0):g} GPUs")
ray.shutdown()
EOF
    raytrain doctor
}

# --- d: the GPU test tier.
stage_d() {
    "$PY" -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider -o addopts="-ra --durations=10" \
        ${GPU_CHECK_TESTS:+-k "$GPU_CHECK_TESTS"}
}

# --- e: one fsdp + compile + activation-checkpointing run under bf16, its throughput and memory.
stage_e() {
    local size=(--pipeline-arg width=1024 --pipeline-arg layers=8 --pipeline-arg heads=16 --pipeline-arg block=256
        --pipeline-arg corpus_mb=4 --batch-size-per-worker 64 --max-steps 200 --compile)
    [ "$DEV" = --no-gpu ] && size=(--pipeline-arg width=64 --pipeline-arg layers=2 --pipeline-arg heads=2
        --pipeline-arg block=64 --pipeline-arg corpus_mb=0.25 --batch-size-per-worker 8 --max-steps 30)
    local mem=$RUNS/gpu-memory.txt
    mkdir -p "$RUNS"
    if command -v nvidia-smi >/dev/null && [ "$DEV" = --gpu ]; then
        nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 250 > "$mem" 2>/dev/null &
    fi
    local smi=$!
    raytrain train charlm "$DEV" --workers 1 --precision bf16 --strategy fsdp --activation-checkpointing \
        "${size[@]}" --epochs 3 --storage "$RUNS" --name charlm-fsdp --progress plain
    local rc=$?
    kill "$smi" 2>/dev/null
    cp "$RUNS/charlm-fsdp/summary.json" "$OUT/train-summary.json" 2>/dev/null
    "$PY" - "$RUNS/charlm-fsdp/summary.json" "$mem" <<'EOF' || return 1
import json, os, sys
s = json.load(open(sys.argv[1]))
cost = s.get("cost") or s.get("extra", {}).get("cost") or {}
mem = [int(x) for x in open(sys.argv[2]).read().split() if x.isdigit()] if os.path.exists(sys.argv[2]) else []
mfu = cost.get("mfu")
fig = {"status": s["status"], "steps": s["steps"], "steady_samples_per_s": s.get("steady_samples_per_s"),
       "achieved_tflops_per_worker": cost.get("achieved_tflops_per_worker"), "mfu": mfu,
       "peak_gpu_memory_mib": max(mem) if mem else None, "final_metrics": s.get("final_metrics")}
print(f"gpu-check: e: {s['status']}, {s['steps']} steps, {s.get('steady_samples_per_s') or 0:,.0f} samples/s steady, "
      f"{cost.get('achieved_tflops_per_worker') or 0:.3g} TFLOP/s, MFU {'n/a' if mfu is None else f'{mfu:.1%}'}, "
      f"peak GPU memory {max(mem) if mem else 'n/a'} MiB (nvidia-smi)")
print("FIGURES " + json.dumps(fig))
sys.exit(0 if s["status"] == "finished" else 1)
EOF
    return $rc
}

# --- f: raytrain against the plain loop, same GPU, same run.
stage_f() {
    local steps=200
    [ "$DEV" = --no-gpu ] && steps=30
    raytrain bench digits "$DEV" --workers 1 --steps "$steps" --repeat 1 --baseline plain \
        --storage "$RUNS" --name bench-plain || return 1
    cp "$RUNS/bench-plain/bench.json" "$RUNS/bench-plain/bench.md" "$OUT/" 2>/dev/null
    "$PY" - "$RUNS/bench-plain/bench.json" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
for b in r["baselines"]:
    print(f"gpu-check: f: raytrain {b['raytrain_samples_per_s']:,.0f} samples/s against the {b['baseline']} loop's "
          f"{b['baseline_samples_per_s']:,.0f} at {b['workers']} worker: {b['ratio']:.3f} (target >= 0.97)")
    print("FIGURES " + json.dumps({"ratio": b["ratio"], "raytrain_samples_per_s": b["raytrain_samples_per_s"],
                                   "plain_samples_per_s": b["baseline_samples_per_s"]}))
EOF
}

# --- p: the input copy staged ahead (--prefetch) against copied at the step: bench's data wait.
stage_p() {
    local steps=150 mode
    [ "$DEV" = --no-gpu ] && steps=20
    for mode in off on; do
        raytrain bench benchmarks.overhead:ImageCNN "$DEV" --workers 1 --steps "$steps" --prefetch "$mode" \
            --storage "$RUNS" --name "prefetch-$mode" > "$RUNS/prefetch-$mode.txt" 2>&1 \
            || { tail -20 "$RUNS/prefetch-$mode.txt"; return 1; }
    done
    "$PY" - "$RUNS" <<'EOF'
import json, sys
r = {m: json.load(open(f"{sys.argv[1]}/prefetch-{m}/bench.json"))["results"][0] for m in ("off", "on")}
wait = {m: r[m]["split_ms"]["data_wait"] for m in r}
rate = {m: r[m]["steady_samples_per_s"] for m in r}
print(f"gpu-check: p: data wait per step {wait['off']:.3f} ms copied at the step, {wait['on']:.3f} ms staged ahead; "
      f"samples/s {rate['off']:,.0f} vs {rate['on']:,.0f} ({rate['on'] / rate['off']:.2f}x)")
print("FIGURES " + json.dumps({"data_wait_ms": wait, "samples_per_s": rate}))
EOF
}

# --- g: across GPUs.
stage_g() {
    if [ "$GPUS" -lt 2 ]; then
        say "g: skipped: $GPUS GPU (DDP, fsdp and check across GPUs need 2 or more)"
        return 0
    fi
    raytrain train digits --gpu --workers 2 --epochs 2 --storage "$RUNS" --name ddp2 --progress plain || return 1
    raytrain train charlm --gpu --workers 2 --strategy fsdp --precision bf16 --max-steps 100 --storage "$RUNS" \
        --name fsdp2 --progress plain || return 1
    raytrain check digits --gpu --workers 2
}
export -f stage_b stage_c stage_d stage_e stage_f stage_p stage_g

# A stage's "FIGURES {json}" line goes into stages.json.
run_stage() {
    local name=$1 budget=$2 log
    log=$(mktemp)
    stage "$name" "$budget" "stage_$name" | tee "$log"
    local fig
    fig=$(grep -m1 '^FIGURES ' "$log" | cut -d' ' -f2-)
    [ -n "$fig" ] && figure "$name" "$fig"
    rm -f "$log"
}
# `stage` records into $STAGES from a pipeline's subshell: fine, it appends to a file.
# GPU_CHECK_STAGES picks stages for a short rerun (e.g. "d f"); GPU_CHECK_TESTS, stage d's -k.
wanted=" ${GPU_CHECK_STAGES:-b c f d e p g} "
for spec in "b ${GPU_CHECK_B_S:-120}" "c 90" "f 150" "d 180" "e 150" "p 100" "g 120"; do
    set -- $spec
    case "$wanted" in *" $1 "*) run_stage "$1" "$2" ;; esac
done
write_stages
say "done in $(elapsed) s: $(cut -f1,2 "$STAGES" | tr '\t' ' ' | paste -sd, | sed 's/,/, /g')"
n=$(find "$OUT" -type f | wc -l)
[ "$n" -gt 8 ] && say "note: $n files in $OUT, only 8 come back from the device call"
exit 0
