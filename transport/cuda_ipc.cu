#include "transport/cuda_ipc.h"

#include <cuda.h>  // the driver's types and prototypes only: its functions are looked up below
#include <cuda_runtime.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <map>
#include <mutex>
#include <stdexcept>

#include "transport/fd_socket.h"

namespace jax_ep::cuda_ipc {
namespace {

// The driver functions the engine calls, found through cudart (libcuda is already loaded by
// then: the runtime loaded it), so that nothing links against libcuda.
struct Driver {
  decltype(&::cuGetErrorString) GetErrorString;
  decltype(&::cuDeviceGet) DeviceGet;
  decltype(&::cuDeviceGetAttribute) DeviceGetAttribute;
  decltype(&::cuMemGetAllocationGranularity) MemGetAllocationGranularity;
  decltype(&::cuMemCreate) MemCreate;
  decltype(&::cuMemRelease) MemRelease;
  decltype(&::cuMemAddressReserve) MemAddressReserve;
  decltype(&::cuMemAddressFree) MemAddressFree;
  decltype(&::cuMemMap) MemMap;
  decltype(&::cuMemUnmap) MemUnmap;
  decltype(&::cuMemSetAccess) MemSetAccess;
  decltype(&::cuMemExportToShareableHandle) MemExportToShareableHandle;
  decltype(&::cuMemImportFromShareableHandle) MemImportFromShareableHandle;
};

void check_cuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess)
    throw std::runtime_error(std::string("jax_ep: ") + what + ": " + cudaGetErrorString(e));
}

template <typename F>
void resolve(const char* name, F* out) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
#if CUDART_VERSION >= 12050
  cudaError_t e = cudaGetDriverEntryPointByVersion(name, &fn, 12000, cudaEnableDefault, &found);
#else
  cudaError_t e = cudaGetDriverEntryPoint(name, &fn, cudaEnableDefault, &found);
#endif
  if (e != cudaSuccess || found != cudaDriverEntryPointSuccess || !fn)
    throw std::runtime_error(std::string("jax_ep: the CUDA driver has no ") + name +
                             " (the CUDA-IPC engine needs a driver for CUDA 12 or newer)");
  *out = reinterpret_cast<F>(fn);
}

const Driver& driver() {
  static std::mutex mu;
  static std::unique_ptr<Driver> loaded;
  std::lock_guard<std::mutex> lock(mu);
  if (loaded) return *loaded;
  check_cuda(cudaFree(nullptr), "initialising CUDA");  // loads libcuda, makes a context current
  auto d = std::make_unique<Driver>();
  resolve("cuGetErrorString", &d->GetErrorString);
  resolve("cuDeviceGet", &d->DeviceGet);
  resolve("cuDeviceGetAttribute", &d->DeviceGetAttribute);
  resolve("cuMemGetAllocationGranularity", &d->MemGetAllocationGranularity);
  resolve("cuMemCreate", &d->MemCreate);
  resolve("cuMemRelease", &d->MemRelease);
  resolve("cuMemAddressReserve", &d->MemAddressReserve);
  resolve("cuMemAddressFree", &d->MemAddressFree);
  resolve("cuMemMap", &d->MemMap);
  resolve("cuMemUnmap", &d->MemUnmap);
  resolve("cuMemSetAccess", &d->MemSetAccess);
  resolve("cuMemExportToShareableHandle", &d->MemExportToShareableHandle);
  resolve("cuMemImportFromShareableHandle", &d->MemImportFromShareableHandle);
  loaded = std::move(d);
  return *loaded;
}

void check(CUresult r, const std::string& what) {
  if (r == CUDA_SUCCESS) return;
  const char* text = nullptr;
  driver().GetErrorString(r, &text);
  throw std::runtime_error("jax_ep: " + what + ": " +
                           (text ? text : "CUDA driver error " + std::to_string(int(r))));
}

CUdevice cu_device(int ordinal) {
  CUdevice d = 0;
  check(driver().DeviceGet(&d, ordinal), "cuDeviceGet");
  return d;
}

CUmemAllocationProp allocation(CUdevice device) {
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = device;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  return prop;
}

}  // namespace

std::string device_uuid(int device) {
  cudaDeviceProp prop{};
  check_cuda(cudaGetDeviceProperties(&prop, device), "cudaGetDeviceProperties");
  std::string out;
  char hex[3];
  for (int i = 0; i < 16; ++i) {
    std::snprintf(hex, sizeof(hex), "%02x", static_cast<unsigned char>(prop.uuid.bytes[i]));
    out += hex;
  }
  return out;
}

std::string unsupported(int device) {
  try {
    const Driver& d = driver();
    const CUdevice dev = cu_device(device);
    int vmm = 0, fd = 0;
    check(d.DeviceGetAttribute(&vmm, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, dev),
          "cuDeviceGetAttribute");
    check(d.DeviceGetAttribute(&fd, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
                               dev),
          "cuDeviceGetAttribute");
    if (!vmm) return "GPU " + std::to_string(device) + " has no virtual memory management";
    if (!fd) return "GPU " + std::to_string(device) + " cannot share memory as file descriptors";
    return {};
  } catch (const std::exception& e) {
    return e.what();
  }
}

// One mapping of an allocation into this process: the handle, the address range, its size.
struct Mapping {
  CUmemGenericAllocationHandle handle = 0;
  CUdeviceptr address = 0;
  size_t bytes = 0;
  bool mapped = false;
};

struct Engine::Impl {
  std::string secret;
  int num_ranks;
  size_t window_bytes;
  std::vector<Mapping> own;                          // by member
  std::vector<int> exported;                         // by member: the descriptor served, or -1
  std::unique_ptr<fd_socket::Server> server;         // while peers may still ask
  std::map<std::pair<int, int>, Mapping> imported;   // (group, rank) of other processes
  std::map<int, std::vector<int>> devices_of_group;  // this process's devices of each group

  // Maps `m.handle` into a fresh address range readable and writable by `devices`.
  static void map(Mapping& m, size_t alignment, const std::vector<int>& devices) {
    const Driver& d = driver();
    check(d.MemAddressReserve(&m.address, m.bytes, alignment, 0, 0), "cuMemAddressReserve");
    check(d.MemMap(m.address, m.bytes, 0, m.handle, 0), "cuMemMap");
    m.mapped = true;
    std::vector<CUmemAccessDesc> access;
    for (int device : devices) {
      CUmemAccessDesc a{};
      a.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
      a.location.id = cu_device(device);
      a.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
      access.push_back(a);
    }
    check(d.MemSetAccess(m.address, m.bytes, access.data(), access.size()),
          "cuMemSetAccess (can each GPU of this process reach the others' memory?)");
  }

  // Unmaps, frees the address range and releases the handle (each step only if it was done).
  static void unmap(Mapping& m) {
    const Driver& d = driver();
    if (m.mapped) d.MemUnmap(m.address, m.bytes);
    if (m.address) d.MemAddressFree(m.address, m.bytes);
    if (m.handle) d.MemRelease(m.handle);
    m = Mapping{};
  }
};

Engine::Engine(const std::string& socket_name, const std::string& secret,
               const std::vector<int>& pids, int num_ranks, const std::vector<Member>& local,
               size_t window_bytes)
    : members(local), impl_(new Impl) {
  Impl& im = *impl_;
  im.secret = secret;
  im.num_ranks = num_ranks;
  im.window_bytes = window_bytes;
  im.own.resize(members.size());
  im.exported.assign(members.size(), -1);
  for (const Member& m : members) im.devices_of_group[m.group].push_back(m.device);
  int previous = 0;
  cudaGetDevice(&previous);
  try {
    const Driver& d = driver();
    std::map<std::pair<int, int>, fd_socket::Descriptor> served;
    for (size_t i = 0; i < members.size(); ++i) {
      Member& m = members[i];
      if (std::string why = unsupported(m.device); !why.empty())
        throw std::runtime_error("jax_ep: the CUDA-IPC engine cannot run here: " + why);
      check_cuda(cudaSetDevice(m.device), "cudaSetDevice");
      const CUmemAllocationProp prop = allocation(cu_device(m.device));
      size_t granularity = 0;
      check(
          d.MemGetAllocationGranularity(&granularity, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED),
          "cuMemGetAllocationGranularity");
      Mapping& own = im.own[i];
      own.bytes = (window_bytes + granularity - 1) / granularity * granularity;
      check(d.MemCreate(&own.handle, own.bytes, &prop, 0),
            "cuMemCreate of a " + std::to_string(own.bytes) + "-byte window");
      Impl::map(own, granularity, im.devices_of_group[m.group]);
      m.window = reinterpret_cast<uint8_t*>(own.address);
      // Zeroed before any peer can know of it: peers map it only after every process got here.
      check_cuda(cudaMemset(m.window, 0, own.bytes), "zeroing the window");
      check_cuda(cudaDeviceSynchronize(), "zeroing the window");
      int fd = -1;
      check(d.MemExportToShareableHandle(&fd, own.handle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                                         0),
            "cuMemExportToShareableHandle");
      im.exported[i] = fd;
      served[{m.group, m.rank}] = {fd, uint64_t(own.bytes)};
    }
    bool shared = false;  // a rank of these groups lives in another process
    for (const auto& [group, devices] : im.devices_of_group)
      shared = shared || int(devices.size()) < num_ranks;
    if (shared)
      im.server = std::make_unique<fd_socket::Server>(socket_name, secret, pids, std::move(served));
  } catch (...) {
    cudaSetDevice(previous);
    release();
    throw;
  }
  cudaSetDevice(previous);
}

std::string Engine::socket() const {
  return impl_ && impl_->server ? impl_->server->name() : std::string();
}

std::vector<std::string> Engine::notes() const {
  return impl_ && impl_->server ? impl_->server->notes() : std::vector<std::string>();
}

std::vector<std::pair<int, int>> Engine::connect(const std::vector<EnginePeer>& peers,
                                                 double slice_s) {
  Impl& im = *impl_;
  std::map<std::pair<int, int>, uint8_t*> windows;  // (group, rank) -> address in this process
  for (const Member& m : members) windows[{m.group, m.rank}] = m.window;
  for (const auto& [key, m] : im.imported) windows[key] = reinterpret_cast<uint8_t*>(m.address);
  int previous = 0;
  cudaGetDevice(&previous);
  std::vector<std::pair<int, int>> missing;
  try {
    missing = fd_socket::receive_windows(
        peers, im.secret, slice_s,
        [&](int group, int rank) { return windows.count({group, rank}) > 0; },
        [&](const EnginePeer& p, int fd, uint64_t bytes) {
          const std::string who = rank_name(p.group, p.rank);
          if (bytes < im.window_bytes) {
            close(fd);
            throw std::runtime_error("jax_ep: " + who + " has a " + std::to_string(bytes) +
                                     "-byte window, this Buffer needs " +
                                     std::to_string(im.window_bytes));
          }
          auto devices = im.devices_of_group.find(p.group);
          if (devices == im.devices_of_group.end()) {
            close(fd);
            throw std::runtime_error("jax_ep: this process holds no rank of EP group " +
                                     std::to_string(p.group));
          }
          check_cuda(cudaSetDevice(devices->second[0]), "cudaSetDevice");
          Mapping& m = im.imported[{p.group, p.rank}];
          m.bytes = bytes;
          CUresult imported = driver().MemImportFromShareableHandle(
              &m.handle, reinterpret_cast<void*>(static_cast<uintptr_t>(fd)),
              CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
          close(fd);  // the handle holds the memory now
          check(imported, "importing the window of " + who);
          const CUmemAllocationProp prop = allocation(cu_device(devices->second[0]));
          size_t granularity = 0;
          check(driver().MemGetAllocationGranularity(&granularity, &prop,
                                                     CU_MEM_ALLOC_GRANULARITY_MINIMUM),
                "cuMemGetAllocationGranularity");
          Impl::map(m, granularity, devices->second);
          windows[{p.group, p.rank}] = reinterpret_cast<uint8_t*>(m.address);
        });
  } catch (...) {
    cudaSetDevice(previous);
    throw;  // the destructor frees what was mapped
  }
  cudaSetDevice(previous);
  if (!missing.empty()) return missing;
  for (Member& m : members) {
    m.peers.resize(im.num_ranks);
    for (int r = 0; r < im.num_ranks; ++r) {
      auto it = windows.find({m.group, r});
      if (it == windows.end())
        throw std::runtime_error("jax_ep: nobody gave the window of " + rank_name(m.group, r));
      m.peers[r] = it->second;
    }
  }
  return {};
}

void Engine::stop() {
  if (!impl_) return;
  if (impl_->server) impl_->server->stop();
  impl_->server.reset();
  for (int& fd : impl_->exported)
    if (fd >= 0) close(fd), fd = -1;
}

Engine::~Engine() { release(); }

void Engine::release() {
  if (!impl_) return;
  Impl& im = *impl_;
  int previous = 0;
  const bool cuda_alive = cudaGetDevice(&previous) == cudaSuccess;  // at exit, CUDA may be gone
  if (cuda_alive)
    for (const Member& m : members)  // kernels may still use the windows
      if (cudaSetDevice(m.device) == cudaSuccess) cudaDeviceSynchronize();
  stop();
  if (cuda_alive) {
    for (auto& [key, m] : im.imported) Impl::unmap(m);
    for (Mapping& m : im.own) Impl::unmap(m);
    cudaSetDevice(previous);
  }
  impl_.reset();
  members.clear();
}

}  // namespace jax_ep::cuda_ipc
