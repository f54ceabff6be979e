#!/bin/bash
# One round of the CUDA row operations on the GPU machine (not part of the
# build): build for sm_90a, then the stages named, in order.
#
#   src/cuda/tools/rows_device_round.sh STAGE...   (from the repository root)
#
#   numerics   device_check.cu: hardware e4m3 / i8 shortcuts, device exp = host exp, division
#   host       check_numerics.c on the machine's cores (the full host check)
#   tests      the Check suites of the row ops, topk and the API on the CUDA backend
#   sanitize   compute-sanitizer memcheck (and racecheck on the masked test) over them
#   bench      bench_rows.c --check: timings against the copy bandwidth, CPU comparison
#   variants   bench_rows with rows.cu built for MF_BLOCKS_PER_SM in $VARIANTS (default 2 3 4)
#
# Check and subunit travel as Debian packages in .deps/ (tools/fetch-device-deps.sh),
# unpacked under /opt/mfdeps. Logs go to $OUT (or out/).
set -uo pipefail
cd "$(dirname "$0")/../../.."
out=${OUT:-out}
mkdir -p "$out"
deps=/opt/mfdeps
if ls .deps/*.deb >/dev/null 2>&1; then
    mkdir -p "$deps"
    for f in .deps/*.deb; do dpkg -x "$f" "$deps"; done
    for pc in "$deps"/usr/lib/x86_64-linux-gnu/pkgconfig/*.pc; do
        sed -i "s|^prefix=.*|prefix=$deps/usr|" "$pc"
    done
    export PKG_CONFIG_PATH="$deps/usr/lib/x86_64-linux-gnu/pkgconfig${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}"
    export LD_LIBRARY_PATH="$deps/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
# With MOE_STUB=1 the build runs in a copy of the tree whose MoE kernels (another
# engineer's files, possibly mid-edit) are replaced by stubs answering UNSUPPORTED.
if [ "${MOE_STUB:-0}" = 1 ]; then
    mkdir -p /tmp/mfrows
    tar --exclude='./build*' --exclude=./.git -cf - . | tar -xf - -C /tmp/mfrows
    cd /tmp/mfrows
    sed -i "/'moe_[a-z_]*\.cu',/d" src/cuda/meson.build
    sed -i "s/  'topk.cu',/  'topk.cu',\n  'moe_stub.cu',/" src/cuda/meson.build
    cat >src/cuda/moe_stub.cu <<'STUB'
#include "cuda/cuda_internal.h"
static moefuse_status no(moefuse_context *ctx) { return mf_error(ctx, MOEFUSE_ERR_UNSUPPORTED, "moe: stub"); }
moefuse_status mf_cuda_moe_gate(moefuse_context *c, void *s, const mf_moe_args *a) { (void)s; (void)a; return no(c); }
moefuse_status mf_cuda_moe_final(moefuse_context *c, void *s, const mf_moe_args *a) { (void)s; (void)a; return no(c); }
moefuse_status mf_cuda_moe_forward(moefuse_context *c, void *s, const mf_moe_args *a) { (void)s; (void)a; return no(c); }
STUB
    grep -n "cu'" src/cuda/meson.build
fi
build=build-rowsdev
if [ ! -f "$build/build.ninja" ]; then
    meson setup "$build" -Dcuda=enabled -Dopencl=disabled -Dblas=disabled \
        -Dnvcc_targets=sm_90a >"$out/setup.log" 2>&1 || { tail -30 "$out/setup.log"; exit 1; }
fi
t0=$(date +%s)
ninja -C "$build" >"$out/build.log" 2>&1 || { grep -E "error|Error" -A3 "$out/build.log" | head -80; exit 1; }
echo "build: $(( $(date +%s) - t0 )) s"
NVFLAGS="-O3 -std=c++17 --fmad=false -gencode=arch=compute_90a,code=sm_90a -Isrc -Iinclude"
LINK="$build/src/libmoefuse.a -Xcompiler -fopenmp -lgomp -lm -ldl -lrt -lpthread"
row_tests="test_quant test_act_quant test_act_quant_masked test_act_mul test_topk test_api_errors test_determinism test_cross_backend"

for stage in "$@"; do
    case "$stage" in
    numerics)
        nvcc $NVFLAGS -Xcompiler -fopenmp src/cuda/tools/device_check.cu -o "$build/device_check" -lgomp &&
            "$build/device_check" 2>&1 | tee "$out/device_check.txt"
        ;;
    host)
        gcc -O2 -std=c11 -ffp-contract=off -fno-fast-math -fopenmp -Iinclude -Isrc \
            src/cuda/tools/check_numerics.c src/cuda/tools/check_numerics_ref.c -lm \
            -o "$build/check_numerics" && "$build/check_numerics" 2>&1 | tee "$out/check_numerics.txt"
        ;;
    tests)
        names=""
        for t in $row_tests; do names="$names $t@cuda"; done
        # shellcheck disable=SC2086
        meson test -C "$build" --print-errorlogs --num-processes 8 $names >"$out/tests.log" 2>&1
        echo "tests: rc=$?"
        grep -E "^ *[0-9]+/[0-9]+ " "$out/tests.log" | tail -20
        grep -E "FAIL|Assertion|seed|:F:|:E:" "$out/tests.log" | head -40
        ;;
    sanitize)
        : >"$out/sanitize.log"
        for t in test_quant test_act_quant test_act_quant_masked test_act_mul test_topk; do
            MOEFUSE_TEST_BACKEND=cuda CK_FORK=no timeout ${SAN_TIMEOUT:-400} compute-sanitizer --tool memcheck \
                --error-exitcode 9 "$build/tests/$t" >>"$out/sanitize.log" 2>&1
            echo "memcheck $t: rc=$?" | tee -a "$out/sanitize.log"
        done
        MOEFUSE_TEST_BACKEND=cuda CK_FORK=no timeout ${SAN_TIMEOUT:-400} compute-sanitizer --tool racecheck \
            --error-exitcode 9 "$build/tests/test_act_quant_masked" >>"$out/sanitize.log" 2>&1
        echo "racecheck test_act_quant_masked: rc=$?" | tee -a "$out/sanitize.log"
        grep -h "ERROR SUMMARY" "$out/sanitize.log" | sort | uniq -c
        grep -B2 -A12 "Invalid\|Race\|Hazard" "$out/sanitize.log" | head -60
        ;;
    bench)
        nvcc -O2 -Iinclude src/cuda/tools/bench_rows.c $LINK -o "$build/bench_rows" &&
            "$build/bench_rows" --check 2>&1 | tee "$out/bench.txt"
        ;;
    variants)
        # VARIANTS: words BxSy[Lz] = MF_BLOCKS_PER_SM x, MF_STAGES y, MF_ST_SLOTS z (default 4)
        for v in ${VARIANTS:-B3S2 B2S2 B2S3}; do
            b=${v#B}; b=${b%%S*}; st=${v#*S}; st=${st%%L*}; sl=4
            case "$v" in *L*) sl=${v#*L} ;; esac
            nvcc $NVFLAGS -lineinfo -DMOEFUSE_BUILDING -DMF_BLOCKS_PER_SM=$b -DMF_STAGES=$st \
                -DMF_ST_SLOTS=$sl -Xptxas -v \
                -c src/cuda/rows.cu -o "$build/rows_$v.o" 2>"$out/ptxas_$v.txt" &&
                nvcc -O2 -Iinclude src/cuda/tools/bench_rows.c "$build/rows_$v.o" $LINK \
                    -o "$build/bench_$v" || continue
            echo "== $v: $(grep -A2 quant_silu_st "$out/ptxas_$v.txt" | grep -oE 'Used [0-9]+ registers|[0-9]+ bytes spill stores' | tr '\n' ' ')"
            "$build/bench_$v" --iters 30 2>&1 | grep -v "^device\|^copy" | cut -c1-120
        done
        ;;
    ncu)
        # NCU_VARIANT (a BxSy built by the variants stage), BENCH_ONLY (case index, default 1)
        v=${NCU_VARIANT:-B3S2}
        BENCH_ONLY=${BENCH_ONLY:-1} ncu --launch-skip 2 --launch-count 1 -k regex:mf_k_ \
            --section SpeedOfLight --section Occupancy --section WarpStateStats \
            --section SchedulerStats --section MemoryWorkloadAnalysis --section InstructionStats \
            --section ComputeWorkloadAnalysis --metrics smsp__inst_executed.sum,smsp__thread_inst_executed.sum \
            --print-details all \
            "$build/bench_$v" --iters 1 >"$out/ncu_$v.txt" 2>&1
        grep -vE "^==PROF==|^\s*$|^    -----" "$out/ncu_$v.txt" | cut -c1-110 | head -150
        ;;
    ncusrc)
        # per-SASS-instruction execution counts of one kernel launch (NCU_VARIANT, BENCH_ONLY)
        v=${NCU_VARIANT:-B3S2}
        BENCH_ONLY=${BENCH_ONLY:-1} ncu --launch-skip 2 --launch-count 1 -k regex:mf_k_ \
            --section SourceCounters --page source --csv --print-source sass \
            "$build/bench_$v" --iters 1 >"$out/ncusrc_$v.csv" 2>&1
        wc -l "$out/ncusrc_$v.csv"
        ;;
    *) echo "unknown stage $stage" ;;
    esac
done
