#include "transport/fd_socket.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/un.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstring>
#include <random>
#include <set>
#include <stdexcept>
#include <thread>

namespace jax_ep::fd_socket {
namespace {

using Clock = std::chrono::steady_clock;

// What a peer sends: the window it asks for, with the job's secret.
struct Request {
  uint64_t magic;
  uint8_t secret[kSecretBytes];
  int32_t group, rank;
};

// What the server answers, beside the descriptor (none when it has no such window).
struct Reply {
  uint64_t magic;
  uint8_t secret[kSecretBytes];
  int32_t group, rank;
  uint64_t bytes;
  uint32_t found;
  uint32_t reserved;
};

constexpr int kBindTries = 8;
constexpr size_t kSuffixBytes = 9;  // "_" and 8 hex digits

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

void check_secret(const std::string& secret) {
  if (secret.size() != kSecretBytes)
    throw std::runtime_error("jax_ep: a descriptor socket's secret must be " +
                             std::to_string(kSecretBytes) + " bytes, got " +
                             std::to_string(secret.size()));
}

bool credentials(int conn, ucred* out) {
  socklen_t len = sizeof(*out);
  return getsockopt(conn, SOL_SOCKET, SO_PEERCRED, out, &len) == 0;
}

std::string process(const ucred& c) {
  return "process " + std::to_string(c.pid) + " (uid " + std::to_string(c.uid) + ")";
}

std::string random_suffix() {
  std::random_device device;
  char hex[kSuffixBytes + 1];
  std::snprintf(hex, sizeof(hex), "_%08x", unsigned(device()));
  return hex;
}

// Sends the reply, and the descriptor if there is one, on a connected socket.
bool send_reply(int conn, const Reply& reply, int fd) {
  iovec iov{const_cast<Reply*>(&reply), sizeof(reply)};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  if (fd >= 0) {
    msg.msg_control = control;
    msg.msg_controllen = sizeof(control);
    cmsghdr* c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int));
    std::memcpy(CMSG_DATA(c), &fd, sizeof(int));
  }
  return sendmsg(conn, &msg, MSG_NOSIGNAL) == ssize_t(sizeof(reply));
}

}  // namespace

std::string owner(const std::string& name) {
  sockaddr_un addr;
  const socklen_t len = address(name, &addr);
  const int conn = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (conn < 0) return {};
  std::string out;
  ucred c{};
  if (connect(conn, reinterpret_cast<sockaddr*>(&addr), len) == 0 && credentials(conn, &c))
    out = process(c);
  close(conn);
  return out;
}

struct Server::Impl {
  std::string name;
  int listener = -1;
  std::string secret;
  std::set<int> pids;
  std::map<std::pair<int, int>, Descriptor> descriptors;
  std::vector<std::string> notes;
  std::atomic<bool> stopping{false};
  std::atomic<int> served{0}, refused{0};
  std::thread thread;

  void serve() {
    while (!stopping.load()) {
      pollfd p{listener, POLLIN, 0};
      if (poll(&p, 1, 20) <= 0) continue;  // wakes up to look at `stopping`
      const int conn = accept4(listener, nullptr, nullptr, SOCK_CLOEXEC);
      if (conn < 0) continue;
      const int answered = answer(conn);
      if (answered > 0) served.fetch_add(1);
      if (answered < 0) refused.fetch_add(1);
      close(conn);  // the peer reads what was sent before it sees the end
    }
  }

  // Answers one connection: 1 if it got a descriptor, 0 if it asked for one not served here,
  // -1 if it was refused (closed without an answer).
  int answer(int conn) {
    // An abstract name is open to the whole host: only this user's expected processes.
    ucred peer{};
    if (!credentials(conn, &peer) || peer.uid != geteuid() ||
        (!pids.empty() && !pids.count(int(peer.pid))))
      return -1;
    timeval limit{1, 0};  // a peer that connects and sends nothing does not hold up the others
    setsockopt(conn, SOL_SOCKET, SO_RCVTIMEO, &limit, sizeof(limit));
    Request request{};
    if (recv(conn, &request, sizeof(request), MSG_WAITALL) != ssize_t(sizeof(request)) ||
        request.magic != kMagic || std::memcmp(request.secret, secret.data(), kSecretBytes) != 0)
      return -1;
    Reply reply{};
    reply.magic = kMagic;
    std::memcpy(reply.secret, secret.data(), kSecretBytes);
    reply.group = request.group;
    reply.rank = request.rank;
    auto it = descriptors.find({request.group, request.rank});
    reply.found = it != descriptors.end();
    reply.bytes = reply.found ? it->second.bytes : 0;
    return send_reply(conn, reply, reply.found ? it->second.fd : -1) && reply.found ? 1 : 0;
  }
};

Server::Server(const std::string& name, const std::string& secret, std::vector<int> pids,
               std::map<std::pair<int, int>, Descriptor> descriptors)
    : impl_(new Impl) {
  check_secret(secret);
  sockaddr_un addr;
  address(name + random_suffix(), &addr);  // every name tried is within the bound
  impl_->secret = secret;
  impl_->pids = std::set<int>(pids.begin(), pids.end());
  impl_->descriptors = std::move(descriptors);
  for (int attempt = 0; attempt < kBindTries && impl_->listener < 0; ++attempt) {
    const std::string candidate = attempt == 0 ? name : name + random_suffix();
    const socklen_t len = address(candidate, &addr);
    const int s = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (s < 0) throw std::runtime_error(failed("socket"));
    if (bind(s, reinterpret_cast<sockaddr*>(&addr), len) == 0 && listen(s, 64) == 0) {
      impl_->listener = s;
      impl_->name = candidate;
      break;
    }
    const int err = errno;
    close(s);
    if (err != EADDRINUSE) {
      errno = err;
      throw std::runtime_error(failed("binding the Unix socket '@" + candidate + "'"));
    }
    const std::string who = owner(candidate);
    impl_->notes.push_back("jax_ep: the Unix socket '@" + candidate + "' is taken (by " +
                           (who.empty() ? "a process that does not answer" : who) +
                           "); serving under another name");
  }
  if (impl_->listener < 0) {
    std::string all;
    for (const std::string& n : impl_->notes) all += "\n" + n;
    throw std::runtime_error("jax_ep: no free name to serve windows at after " +
                             std::to_string(kBindTries) + " tries:" + all);
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

const std::string& Server::name() const { return impl_->name; }
const std::vector<std::string>& Server::notes() const { return impl_->notes; }
int Server::served() const { return impl_ ? impl_->served.load() : 0; }
int Server::refused() const { return impl_ ? impl_->refused.load() : 0; }

int receive(const std::string& name, int group, int rank, const std::string& secret, int pid,
            double timeout_s, const std::string& who, uint64_t* bytes) {
  check_secret(secret);
  sockaddr_un addr;
  const socklen_t len = address(name, &addr);
  const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                           std::chrono::duration<double>(timeout_s));
  const std::string where = " (socket '@" + name + "')";
  int conn = -1;
  while (true) {  // connect, retrying while nobody listens at the name
    conn = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (conn < 0) throw std::runtime_error(failed("socket"));
    if (connect(conn, reinterpret_cast<sockaddr*>(&addr), len) == 0) break;
    const int err = errno;
    close(conn);
    if (err == EINTR) return -2;  // a signal: the caller's turn
    if (err != ECONNREFUSED && err != ENOENT && err != EAGAIN) {
      errno = err;
      throw std::runtime_error(failed("connecting to " + who + where));
    }
    if (Clock::now() >= deadline) return -1;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  auto fail = [&](const std::string& what) {
    close(conn);
    return std::runtime_error("jax_ep: " + who + where + " " + what);
  };
  // The server: a process of this user, the one expected; checked before the secret is sent.
  ucred server{};
  if (!credentials(conn, &server))
    throw fail("has no credentials: " + std::string(strerror(errno)));
  if (server.uid != geteuid() || (pid > 0 && int(server.pid) != pid))
    throw fail("is served by " + process(server) + ", not by process " +
               (pid > 0 ? std::to_string(pid) : std::string("of this user")) + " (uid " +
               std::to_string(geteuid()) + "): another program holds the name");
  Request request{};
  request.magic = kMagic;
  std::memcpy(request.secret, secret.data(), kSecretBytes);
  request.group = group;
  request.rank = rank;
  const std::string refused =
      "closed the connection without an answer: it refused this process (the processes of a "
      "Buffer must be one job, of one user), or its process ended";
  if (send(conn, &request, sizeof(request), MSG_NOSIGNAL) != ssize_t(sizeof(request)))
    throw fail(refused);
  Reply reply{};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  iovec iov{&reply, sizeof(reply)};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = sizeof(control);
  pollfd p{conn, POLLIN, 0};
  const int ready = poll(&p, 1, remaining_ms(deadline));
  if (ready <= 0) {  // no answer yet, or a signal: the caller's turn
    const bool interrupted = ready < 0 && errno == EINTR;
    close(conn);
    return interrupted ? -2 : -1;
  }
  const ssize_t got = recvmsg(conn, &msg, MSG_CMSG_CLOEXEC | MSG_WAITALL);
  if (got < 0 && errno == EINTR) {
    close(conn);
    return -2;
  }
  close(conn);
  int fd = -1;
  for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c; c = CMSG_NXTHDR(&msg, c))
    if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS &&
        c->cmsg_len == CMSG_LEN(sizeof(int)))
      std::memcpy(&fd, CMSG_DATA(c), sizeof(int));
  auto bad = [&](const std::string& what) {
    if (fd >= 0) close(fd);
    return std::runtime_error("jax_ep: " + who + where + " " + what);
  };
  if (got <= 0) throw bad(refused);
  if (got != ssize_t(sizeof(reply)) || reply.magic != kMagic)
    throw bad("answered with something else than a window (another protocol)");
  if (std::memcmp(reply.secret, secret.data(), kSecretBytes) != 0)
    throw bad("answered with another job's secret");
  if (!reply.found || reply.group != group || reply.rank != rank)
    throw bad("serves no window of rank " + std::to_string(rank) + " of EP group " +
              std::to_string(group));
  if (fd < 0) throw bad("sent no descriptor");
  if (bytes) *bytes = reply.bytes;
  return fd;
}

std::vector<std::pair<int, int>> receive_windows(
    const std::vector<EnginePeer>& peers, const std::string& secret, double slice_s,
    const std::function<bool(int, int)>& have,
    const std::function<void(const EnginePeer&, int, uint64_t)>& take) {
  const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                           std::chrono::duration<double>(slice_s));
  std::vector<const EnginePeer*> missing;
  for (const EnginePeer& p : peers)
    if (!have(p.group, p.rank)) missing.push_back(&p);
  bool interrupted = false;
  while (!missing.empty() && !interrupted) {
    std::vector<const EnginePeer*> still;
    for (const EnginePeer* p : missing) {
      const double left = std::chrono::duration<double>(deadline - Clock::now()).count();
      uint64_t bytes = 0;
      const int fd = left > 0 && !interrupted
                         ? receive(p->socket, p->group, p->rank, secret, p->pid,
                                   left < 0.1 ? left : 0.1, rank_name(p->group, p->rank), &bytes)
                         : -1;
      interrupted = interrupted || fd == -2;
      if (fd < 0)
        still.push_back(p);
      else
        take(*p, fd, bytes);
    }
    missing.swap(still);
    if (Clock::now() >= deadline) break;
  }
  std::vector<std::pair<int, int>> out;
  for (const EnginePeer* p : missing) out.push_back({p->group, p->rank});
  return out;
}

}  // namespace jax_ep::fd_socket
