# Sourced by adversarial_cases.sh and hardening_cases.sh: one Markdown row per case.
# case_ NAME COMMAND...: runs COMMAND in the working directory, prints its exit status, wall
# time and raytrain's first line on stderr, and keeps that stderr as $WORK/err-NAME.txt.
case_() {
    local name=$1; shift
    local start; start=$(date +%s)
    "$@" > out.txt 2> err.txt; local rc=$?
    local first; first=$(grep -m1 '^raytrain' err.txt | cut -c1-400)
    echo "| $name | $rc | $(( $(date +%s) - start )) s | ${first:-} |"
    cp err.txt "$WORK/err-$(echo "$name" | tr -c 'A-Za-z0-9' _ | cut -c1-60).txt"
}
