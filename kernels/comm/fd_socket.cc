#include "kernels/comm/fd_socket.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstring>
#include <stdexcept>
#include <thread>

namespace jax_ep::fd_socket {
namespace {

using Clock = std::chrono::steady_clock;

// An abstract address: sun_path starts with a zero byte, the name follows (not zero-terminated).
socklen_t address(const std::string& name, sockaddr_un* addr) {
  if (name.empty() || name.size() + 1 > sizeof(addr->sun_path))
    throw std::runtime_error("jax_ep: socket name '" + name + "' is empty or longer than " +
                             std::to_string(sizeof(addr->sun_path) - 1) + " bytes");
  std::memset(addr, 0, sizeof(*addr));
  addr->sun_family = AF_UNIX;
  std::memcpy(addr->sun_path + 1, name.data(), name.size());
  return socklen_t(offsetof(sockaddr_un, sun_path) + 1 + name.size());
}

std::string failed(const std::string& what) {
  return "jax_ep: " + what + ": " + std::strerror(errno);
}

int remaining_ms(Clock::time_point deadline) {
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
  return left.count() < 0 ? 0 : int(left.count());
}

// Sends the header and the descriptor on a connected socket.
bool send_fd(int conn, int fd, const Header& header) {
  iovec iov{const_cast<Header*>(&header), sizeof(header)};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = sizeof(control);
  cmsghdr* c = CMSG_FIRSTHDR(&msg);
  c->cmsg_level = SOL_SOCKET;
  c->cmsg_type = SCM_RIGHTS;
  c->cmsg_len = CMSG_LEN(sizeof(int));
  std::memcpy(CMSG_DATA(c), &fd, sizeof(int));
  return sendmsg(conn, &msg, MSG_NOSIGNAL) == ssize_t(sizeof(header));
}

}  // namespace

struct Server::Impl {
  std::string name;
  int listener = -1;
  int fd;
  Header header;
  std::atomic<bool> stopping{false};
  std::atomic<int> served{0};
  std::thread thread;

  void serve() {
    while (!stopping.load()) {
      pollfd p{listener, POLLIN, 0};
      if (poll(&p, 1, 20) <= 0) continue;  // wakes up to look at `stopping`
      const int conn = accept4(listener, nullptr, nullptr, SOCK_CLOEXEC);
      if (conn < 0) continue;
      // Only processes of this user get the window (an abstract name is open to the host).
      ucred peer{};
      socklen_t len = sizeof(peer);
      if (getsockopt(conn, SOL_SOCKET, SO_PEERCRED, &peer, &len) == 0 && peer.uid == geteuid() &&
          send_fd(conn, fd, header))
        served.fetch_add(1);
      close(conn);  // the peer reads what was sent before it sees the end
    }
  }
};

Server::Server(const std::string& name, int fd, Header header) : impl_(new Impl) {
  impl_->name = name;
  impl_->fd = fd;
  impl_->header = header;
  sockaddr_un addr;
  const socklen_t len = address(name, &addr);
  impl_->listener = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (impl_->listener < 0) throw std::runtime_error(failed("socket"));
  if (bind(impl_->listener, reinterpret_cast<sockaddr*>(&addr), len) != 0 ||
      listen(impl_->listener, 64) != 0) {
    std::string err = failed("binding the Unix socket '@" + name + "'" +
                             (errno == EADDRINUSE ? " (the name is taken: another Buffer of "
                                                    "the same name on this host?)"
                                                  : ""));
    close(impl_->listener);
    throw std::runtime_error(err);
  }
  impl_->thread = std::thread([impl = impl_.get()] { impl->serve(); });
}

Server::~Server() { stop(); }

void Server::stop() {
  if (!impl_) return;
  impl_->stopping.store(true);
  if (impl_->thread.joinable()) impl_->thread.join();
  if (impl_->listener >= 0) close(impl_->listener);  // frees the name
  impl_->listener = -1;
}

int Server::served() const { return impl_ ? impl_->served.load() : 0; }

int receive(const std::string& name, uint64_t tag, double timeout_s, const std::string& who,
            Header* header) {
  sockaddr_un addr;
  const socklen_t len = address(name, &addr);
  const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                           std::chrono::duration<double>(timeout_s));
  auto late = [&](const std::string& what) {
    return std::runtime_error("jax_ep: " + who + " did not " + what + " within " +
                              std::to_string(timeout_s) + " s (socket '@" + name +
                              "'; did its process stop, or not create the Buffer?)");
  };
  int conn = -1;
  while (true) {  // connect, retrying while nobody listens at the name yet
    conn = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (conn < 0) throw std::runtime_error(failed("socket"));
    if (connect(conn, reinterpret_cast<sockaddr*>(&addr), len) == 0) break;
    const int err = errno;
    close(conn);
    if (err != ECONNREFUSED && err != ENOENT && err != EAGAIN && err != EINTR) {
      errno = err;
      throw std::runtime_error(failed("connecting to " + who + " (socket '@" + name + "')"));
    }
    if (Clock::now() >= deadline) throw late("serve its window");
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  Header h{};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  iovec iov{&h, sizeof(h)};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = sizeof(control);
  ssize_t got = -1;
  while (true) {
    pollfd p{conn, POLLIN, 0};
    const int ready = poll(&p, 1, remaining_ms(deadline));
    if (ready < 0 && errno == EINTR) continue;
    if (ready <= 0) {
      close(conn);
      throw late("send its window's descriptor");
    }
    got = recvmsg(conn, &msg, MSG_CMSG_CLOEXEC | MSG_WAITALL);
    if (got < 0 && errno == EINTR) continue;
    break;
  }
  close(conn);
  int fd = -1;
  for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c; c = CMSG_NXTHDR(&msg, c))
    if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS &&
        c->cmsg_len == CMSG_LEN(sizeof(int)))
      std::memcpy(&fd, CMSG_DATA(c), sizeof(int));
  if (got != ssize_t(sizeof(h)) || fd < 0 || h.magic != kMagic || h.tag != tag) {
    if (fd >= 0) close(fd);
    throw std::runtime_error("jax_ep: " + who + " answered at socket '@" + name +
                             "' with something else than its "
                             "window (" +
                             (got != ssize_t(sizeof(h)) ? "a short message"
                              : fd < 0                  ? "no descriptor"
                              : h.magic != kMagic       ? "another protocol"
                                                        : "another Buffer's tag") +
                             ")");
  }
  if (header) *header = h;
  return fd;
}

}  // namespace jax_ep::fd_socket
