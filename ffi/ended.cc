#include "ffi/ended.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <map>
#include <mutex>
#include <set>
#include <stdexcept>
#include <thread>
#include <utility>

namespace jax_ep {
namespace {

using RankProcesses = std::vector<std::vector<int>>;

struct Watches {
  std::mutex mu;
  std::set<int> ended;
  std::vector<std::pair<std::weak_ptr<NativeBuffer>, RankProcesses>> buffers;
  std::map<int, std::pair<int, std::string>> connections;  // fd -> (process, message)
  int wake = -1;                                           // an eventfd: the set changed
  bool stop = false;
  std::thread thread;
};

// Never destroyed: the thread may still poll while the process exits.
Watches& watches() {
  static auto* w = new Watches();
  return *w;
}

void tell(NativeBuffer& buffer, const RankProcesses& processes, int process) {
  for (size_t g = 0; g < processes.size(); ++g)
    for (size_t r = 0; r < processes[g].size(); ++r)
      if (processes[g][r] == process) buffer.peer_ended(int(g), int(r));
}

void process_ended(int process) {
  Watches& w = watches();
  std::vector<std::pair<std::shared_ptr<NativeBuffer>, RankProcesses>> live;
  {
    std::lock_guard<std::mutex> lock(w.mu);
    if (!w.ended.insert(process).second) return;
    for (const auto& [buffer, processes] : w.buffers)
      if (auto b = buffer.lock()) live.push_back({std::move(b), processes});
  }
  for (const auto& [buffer, processes] : live) tell(*buffer, processes, process);
}

void watch(Watches* w) {
  std::vector<pollfd> fds;
  while (true) {
    {
      std::lock_guard<std::mutex> lock(w->mu);
      if (w->stop) {
        for (auto& [fd, _] : w->connections) close(fd);
        w->connections.clear();
        return;
      }
      fds.assign(1, pollfd{w->wake, POLLIN, 0});
      for (auto& [fd, _] : w->connections) fds.push_back(pollfd{fd, POLLIN, 0});
    }
    if (poll(fds.data(), fds.size(), -1) < 0) continue;  // EINTR
    uint64_t drained;
    if (fds[0].revents) (void)!read(w->wake, &drained, sizeof drained);
    for (size_t i = 1; i < fds.size(); ++i) {
      if (!fds[i].revents) continue;
      char bytes[16];
      const ssize_t n = recv(fds[i].fd, bytes, sizeof bytes, MSG_DONTWAIT);
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) continue;
      const bool goodbye = n > 0 && std::memchr(bytes, kGoodbye, size_t(n));
      const bool exiting = n > 0 && std::memchr(bytes, kExiting, size_t(n));
      if (n > 0 && !goodbye && !exiting) continue;
      std::pair<int, std::string> gone;
      {
        std::lock_guard<std::mutex> lock(w->mu);
        gone = std::move(w->connections[fds[i].fd]);
        w->connections.erase(fds[i].fd);
      }
      close(fds[i].fd);
      if (goodbye) continue;  // it closed its Buffers and goes on
      // Said first: JAX may terminate this process at once (the coordination service's end).
      if (!exiting) (void)!write(STDERR_FILENO, gone.second.data(), gone.second.size());
      process_ended(gone.first);
    }
  }
}

}  // namespace

void watch_buffer(std::shared_ptr<NativeBuffer> buffer, RankProcesses rank_processes) {
  Watches& w = watches();
  std::set<int> ended;
  {
    std::lock_guard<std::mutex> lock(w.mu);
    w.buffers.erase(std::remove_if(w.buffers.begin(), w.buffers.end(),
                                   [](const auto& b) { return b.first.expired(); }),
                    w.buffers.end());
    w.buffers.push_back({buffer, rank_processes});
    ended = w.ended;
  }
  for (int process : ended) tell(*buffer, rank_processes, process);
}

void watch_process(int process, int fd, std::string message) {
  Watches& w = watches();
  std::lock_guard<std::mutex> lock(w.mu);
  if (w.wake < 0) w.wake = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (w.wake < 0) {
    close(fd);
    throw std::runtime_error(std::string("jax_ep: eventfd: ") + std::strerror(errno));
  }
  for (const auto& [_, watched] : w.connections)
    if (watched.first == process) {
      close(fd);
      return;
    }
  w.connections[fd] = {process, std::move(message)};
  if (!w.thread.joinable()) w.thread = std::thread(watch, &w);
  const uint64_t one = 1;
  (void)!write(w.wake, &one, sizeof one);
}

std::vector<int> ended_processes() {
  Watches& w = watches();
  std::lock_guard<std::mutex> lock(w.mu);
  return {w.ended.begin(), w.ended.end()};
}

void stop_watching() {
  Watches& w = watches();
  std::thread thread;
  {
    std::lock_guard<std::mutex> lock(w.mu);
    if (!w.thread.joinable()) return;
    w.stop = true;
    thread = std::move(w.thread);
    const uint64_t one = 1;
    (void)!write(w.wake, &one, sizeof one);
  }
  thread.join();
  std::lock_guard<std::mutex> lock(w.mu);
  w.stop = false;
}

}  // namespace jax_ep
