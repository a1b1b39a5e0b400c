#!/usr/bin/env bash
# The GPU checks in one command that ends within 10 minutes on an H100 / H200: the GPU tests, then the parts of
# benchmarks/gpu.py not yet measured, in order of value, each under its own time limit so that one slow part cannot
# take the others' time (a speed part stopped at its limit keeps the methods it finished; the log says which).
#
#     bash benchmarks/gpu_all.sh OUT_DIR        # OUT_DIR/log.txt and one JSON per part
#     cp OUT_DIR/*.json benchmarks/results/gpu/ && python benchmarks/assemble.py
#
# On a machine whose python has a CUDA torch but no dcache, build the wheels here first
# (`pip wheel --no-deps -w whl . && pip download --no-deps -d whl diffusers==0.42.1 importlib_metadata`) and set
# WHEELS=whl: they are installed into a private folder and everything runs with `python -P`, which keeps this
# checkout's source folders (dcache/, schedules/, ...) off sys.path, where they would shadow the installed layout.
# Limits in seconds (tests, Wan speed, offload, Qwen-Image speed): GPU_LIMITS="90 200 120 150".
set -u
out=${1:?usage: bash benchmarks/gpu_all.sh OUT_DIR}
mkdir -p "$out"
read -r t_tests t_wan t_offload t_qwen <<<"${GPU_LIMITS:-90 200 120 150}"
export PYTHONUNBUFFERED=1
python=${PYTHON:-python3}
log="$out/log.txt"
if [ -n "${WHEELS:-}" ]; then
    "$python" -m pip install -q --no-index --no-deps --no-compile --target /tmp/dcache-site "$WHEELS"/*.whl || exit 1
    export PYTHONPATH=/tmp/dcache-site
fi

step() {  # step LIMIT NAME COMMAND...: run with a time limit, log the outcome
    local limit=$1 name=$2
    shift 2
    local t0=$SECONDS
    echo "=== $name (limit ${limit}s)" | tee -a "$log"
    timeout "$limit" "$@" 2>&1 | tee -a "$log"
    local rc=${PIPESTATUS[0]}
    echo "=== $name: exit $rc after $((SECONDS - t0))s$([ "$rc" = 124 ] && echo ' (stopped at its time limit)')" \
        | tee -a "$log"
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | tee -a "$log"
"$python" -P -c "import torch, diffusers; print('torch', torch.__version__, 'diffusers', diffusers.__version__)" \
    2>&1 | tee -a "$log"
step "$t_tests" tests "$python" -P -m pytest tests/gpu -q -p no:cacheprovider -n 8 -W ignore
# 10 steps and one timed run per variant: a Wan 480p x 81 frames generation with split CFG takes ~13 s on an H100
step "$t_wan" speed-wan "$python" -P benchmarks/gpu.py --part speed --model wan2.1-t2v-1.3b --steps 10 --runs 1 \
    --out "$out/speed-wan2.1-t2v-1.3b.json"
step "$t_offload" offload-flux "$python" -P benchmarks/gpu.py --part offload --model flux.1-dev --steps 14 --runs 1 \
    --out "$out/offload-flux.1-dev.json"
step "$t_qwen" speed-qwen "$python" -P benchmarks/gpu.py --part speed --model qwen-image --steps 10 --runs 1 \
    --out "$out/speed-qwen-image.json"
