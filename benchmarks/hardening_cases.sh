#!/usr/bin/env bash
# The second hardening pass (issue 26), played as a user would: every pipeline hook's faults,
# Parquet files that drift, names that look like "no value", a clone that could shadow the
# package, damaged checkpoints, resumes under changed flags, configs of the wrong shape. One row
# per case with the exit status, the wall time and raytrain's first line on stderr (a Markdown
# table on stdout). About 15 minutes on 2 cores (it starts Ray).
#
#     bash benchmarks/hardening_cases.sh [WORK_DIR]
set -u
REPO=$(cd "$(dirname "$0")/.." && pwd)
WORK=${1:-/tmp/raytrain-hcases}
RT=${RAYTRAIN:-$(dirname "$(command -v python)")/raytrain}
PY=$(command -v python)
[ -x "$RT" ] || { echo "no raytrain at $RT: activate the virtualenv first" >&2; exit 2; }
export PYTHONPATH=$REPO:$REPO/benchmarks
S=$WORK/runs
rm -rf "$WORK"; mkdir -p "$S"; cd "$WORK" || exit 1
. "$REPO/benchmarks/cases_common.sh"
echo "| case | exit | wall | raytrain's first line on stderr |"
echo "|---|---:|---:|---|"
Q=(--epochs 1 --workers 2 --storage "$S" --progress off)
P=adversarial_pipelines

# -- every pipeline hook under one rule
case_ "lr_factor raises" "$RT" train $P:LrRaises "${Q[@]}" --max-failures 3 --name lr1
case_ "lr_factor returns a string" "$RT" train $P:LrString "${Q[@]}" --max-failures 3 --name lr2
case_ "lr_factor returns -1" "$RT" train $P:LrNegative "${Q[@]}" --name lr3
case_ "lr_factor returns NaN" "$RT" train $P:LrNan "${Q[@]}" --name lr4
case_ "build_optimizer over another model's tensors" "$RT" train $P:ForeignOptimizer "${Q[@]}" --name opt
case_ "transform_batch drops half the rows" "$RT" train $P:DropRows "${Q[@]}" --max-failures 3 --name tb1
case_ "transform_batch drops the label column" "$RT" train $P:DropColumn "${Q[@]}" --name tb2
case_ "transform_batch forgets its return (None)" "$RT" train $P:TransformNone "${Q[@]}" --name tb3
case_ "Args = dict" "$RT" train $P:DictArgs "${Q[@]}" --name args
case_ "shard_modules returns a non-submodule (fsdp)" "$RT" train $P:ForeignShard "${Q[@]}" --strategy fsdp --name shard
case_ "compute_loss returns loss.item()" "$RT" train $P:DetachedLoss "${Q[@]}" --name det
case_ "build_datasets without a 'train' key" "$RT" train $P:NoTrain "${Q[@]}" --name notrain
case_ "module:attr names a function" "$RT" train $P:not_a_pipeline "${Q[@]}" --name fn

case_ "default_config with a typo (epocs)" "$RT" train $P:DefaultConfigTypo "${Q[@]}" --name dct
case_ "torch Dataset, sample 7 of another shape" "$RT" train $P:TorchOddShape "${Q[@]}" --name odd
case_ "--micro-batch-size 64 > --batch-size-per-worker 32" "$RT" train digits "${Q[@]}" --micro-batch-size 64 --name mb
# -- names are text
case_ "--name none (a run named none)" "$RT" train digits "${Q[@]}" --max-steps 3 --name none
[ -d "$S/none" ] && echo "| (the run directory is $S/none) | | | |"
case_ "--name null" "$RT" train digits "${Q[@]}" --max-steps 3 --name null
[ -d "$S/null" ] && echo "| (the run directory is $S/null) | | | |"
case_ '--name ""' "$RT" train digits "${Q[@]}" --name ""
case_ '--storage ""' "$RT" train digits --epochs 1 --workers 2 --storage "" --progress off --name e
case_ "--name ../escape" "$RT" train digits "${Q[@]}" --name ../escape
case_ "--name a/b" "$RT" train digits "${Q[@]}" --name a/b

# -- Parquet files that drift or go missing
"$PY" - "$WORK" <<'PYEOF'
import os, sys
import numpy as np, pyarrow as pa, pyarrow.parquet as pq
work = sys.argv[1]
def table(seed, label="label"):
    rng = np.random.default_rng(seed)
    return pa.table({"x": rng.random(200).astype("float32"), "y": rng.random(200).astype("float32"),
                     label: rng.integers(0, 2, 200)})
for name in ("renamed", "truncated", "deleted"):
    os.makedirs(os.path.join(work, name))
    for i, f in enumerate("ab"):
        pq.write_table(table(i), os.path.join(work, name, f + ".parquet"))
pq.write_table(table(2, label="target"), os.path.join(work, "renamed", "c.parquet"))
pq.write_table(table(2), os.path.join(work, "deleted", "c.parquet"))
pq.write_table(table(2), os.path.join(work, "truncated", "c.parquet"))
path = os.path.join(work, "truncated", "c.parquet")
with open(path, "r+b") as f:
    f.truncate(os.path.getsize(path) // 2)
PYEOF
PQ=(--pipeline-arg label=label "${Q[@]}")
case_ "parquet: one file's column renamed" "$RT" train parquet --pipeline-arg path="$WORK/renamed" "${PQ[@]}" --name pq1
case_ "parquet: one file truncated" "$RT" train parquet --pipeline-arg path="$WORK/truncated" "${PQ[@]}" --name pq2
case_ "parquet: a file deleted after planning" "$RT" train $P:ParquetLosesFile --pipeline-arg path="$WORK/deleted" "${PQ[@]}" --max-failures 3 --name pq3

case_ "parquet: --pipeline-arg path= (empty)" "$RT" train parquet --pipeline-arg path= "${PQ[@]}" --name pq4
case_ "parquet: --pipeline-arg label=nosuch" "$RT" train parquet --pipeline-arg path="$WORK/deleted" --pipeline-arg label=nosuch "${Q[@]}" --name pq5
# -- the working directory holds a clone's raytrain/ folder
mkdir -p "$WORK/port/raytrain"
echo '"""A clone of another version of raytrain."""' > "$WORK/port/raytrain/__init__.py"
printf 'from pipelines.digits.pipeline import DigitsPipeline\n\n\nclass Pipe(DigitsPipeline):\n    pass\n' > "$WORK/port/my_port.py"
(cd "$WORK/port" && case_ "train my_port:Pipe beside a ./raytrain/ clone" "$RT" train my_port:Pipe "${Q[@]}" --max-steps 3 --name port)

# -- export
"$PY" -c "import torch; torch.save(torch.nn.Linear(4, 2), '$WORK/whole.pt')"
case_ "export of a pickled whole-model file" "$RT" export "$WORK/whole.pt" -o "$WORK/out.pt"
echo "not a checkpoint" > "$WORK/text.pt"
case_ "export of a text file named .pt" "$RT" export "$WORK/text.pt" -o "$WORK/out2.pt"

# -- damaged checkpoints, resumes under changed flags
case_ "a good run (2 epochs)" "$RT" train digits --epochs 2 --workers 2 --storage "$S" --progress off --name good
last=$(ls -d "$S"/good/checkpoint_* | sort | tail -1)
echo "garbage" > "$last/train_state.pt"; echo "garbage" > "$last/model.pt"
case_ "--resume, last checkpoint's train_state.pt and model.pt corrupt" "$RT" train --storage "$S" --name good --resume --progress off
case_ "--resume --epochs 3 --global-batch-size 128" "$RT" train --storage "$S" --name good --resume --progress off --epochs 3 --global-batch-size 128
case_ "--resume --epochs 4 --strategy fsdp" "$RT" train --storage "$S" --name good --resume --progress off --epochs 4 --strategy fsdp
case_ "--resume of a run that does not exist" "$RT" train digits --storage "$S" --name never --resume --progress off

# -- steps and evaluation
case_ "--max-steps 0" "$RT" train digits "${Q[@]}" --max-steps 0 --name s0
case_ "--max-steps -1" "$RT" train digits "${Q[@]}" --max-steps -1 --name s1
case_ "--eval-every-steps 5 without a val set" "$RT" train $P:NoVal "${Q[@]}" --eval-every-steps 5 --name ev
case_ "--workers 3:2" "$RT" train digits "${Q[@]}" --workers 3:2 --name w

# -- storage and config
case_ "--storage s3://no-such-bucket/x, no server" timeout 120 "$RT" train digits --epochs 1 --workers 2 --storage s3://no-such-bucket/x --progress off --name s3
case_ "--storage s3://..., made-up credentials, no network" env AWS_ACCESS_KEY_ID=x AWS_SECRET_ACCESS_KEY=y timeout 120 "$RT" train digits --epochs 1 --workers 2 --storage s3://no-such-bucket/x --progress off --name s3b
printf 'pipeline: digits\nepochs: many\n' > "$WORK/type.yaml"
case_ "YAML epochs: many" "$RT" train --config "$WORK/type.yaml" --storage "$S" --name y1
printf 'pipeline: digits\nepocs: 1\n' > "$WORK/key.yaml"
case_ "YAML unknown key epocs" "$RT" train --config "$WORK/key.yaml" --storage "$S" --name y2
printf -- '- pipeline: digits\n- epochs: 1\n' > "$WORK/list.yaml"
case_ "YAML a list, not a mapping" "$RT" train --config "$WORK/list.yaml" --storage "$S" --name y3
printf 'pipeline: digits\nepochs: 1\n  lr: 0.1\n' > "$WORK/indent.yaml"
case_ "YAML bad indentation" "$RT" train --config "$WORK/indent.yaml" --storage "$S" --name y4
printf 'pipeline: digits\nlr: !!python/object/apply:os.system ["touch %s/pwned"]\n' "$WORK" > "$WORK/tag.yaml"
case_ "YAML python tag" "$RT" train --config "$WORK/tag.yaml" --storage "$S" --name y5
[ -e "$WORK/pwned" ] && echo "| (the YAML tag RAN CODE) | | | |"
printf 'pipeline: digits\nname: no\n' > "$WORK/no.yaml"
case_ "YAML name: no (a boolean to YAML)" "$RT" train --config "$WORK/no.yaml" --storage "$S"
printf 'pipeline: digits\nname: 2024\n' > "$WORK/year.yaml"
case_ "YAML name: 2024 (a number to YAML)" "$RT" train --config "$WORK/year.yaml" --storage "$S"
case_ "--config of a missing file" "$RT" train --config "$WORK/nope.yaml" --storage "$S" --name y6
printf 'import raytrain\n\nclass Pipe(raytrain.Pipeline)\n    pass\n' > "$WORK/broken_mod.py"
case_ "pipeline module with a syntax error" "$RT" train broken_mod:Pipe "${Q[@]}" --name syn
case_ "--pipeline-arg without =" "$RT" train parquet --pipeline-arg path "${Q[@]}" --name pa
case_ "report of a directory that is not a run" "$RT" report "$WORK/port"

# -- bench and check (last: the longest)
case_ "bench digits --fault-tolerance per-step" timeout 300 "$RT" bench digits --fault-tolerance per-step --workers 1,2 --steps 5 --storage "$S" --name bench
case_ "check digits --workers 1" timeout 300 "$RT" check digits --workers 1 --steps 5
