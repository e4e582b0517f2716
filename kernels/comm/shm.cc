#include "kernels/comm/shm.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace jax_ep::shm {
namespace {

std::string failed(const char* what, const std::string& name) {
  return "jax_ep: " + std::string(what) + " of shared memory " + name + " failed: " +
         std::strerror(errno);
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
  if (ftruncate(fd, off_t(bytes)) != 0) {  // new pages read as zeros
    std::string err = failed("ftruncate", name);
    close(fd);
    return err;
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
  struct stat st {};
  if (fstat(fd, &st) != 0 || size_t(st.st_size) != bytes) {
    close(fd);
    return "jax_ep: shared memory " + name + " has another size than this Buffer's window "
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

}  // namespace jax_ep::shm
