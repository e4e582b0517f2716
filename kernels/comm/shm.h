// The engine for CPU devices: each rank's window is a POSIX shared-memory segment, which every
// process of the host maps (ranks of one process map them too: one code path). Segments are
// named after the Buffer; the owner creates and zeroes its own, peers open them once they exist,
// and every name is unlinked once all processes have mapped it (the memory lives as long as a
// mapping does).
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

namespace jax_ep::shm {

class Segment {
 public:
  Segment() = default;
  Segment(Segment&& other) noexcept { *this = static_cast<Segment&&>(other); }
  Segment& operator=(Segment&& other) noexcept;
  Segment(const Segment&) = delete;
  ~Segment();

  // Creates `name` with `bytes` zero bytes (fails if it exists) and maps it.
  static std::string create(const std::string& name, size_t bytes, Segment* out);
  // Maps the existing segment `name`, which must hold `bytes`.
  static std::string open(const std::string& name, size_t bytes, Segment* out);

  uint8_t* data() const { return data_; }
  void unlink();  // removes the name; the mapping stays

 private:
  std::string name_;
  uint8_t* data_ = nullptr;
  size_t bytes_ = 0;
  bool owner_ = false;
};

}  // namespace jax_ep::shm
