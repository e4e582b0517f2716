#include "kernels/comm/shm.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <stdexcept>

namespace jax_ep::shm {
namespace {

std::string failed(const char* what, const std::string& name) {
  return "jax_ep: " + std::string(what) + " of shared memory " + name +
         " failed: " + std::strerror(errno);
}

}  // namespace

Segment& Segment::operator=(Segment&& other) noexcept {
  std::swap(name_, other.name_);
  std::swap(data_, other.data_);
  std::swap(bytes_, other.bytes_);
  std::swap(owner_, other.owner_);
  return *this;
}

Segment::~Segment() {
  if (data_) munmap(data_, bytes_);
  if (owner_) shm_unlink(name_.c_str());  // a name still there: the Buffer never connected
}

std::string Segment::create(const std::string& name, size_t bytes, Segment* out) {
  const int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) return failed("shm_open (create)", name);
  Segment s;
  s.name_ = name;
  s.owner_ = true;
  // Allocated now (a sparse file would fail with SIGBUS at the first write past what /dev/shm
  // holds); new pages read as zeros.
  if (const int e = posix_fallocate(fd, 0, off_t(bytes)); e != 0) {
    close(fd);
    shm_unlink(name.c_str());
    s.owner_ = false;
    return "jax_ep: cannot allocate " + std::to_string(bytes) + " bytes (" +
           std::to_string(bytes >> 20) + " MiB) of shared memory for " + name + ": " +
           std::strerror(e) +
           (e == ENOSPC || e == EFBIG
                ? " (/dev/shm is too small for this Buffer's window: make it larger, or make "
                  "the Buffer smaller: max_tokens_per_rank, hidden, max_row_dtype=bfloat16)"
                : "");
  }
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (p == MAP_FAILED) return failed("mmap", name);
  s.data_ = static_cast<uint8_t*>(p);
  s.bytes_ = bytes;
  *out = std::move(s);
  return {};
}

std::string Segment::open(const std::string& name, size_t bytes, Segment* out) {
  const int fd = shm_open(name.c_str(), O_RDWR, 0600);
  if (fd < 0) return failed("shm_open", name);
  struct stat st{};
  if (fstat(fd, &st) != 0 || size_t(st.st_size) != bytes) {
    close(fd);
    return "jax_ep: shared memory " + name +
           " has another size than this Buffer's window "
           "(do all processes create the Buffer with the same arguments?)";
  }
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (p == MAP_FAILED) return failed("mmap", name);
  out->name_ = name;
  out->data_ = static_cast<uint8_t*>(p);
  out->bytes_ = bytes;
  out->owner_ = false;
  return {};
}

void Segment::unlink() {
  if (owner_) shm_unlink(name_.c_str());
  owner_ = false;
}

Engine::Engine(const std::string& prefix, int num_ranks, const std::vector<Member>& local,
               size_t window_bytes)
    : members(local), prefix_(prefix), num_ranks_(num_ranks), window_bytes_(window_bytes) {
  for (Member& m : members) {
    Segment s;
    if (auto err = Segment::create(name(m.group, m.rank), window_bytes_, &s); !err.empty())
      throw std::runtime_error(err);
    m.window = s.data();
    segments_[{m.group, m.rank}] = std::move(s);
  }
}

std::string Engine::name(int group, int rank) const {
  return prefix_ + "_g" + std::to_string(group) + "_r" + std::to_string(rank);
}

void Engine::connect() {
  for (const Member& m : members)
    for (int r = 0; r < num_ranks_; ++r) {
      if (segments_.count({m.group, r})) continue;
      Segment s;
      if (auto err = Segment::open(name(m.group, r), window_bytes_, &s); !err.empty())
        throw std::runtime_error(err);
      segments_[{m.group, r}] = std::move(s);
    }
  for (Member& m : members) {
    m.peers.resize(num_ranks_);
    for (int r = 0; r < num_ranks_; ++r) m.peers[r] = segments_.at({m.group, r}).data();
  }
}

void Engine::unlink() {
  for (auto& [key, segment] : segments_) segment.unlink();
}

}  // namespace jax_ep::shm
