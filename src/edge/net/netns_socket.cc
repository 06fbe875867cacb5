#include "edge/net/netns_socket.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sched.h>
#include <sys/socket.h>

#include <cerrno>
#include <cmath>
#include <string>
#include <system_error>
#include <thread>

#include "common/util.h"

namespace dsec::edge {
namespace {

Result<UniqueFd> socketHere(int family) {
  UniqueFd fd(::socket(family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
  if (!fd) {
    return sysError(std::string("socket(") + (family == AF_INET6 ? "AF_INET6" : "AF_INET") + ")");
  }
  return fd;
}

// Errors of a connect that mean "nothing there for this family": refused,
// or the netns has no such loopback address (IPv6 off, lo down).
bool nothingThere(int err) {
  return err == ECONNREFUSED || err == EADDRNOTAVAIL || err == ENETUNREACH || err == EAFNOSUPPORT ||
         err == EHOSTUNREACH;
}

struct Attempt {
  UniqueFd fd;  // connected when err == 0
  int err = 0;
  bool timedOut = false;
  Status failure;  // a socket that could not even be made (not ok)
};

Attempt connectOnce(int netnsFd, int family, int port, double deadline) {
  Attempt a;
  auto s = socketInNetns(netnsFd, family);
  if (!s.isOk()) {
    if (s.status().sysErrno() == EAFNOSUPPORT) {
      a.err = EAFNOSUPPORT;
    } else {
      a.failure = s.status();
    }
    return a;
  }
  a.fd = std::move(*s);
  sockaddr_storage ss{};
  socklen_t len;
  if (family == AF_INET) {
    auto* in = reinterpret_cast<sockaddr_in*>(&ss);
    in->sin_family = AF_INET;
    in->sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    in->sin_port = htons(uint16_t(port));
    len = sizeof(sockaddr_in);
  } else {
    auto* in6 = reinterpret_cast<sockaddr_in6*>(&ss);
    in6->sin6_family = AF_INET6;
    in6->sin6_addr = in6addr_loopback;
    in6->sin6_port = htons(uint16_t(port));
    len = sizeof(sockaddr_in6);
  }
  int rc;
  do {
    rc = ::connect(a.fd.get(), reinterpret_cast<sockaddr*>(&ss), len);
  } while (rc != 0 && errno == EINTR);
  if (rc == 0) return a;
  if (errno != EINPROGRESS) {
    a.err = errno;
    a.fd.reset();
    return a;
  }
  for (;;) {
    double left = deadline - monoSeconds();
    if (left <= 0) {
      a.timedOut = true;
      a.fd.reset();
      return a;
    }
    pollfd p{a.fd.get(), POLLOUT, 0};
    int n = ::poll(&p, 1, int(std::ceil(left * 1000)));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      a.failure = sysError("poll (connect)");
      a.fd.reset();
      return a;
    }
    if (n == 0) continue;  // the deadline check above ends it
    int soErr = 0;
    socklen_t sl = sizeof soErr;
    if (::getsockopt(a.fd.get(), SOL_SOCKET, SO_ERROR, &soErr, &sl) != 0) soErr = errno;
    if (soErr != 0) {
      a.err = soErr;
      a.fd.reset();
    }
    return a;
  }
}

}  // namespace

Result<UniqueFd> socketInNetns(int netnsFd, int family) {
  if (netnsFd < 0) return socketHere(family);
  Result<UniqueFd> result = internalError("netns thread did not run");
  try {
    std::thread([&] {
      // Only this thread moves; it exits right after, and the socket keeps
      // its netns.
      if (::setns(netnsFd, CLONE_NEWNET) != 0) {
        result = sysError("setns(CLONE_NEWNET)");
        return;
      }
      result = socketHere(family);
    }).join();
  } catch (const std::system_error& e) {
    return sysError("start a thread to enter the netns", e.code().value());
  }
  return result;
}

Result<UniqueFd> connectLoopback(int netnsFd, int port, double timeoutS) {
  if (port < 1 || port > 65535) return invalidArg("port", "port must be from 1 to 65535");
  const std::string p = std::to_string(port);
  const double deadline = monoSeconds() + timeoutS;
  int firstErr = 0;
  for (int family : {AF_INET, AF_INET6}) {
    Attempt a = connectOnce(netnsFd, family, port, deadline);
    if (!a.failure.isOk()) return a.failure;
    if (a.timedOut) {
      char took[32];
      std::snprintf(took, sizeof took, "%g", timeoutS);
      return Status(Code::kDeadlineExceeded,
                    "port " + p + " did not accept the connection within " + took + " s", 0,
                    "port");
    }
    if (a.fd) {
      int one = 1;
      (void)::setsockopt(a.fd.get(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
      return std::move(a.fd);
    }
    if (!nothingThere(a.err)) {
      return sysError(
          std::string("connect to ") + (family == AF_INET ? "127.0.0.1:" : "[::1]:") + p, a.err);
    }
    if (firstErr == 0) firstErr = a.err;
  }
  return Status(Code::kUnavailable, "nothing listens on port " + p, firstErr, "port");
}

}  // namespace dsec::edge
