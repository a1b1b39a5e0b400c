#!/usr/bin/env bash
# GPU checks in one command that ends within 10 minutes on an H100 / H200: the named steps in order, each under its
# own time limit so that one slow step cannot take the others' time (a speed part stopped at its limit keeps the
# methods it finished; the log says which step stopped).
#
#     bash benchmarks/gpu_all.sh OUT_DIR                       # tests wan offload qwen (about 9 minutes)
#     bash benchmarks/gpu_all.sh OUT_DIR cudagraphs kernels    # any steps, in the order given
#     cp OUT_DIR/*.json benchmarks/results/gpu/ && python benchmarks/assemble.py
#
# Steps (limit in seconds): tests (90), wan (200: Wan2.1 1.3B speed, 480p x 81 frames, 10 steps), offload (120:
# FLUX.1-dev), qwen (150: Qwen-Image speed, 10 steps), cudagraphs (300: FLUX.1-dev compiled whole with fullgraph
# and mode="reduce-overhead", 14 steps), compile (200: regional compile), memory (90), kernels (60), forecast_cost
# (60: benchmarks/forecast_cost.py, bfloat16). Override a limit with e.g. LIMIT_wan=240.
#
# On a machine whose python has a CUDA torch but no dcache, build the wheels here first
# (`pip wheel --no-deps -w whl . && pip download --no-deps -d whl diffusers==0.42.1 importlib_metadata`) and set
# WHEELS=whl: they are installed into a private folder and everything runs with `python -P`, which keeps this
# checkout's source folders (dcache/, schedules/, ...) off sys.path, where they would shadow the installed layout.
set -u
out=${1:?usage: bash benchmarks/gpu_all.sh OUT_DIR [step ...]}
shift
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(tests wan offload qwen)
mkdir -p "$out"
export PYTHONUNBUFFERED=1
python=${PYTHON:-python3}
log="$out/log.txt"
if [ -n "${WHEELS:-}" ]; then
    "$python" -m pip install -q --no-index --no-deps --no-compile --target /tmp/dcache-site "$WHEELS"/*.whl || exit 1
    export PYTHONPATH=/tmp/dcache-site
fi
bench=("$python" -P benchmarks/gpu.py)

run_step() {  # run_step NAME DEFAULT_LIMIT COMMAND...: run with a time limit, log the outcome
    local name=$1 default=$2
    shift 2
    local var="LIMIT_$name" t0=$SECONDS
    local limit=${!var:-$default}
    echo "=== $name (limit ${limit}s)" | tee -a "$log"
    timeout "$limit" "$@" 2>&1 | tee -a "$log"
    local rc=${PIPESTATUS[0]}
    echo "=== $name: exit $rc after $((SECONDS - t0))s$([ "$rc" = 124 ] && echo ' (stopped at its time limit)')" \
        | tee -a "$log"
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | tee -a "$log"
"$python" -P -c "import torch, diffusers; print('torch', torch.__version__, 'diffusers', diffusers.__version__)" \
    2>&1 | tee -a "$log"
for step in "${steps[@]}"; do
    case $step in
        tests) run_step tests 90 "$python" -P -m pytest tests/gpu -q -p no:cacheprovider -n 8 -W ignore ;;
        wan) run_step wan 200 "${bench[@]}" --part speed --model wan2.1-t2v-1.3b --steps 10 --runs 1 \
                 --out "$out/speed-wan2.1-t2v-1.3b.json" ;;
        offload) run_step offload 120 "${bench[@]}" --part offload --model flux.1-dev --steps 14 --runs 1 \
                     --out "$out/offload-flux.1-dev.json" ;;
        qwen) run_step qwen 150 "${bench[@]}" --part speed --model qwen-image --steps 10 --runs 1 \
                  --out "$out/speed-qwen-image.json" ;;
        cudagraphs) run_step cudagraphs 300 "${bench[@]}" --part cudagraphs --model flux.1-dev --steps 14 --runs 2 \
                        --out "$out/cudagraphs-flux.1-dev.json" ;;
        compile) run_step compile 200 "${bench[@]}" --part compile --model flux.1-dev --runs 2 \
                     --out "$out/compile-flux.1-dev.json" ;;
        memory) run_step memory 90 "${bench[@]}" --part memory --model flux.1-dev --out "$out/memory-flux.1-dev.json" ;;
        kernels) run_step kernels 60 "${bench[@]}" --part kernels --out "$out/kernels.json" ;;
        forecast_cost) run_step forecast_cost 60 "$python" -P benchmarks/forecast_cost.py --device cuda --out "$out" ;;
        *) echo "unknown step '$step': tests wan offload qwen cudagraphs compile memory kernels forecast_cost" \
               | tee -a "$log"
           exit 2 ;;
    esac
done
