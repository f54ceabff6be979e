#!/bin/bash
# A/B of two builds on the GPU machine: an earlier commit against the working tree, their
# `moefuse bench` runs alternated so that both see the same machine and its drift.
#
#   tools/device-ab.sh prepare REF      here: REF's tree into .ab-base/ (git-ignored)
#   tools/device-ab.sh run [LIST] [N]   on the device machine (carry .ab-base): build both
#                                       (library and tool only), then N rounds (default 2) of
#                                       each line of LIST (default tools/bench-decode.txt),
#                                       base then head
#
# SETUP_ARGS adds `meson setup` options to both builds (e.g. -Dnvcc_targets=sm_90a); BACKEND
# picks the bench's backend (default cuda). Output: one line per run, "base|head | the bench
# line | time: ...", in $OUT/ab.txt (or out/ab.txt).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
case "${1:-}" in
prepare)
    ref=${2:?"usage: tools/device-ab.sh prepare REF"}
    rm -rf .ab-base && mkdir .ab-base && git archive "$ref" | tar -x -C .ab-base &&
        git rev-parse --short "$ref" >.ab-base/.ref && echo "base $(cat .ab-base/.ref) in .ab-base/"
    ;;
run)
    list=${2:-tools/bench-decode.txt} rounds=${3:-2} out=${OUT:-out}
    [ -d .ab-base ] || { echo "no .ab-base: run 'tools/device-ab.sh prepare REF' here first"; exit 1; }
    mkdir -p "$out"
    build() { # SOURCE BUILD: the library and the tool, nothing else
        # shellcheck disable=SC2086
        (cd "$1" && meson setup "$2" -Dtests=disabled -Dopencl=disabled ${SETUP_ARGS:-} \
            >"$2.log" 2>&1 && ninja -C "$2" tools/moefuse >>"$2.log" 2>&1) ||
            { echo "build of $1 failed:"; tail -20 "$2.log"; }
    }
    rm -rf /tmp/ab-head /tmp/ab-base
    build . /tmp/ab-head &
    build .ab-base /tmp/ab-base &
    wait
    head=/tmp/ab-head/tools/moefuse base=/tmp/ab-base/tools/moefuse
    [ -x "$head" ] && [ -x "$base" ] || exit 1
    echo "base $(cat .ab-base/.ref 2>/dev/null) against the working tree" | tee "$out/ab.txt"
    for ((r = 0; r < rounds; r++)); do
        grep -vE '^\s*(#|$)' "$list" | while read -r line; do
            for side in base head; do
                bin=$base
                [ $side = head ] && bin=$head
                # shellcheck disable=SC2086
                t=$(timeout 120 "$bin" bench --backend "${BACKEND:-cuda}" $line 2>&1 | grep -E '^time:' |
                    sed 's/, per call.*//')
                echo "$side | $line | $t"
            done
        done
    done | tee -a "$out/ab.txt"
    ;;
*)
    sed -n '2,14p' "$0"
    exit 2
    ;;
esac
