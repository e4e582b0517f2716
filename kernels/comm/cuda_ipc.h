// The engine on GPUs that share a host without NCCL: the CUDA driver's IPC. Each rank's window
// is a VMM allocation (cuMemCreate) exportable as a POSIX file descriptor; the owner serves that
// descriptor on an abstract Unix socket named after the Buffer and the rank (fd_socket.h); every
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
#include <vector>

#include "kernels/comm/engine.h"

namespace jax_ep::cuda_ipc {

// The GPU's UUID (32 hex digits) for a local device ordinal: the same in every process that
// sees this GPU, whatever CUDA_VISIBLE_DEVICES says; tells which ranks share a GPU.
std::string device_uuid(int device);

// Why this driver cannot serve the engine on `device`, or "".
std::string unsupported(int device);

// This process's ranks of a Buffer's EP groups, over CUDA IPC. Built in three steps, with every
// process of the mesh between them (jax_ep/bootstrap.py): the constructor, connect(), stop().
class Engine {
 public:
  using Member = EngineMember;
  // Allocates, zeroes and exports the windows of this process's ranks (device, group, rank) and
  // serves them at `prefix`_g<group>_r<rank>; `tag` (the Buffer's key) must match on the peers.
  Engine(const std::string& prefix, uint64_t tag, int num_ranks, const std::vector<Member>& local,
         size_t window_bytes, double timeout_s);
  // Once every process of the mesh was constructed: receives, imports and maps every other
  // rank's window of this process's groups (a rank that does not answer within timeout_s is
  // named in the error) and fills members[i].peers.
  void connect();
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
