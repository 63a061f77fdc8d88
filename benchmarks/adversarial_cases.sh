#!/usr/bin/env bash
# Faults a careful user meets, run as that user would: one row per case with the exit status,
# the wall time and raytrain's first line on stderr (a Markdown table on stdout). About 10
# minutes on 2 cores. The full-disk case mounts a 3 MiB tmpfs (needs root; skipped otherwise).
#
#     bash benchmarks/adversarial_cases.sh [WORK_DIR]
set -u
REPO=$(cd "$(dirname "$0")/.." && pwd)
WORK=${1:-/tmp/raytrain-cases}
RT=${RAYTRAIN:-$(dirname "$(command -v python)")/raytrain}
PY=$(command -v python)
export PYTHONPATH=$REPO:$REPO/benchmarks
S=$WORK/runs
rm -rf "$S"; mkdir -p "$S"; cd "$WORK" || exit 1
. "$REPO/benchmarks/cases_common.sh"
echo "| case | exit | wall | raytrain's first line on stderr |"
echo "|---|---:|---:|---|"
Q=(--epochs 1 --workers 2 --storage "$S" --progress off)
case_ "bad flag value" "$RT" train digits --lr -1 "${Q[@]}" --name a
case_ "unknown --pipeline-arg" "$RT" train digits --pipeline-arg nope=1 "${Q[@]}" --name b
case_ "--workers 64 on a small machine" "$RT" train digits --workers 64 --epochs 1 --storage "$S" --name c
"$PY" -m http.server 18123 > /dev/null 2>&1 & HTTP=$!; sleep 1
case_ "--address at a non-Ray port" timeout 120 "$RT" train digits --address 127.0.0.1:18123 "${Q[@]}" --name d
kill $HTTP
case_ "NaN loss from the 20th step" "$RT" train adversarial_pipelines:NanAt20 "${Q[@]}" --epochs 3 --name e
case_ "build_model raises" "$RT" train adversarial_pipelines:BadModel "${Q[@]}" --max-failures 3 --name f
case_ "compute_loss returns a vector" "$RT" train adversarial_pipelines:VectorLoss "${Q[@]}" --name g
case_ "label out of range" "$RT" train adversarial_pipelines:BadLabel "${Q[@]}" --max-failures 3 --name h
"$PY" - "$WORK/strlabel" <<'PYEOF'
import os, sys
import numpy as np, pyarrow as pa, pyarrow.parquet as pq
os.makedirs(sys.argv[1], exist_ok=True)
n = 300
pq.write_table(pa.table({"x": np.random.rand(n).astype("float32"), "y": np.random.rand(n).astype("float32"),
                         "label": [["cat", "dog"][i % 2] for i in range(n)]}), os.path.join(sys.argv[1], "a.parquet"))
PYEOF
case_ "parquet with a string label" "$RT" train parquet --pipeline-arg path="$WORK/strlabel" --pipeline-arg label=label "${Q[@]}" --name i
case_ "a good run (2 epochs)" "$RT" train digits --epochs 2 --workers 2 --storage "$S" --progress off --name good
cp -a "$S/good" "$S/good.copy"
case_ "--resume of a finished run with another pipeline" "$RT" train adversarial_pipelines:OtherShape --storage "$S" --name good --resume --progress off
diff -r "$S/good" "$S/good.copy" > /dev/null && echo "| (the run's files byte-identical after the refusal) | | | |"
case_ "export onto a directory" "$RT" export "$S/good" -o "$S"
case_ "export of the good run" "$RT" export "$S/good" -o "$WORK/good.pt"
mkdir -p "$WORK/tiny"
if mountpoint -q "$WORK/tiny" || mount -t tmpfs -o size=3m tmpfs "$WORK/tiny" 2> /dev/null; then
    case_ "--storage on a full 3 MiB disk" "$RT" train digits --epochs 2 --workers 2 --storage "$WORK/tiny" --progress off --name full
    umount "$WORK/tiny"
fi
"$RT" train digits --epochs 12 --workers 2 --storage "$S" --progress off --name sig > sig.out 2> sig.err & P=$!
for _ in $(seq 240); do  # SIGTERM once the first checkpoint is in place: mid-run
    compgen -G "$S/sig/checkpoint_*" > /dev/null && break
    sleep 0.5
done
kill -TERM $P; wait $P; rc=$?
echo "| SIGTERM mid-run | $rc | | $(grep -m1 '^raytrain' sig.err | cut -c1-400) |"
case_ "--resume after SIGTERM, no other flags" "$RT" train --storage "$S" --name sig --resume --progress off
