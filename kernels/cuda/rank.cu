#include <mutex>
#include <stdexcept>
#include <unordered_map>

#include "kernels/cuda/sync.cuh"

namespace jax_ep::cuda {

Peers Rank::peers() const {
  Peers peers{};
  peers.window = window;
  for (int r = 0; r < window.num_ranks; ++r) peers.windows[r] = windows[r];
  peers.rank = rank;
  peers.timeout_ns = uint64_t(timeout_s * 1e9);
  peers.failure = failure_on_device;
  peers.direct_local = direct_local;
  return peers;
}

std::string Rank::failed() const {
  const volatile Failure& f = *failure;
  if (f.written == 0) return {};
  AbortRecord a;
  const volatile uint64_t* from = reinterpret_cast<const volatile uint64_t*>(&f.record);
  uint64_t* to = reinterpret_cast<uint64_t*>(&a);
  for (size_t i = 0; i < sizeof a / 8; ++i) to[i] = from[i];
  return abort_message(a, group, rank, timeout_s) + " [GPU " + std::to_string(device) + "]";
}

void Rank::stop(const AbortRecord& record) const {
  if (__atomic_load_n(&failure->written, __ATOMIC_ACQUIRE) != 0) return;  // the first stays
  failure->record = record;
  __atomic_store_n(&failure->written, uint64_t(1), __ATOMIC_RELEASE);
}

void Rank::peer_ended(int r) const {
  __atomic_fetch_or(&failure->ended, uint64_t(1) << r, __ATOMIC_RELEASE);
}

namespace {

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess)
    throw std::runtime_error(std::string("jax_ep: ") + what + ": " + cudaGetErrorString(e));
}

// A rank's failure record, in host memory its kernels write through.
std::shared_ptr<Failure> host_failure_record(Failure** on_device) {
  Failure* f = nullptr;
  check(cudaHostAlloc(reinterpret_cast<void**>(&f), sizeof(Failure),
                      cudaHostAllocMapped | cudaHostAllocPortable),
        "cudaHostAlloc");
  *f = Failure{};
  check(cudaHostGetDevicePointer(reinterpret_cast<void**>(on_device), f, 0),
        "cudaHostGetDevicePointer");
  return std::shared_ptr<Failure>(f, [](Failure* p) { cudaFreeHost(p); });
}

// What a rank's memory is freed in: its group's share of the windows first (the group's
// release waits for the devices), then, once its device is done, the failure record its
// kernels may still write.
struct RankMemory {
  int device;
  std::shared_ptr<Failure> failure;
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
void initial_window(const Rank& r, uint64_t first_op) {
  uint8_t* mine = r.windows[r.rank];
  auto set = [&](int64_t at, uint64_t value) {
    check(cudaMemcpy(mine + at, &value, 8, cudaMemcpyHostToDevice), "initialising the window");
  };
  if (first_op == 0) return;  // zeroed
  check(cudaSetDevice(r.device), "cudaSetDevice");
  initial_words(r.window, first_op, set);
  set(r.window.started_at(), first_op * uint64_t(r.blocks));
}

}  // namespace

std::shared_ptr<Rank> make_rank(const RankConfig& config, int group, int rank, int device,
                                std::vector<uint8_t*> peers, std::shared_ptr<void> engine) {
  int sms = 0;
  check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device),
        "cudaDeviceGetAttribute");
  auto r = std::make_shared<Rank>();
  r->window = config.window;
  r->group = group;
  r->rank = rank;
  r->device = device;
  r->blocks = config.num_sms < sms ? config.num_sms : sms;
  r->timeout_s = config.timeout_s;
  r->direct_local = config.direct_local;
  r->windows = std::move(peers);
  auto failure = host_failure_record(&r->failure_on_device);
  r->failure = failure.get();
  auto memory = std::make_shared<RankMemory>();
  memory->device = device;
  memory->failure = failure;
  memory->engine = std::move(engine);
  r->keep = memory;
  initial_window(*r, config.first_op);
  return r;
}

cudaError_t static_shared_bytes(const void* kernel, size_t* bytes) {
  static std::mutex mutex;
  static std::unordered_map<const void*, size_t> known;
  std::lock_guard<std::mutex> lock(mutex);
  if (auto it = known.find(kernel); it != known.end()) return *bytes = it->second, cudaSuccess;
  cudaFuncAttributes attributes;
  if (cudaError_t err = cudaFuncGetAttributes(&attributes, kernel); err != cudaSuccess) return err;
  return *bytes = known[kernel] = attributes.sharedSizeBytes, cudaSuccess;
}

}  // namespace jax_ep::cuda
