#!/usr/bin/env bash
# A run on a GPU machine: install jax_ep (a wheel built beforehand in .wheel/ for this Python,
# else from source), then the GPU tests, the benchmark, the bandwidth probes or the MoE layer's
# benchmarks; logs and results under $RESULTS_DIR (default /tmp/jax_ep_out).
#   bench/run_gpu.sh [tests|bench|probe|layer|processes|deepgemm|deepep|all] [extra bench/probe/moe_layer args...]
# bench, probe and all also build the probes' extension bench._probe (the benchmark reports the
# copy engine's peer bandwidth through it); layer: the grouped-matmul GPU tests,
# bench.grouped_matmul and bench.moe_layer; processes: tests/test_gpu_processes.py (2 and 4
# processes on GPU 0 through the CUDA-IPC engine, under a private MPS daemon the tests start);
# deepgemm: lab.versus_deepgemm (jax_ep's grouped matmuls against DeepGEMM's) with the program
# of lab/cuda/versus_deepgemm.cu built beforehand (its header gives the build line), at
# $VERSUS_DEEPGEMM or build/versus_deepgemm; deepep: DeepEP V1 built from its source in .deepep/
# (bench/deepep_build.sh; a failed build is logged and the comparison still runs, its DeepEP side
# recording the import error), then bench.versus_deepep (DeepEP beside jax_ep, 2 and 4 processes
# on GPU 0 under a private MPS daemon), every rank's output under $RESULTS_DIR/versus_deepep/.
set -u -o pipefail  # a stage's status is its command's, not the tee's or tail's after it
failed=0  # the exit status: 1 when any test or benchmark stage failed or ran out of time
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
gpus=$(nvidia-smi -L | wc -l)
export JAX_EP_MACHINE=${JAX_EP_MACHINE:-nvidia-h200$([ "$gpus" -gt 1 ] && echo "-x$gpus")}
results=${RESULTS_DIR:-/tmp/jax_ep_out}
mkdir -p "$results"
what=${1:-all}
shift || true
{
  nvidia-smi -L
  nvidia-smi topo -m
  python3 -c "import jax; print('jax', jax.__version__, jax.devices())"
} > "$results/machine.txt" 2>&1
tag=$(python3 -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
if ls .wheel/*"$tag"*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-deps --no-index --force-reinstall .wheel/*"$tag"*.whl
else
  JAX_EP_CUDA=ON python3 -m pip install -q --no-build-isolation --no-deps .
fi 2>&1 | tail -3
python3 -c "import jax_ep, jax_ep._native as n; print('jax_ep with CUDA:', n.has_cuda)" || exit 1
if [ "$what" != tests ] && [ "$what" != processes ] && [ "$what" != deepgemm ] && [ "$what" != deepep ]; then  # without bench._probe the benchmark's peer bandwidth is null
  if ! { cmake -S . -B build/probe -DJAX_EP_PROBES=ON -DPython_EXECUTABLE="$(command -v python3)" &&
         cmake --build build/probe --target _probe -j && python3 -c "import bench._probe"; } \
       > "$results/probe_build.log" 2>&1; then
    tail -20 "$results/probe_build.log"
    [ "$what" = probe ] && exit 1
  fi
fi
if [ "$what" = tests ] || [ "$what" = all ]; then
  timeout ${TEST_TIMEOUT:-420} python3 -m pytest tests/test_gpu.py -q -p no:cacheprovider --timeout 200 -rA \
    2>&1 | tee "$results/gpu_tests.log" | tail -40 || failed=1
fi
if [ "$what" = processes ]; then  # this process keeps little GPU memory: its children need it
  XLA_PYTHON_CLIENT_PREALLOCATE=false timeout ${TEST_TIMEOUT:-900} python3 -m pytest \
    tests/test_gpu_processes.py -q -p no:cacheprovider -rA "$@" 2>&1 | tee "$results/gpu_processes.log" | tail -60 || failed=1
fi
if [ "$what" = probe ]; then
  timeout ${BENCH_TIMEOUT:-480} python3 -m bench.probe "$@" 2>&1 | tee "$results/probe.log" || failed=1
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  timeout ${BENCH_TIMEOUT:-480} python3 -m bench.ep --machine "$JAX_EP_MACHINE" "$@" 2>&1 | tee "$results/bench.log" | tail -60 || failed=1
  cp bench/results/ops/*"$JAX_EP_MACHINE"* "$results/" 2>/dev/null
fi
if [ "$what" = layer ]; then
  timeout ${TEST_TIMEOUT:-420} python3 -m pytest tests/test_gpu_grouped.py -q -p no:cacheprovider --timeout 200 -rA \
    2>&1 | tee "$results/gpu_grouped_tests.log" | tail -20 || failed=1
  timeout ${BENCH_TIMEOUT:-480} python3 -m bench.grouped_matmul --machine "$JAX_EP_MACHINE" 2>&1 | tee "$results/grouped_matmul.log" | tail -40 || failed=1
  timeout ${BENCH_TIMEOUT:-600} python3 -m bench.moe_layer --machine "$JAX_EP_MACHINE" "$@" 2>&1 | tee "$results/moe_layer.log" | tail -30 || failed=1
  cp bench/results/grouped_matmul/*"$JAX_EP_MACHINE"* bench/results/moe_layer/*"$JAX_EP_MACHINE"* \
    "$results/" 2>/dev/null
fi
if [ "$what" = deepgemm ]; then
  timeout ${BENCH_TIMEOUT:-480} python3 -m lab.versus_deepgemm --machine "$JAX_EP_MACHINE" \
    --program "${VERSUS_DEEPGEMM:-build/versus_deepgemm}" "$@" 2>&1 | tee "$results/versus_deepgemm.log" || failed=1
  cp bench/results/grouped_matmul/versus-deepgemm-"$JAX_EP_MACHINE"* "$results/" 2>/dev/null
fi
if [ "$what" = deepep ]; then
  if ! timeout ${BUILD_TIMEOUT:-300} bench/deepep_build.sh .deepep > "$results/deepep_build.log" 2>&1; then
    tail -30 "$results/deepep_build.log"
    failed=1
  fi
  timeout ${BENCH_TIMEOUT:-450} python3 -m bench.versus_deepep --machine "$JAX_EP_MACHINE" \
    --logs "$results/versus_deepep" "$@" 2>&1 | tee "$results/versus_deepep.log" | tail -80 || failed=1
  cp bench/results/ops/versus-deepep-"$JAX_EP_MACHINE"* "$results/" 2>/dev/null
fi
exit $failed
