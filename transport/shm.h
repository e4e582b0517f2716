// The engine for CPU devices: each rank's window is a file of shared memory that has no name at
// any time (O_TMPFILE in /dev/shm, so that /dev/shm's size limit holds; memfd_create where
// /dev/shm cannot make one), mapped by every process of the host that holds a rank of its group
// (ranks of one process map them too: one code path). Peers in other processes receive its
// descriptor from the owner's descriptor socket (fd_socket.h). The memory goes with the last
// descriptor or mapping, and the socket's name with the process: a job killed at any point
// leaves nothing behind.
#pragma once
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "transport/engine.h"

namespace jax_ep::fd_socket {
class Server;
}

namespace jax_ep::shm {

class Segment {
 public:
  Segment() = default;
  Segment(Segment&& other) noexcept { *this = static_cast<Segment&&>(other); }
  Segment& operator=(Segment&& other) noexcept;
  Segment(const Segment&) = delete;
  ~Segment();

  // Creates a window of `bytes` zero bytes for `what` (e.g. "rank 0 of EP group 1") and maps
  // it; keeps its descriptor (to serve it) until close_fd().
  static std::string create(size_t bytes, const std::string& what, Segment* out);
  // Maps the window of descriptor `fd` (taken: closed here), which must hold `bytes`.
  static std::string map(int fd, size_t bytes, const std::string& what, Segment* out);

  uint8_t* data() const { return data_; }
  int fd() const { return fd_; }
  void close_fd();  // the mapping stays

 private:
  uint8_t* data_ = nullptr;
  size_t bytes_ = 0;
  int fd_ = -1;
};

// This process's ranks of a Buffer's EP groups, in shared memory. Built in steps with every
// process of the host between them (jax_ep/bootstrap.py): the constructor creates this
// process's windows, serve() offers them to the others, connect() maps every other window of
// their groups (called again until none is missing), stop_serving() closes the socket. Each
// throws on failure.
class Engine {
 public:
  using Member = EngineMember;
  Engine(int num_ranks, const std::vector<Member>& local, size_t window_bytes);
  ~Engine();
  // Serves this process's windows at the abstract socket `name` (or another name if it is
  // taken: socket() says which) to the processes `pids` (empty: any of this user) that send
  // `secret`; only if a rank of their groups lives in another process (socket() is "" if not).
  void serve(const std::string& name, const std::string& secret, const std::vector<int>& pids);
  std::string socket() const;
  std::vector<std::string> notes() const;  // socket names found taken, and by whom
  // Maps the windows of `peers` not mapped yet, trying each for up to slice_s in all; returns
  // the (group, rank) still missing. Once none is, fills members[i].peers.
  std::vector<std::pair<int, int>> connect(const std::vector<EnginePeer>& peers, double slice_s);
  void stop_serving();  // once every process has connected

  std::vector<Member> members;

 private:
  int num_ranks_;
  size_t window_bytes_;
  std::string secret_;
  std::map<std::pair<int, int>, Segment> segments_;  // by (group, rank)
  std::unique_ptr<fd_socket::Server> server_;
};

}  // namespace jax_ep::shm
