#!/usr/bin/env bash
# One GPU session's checks and timings of the cuda backend in one command, most important
# first: the device-only check (the TF32 tensor cores' fragments and products on real
# hardware), then the GPU benchmark in IEEE float32 and with NUMBACONV_CUDA_TF32=1,
# the recurrent step, the host time of a launch and the recurrent algorithms, then the rest
# of the device tests. Each step runs under its own limit and all of them under
# SESSION_SECONDS (default 540), so that a short device lease ends with the figures that
# matter most. From the repository root of a machine with a GPU, with PYTHONPATH naming
# the project (and any wheels carried there: the device machine's NumPy 2.5 breaks
# numba-cuda 0.30.4, so carry NumPy 2.4 and nvmath-python; docs/gpu-benchmark.md):
#
#     OUT=/some/folder SESSION_SECONDS=540 bash docs/benchmarks/gpu_session.sh
#
# writes session.log and four JSON records to $OUT (default ./gpu-session). With --sim
# it runs the same steps under Numba's CUDA simulator on the tiny twins (a dry run of
# the plumbing; the times mean nothing).
set -u
sim=()
if [ "${1:-}" = "--sim" ]; then
    sim=(--sim)
    export NUMBA_ENABLE_CUDASIM=1
fi
out=${OUT:-gpu-session}
mkdir -p "$out"
deadline=$(( $(date +%s) + ${SESSION_SECONDS:-540} ))
export PYTHONUNBUFFERED=1

# step SECONDS NAME COMMAND...: COMMAND under SECONDS or what is left of the session.
step() {
    local limit=$1 name=$2
    shift 2
    local left=$(( deadline - $(date +%s) ))
    if [ "$left" -lt 20 ]; then
        echo "== $name: skipped (the session's time is spent)"
        return
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    echo "== $name (at most $limit s): $*"
    local start
    start=$(date +%s)
    timeout "$limit" "$@"
    local status=$?
    echo
    echo "== $name: exit $status after $(( $(date +%s) - start )) s"
}

tests=()
[ ${#sim[@]} -eq 0 ] && tests=(env NUMBACONV_TEST_GPU=1)
bench=(python3 -m numbaconv bench --device cuda "${sim[@]}")
{
    date -u
    step 30 "info" python3 -m numbaconv info
    step 120 "device tests: TF32" "${tests[@]}" python3 -m pytest -q tests/test_cuda_sim.py \
        -k "tf32 or mma"
    step 150 "conv bench, IEEE float32" "${bench[@]}" --suite conv --budget 0.5 --reps 8 \
        --time-limit 110 --json "$out/conv.json"
    step 150 "conv bench, NUMBACONV_CUDA_TF32=1" env NUMBACONV_CUDA_TF32=1 "${bench[@]}" \
        --suite conv --budget 0.5 --reps 8 --time-limit 110 --json "$out/conv-tf32.json"
    step 120 "rnn bench" "${bench[@]}" --suite rnn --budget 1 --reps 10 --time-limit 90 \
        --json "$out/rnn.json"
    step 90 "bias gradient bench" "${bench[@]}" --suite conv --op conv_backward_bias \
        --budget 0.5 --reps 8 --time-limit 60 --json "$out/bias.json"
    step 90 "host time of a launch" python3 docs/benchmarks/gpu_host_time.py "${sim[@]}" \
        --reps 50
    step 120 "rnn algorithms" python3 docs/benchmarks/gpu_rnn_algorithms.py "${sim[@]}" \
        --reps 20
    step 300 "device tests: the rest" "${tests[@]}" python3 -m pytest -q \
        tests/test_cuda_sim.py tests/test_cuda_rnn_sim.py -k "not (tf32 or mma)"
    date -u
} 2>&1 | tee "$out/session.log"
