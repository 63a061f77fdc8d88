#!/usr/bin/env bash
# The whole test suite in three stages, cheapest first, stopping at the first stage that fails:
#   quick  -m "not ray and not slow"   pure tests (and gpu tests, skipped without a GPU)
#   slow   -m "slow and not ray"       tests that start processes (torchrun, the CLI, a server)
#   ray    -m ray                      tests on a CPU Ray instance
# Together the three select every test once, as `python -m pytest -q` does; a failure in a
# cheap stage is reported in seconds instead of after the Ray tier. Arguments are passed to
# every stage (`bash scripts/test.sh -x`, `bash scripts/test.sh tests/test_cli.py`).
#
# Each stage is its own pytest session: its --durations table, its check that nothing was left
# outside tmp_path (tests/conftest.py). A stage that selects no test (pytest's exit status 5)
# passes. The last line is the sum of the stages' counts, in pytest's words:
#   "812 passed, 0 failed, 4 skipped in 1450.3s (stages: quick, slow, ray)"
# Exit status: 0, or the status of the stage that failed.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
names=(quick slow ray)
marks=("not ray and not slow" "slow and not ray" "ray")

# Each stage's closing pytest line, to sum at the end (not a "raytrain*" name: the suite
# checks that it leaves none of those in the temp directory).
summaries=$(mktemp -t rtstages.XXXXXX)
trap 'rm -f "$summaries"' EXIT
ran=()

total_line() {
    # Sum "N word" counts over the stages' lines ("deselected" left out: each stage deselects
    # the other stages' tests) and their times.
    awk -v stages="$(IFS=,; echo "${ran[*]}" | sed 's/,/, /g')" '
        {
            line = $0
            if (match(line, / in [0-9.]+s/)) {
                t = substr(line, RSTART + 4, RLENGTH - 5); seconds += t
                line = substr(line, 1, RSTART - 1)
            }
            n = split(line, parts, ", ")
            for (i = 1; i <= n; i++) {
                if (split(parts[i], kv, " ") == 2 && kv[1] ~ /^[0-9]+$/) {
                    word = kv[2]; sub(/s$/, "", word)          # warnings -> warning, errors -> error
                    count[word] += kv[1]
                }
            }
        }
        END {
            out = (count["passed"] + 0) " passed, " (count["failed"] + 0) " failed"
            if (count["skipped"]) out = out ", " count["skipped"] " skipped"
            if (count["xfailed"]) out = out ", " count["xfailed"] " xfailed"
            if (count["xpassed"]) out = out ", " count["xpassed"] " xpassed"
            if (count["warning"]) out = out ", " count["warning"] " warning" (count["warning"] > 1 ? "s" : "")
            if (count["error"]) out = out ", " count["error"] " error" (count["error"] > 1 ? "s" : "")
            printf "%s in %.1fs (stages: %s)\n", out, seconds, stages
        }' "$summaries"
}

for i in "${!names[@]}"; do
    name=${names[$i]}
    echo "test: stage $((i + 1))/${#names[@]} ${name} (-m \"${marks[$i]}\")"
    out=$(mktemp -t rtstage.XXXXXX)
    "$PY" -m pytest -q -m "${marks[$i]}" "$@" 2>&1 | tee "$out"
    status=${PIPESTATUS[0]}
    # pytest's closing line: "N passed, ... in 12.34s" (or "no tests ran in 0.01s").
    grep -E '^(no tests ran|[0-9]+ [a-z]+.*) in [0-9.]+s' "$out" | tail -n 1 >>"$summaries"
    rm -f "$out"
    ran+=("$name")
    if [ "$status" -ne 0 ] && [ "$status" -ne 5 ]; then
        echo "test: stage ${name} failed (pytest exit status ${status}); later stages not run"
        total_line
        exit "$status"
    fi
done
total_line
