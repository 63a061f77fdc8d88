#!/usr/bin/env bash
# Prepare .whl/ (ignored by git) for benchmarks/gpu_check.sh on the GPU machine, which has its own
# Python, torch and many packages but no Ray and no network. Run it here, in the repo's root,
# where pip reaches the package index:
#
#     bash scripts/gpu_wheels.sh            # cp312 wheels (the GPU machine's Python 3.12)
#     GPU_PYTHON=3.11 bash scripts/gpu_wheels.sh   # another Python (a rehearsal on this machine)
#
# .whl/ then holds:
#   ray-<version>-<tag>.tar.xz  Ray's wheel unpacked, without what raytrain never uses (the Java
#                               jars, RLlib, Serve, ray.llm), packed with xz: 79 MB -> about 31 MB
#   *.whl                       every other distribution `ray[default,train,tune,data]` and
#                               raytrain need (pyproject.toml), as one resolved set, except
#                               - torch (the machine's own) and torchft (per-step needs 2+ GPUs);
#                               - boto3 and its botocore (13 MB; only --storage s3:// imports them);
#                               - what the GPU machine already has (DEVICE_HAS, from its package
#                                 list) when its wheel is over SPARE_MB: there the machine's own
#                                 version is taken on trust. Smaller ones are carried anyway, as
#                                 spares: benchmarks/gpu_site.py installs a spare only where the
#                                 machine's version is missing or fails a bound (aiohttp>=3.14.4).
#   manifest.txt                what was carried, its sizes, and the total with the working tree
# The working tree travels as well, so raytrain itself needs no wheel. Everything must stay under
# the device call's 64 MiB; the script fails past LIMIT_MB.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
PYV=${GPU_PYTHON:-3.12}
TAG=cp${PYV/./}
RAY_VERSION=2.60.0
DEST=.whl
CACHE=${GPU_WHEELS_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/raytrain-gpu-wheels/$TAG}
SPARE_MB=${SPARE_MB:-2}
LIMIT_MB=${LIMIT_MB:-60}
# The GPU machine's Python packages (its package list), normalized names.
DEVICE_HAS="absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build
certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core
cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock flatbuffers
flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize
hypothesis idna imageio iniconfig interface-meta jax jaxlib jaxtyping jinja2 joblib kiwisolver lazy-loader lightning
lightning-utilities linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe matplotlib mdurl meson
ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals networkx ninja numba
numba-cuda numpy numpyro nvidia-ml-py onnx onnxruntime opencv-python-headless optax opt-einsum orbax-checkpoint
packaging pandas pathspec patsy peft pillow pip pluggy portalocker prometheus-client propcache protobuf psutil pyarrow
pybind11 py-cpuinfo pygments pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock
pytest-timeout pytest-xdist python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors
scikit-build-core scikit-image scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham
simplejson six sortedcontainers statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore
threadpoolctl tifffile tiktoken timm tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics
torchvision tqdm transformers treescope triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig
werkzeug wheel wrapt xarray xxhash yarl zipp"
# Not carried: torch (the machine's own), torchft (per-step needs 2+ GPUs), boto3 (only --storage
# s3:// imports it), what Ray's metadata asks for but a Ray run on one machine never imports:
# virtualenv (runtime_env pip/virtualenv), py-spy (the dashboard's profiler), google-api-core and its
# google-auth and cryptography (opencensus imports only googleapis-common-protos' google.rpc).
SKIP="torch torchft-nightly boto3 botocore s3transfer jmespath virtualenv distlib python-discovery py-spy
google-api-core google-auth cryptography cffi pycparser pyasn1 pyasn1-modules proto-plus"

"$PY" -m pip --version >/dev/null || { echo "gpu-wheels: $PY has no pip" >&2; exit 1; }
mkdir -p "$CACHE" "$DEST"
rm -f "$DEST"/*.whl "$DEST"/ray-*.tar.xz "$DEST"/manifest.txt

# raytrain's own requirements (pyproject.toml), less torch and the skipped ones.
mapfile -t REQS < <("$PY" - "$(echo $SKIP)" <<'EOF'
import re, sys, tomllib
skip = set(sys.argv[1].split())
for req in tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]:
    name = re.split(r"[\[<>=!~; ]", req, maxsplit=1)[0]
    if re.sub(r"[-_.]+", "-", name).lower() not in skip and not name.startswith("ray"):
        print(req)
EOF
)
PLATFORMS=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
    manylinux2014_x86_64 manylinux2010_x86_64 manylinux_2_5_x86_64 manylinux1_x86_64; do
    PLATFORMS+=(--platform "$p")
done
TARGET_FLAGS=(--only-binary=:all: --python-version "$PYV" --implementation cp --abi "$TAG" --abi abi3 --abi none
    "${PLATFORMS[@]}")

# One resolution of the whole set for the GPU machine's Python (no install: a report).
echo "gpu-wheels: resolving ray[default,train,tune,data]==$RAY_VERSION and ${#REQS[@]} of raytrain's requirements for $TAG"
"$PY" -m pip install -q --dry-run --ignore-installed --target "$CACHE/.resolve" --report "$CACHE/report.json" \
    "${TARGET_FLAGS[@]}" "ray[default,train,tune,data]==$RAY_VERSION" "${REQS[@]}"

# What to carry: name==version of each resolved distribution but Ray and the skipped ones.
"$PY" - "$CACHE/report.json" "$(echo $SKIP)" > "$CACHE/pins.txt" <<'EOF'
import json, re, sys
skip = set(sys.argv[2].split())
for item in json.load(open(sys.argv[1]))["install"]:
    name = re.sub(r"[-_.]+", "-", item["metadata"]["name"]).lower()
    if name != "ray" and name not in skip:
        print(f"{name}=={item['metadata']['version']}")
EOF
"$PY" -m pip download -q --no-deps "${TARGET_FLAGS[@]}" -d "$CACHE" "ray==$RAY_VERSION" -r "$CACHE/pins.txt"

# Ray, stripped: unpacked with its files' modes (gcs_server and raylet are executables), packed with xz.
RAY_WHEEL=$(ls "$CACHE"/ray-"$RAY_VERSION"-"$TAG"-*.whl)
RAY_TAR="$CACHE/ray-$RAY_VERSION-$TAG.tar.xz"
if [ ! -s "$RAY_TAR" ] || [ "$RAY_TAR" -ot "$RAY_WHEEL" ]; then  # delete it after changing what is stripped
    echo "gpu-wheels: stripping $(basename "$RAY_WHEEL") (xz takes a minute)"
    tree=$(mktemp -d)
    "$PY" - "$RAY_WHEEL" "$tree" <<'EOF'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as wheel:
    for info in wheel.infolist():
        path = wheel.extract(info, sys.argv[2])
        mode = info.external_attr >> 16
        if mode and not info.is_dir():
            __import__("os").chmod(path, mode & 0o7777)
EOF
    rm -rf "$tree"/ray/jars "$tree"/ray/rllib "$tree"/ray/serve "$tree"/ray/llm
    # The dashboard's web pages (8.9 MB): its server needs the folder and index.html, not the app.
    rm -rf "$tree"/ray/dashboard/client/build/static/* "$tree"/ray/dashboard/client/build/speedscope-*
    for exe in "$tree"/ray/core/src/ray/gcs/gcs_server "$tree"/ray/core/src/ray/raylet/raylet; do
        [ -f "$exe" ] || { echo "gpu-wheels: $exe missing from Ray's wheel" >&2; exit 1; }
        chmod 755 "$exe"
    done
    (cd "$tree" && tar cf - --owner=0 --group=0 . | xz -T2 -6) > "$RAY_TAR.partial"
    mv "$RAY_TAR.partial" "$RAY_TAR"
    rm -rf "$tree"
fi
cp "$RAY_TAR" "$DEST/"

# The wheels: each distribution the machine lacks, and the small spares of what it has.
: > "$DEST/manifest.txt"
carried=0 spares=0 left=()
while IFS= read -r pin; do
    name=${pin%%==*} version=${pin#*==}
    glob=$(echo "$name" | tr '-' '_')
    wheel=$(ls "$CACHE"/* 2>/dev/null | grep -i "/${glob}-${version}-" | grep '\.whl$' | head -1 || true)
    [ -n "$wheel" ] || { echo "gpu-wheels: no wheel for $pin in $CACHE" >&2; exit 1; }
    size=$(stat -c %s "$wheel")
    if [[ " $(echo $DEVICE_HAS) " == *" $name "* ]]; then
        if [ "$size" -gt $((SPARE_MB * 1000000)) ]; then
            left+=("$name")
            continue
        fi
        kind=spare spares=$((spares + 1))
    else
        kind=needed carried=$((carried + 1))
    fi
    cp "$wheel" "$DEST/"
    printf '%-8s %8d %s\n' "$kind" "$size" "$(basename "$wheel")" >> "$DEST/manifest.txt"
done < "$CACHE/pins.txt"
printf '%-8s %8d %s\n' ray "$(stat -c %s "$RAY_TAR")" "$(basename "$RAY_TAR")" >> "$DEST/manifest.txt"

whl_bytes=$(du -cb "$DEST"/* | tail -1 | cut -f1)
tree_bytes=$(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
untracked=$(git ls-files -z --others --exclude-standard | xargs -0 -r du -cb 2>/dev/null | tail -1 | cut -f1)
total=$((whl_bytes + tree_bytes + ${untracked:-0}))
{
    echo "# not carried (the GPU machine has them; over ${SPARE_MB} MB): ${left[*]:-none}"
    echo "# skipped:" $SKIP
    echo "# .whl $whl_bytes bytes + working tree $tree_bytes + untracked ${untracked:-0} = $total bytes"
} >> "$DEST/manifest.txt"
echo "gpu-wheels: $carried wheels the GPU machine lacks, $spares spares, Ray stripped; not carried (machine has them): ${left[*]:-none}"
echo "gpu-wheels: .whl/ $((whl_bytes / 1048576)) MiB + working tree $(( (tree_bytes + ${untracked:-0}) / 1048576 )) MiB = $((total / 1048576)) MiB ($total bytes; the device call takes 64 MiB)"
if [ "$total" -gt $((LIMIT_MB * 1048576)) ]; then
    echo "gpu-wheels: over ${LIMIT_MB} MiB: too close to the device call's limit" >&2
    exit 1
fi
