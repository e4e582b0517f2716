#!/usr/bin/env bash
# Builds DeepEP V1's intranode path (no NVSHMEM) in place, for bench/versus_deepep.py: afterwards
# `PYTHONPATH=.deepep python3 -c "import deep_ep"` works. DeepEP is no dependency of jax_ep; its
# source is a folder beside the checkout (ignored by git), DeepEP's commit 9249c25 (2025-11-04,
# the last V1-only release), extracted from a clone of its repository with
#   mkdir .deepep && git -C DEEPEP_CLONE archive 9249c25 | tar -x -C .deepep &&
#   git -C DEEPEP_CLONE rev-parse 9249c25 > .deepep/COMMIT
#   bench/deepep_build.sh [TREE]     # TREE: default .deepep; ~1-2 min on 16 cores with ninja
# Needs torch (2.11 + CUDA 13 here), nvcc and the CUDA headers torch's own headers include
# (cuBLAS, cuSPARSE, cuSOLVER: from the toolkit, else from the pip packages torch installs).
# Three changes to DeepEP's build, none to its kernels, each because the build would otherwise
# fail or not import:
# - setup.py builds the internode and low-latency kernels, which need NVSHMEM's device library,
#   wherever `nvidia.nvshmem` imports, and torch 2.11 installs nvidia-nvshmem-cu13: it runs here
#   with that module hidden (and NVSHMEM_DIR unset), so it takes its own -DDISABLE_NVSHMEM path.
# - -rdc=true is dropped: relocatable device code needs a device-link step, which setup.py adds
#   only with NVSHMEM; without it the import fails on an undefined
#   __cudaRegisterLinkedBinary_*_intranode_cu (DeepEP issue 429). The intranode, layout and
#   runtime kernels call no device code of another file.
# - deep_ep.cpp calls three host functions of internode_ll.cu (the shrink mode's mask buffer)
#   outside its DISABLE_NVSHMEM guards, so the import fails on undefined
#   deep_ep::internode_ll::*_mask_buffer: csrc/no_nvshmem_stubs.cpp, written here, defines them
#   to throw (unreachable: each is behind an assertion that NVSHMEM allocated the buffer).
set -euo pipefail
tree=${1:-.deepep}
cd "$tree"
if [ ! -f setup.py ] || [ ! -f csrc/kernels/intranode.cu ]; then
  echo "deepep_build.sh: no DeepEP source in $tree (its header says how to extract it)" >&2
  exit 1
fi
cat > csrc/no_nvshmem_stubs.cpp <<'EOF'
// Written by jax_ep's bench/deepep_build.sh: an intranode-only build has no internode_ll.cu.
#include <cuda_runtime.h>

#include <stdexcept>

namespace deep_ep::internode_ll {
[[noreturn]] static void no_nvshmem() {
    throw std::runtime_error("DeepEP was built without NVSHMEM: no low-latency mask buffer");
}
void query_mask_buffer(int*, int, int*, cudaStream_t) { no_nvshmem(); }
void update_mask_buffer(int*, int, bool, cudaStream_t) { no_nvshmem(); }
void clean_mask_buffer(int*, int, cudaStream_t) { no_nvshmem(); }
}  // namespace deep_ep::internode_ll
EOF
sed -i -e "s#'csrc/kernels/intranode.cu'\]#'csrc/kernels/intranode.cu', 'csrc/no_nvshmem_stubs.cpp']#" \
  -e "s#'-rdc=true', ##" setup.py
if ! grep -q "no_nvshmem_stubs.cpp'\]" setup.py || grep -q -- "-rdc=true" setup.py; then
  echo "deepep_build.sh: setup.py is not the one of DeepEP 9249c25 (sources, -rdc=true)" >&2
  exit 1
fi
cuda_home=${CUDA_HOME:-$(dirname "$(dirname "$(command -v nvcc)")")}
if [ ! -f "$cuda_home/include/cusparse.h" ]; then  # torch's headers include it: the pip one
  pip_include=$(python3 -c "import nvidia, os; print(os.path.join(nvidia.__path__[0], 'cu13', 'include'))")
  export CPATH="$pip_include${CPATH:+:$CPATH}"
fi
# setup.py links -lcuda; a driver mounted into a container may bring libcuda.so.1 alone (the
# stub has the same soname: the driver's library is the one loaded).
for stubs in "$cuda_home/lib64/stubs" "$cuda_home/targets/x86_64-linux/lib/stubs"; do
  if [ -f "$stubs/libcuda.so" ]; then
    export LIBRARY_PATH="${LIBRARY_PATH:+$LIBRARY_PATH:}$stubs"
    break
  fi
done
unset NVSHMEM_DIR
export TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=${MAX_JOBS:-$(nproc)}
python3 -c "
import runpy, sys
sys.modules['nvidia.nvshmem'] = None  # find_spec finds nothing: setup.py disables NVSHMEM
sys.argv = ['setup.py', 'build_ext', '--inplace']
runpy.run_path('setup.py', run_name='__main__')
"
PYTHONPATH=. python3 -c "import deep_ep; print('deep_ep built, SM90 features:', deep_ep.Buffer.is_sm90_compiled())"
