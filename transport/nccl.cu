#include "transport/nccl.h"

#include <cuda_runtime.h>
#include <dlfcn.h>
#include <nccl.h>
#include <nccl_device.h>

#include <chrono>
#include <cstring>
#include <map>
#include <mutex>
#include <stdexcept>
#include <thread>

namespace jax_ep::nccl {
namespace {

// The functions of libnccl jax_ep calls, resolved once per library.
struct Library {
  decltype(&ncclGetVersion) GetVersion;
  decltype(&ncclGetErrorString) GetErrorString;
  decltype(&ncclGetUniqueId) GetUniqueId;
  decltype(&ncclCommInitRankConfig) CommInitRankConfig;
  decltype(&ncclCommGetAsyncError) CommGetAsyncError;
  decltype(&ncclCommAbort) CommAbort;
  decltype(&ncclGroupStart) GroupStart;
  decltype(&ncclGroupEnd) GroupEnd;
  decltype(&ncclMemAlloc) MemAlloc;
  decltype(&ncclMemFree) MemFree;
  decltype(&ncclCommWindowRegister) CommWindowRegister;
  decltype(&ncclCommWindowDeregister) CommWindowDeregister;
  ncclTeam_t (*TeamLsa)(ncclComm_t);
};

template <typename F>
void resolve(void* handle, const char* name, F* out) {
  *out = reinterpret_cast<F>(dlsym(handle, name));
  if (!*out) throw std::runtime_error(std::string("jax_ep: libnccl has no ") + name);
}

const Library& load(const std::string& path) {
  static std::mutex mu;
  static std::map<std::string, Library> loaded;
  std::lock_guard<std::mutex> lock(mu);
  if (auto it = loaded.find(path); it != loaded.end()) return it->second;
  void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_GLOBAL);  // never closed
  if (!handle)
    throw std::runtime_error("jax_ep: cannot load NCCL (" + path + "): " + dlerror() +
                             "; install nvidia-nccl-cu13 (or -cu12) or set JAX_EP_NCCL_LIBRARY");
  Library lib{};
  resolve(handle, "ncclGetVersion", &lib.GetVersion);
  resolve(handle, "ncclGetErrorString", &lib.GetErrorString);
  resolve(handle, "ncclGetUniqueId", &lib.GetUniqueId);
  resolve(handle, "ncclCommInitRankConfig", &lib.CommInitRankConfig);
  resolve(handle, "ncclCommGetAsyncError", &lib.CommGetAsyncError);
  resolve(handle, "ncclCommAbort", &lib.CommAbort);
  resolve(handle, "ncclGroupStart", &lib.GroupStart);
  resolve(handle, "ncclGroupEnd", &lib.GroupEnd);
  resolve(handle, "ncclMemAlloc", &lib.MemAlloc);
  resolve(handle, "ncclMemFree", &lib.MemFree);
  resolve(handle, "ncclCommWindowRegister", &lib.CommWindowRegister);
  resolve(handle, "ncclCommWindowDeregister", &lib.CommWindowDeregister);
  resolve(handle, "ncclTeamLsa", &lib.TeamLsa);
  int version = 0;
  lib.GetVersion(&version);
  // The windows' device layout is compiled in from nccl_device.h: the library must match it.
  if (version / 100 != NCCL_VERSION_CODE / 100)
    throw std::runtime_error("jax_ep was built against NCCL " + std::to_string(NCCL_VERSION_CODE) +
                             " but " + path + " is NCCL " + std::to_string(version) +
                             ": rebuild jax_ep where this NCCL is installed (pip install "
                             "--no-build-isolation .)");
  return loaded.emplace(path, lib).first->second;
}

void check(const Library& lib, ncclResult_t r, const char* what) {
  if (r != ncclSuccess && r != ncclInProgress)
    throw std::runtime_error(std::string("jax_ep: ") + what + ": " + lib.GetErrorString(r));
}

void check_cuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess)
    throw std::runtime_error(std::string("jax_ep: ") + what + ": " + cudaGetErrorString(e));
}

__global__ void peer_windows(ncclWindow_t window, int num_ranks, uint8_t** out) {
  for (int r = threadIdx.x; r < num_ranks; r += blockDim.x)
    out[r] = static_cast<uint8_t*>(ncclGetPeerPointer(window, 0, r));
}

}  // namespace

int built_version() { return NCCL_VERSION_CODE; }

int library_version(const std::string& path) {
  void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_GLOBAL);  // never closed, like load()'s
  if (!handle) return 0;
  auto get = reinterpret_cast<decltype(&ncclGetVersion)>(dlsym(handle, "ncclGetVersion"));
  int version = 0;
  if (!get || get(&version) != ncclSuccess) return 0;
  return version;
}

std::string unique_id(const std::string& path) {
  const Library& lib = load(path);
  ncclUniqueId id;
  check(lib, lib.GetUniqueId(&id), "ncclGetUniqueId");
  return std::string(id.internal, sizeof(id.internal));
}

struct Group::Impl {
  const Library* lib;
  std::vector<ncclComm_t> comms;
  std::vector<ncclWindow_t> windows;
};

namespace {

// Nonblocking communicators: polls them until their calls are done, or gives up (at the
// deadline, or when interrupted() says so, asked every 100 ms).
void wait_ready(const Library& lib, const std::vector<ncclComm_t>& comms,
                std::chrono::steady_clock::time_point deadline, const char* what,
                const std::function<bool()>& interrupted) {
  auto asked = std::chrono::steady_clock::now();
  for (ncclComm_t comm : comms) {
    ncclResult_t state = ncclInProgress;
    while (true) {
      check(lib, lib.CommGetAsyncError(comm, &state), what);
      if (state != ncclInProgress) break;
      const auto now = std::chrono::steady_clock::now();
      if (now > deadline)
        throw std::runtime_error(std::string("jax_ep: ") + what + " did not finish in time: " +
                                 "not every rank of the EP group joined (did a process stop?)");
      if (interrupted && now - asked > std::chrono::milliseconds(100)) {
        asked = now;
        if (interrupted()) throw std::runtime_error(std::string("jax_ep: interrupted ") + what);
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    check(lib, state, what);
  }
}

}  // namespace

Group::Group(const std::string& path, const std::string& id_bytes, int num_ranks,
             const std::vector<std::pair<int, int>>& devices_and_ranks, size_t window_bytes,
             double timeout_s, const std::function<bool()>& interrupted)
    : impl_(new Impl{&load(path), {}, {}}) {
  const Library& lib = *impl_->lib;
  ncclUniqueId id;
  if (id_bytes.size() != sizeof(id.internal))
    throw std::runtime_error("jax_ep: an NCCL unique id has the wrong size");
  std::memcpy(id.internal, id_bytes.data(), sizeof(id.internal));
  const auto deadline = std::chrono::steady_clock::now() +
                        std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                            std::chrono::duration<double>(timeout_s));
  int previous = 0;
  cudaGetDevice(&previous);
  try {
    for (auto [device, rank] : devices_and_ranks)
      members.push_back(Member{device, rank, nullptr, {}});
    impl_->comms.resize(members.size());
    impl_->windows.resize(members.size());
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;  // so that a rank that never comes is a timeout, not a hang
    check(lib, lib.GroupStart(), "ncclGroupStart");
    for (size_t i = 0; i < members.size(); ++i) {
      check_cuda(cudaSetDevice(members[i].device), "cudaSetDevice");
      check(lib, lib.CommInitRankConfig(&impl_->comms[i], num_ranks, id, members[i].rank, &config),
            "ncclCommInitRankConfig");
    }
    check(lib, lib.GroupEnd(), "ncclGroupEnd");
    wait_ready(lib, impl_->comms, deadline, "creating the NCCL communicator", interrupted);
    for (size_t i = 0; i < members.size(); ++i) {
      const ncclTeam_t lsa = lib.TeamLsa(impl_->comms[i]);
      if (lsa.nRanks != num_ranks)
        throw std::runtime_error(
            "jax_ep: only " + std::to_string(lsa.nRanks) + " of the " + std::to_string(num_ranks) +
            " GPUs of an EP group reach each other over NVLink; jax_ep needs an EP group within "
            "one NVLink domain (across nodes comes later)");
      check_cuda(cudaSetDevice(members[i].device), "cudaSetDevice");
      check(lib, lib.MemAlloc(&members[i].window, window_bytes), "ncclMemAlloc");
      check_cuda(cudaMemset(members[i].window, 0, window_bytes), "zeroing the window");
      check_cuda(cudaDeviceSynchronize(), "zeroing the window");
    }
    // Registration is collective: no rank's window is written before every rank zeroed its own.
    check(lib, lib.GroupStart(), "ncclGroupStart");
    for (size_t i = 0; i < members.size(); ++i)
      check(lib,
            lib.CommWindowRegister(impl_->comms[i], members[i].window, window_bytes,
                                   &impl_->windows[i], NCCL_WIN_COLL_SYMMETRIC),
            "ncclCommWindowRegister");
    check(lib, lib.GroupEnd(), "ncclGroupEnd");
    wait_ready(lib, impl_->comms, deadline, "registering the Buffer's windows", interrupted);
    for (size_t i = 0; i < members.size(); ++i) {
      check_cuda(cudaSetDevice(members[i].device), "cudaSetDevice");
      uint8_t** table = nullptr;
      check_cuda(cudaMalloc(&table, sizeof(uint8_t*) * num_ranks), "cudaMalloc");
      peer_windows<<<1, 32>>>(impl_->windows[i], num_ranks, table);
      members[i].peers.resize(num_ranks);
      cudaError_t err = cudaMemcpy(members[i].peers.data(), table, sizeof(uint8_t*) * num_ranks,
                                   cudaMemcpyDeviceToHost);
      cudaFree(table);
      check_cuda(err, "reading the peers' window addresses");
    }
  } catch (...) {
    cudaSetDevice(previous);
    release();  // what was made so far
    throw;
  }
  cudaSetDevice(previous);
}

Group::~Group() { release(); }

void Group::release() {
  if (!impl_) return;
  const Library& lib = *impl_->lib;
  int previous = 0;
  cudaGetDevice(&previous);
  for (size_t i = 0; i < members.size(); ++i) {  // local calls: peers need not take part
    if (cudaSetDevice(members[i].device) != cudaSuccess) continue;  // at exit, CUDA may be gone
    cudaDeviceSynchronize();  // kernels may still use the window
    if (impl_->windows[i]) lib.CommWindowDeregister(impl_->comms[i], impl_->windows[i]);
    if (members[i].window) lib.MemFree(members[i].window);
    if (impl_->comms[i]) lib.CommAbort(impl_->comms[i]);
  }
  cudaSetDevice(previous);
  impl_.reset();
  members.clear();
}

}  // namespace jax_ep::nccl
