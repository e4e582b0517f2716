// File descriptors passed between the processes of a host over Unix domain sockets (SCM_RIGHTS),
// in Linux's abstract namespace (no file to clean up; the name goes with the last socket).
// The CUDA-IPC engine (cuda_ipc.h) serves each rank's exported window this way; nothing here
// needs a GPU, so CPU builds carry it too (and its tests run in CI).
#pragma once
#include <cstdint>
#include <memory>
#include <string>

namespace jax_ep::fd_socket {

// What a server sends beside its descriptor.
struct Header {
  uint64_t magic;  // kMagic: a jax_ep server of this version
  uint64_t bytes;  // the size of what the descriptor holds
  uint64_t tag;    // set by the caller (e.g. the Buffer's key): a peer checks it
};
constexpr uint64_t kMagic = 0x6a61785f65703031ull;  // "jax_ep01"

// Serves one descriptor at an abstract socket `name` from a thread of its own: every connection
// of a process of this user (SO_PEERCRED) gets the header and a duplicate of `fd` (the caller keeps
// `fd` and closes it). Binding fails (throws) if the name is taken. stop() (or the destructor) ends
// the thread and frees the name.
class Server {
 public:
  Server(const std::string& name, int fd, Header header);
  ~Server();
  void stop();
  int served() const;  // connections answered so far

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Connects to `name` (retrying while nobody listens there) and receives its descriptor; gives up
// after timeout_s with an error naming `who` (e.g. "rank 1 of EP group 0"). The caller owns the
// returned descriptor. `header` gets what the server sent; a wrong magic or tag is an error.
int receive(const std::string& name, uint64_t tag, double timeout_s, const std::string& who,
            Header* header);

}  // namespace jax_ep::fd_socket
