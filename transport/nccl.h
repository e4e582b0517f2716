// The engine on GPUs: NCCL's symmetric memory. One communicator per EP group (one per local
// device of the group in this process, created together), each rank's window allocated with
// ncclMemAlloc and registered as a symmetric window; every peer's window is then reachable from
// this GPU through its NVLink (LSA) address, also across processes, which the host knows and
// kernels and copy engines can use alike. libnccl is loaded at run time (the one jax's CUDA
// plugin loads), so a build with the CUDA backend imports without it.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace jax_ep::nccl {

// NCCL_VERSION_CODE of the headers this build used; ncclGetVersion of the library at `path`,
// or 0 where it cannot be loaded (neither throws: the engine choice asks before loading).
int built_version();
int library_version(const std::string& path);

// ncclGetUniqueId of the library at `path` (128 bytes), or throws.
std::string unique_id(const std::string& path);

// This process's ranks of one EP group: their communicators and windows.
class Group {
 public:
  struct Member {
    int device, rank;
    void* window = nullptr;       // this rank's window (ncclMemAlloc), zeroed
    std::vector<uint8_t*> peers;  // every rank's window as this device reaches it
  };
  // Collective over the group's processes; gives up after timeout_s, or as soon as
  // interrupted() says so (asked every 100 ms while it waits for the others: e.g. Ctrl-C).
  // Throws on failure.
  Group(const std::string& path, const std::string& unique_id, int num_ranks,
        const std::vector<std::pair<int, int>>& devices_and_ranks, size_t window_bytes,
        double timeout_s, const std::function<bool()>& interrupted = {});
  ~Group();
  std::vector<Member> members;

 private:
  void release();
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace jax_ep::nccl
