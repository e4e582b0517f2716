// What each backend gives the Python module: its custom-call targets and how a Buffer's native
// side is built on it. Building is split into steps so that the processes of a mesh can meet
// between them (jax_ep/bootstrap.py drives the steps and the meetings).
#pragma once
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "ffi/buffers.h"
#include "transport/engine.h"
#include "kernels/window.h"
#include "xla/ffi/api/c_api.h"

namespace jax_ep {
namespace shm {
class Engine;
}
namespace cuda_ipc {
class Engine;
}
namespace cuda {
struct RankConfig;
}

using Handler = XLA_FFI_Error* (*)(XLA_FFI_CallFrame*);
struct Target {
  Handler instantiate;  // null for calls without a Buffer
  Handler execute;
};
using Targets = std::map<std::string, Target>;

// A rank of a Buffer that runs on one of this process's devices (its engine adds its windows).
using LocalRank = EngineMember;

Targets cpu_targets();
XLA_FFI_TypeId* cpu_state_type_id();
const XLA_FFI_TypeInfo* cpu_state_type_info();

// CPU devices: windows in shared memory with no name (transport/shm.h; ffi/cpu_buffer.cc).
// Built in steps with every process of the mesh between them, as a CudaIpcBuffer: the
// constructor (this process's windows, served at the abstract socket `socket_name` or, if that is
// taken, another: socket()), connect() (maps the peers' and, once none is missing, makes the
// ranks), stop_serving().
class CpuBuffer : public NativeBuffer {
 public:
  // Ops are numbered from first_op + 1 (0 but in tests of op numbers past 2^32). `secret` and
  // `pids`: who may ask for this process's windows (transport/fd_socket.h).
  CpuBuffer(const Window& window, const std::string& socket_name, const std::string& secret,
            const std::vector<int>& pids, double timeout_s, const std::vector<LocalRank>& local,
            uint64_t first_op);
  std::string socket() const;
  std::vector<std::string> notes() const;
  // The (group, rank) whose windows are still missing after trying for slice_s.
  std::vector<std::pair<int, int>> connect(const std::vector<EnginePeer>& peers, double slice_s);
  void stop_serving();
  ~CpuBuffer() override;
  std::string status() const override;
  void peer_ended(int group, int rank) override;
  void stop(const AbortRecord& record) override;

 private:
  Window window_;
  double timeout_s_;
  uint64_t first_op_;
  std::shared_ptr<shm::Engine> engine_;  // the ranks keep it too
};

#ifdef JAX_EP_WITH_CUDA
Targets cuda_targets();
XLA_FFI_TypeId* cuda_state_type_id();
const XLA_FFI_TypeInfo* cuda_state_type_info();
// How many times the cross-rank CUDA handlers ran (tests: command-buffer replays skip them).
int64_t cuda_handler_calls();

// CUDA devices: one NCCL communicator per EP group, windows in NCCL symmetric memory, peers
// through NVLink (LSA) pointers (ffi/cuda_buffers.cu). Creation is collective over the group's
// processes.
class CudaBuffer : public NativeBuffer {
 public:
  // interrupted(): asked while it waits for the group's other processes (nccl::Group).
  CudaBuffer(const Window& window, const std::string& nccl_library, double timeout_s, int num_sms,
             std::vector<LocalRank> local, const std::map<int, std::string>& unique_ids,
             bool direct_local, uint64_t first_op, const std::function<bool()>& interrupted);
  ~CudaBuffer() override;
  std::string status() const override;
  void peer_ended(int group, int rank) override;
  void stop(const AbortRecord& record) override;
};

// CUDA devices of one host, without NCCL: windows in VMM memory shared between the processes
// through the CUDA driver's IPC (transport/cuda_ipc.h); ranks may share a GPU. Built in
// steps with every process of the mesh between them, as a CpuBuffer: the constructor (allocate,
// export, serve at `socket_name` or, if taken, another: socket()), connect() (import and map the
// peers'; once none is missing, make the ranks), stop_serving().
class CudaIpcBuffer : public NativeBuffer {
 public:
  CudaIpcBuffer(const Window& window, const std::string& socket_name, const std::string& secret,
                const std::vector<int>& pids, double timeout_s, int num_sms,
                std::vector<LocalRank> local, bool direct_local, uint64_t first_op);
  std::string socket() const;
  std::vector<std::string> notes() const;
  std::vector<std::pair<int, int>> connect(const std::vector<EnginePeer>& peers, double slice_s);
  void stop_serving();
  ~CudaIpcBuffer() override;
  std::string status() const override;
  void peer_ended(int group, int rank) override;
  void stop(const AbortRecord& record) override;

 private:
  std::shared_ptr<cuda_ipc::Engine> engine_;  // the ranks keep it too
  std::shared_ptr<const cuda::RankConfig> config_;
};
#endif

}  // namespace jax_ep
