#!/usr/bin/env bash
# The test suite in stages, cheapest first, stopping at the first stage that fails:
#   quick     -m "not ray and not slow and not scenario"   pure tests (and gpu tests, skipped without a GPU)
#   slow      -m "slow and not ray and not scenario"       tests that start processes (torchrun, the CLI, a server)
#   ray       -m "ray and not scenario"                    tests on a CPU Ray instance
#   scenario  -m "scenario"                                long multi-fit fault scenarios on Ray (only with --all)
# `bash scripts/test.sh` runs quick, slow and ray: what CI runs. `bash scripts/test.sh --all` adds
# scenario; then every test is selected by exactly one stage, as `python -m pytest -q` selects it
# once (docs/testing.md says what each scenario test covers beyond the CI stages). Other arguments
# are passed to every stage (`bash scripts/test.sh -x`, `bash scripts/test.sh tests/test_cli.py`).
#
# Each stage is its own pytest session: its time, its 10 slowest tests (--durations=10; an argument
# given here wins), its check that nothing was left outside tmp_path (tests/conftest.py). A stage
# that selects no test (pytest's exit status 5) passes, but when no stage selects one (a -k or a
# path that matches nothing: a typo would read as a green run) the script says so and exits 5.
# The line before the last compares each CI stage's wall time with its budget on a quiet 2-core
# machine (it reports, it does not fail):
#   "test: budget quick 68 s/120 s ok, slow 160 s/480 s ok, ray 1900 s/1500 s OVER"
# The last line is the sum of the stages' counts, in pytest's words:
#   "812 passed, 0 failed, 4 skipped in 1450.3s (stages: quick, slow, ray)"
# Exit status: 0, the status of the stage that failed, or 5 when no stage selected a test.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
names=(quick slow ray scenario)
marks=("not ray and not slow and not scenario" "slow and not ray and not scenario" "ray and not scenario" "scenario")
budgets_s=(120 480 1500 "") # CI stages only: scenario has none (CI does not run it)

stages=3
args=()
for arg in "$@"; do
    if [ "$arg" = "--all" ]; then stages=${#names[@]}; else args+=("$arg"); fi
done

# Each stage's closing pytest line, to sum at the end (not a "raytrain*" name: the suite
# checks that it leaves none of those in the temp directory).
summaries=$(mktemp -t rtstages.XXXXXX)
trap 'rm -f "$summaries"' EXIT
ran=()
took_s=()
selected=0 # stages that selected a test (pytest's status not 5)

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

budget_line() {
    # Every CI stage against its budget: "ok", "OVER", or "not run" when an earlier stage failed.
    local parts=() i
    for i in 0 1 2; do
        if [ "$i" -lt "${#took_s[@]}" ]; then
            local verdict=ok
            [ "${took_s[$i]}" -gt "${budgets_s[$i]}" ] && verdict=OVER
            parts+=("${names[$i]} ${took_s[$i]} s/${budgets_s[$i]} s ${verdict}")
        else
            parts+=("${names[$i]} not run/${budgets_s[$i]} s")
        fi
    done
    local line
    line=$(IFS=,; echo "${parts[*]}" | sed 's/,/, /g')
    if [ "${#took_s[@]}" -gt 3 ]; then
        line="${line}; scenario ${took_s[3]} s (no budget: not in CI)"
    fi
    echo "test: budget ${line}"
}

for ((i = 0; i < stages; i++)); do
    name=${names[$i]}
    echo "test: stage $((i + 1))/${stages} ${name} (-m \"${marks[$i]}\")"
    out=$(mktemp -t rtstage.XXXXXX)
    start_s=$(date +%s)
    "$PY" -m pytest -q -m "${marks[$i]}" --durations=10 "${args[@]}" 2>&1 | tee "$out"
    status=${PIPESTATUS[0]}
    took_s+=($(($(date +%s) - start_s)))
    echo "test: stage ${name} took ${took_s[$i]} s"
    # pytest's closing line: "N passed, ... in 12.34s" (or "no tests ran in 0.01s").
    grep -E '^(no tests ran|[0-9]+ [a-z]+.*) in [0-9.]+s' "$out" | tail -n 1 >>"$summaries"
    rm -f "$out"
    ran+=("$name")
    [ "$status" -ne 5 ] && selected=$((selected + 1))
    if [ "$status" -ne 0 ] && [ "$status" -ne 5 ]; then
        echo "test: stage ${name} failed (pytest exit status ${status}); later stages not run"
        budget_line
        total_line
        exit "$status"
    fi
done
if [ "$selected" -eq 0 ]; then
    echo "test: no stage selected a test (pytest's exit status 5 in each of the ${stages} stages): check the arguments," \
        "a -k or a path that matches nothing"
    budget_line
    total_line
    exit 5
fi
budget_line
total_line
