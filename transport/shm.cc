#include "transport/shm.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <stdexcept>

#include "transport/fd_socket.h"

namespace jax_ep::shm {
namespace {

std::string failed(const char* what, const std::string& of) {
  return "jax_ep: " + std::string(what) + " of the shared memory of " + of +
         " failed: " + std::strerror(errno);
}

// The bytes of memory the host can still give (/proc/meminfo's MemAvailable), or 0 if unknown.
size_t available_memory() {
  std::ifstream meminfo("/proc/meminfo");
  std::string key;
  size_t kib = 0;
  std::string unit;
  while (meminfo >> key >> kib >> unit)
    if (key == "MemAvailable:") return kib << 10;
  return 0;
}

}  // namespace

Segment& Segment::operator=(Segment&& other) noexcept {
  std::swap(data_, other.data_);
  std::swap(bytes_, other.bytes_);
  std::swap(fd_, other.fd_);
  return *this;
}

Segment::~Segment() {
  if (data_) munmap(data_, bytes_);
  close_fd();
}

void Segment::close_fd() {
  if (fd_ >= 0) close(fd_);
  fd_ = -1;
}

std::string Segment::create(size_t bytes, const std::string& what, Segment* out) {
  // A file of /dev/shm that never has a name: /dev/shm's size limit holds, and nothing is left
  // behind however the process ends. memfd_create (no size limit but the host's memory) where
  // /dev/shm is missing or cannot make one.
  bool in_dev_shm = true;
  int fd = open("/dev/shm", O_TMPFILE | O_RDWR | O_CLOEXEC, 0600);
  if (fd < 0) {
    in_dev_shm = false;
    const size_t available = available_memory();
    if (available && bytes > available)
      return "jax_ep: cannot allocate " + std::to_string(bytes) + " bytes (" +
             std::to_string(bytes >> 20) + " MiB) of shared memory for " + what +
             ": the host has " + std::to_string(available >> 20) +
             " MiB available (make the Buffer smaller: max_tokens_per_rank, hidden, "
             "max_row_dtype=bfloat16)";
    fd = memfd_create("jax_ep_window", MFD_CLOEXEC);
  }
  if (fd < 0) return failed("creating", what);
  // Allocated now (a sparse file would fail with SIGBUS at the first write past what /dev/shm
  // holds); new pages read as zeros.
  if (const int e = posix_fallocate(fd, 0, off_t(bytes)); e != 0) {
    close(fd);
    return "jax_ep: cannot allocate " + std::to_string(bytes) + " bytes (" +
           std::to_string(bytes >> 20) + " MiB) of shared memory for " + what + ": " +
           std::strerror(e) +
           (in_dev_shm && (e == ENOSPC || e == EFBIG)
                ? " (/dev/shm is too small for this Buffer's window: make it larger, or make "
                  "the Buffer smaller: max_tokens_per_rank, hidden, max_row_dtype=bfloat16)"
                : "");
  }
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    std::string err = failed("mmap", what);
    close(fd);
    return err;
  }
  Segment s;
  s.data_ = static_cast<uint8_t*>(p);
  s.bytes_ = bytes;
  s.fd_ = fd;
  *out = std::move(s);
  return {};
}

std::string Segment::map(int fd, size_t bytes, const std::string& what, Segment* out) {
  struct stat st{};
  if (fstat(fd, &st) != 0 || size_t(st.st_size) != bytes) {
    close(fd);
    return "jax_ep: the window of " + what +
           " has another size than this Buffer's (do all processes create the Buffer with the "
           "same arguments?)";
  }
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  std::string err = p == MAP_FAILED ? failed("mmap", what) : "";
  close(fd);  // the mapping holds the memory
  if (!err.empty()) return err;
  Segment s;
  s.data_ = static_cast<uint8_t*>(p);
  s.bytes_ = bytes;
  *out = std::move(s);
  return {};
}

Engine::Engine(int num_ranks, const std::vector<Member>& local, size_t window_bytes)
    : members(local), num_ranks_(num_ranks), window_bytes_(window_bytes) {
  for (Member& m : members) {
    Segment s;
    if (auto err = Segment::create(window_bytes_, rank_name(m.group, m.rank), &s); !err.empty())
      throw std::runtime_error(err);
    m.window = s.data();
    segments_[{m.group, m.rank}] = std::move(s);
  }
}

Engine::~Engine() { stop_serving(); }

void Engine::serve(const std::string& name, const std::string& secret,
                   const std::vector<int>& pids) {
  secret_ = secret;
  std::map<int, int> local_ranks;  // per group
  for (const Member& m : members) ++local_ranks[m.group];
  bool shared = false;
  for (const auto& [group, count] : local_ranks) shared = shared || count < num_ranks_;
  if (!shared) return;  // every rank of its groups is in this process
  std::map<std::pair<int, int>, fd_socket::Descriptor> served;
  for (const Member& m : members)
    served[{m.group, m.rank}] = {segments_.at({m.group, m.rank}).fd(), uint64_t(window_bytes_)};
  server_ = std::make_unique<fd_socket::Server>(name, secret, pids, std::move(served));
}

std::string Engine::socket() const { return server_ ? server_->name() : std::string(); }

std::vector<std::string> Engine::notes() const {
  return server_ ? server_->notes() : std::vector<std::string>();
}

std::vector<std::pair<int, int>> Engine::connect(const std::vector<EnginePeer>& peers,
                                                 double slice_s) {
  auto missing = fd_socket::receive_windows(
      peers, secret_, slice_s, [&](int group, int rank) { return segments_.count({group, rank}); },
      [&](const EnginePeer& p, int fd, uint64_t bytes) {
        const std::string what = rank_name(p.group, p.rank);
        if (bytes != window_bytes_) {
          close(fd);
          throw std::runtime_error("jax_ep: " + what + " has a " + std::to_string(bytes) +
                                   "-byte window, this Buffer's is " +
                                   std::to_string(window_bytes_) +
                                   " bytes (do all processes create the Buffer with the same "
                                   "arguments?)");
        }
        Segment s;
        if (auto err = Segment::map(fd, window_bytes_, what, &s); !err.empty())
          throw std::runtime_error(err);
        segments_[{p.group, p.rank}] = std::move(s);
      });
  if (!missing.empty()) return missing;
  for (Member& m : members) {
    m.peers.resize(num_ranks_);
    for (int r = 0; r < num_ranks_; ++r) {
      auto it = segments_.find({m.group, r});
      if (it == segments_.end())
        throw std::runtime_error("jax_ep: nobody gave the window of " + rank_name(m.group, r));
      m.peers[r] = it->second.data();
    }
  }
  return {};
}

void Engine::stop_serving() {
  if (server_) server_->stop();
  server_.reset();
  for (auto& [key, segment] : segments_) segment.close_fd();
}

}  // namespace jax_ep::shm
