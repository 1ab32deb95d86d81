#!/bin/bash
# The GPU checks, sized for a lent device machine's short lease (one H100 or H200, torch
# 2.11+cu130, no network): run from the repository root there, one stage per call, every
# log under $OUT (or ./gpu-check-out). Each stage stops itself before its budget and still
# prints pytest's summary (SIGINT), so a cut-short call tells which tests failed and why.
#
#   scripts/gpu_check.sh tests [SECONDS]   # the gpu-marked tests: six workers, then the
#                                          # device-wide ones alone (~5 min in all on an H100)
#   scripts/gpu_check.sh bench [SECONDS]   # benchmarks/gpu_overhead.py: plain, compile,
#                                          # checkpoint, deterministic; one round each
#   scripts/gpu_check.sh suite [SECONDS]   # the CPU suite on this torch, 12 workers
#
# Wheels the machine lacks (textual, tomli-w, pytest-asyncio...) travel in .whl/ (see
# ../shared/GPU.md for the download); they are installed first when present.
set -u
stage=${1:-tests}
budget=${2:-420}
out=${OUT:-gpu-check-out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
end=$((SECONDS + budget))
left() { echo $((end - SECONDS)); }

if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site \
        .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >"$out/install.log" 2>&1 \
    || { cat "$out/install.log"; exit 1; }
{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    python3 -c "import sys, torch; print(sys.version.split()[0], torch.__version__)"
} | tee "$out/machine.txt"

# -rfEs: the summary names each failure, error and skip with its reason.
pytest_args=(-p no:cacheprovider -rfEs --tb=short)
case "$stage" in
tests)
    # Tests that read only their own processes share the GPU on six workers (--dist load: a
    # module's tests spread too); those that read the whole device (out of memory, the auto
    # batch's free memory, kill -9 freeing it, NVML's process list) run one at a time after.
    device_wide="oom or out_of_memory or auto_batch or kill_9 or devices_marks or nvml_samples or records_its_gpu"
    timeout -s INT $(($(left) * 3 / 5)) python3 -m pytest -m gpu -v -n 6 --dist load "${pytest_args[@]}" --timeout 180 \
        -k "not ($device_wide)" tests 2>&1 | tee "$out/gpu-tests.log" \
        | grep -E "PASSED|FAILED|ERROR|SKIPPED|^(FAILED|ERROR) |passed|failed"
    timeout -s INT "$(left)" python3 -m pytest -m gpu -v "${pytest_args[@]}" --timeout 120 \
        -k "$device_wide" tests 2>&1 | tee "$out/gpu-tests-device-wide.log" \
        | grep -E "PASSED|FAILED|ERROR|SKIPPED|^(FAILED|ERROR) |passed|failed"
    ;;
bench)
    for b in "" "--compile" "--checkpoint-every 50" "--deterministic"; do
        t=$(left)
        if [ "$t" -lt 40 ]; then echo "not run (no time left): gpu_overhead $b"; continue; fi
        echo "== gpu_overhead --rounds 1 --steps 200 $b ($t s left)"
        # shellcheck disable=SC2086  # $b is several words on purpose
        timeout "$t" python3 benchmarks/gpu_overhead.py --rounds 1 --steps 200 $b 2>&1 | tail -12
    done 2>&1 | tee "$out/bench.log"
    ;;
suite)
    timeout -s INT "$(left)" python3 -m pytest -n 12 "${pytest_args[@]}" --timeout 300 tests \
        >"$out/cpu-suite.log" 2>&1
    grep -E "^(FAILED|ERROR) |passed|failed" "$out/cpu-suite.log" | tail -40
    ;;
*)
    echo "usage: scripts/gpu_check.sh tests|bench|suite [SECONDS]" >&2
    exit 2
    ;;
esac
