#!/usr/bin/env bash
# The GPU path in one short run (about 6 minutes on one GPU): install, NCCL, bf16 and fp16
# training end to end with a checkpointed resume and an export, and throughput against the
# plain loop and the torchrun template in the same run. Every figure lands in $OUT (default
# ./gpu-smoke): gpu-smoke.log, and each run's summary.json, bench.json and bench.md.
#
#     bash benchmarks/gpu_smoke.sh            # on a machine with a CUDA GPU
#
# Fails (exit 1) at the first step that does not hold; each step prints one "gpu-smoke:" line.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-smoke}
mkdir -p "$OUT"
exec > >(tee "$OUT/gpu-smoke.log") 2>&1
say() { echo "gpu-smoke: $*"; }
fail() { say "FAILED: $*"; exit 1; }
started=$(date +%s)

if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv || fail "python3 -m venv"
fi
# shellcheck disable=SC1091
. .venv/bin/activate
bash scripts/install.sh > "$OUT/install.log" 2>&1 || fail "scripts/install.sh (see $OUT/install.log)"
say "installed in $(( $(date +%s) - started )) s"

python - <<'EOF' || fail "torch sees no CUDA GPU with NCCL"
import torch, torch.distributed as dist
assert torch.cuda.is_available(), "torch.cuda.is_available() is False"
assert dist.is_nccl_available(), "NCCL is not available in this torch build"
p = torch.cuda.get_device_properties(0)
print(f"gpu-smoke: torch {torch.__version__}, CUDA {torch.version.cuda}, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}, "
      f"{torch.cuda.device_count()} × {p.name} ({p.total_memory / 2**30:.0f} GiB), bf16 {torch.cuda.is_bf16_supported()}")
EOF

raytrain doctor || fail "raytrain doctor"

STORE="$OUT/runs"
for precision in bf16 fp16; do
    raytrain train digits --gpu --workers 1 --precision "$precision" --epochs 3 --checkpoint-every-steps 10 \
        --storage "$STORE" --name "digits-$precision" --progress plain || fail "train digits --precision $precision"
    python - "$STORE/digits-$precision/summary.json" "$precision" <<'EOF' || fail "summary of the $1 run"
import json, sys
s = json.load(open(sys.argv[1]))
m = s["final_metrics"]
assert s["status"] == "finished", s["status"]
assert m["val_loss"] < 1.0, f"val_loss {m['val_loss']} after 3 epochs"
print(f"gpu-smoke: {sys.argv[2]}: finished, val_loss {m['val_loss']:.4f}")
EOF
done

# Resume from the bf16 run's checkpoint (2 more epochs) and export its weights.
raytrain train --storage "$STORE" --name digits-bf16 --resume --epochs 5 --progress plain || fail "--resume on the GPU"
raytrain export "$STORE/digits-bf16" -o "$OUT/digits-bf16.pt" --pipeline digits || fail "export"
say "resume and export: done"

# Throughput: raytrain at 1 GPU against the plain loop and the torchrun template, same run.
for precision in fp32 bf16; do
    raytrain bench digits --gpu --workers 1 --steps 200 --repeat 3 --precision "$precision" --baseline torchrun,plain \
        --storage "$STORE" --name "bench-$precision" || fail "bench --precision $precision"
    cp "$STORE/bench-$precision/bench.md" "$OUT/bench-$precision.md" 2>/dev/null
    python - "$STORE/bench-$precision/bench.json" <<'EOF' || fail "the cost view of bench-$precision"
import json, sys
cost = json.load(open(sys.argv[1]))["results"][0]["cost"]
assert cost and cost["flops_per_sample"] == 7_548_672, cost
mfu = "none (no peak known for this GPU)" if cost["mfu"] is None else f"{cost['mfu']:.2%} of {cost['peak_tflops']:g} TFLOP/s"
print(f"gpu-smoke: cost: {cost['achieved_tflops_per_worker']:.3g} TFLOP/s per worker on {cost['device']}, MFU {mfu}")
EOF
done
# The input copy overlapped (--prefetch): the time a step waits on its batch (bench's data wait,
# the GPU synchronized around each phase), the CNN on 3×32×32 images at batch 64, staged ahead or not.
for mode in off on; do
    raytrain bench benchmarks.overhead:ImageCNN --gpu --workers 1 --steps 200 --prefetch "$mode" \
        --storage "$STORE" --name "prefetch-$mode" || fail "bench --prefetch $mode"
done
python - "$STORE" <<'EOF' || fail "the prefetched copy did not shorten the data wait"
import json, sys
r = {m: json.load(open(f"{sys.argv[1]}/prefetch-{m}/bench.json"))["results"][0] for m in ("off", "on")}
wait = {m: r[m]["split_ms"]["data_wait"] for m in r}
rate = {m: r[m]["steady_samples_per_s"] for m in r}
print(f"gpu-smoke: data wait per step: {wait['off']:.3f} ms copied at the step, {wait['on']:.3f} ms staged ahead; "
      f"samples/s {rate['off']:,.0f} vs {rate['on']:,.0f} ({rate['on'] / rate['off']:.2f}x)")
assert wait["on"] < wait["off"], wait
EOF

say "all steps passed in $(( $(date +%s) - started )) s; figures in $OUT"
