// The engine on GPUs that share a host without NCCL: the CUDA driver's IPC. Each rank's window
// is a VMM allocation (cuMemCreate) exportable as a POSIX file descriptor; the owner serves that
// descriptor on its process's abstract Unix socket (fd_socket.h, which checks both ends); every
// other process of the group receives it (SCM_RIGHTS), imports it
// (cuMemImportFromShareableHandle) and maps it into its own address space (cuMemAddressReserve,
// cuMemMap, cuMemSetAccess for its devices of the group). The kernels get the same per-rank
// window pointers as from the NCCL engine (its LSA pointers): same layout, same kernels. Ranks
// may share a GPU (several processes on one GPU, under MPS to run at once).
//
// libcuda is reached through cudart's driver entry points at run time: no link-time dependency.
//
// Who owns and frees what: a process owns the allocations of its own ranks (created here, freed
// here) and its imports of the others (a handle and a mapping each, also freed here). Physical
// memory goes when the last process holding a handle or a mapping of it lets go, so a process
// that ends first takes nothing from its peers. Teardown, in this order: wait for this process's
// devices, stop serving, unmap and release the imported windows, unmap and release the own ones,
// close the exported descriptors.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "transport/engine.h"

namespace jax_ep::cuda_ipc {

// The GPU's UUID (32 hex digits) for a local device ordinal: the same in every process that
// sees this GPU, whatever CUDA_VISIBLE_DEVICES says; tells which ranks share a GPU.
std::string device_uuid(int device);

// Why this driver cannot serve the engine on `device`, or "".
std::string unsupported(int device);

// This process's ranks of a Buffer's EP groups, over CUDA IPC. Built in steps, with every
// process of the mesh between them (jax_ep/bootstrap.py): the constructor, connect() (called
// again until no window is missing), stop().
class Engine {
 public:
  using Member = EngineMember;
  // Allocates, zeroes and exports the windows of this process's ranks (device, group, rank) and,
  // if a rank of their groups lives in another process, serves them at the abstract socket
  // `socket_name` (or another name if it is taken: socket()) to the processes `pids` (empty: any
  // of this user) that send `secret` (transport/fd_socket.h).
  Engine(const std::string& socket_name, const std::string& secret, const std::vector<int>& pids,
         int num_ranks, const std::vector<Member>& local, size_t window_bytes);
  std::string socket() const;              // "" when nothing is served
  std::vector<std::string> notes() const;  // socket names found taken, and by whom
  // Once every process of the mesh was constructed: receives, imports and maps the windows of
  // `peers` not mapped yet, trying for up to slice_s; returns the (group, rank) still missing.
  // Once none is, fills members[i].peers.
  std::vector<std::pair<int, int>> connect(const std::vector<EnginePeer>& peers, double slice_s);
  // Once every process connected: stops serving the descriptors.
  void stop();
  ~Engine();

  std::vector<Member> members;

 private:
  void release();
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace jax_ep::cuda_ipc
