// CUDA handlers: XLA calls each device's handler on its own host thread; the handler only
// enqueues kernels on the stream XLA gives it (no host synchronisation, no per-op host state),
// so the calls can be captured in command buffers (CUDA graphs) and replayed.
#include <atomic>
#include <map>
#include <stdexcept>

#include "ffi/backends.h"
#include "ffi/handlers.h"
#include "kernels/comm/cuda_ipc.h"
#include "kernels/comm/nccl.h"
#include "kernels/cuda/rank.h"

namespace jax_ep {

struct CudaContext {
  int32_t device;
  cudaStream_t stream;
};

}  // namespace jax_ep

namespace xla::ffi {
template <>
struct CtxDecoding<jax_ep::CudaContext> {
  using Type = jax_ep::CudaContext;
  static std::optional<Type> Decode(const XLA_FFI_Api* api, XLA_FFI_ExecutionContext* ctx,
                                    DiagnosticEngine& diagnostic) {
    auto device = CtxDecoding<DeviceOrdinal>::Decode(api, ctx, diagnostic);
    auto stream = CtxDecoding<PlatformStream<cudaStream_t>>::Decode(api, ctx, diagnostic);
    if (!device || !stream) return std::nullopt;
    return Type{*device, *stream};
  }
};
}  // namespace xla::ffi

namespace jax_ep {
namespace {

using CudaState = CallState<cuda::Rank>;

// Handler runs in this process: a command buffer (CUDA graph) replays kernels without them.
std::atomic<int64_t> handler_calls{0};

struct CudaBackend {
  using Context = CudaContext;
  using Rank = cuda::Rank;
  using State = CudaState;
  using Result = ffi::Error;  // the kernels are enqueued: the handler is done

  static ffi::Error error(ffi::Error error) { return error; }

  static ffi::Error dispatch(const Context& c, State& st, Rank& rank, Part part,
                             const DispatchSend* send, const DispatchRecv* recv, Tokens tokens) {
    handler_calls.fetch_add(1, std::memory_order_relaxed);
    return to_error(cuda::dispatch(rank, c.stream, part, send, recv, st.config.low_latency,
                                   tokens.ticket, tokens.out));
  }

  static ffi::Error combine(const Context& c, State&, Rank& rank, Part part,
                            const CombineSend* send, const CombineRecv* recv, Tokens tokens) {
    handler_calls.fetch_add(1, std::memory_order_relaxed);
    return to_error(cuda::combine(rank, c.stream, part, send, recv, tokens.ticket, tokens.out));
  }

  static std::string expert_layout(const Context& c, const ExpertLayoutArgs& a) {
    return cuda::expert_layout(c.stream, a);
  }
};

using T = Calls<CudaBackend>;
constexpr auto kGraphSafe = ffi::Traits::kCmdBufferCompatible;

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(jax_ep_cuda_instantiate, Instantiate<CudaBackend>,
                              instantiate_binding());
#define JAX_EP_CUDA_CALL(name)                                                              \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(jax_ep_cuda_##name, T::name, name##_binding<CudaBackend>(), \
                                {kGraphSafe});
JAX_EP_BUFFER_CALLS(JAX_EP_CUDA_CALL)
XLA_FFI_DEFINE_HANDLER_SYMBOL(jax_ep_cuda_expert_layout, ExpertLayout<CudaBackend>,
                              expert_layout_binding<CudaBackend>(), {kGraphSafe});

Targets cuda_targets() {
  const Handler inst = jax_ep_cuda_instantiate;
#define JAX_EP_CUDA_TARGET(name) {#name, {inst, jax_ep_cuda_##name}},
  return {JAX_EP_BUFFER_CALLS(JAX_EP_CUDA_TARGET){"expert_layout",
                                                  {nullptr, jax_ep_cuda_expert_layout}}};
}

XLA_FFI_TypeId* cuda_state_type_id() { return &CudaState::id; }
const XLA_FFI_TypeInfo* cuda_state_type_info() { return state_type_info<CudaState>(); }

int64_t cuda_handler_calls() { return handler_calls.load(); }

std::string nccl_unique_id(const std::string& nccl_library) {
  return nccl::unique_id(nccl_library);
}

namespace {

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess)
    throw std::runtime_error(std::string("jax_ep: ") + what + ": " + cudaGetErrorString(e));
}

// A rank's failure record, in host memory its kernels write through.
std::shared_ptr<cuda::Failure> host_failure_record(cuda::Failure** on_device) {
  cuda::Failure* f = nullptr;
  check(cudaHostAlloc(reinterpret_cast<void**>(&f), sizeof(cuda::Failure),
                      cudaHostAllocMapped | cudaHostAllocPortable),
        "cudaHostAlloc");
  *f = cuda::Failure{};
  check(cudaHostGetDevicePointer(reinterpret_cast<void**>(on_device), f, 0),
        "cudaHostGetDevicePointer");
  return std::shared_ptr<cuda::Failure>(f, [](cuda::Failure* p) { cudaFreeHost(p); });
}

}  // namespace

namespace {

// What a rank's memory is freed in: its group's share of the windows first (the group's
// release waits for the devices), then, once its device is done, the failure record its
// kernels may still write.
struct RankMemory {
  int device;
  std::shared_ptr<cuda::Failure> failure;
  std::shared_ptr<void> engine;  // the engine's share of the windows (nccl::Group, cuda_ipc)
  ~RankMemory() {
    engine.reset();
    int previous = 0;
    cudaGetDevice(&previous);
    if (cudaSetDevice(device) == cudaSuccess) cudaDeviceSynchronize();  // at exit CUDA may be gone
    cudaSetDevice(previous);
  }
};

// The owner's words of a fresh window: ops numbered from first_op + 1 (started counts the
// blocks of every op's first kernel).
void initial_window(const cuda::Rank& r, uint64_t first_op) {
  uint8_t* mine = r.windows[r.rank];
  auto set = [&](int64_t at, uint64_t value) {
    check(cudaMemcpy(mine + at, &value, 8, cudaMemcpyHostToDevice), "initialising the window");
  };
  if (first_op == 0) return;  // zeroed
  check(cudaSetDevice(r.device), "cudaSetDevice");
  initial_words(r.window, first_op, set);
  set(r.window.started_at(), first_op * uint64_t(r.blocks));
}

// A rank of either engine: `peers` are the group's windows as `device` reaches them; `engine`
// holds what they live in. Ops are numbered from first_op + 1.
std::shared_ptr<cuda::Rank> make_rank(const Window& window, int group, int rank, int device,
                                      int num_sms, double timeout_s, bool direct_local,
                                      std::vector<uint8_t*> peers, std::shared_ptr<void> engine,
                                      uint64_t first_op) {
  int sms = 0;
  check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device),
        "cudaDeviceGetAttribute");
  auto r = std::make_shared<cuda::Rank>();
  r->window = window;
  r->group = group;
  r->rank = rank;
  r->device = device;
  r->blocks = num_sms < sms ? num_sms : sms;
  r->timeout_s = timeout_s;
  r->direct_local = direct_local;
  r->windows = std::move(peers);
  auto failure = host_failure_record(&r->failure_on_device);
  r->failure = failure.get();
  auto memory = std::make_shared<RankMemory>();
  memory->device = device;
  memory->failure = failure;
  memory->engine = std::move(engine);
  r->keep = memory;
  initial_window(*r, first_op);
  return r;
}

}  // namespace

CudaBuffer::CudaBuffer(const Window& window, const std::string& nccl_library, double timeout_s,
                       int num_sms, std::vector<LocalRank> local,
                       const std::map<int, std::string>& unique_ids, bool direct_local,
                       uint64_t first_op) {
  int previous = 0;
  cudaGetDevice(&previous);
  std::map<int, std::vector<std::pair<int, int>>> by_group;  // in group order on every process
  for (const LocalRank& l : local) by_group[l.group].push_back({l.device, l.rank});
  for (const auto& [group, members] : by_group) {
    auto comms =
        std::make_shared<nccl::Group>(nccl_library, unique_ids.at(group), window.num_ranks, members,
                                      size_t(align_bytes(window.total_bytes(), 4096)), timeout_s);
    for (const nccl::Group::Member& m : comms->members)
      ranks[m.device] = make_rank(window, group, m.rank, m.device, num_sms, timeout_s, direct_local,
                                  m.peers, comms, first_op);
  }
  cudaSetDevice(previous);
}

CudaBuffer::~CudaBuffer() { ranks.clear(); }

// The first error of one of this process's ranks, or "".
std::string ranks_status(const std::map<int, std::shared_ptr<void>>& ranks) {
  for (const auto& [device, rank] : ranks)
    if (auto err = static_cast<const cuda::Rank*>(rank.get())->failed(); !err.empty()) return err;
  return {};
}

std::string CudaBuffer::status() const { return ranks_status(ranks); }

// ---- the CUDA-IPC engine's side of a Buffer

int nccl_built_version() { return nccl::built_version(); }
int nccl_library_version(const std::string& path) { return nccl::library_version(path); }
std::string cuda_device_uuid(int device) { return cuda_ipc::device_uuid(device); }
std::string cuda_ipc_unsupported(int device) { return cuda_ipc::unsupported(device); }

struct CudaIpcBuffer::Engine : cuda_ipc::Engine {
  using cuda_ipc::Engine::Engine;
};

CudaIpcBuffer::CudaIpcBuffer(const Window& window, const std::string& prefix, uint64_t tag,
                             double timeout_s, int num_sms, std::vector<LocalRank> local,
                             bool direct_local, uint64_t first_op)
    : window_(window),
      timeout_s_(timeout_s),
      num_sms_(num_sms),
      direct_local_(direct_local),
      first_op_(first_op) {
  std::vector<cuda_ipc::Engine::Member> members;
  for (const LocalRank& l : local) members.push_back({l.device, l.group, l.rank, nullptr, {}});
  engine_ = std::make_shared<Engine>(prefix, tag, window.num_ranks, members,
                                     size_t(align_bytes(window.total_bytes(), 4096)), timeout_s);
}

void CudaIpcBuffer::connect() {
  engine_->connect();
  int previous = 0;
  cudaGetDevice(&previous);
  for (const cuda_ipc::Engine::Member& m : engine_->members)
    ranks[m.device] = make_rank(window_, m.group, m.rank, m.device, num_sms_, timeout_s_,
                                direct_local_, m.peers, engine_, first_op_);
  cudaSetDevice(previous);
}

void CudaIpcBuffer::stop_serving() { engine_->stop(); }

CudaIpcBuffer::~CudaIpcBuffer() { ranks.clear(); }

std::string CudaIpcBuffer::status() const { return ranks_status(ranks); }

}  // namespace jax_ep
