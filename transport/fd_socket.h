// File descriptors passed between the processes of a host over Unix domain sockets (SCM_RIGHTS),
// in Linux's abstract namespace (no file to clean up: the name goes with the last socket, so a
// process killed at any point leaves nothing behind). Each process serves the windows of its
// ranks on one socket; a peer asks for one (group, rank) and gets its descriptor. Both engines
// that share windows between processes use it: shm.h (CPUs: tmpfs files) and cuda_ipc.h (GPUs:
// exported driver memory); nothing here needs a GPU, so CPU builds carry it and its tests run
// in CI.
//
// Both ends check the other: the server answers only processes of this user (SO_PEERCRED)
// whose process id it expects (when given) and that send the job's secret; the client checks the
// server's user and process id (when given) before it sends the secret, and that the answer
// carries the secret back.
#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "transport/engine.h"

namespace jax_ep::fd_socket {

constexpr uint64_t kMagic = 0x6a61785f65703032ull;  // "jax_ep02": a jax_ep peer of this protocol
constexpr size_t kSecretBytes = 16;                 // the job's secret, drawn by the caller

// A descriptor served, and the size of what it holds.
struct Descriptor {
  int fd;
  uint64_t bytes;
};

// Serves `descriptors` (by (group, rank)) at an abstract socket from a thread of its own; the
// caller keeps them open until stop(). `pids`: the processes allowed to ask (empty: any process
// of this user). If `name` is taken, binds name + "_" + a fresh random suffix instead (up to 8
// times), and records in notes() who held the name. stop() (or the destructor) ends the thread
// and frees the name. Throws if no name could be bound.
class Server {
 public:
  Server(const std::string& name, const std::string& secret, std::vector<int> pids,
         std::map<std::pair<int, int>, Descriptor> descriptors);
  ~Server();
  void stop();
  const std::string& name() const;                // the name bound
  const std::vector<std::string>& notes() const;  // names found taken, and by whom
  int served() const;                             // descriptors sent so far
  int refused() const;                            // connections refused so far

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Connects to `name`, checks that it is served by this user's process `pid` (0: any process of
// this user), asks for the descriptor of (group, rank) with the secret and returns it (the
// caller owns it; `bytes` gets its size). Returns -1 when nobody listens at `name` or no answer
// came within timeout_s, -2 when a signal interrupted the wait (the caller's to handle, e.g.
// Python's KeyboardInterrupt): the caller tries again. Throws on a wrong answer or a refusal,
// naming `who` (e.g. "rank 1 of EP group 0").
int receive(const std::string& name, int group, int rank, const std::string& secret, int pid,
            double timeout_s, const std::string& who, uint64_t* bytes);

// Receives the windows of `peers` for which have(group, rank) is false, round-robin in short
// tries for up to slice_s in all (a peer that does not answer holds up the others for 0.1 s at
// most; a signal ends the slice at once); take(peer, fd, bytes) gets each one received (and owns
// fd). Returns the (group, rank) still missing: the caller tries again, or names them once its
// timeout is over.
std::vector<std::pair<int, int>> receive_windows(
    const std::vector<EnginePeer>& peers, const std::string& secret, double slice_s,
    const std::function<bool(int, int)>& have,
    const std::function<void(const EnginePeer&, int, uint64_t)>& take);

// Who holds the abstract socket `name` ("process <pid> (uid <uid>)"), or "" if nobody listens.
std::string owner(const std::string& name);

}  // namespace jax_ep::fd_socket
