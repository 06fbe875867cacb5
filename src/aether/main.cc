// dsec-aether: the agent inside every sandbox. Speaks the framed protocol of
// docs/agent-protocol.md on fd 3.
//
//   dsec-aether            wait for the init frame, set up the container, serve
//   dsec-aether --no-init  send hello at once and serve in the current root
//   /init (PID 1)          a microvm guest's init (guest_init.h)
#include <fcntl.h>
#include <poll.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <exception>
#include <string>
#include <string_view>

#include "aether/agent.h"
#include "aether/container_init.h"
#include "aether/files.h"
#include "aether/guest_init.h"
#include "aether/json_fields.h"
#include "common/fd.h"
#include "common/frame.h"

namespace dsec::aether {
namespace {

constexpr int kConnFd = 3;
// Where a sandbox's PID 1 leaves the edge's end of a fresh connection when
// the edge goes away (AgentOptions::reattach_fd); held on /dev/null until
// then. Claimed first thing, before anything else may be given that number.
constexpr int kReattachFd = 9;
// Where PID 1 keeps the read-only clone of its sandbox's disk that the edge
// sends with init (RootfsConfig::diskFd), for a restarted edge to take back
// with pidfd_getfd; /dev/null without one. Close-on-exec: no exec'd process
// inherits it.
constexpr int kDiskFd = 10;

// pipe() and friends must never hand out 0-2 (they would become an exec's
// stdio by accident), so make sure those are open.
void ensureStdFds() {
  for (int fd = 0; fd < 3; ++fd) {
    if (::fcntl(fd, F_GETFD) < 0 && errno == EBADF) {
      int null = ::open("/dev/null", O_RDWR);
      if (null >= 0 && null != fd) {
        ::dup2(null, fd);
        ::close(null);
      }
    }
  }
}

Status writeAllBlocking(int fd, std::string_view data) {
  int waits = 0;
  while (!data.empty()) {
    ssize_t n = ::write(fd, data.data(), data.size());
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN && ++waits <= 5) {  // start() made the connection nonblocking
        struct pollfd p = {fd, POLLOUT, 0};
        (void)::poll(&p, 1, 1000);
        continue;
      }
      return sysError("write connection");
    }
    data.remove_prefix(static_cast<size_t>(n));
  }
  return Status::ok();
}

// Before the event loop exists: a blocking read of the first frame. File
// descriptors sent along with it (SCM_RIGHTS: the rootfs mount, then the
// disk clone) land in `passed` and `second`; any further ones are closed.
Result<proto::Frame> readFirstFrame(int fd, proto::FrameDecoder& decoder, UniqueFd& passed,
                                    UniqueFd& second) {
  char buf[65536];
  proto::Frame f;
  while (!decoder.next(f)) {
    struct iovec iov = {buf, sizeof buf};
    alignas(struct cmsghdr) char control[CMSG_SPACE(4 * sizeof(int))];
    struct msghdr msg = {};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control;
    msg.msg_controllen = sizeof control;
    ssize_t n = ::recvmsg(fd, &msg, MSG_CMSG_CLOEXEC);
    if (n < 0) {
      if (errno == EINTR) continue;
      return sysError("read connection");
    }
    for (struct cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
      if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
      size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
      for (size_t i = 0; i < count; ++i) {
        int got;
        std::memcpy(&got, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
        if (!passed) {
          passed.reset(got);
        } else if (!second) {
          second.reset(got);
        } else {
          ::close(got);
        }
      }
    }
    if (n == 0) return Status(Code::kUnavailable, "connection closed before init");
    RETURN_IF_ERROR(decoder.feed(buf, static_cast<size_t>(n)));
  }
  return f;
}

// Reports a start-up failure on stream 0, as the spec asks, and exits 1.
int failStartup(int fd, const Status& st) {
  std::fprintf(stderr, "dsec-aether: %s\n", st.toString().c_str());
  std::string wire;
  proto::appendFrame(wire, 0, proto::FrameType::kResult, errorJson(st));
  (void)writeAllBlocking(fd, wire);
  return 1;
}

int realMain(int argc, char** argv) {
  // Exec'd from a memfd, the kernel names us "memfd:dsec-aether"; ps in the
  // sandbox should show what PID 1 is.
  ::prctl(PR_SET_NAME, "dsec-aether", 0, 0, 0);
  // The kernel starts the microvm initramfs's /init (this binary) as PID 1.
  if (::getpid() == 1 && argc >= 1 && std::string_view(argv[0]) == "/init") return guestMain();
  bool no_init = false;
  bool prestaged = false;
  std::string stage_dir = kStageDir;
  std::string mask_dir;  // the node's empty read-only directory for masks
  bool pivot = false;    // prestage pivots into the stage (container_init.h)
  for (int i = 1; i < argc; ++i) {
    std::string_view a = argv[i];
    if (a == "--no-init") {
      no_init = true;
    } else if (a == "--prestage") {
      prestaged = true;
    } else if (a.substr(0, 11) == "--prestage=" && a.size() > 11) {
      prestaged = true;
      stage_dir = std::string(a.substr(11));
    } else if (a.substr(0, 7) == "--mask=" && a.size() > 7) {
      mask_dir = std::string(a.substr(7));
    } else if (a == "--pivot") {
      pivot = true;
    } else {
      std::fprintf(stderr,
                   "usage: dsec-aether [--no-init | --prestage[=DIR]] [--mask=DIR] [--pivot]\n"
                   "  (the connection is fd 3)\n");
      return 2;
    }
  }
  if (no_init && prestaged) {
    std::fprintf(stderr, "dsec-aether: --prestage needs an init frame\n");
    return 2;
  }
  ensureStdFds();
  if (!no_init) {
    int null = ::open("/dev/null", O_RDWR | O_CLOEXEC);
    if (null < 0 || ::dup3(null, kReattachFd, O_CLOEXEC) < 0 ||
        ::dup3(null, kDiskFd, O_CLOEXEC) < 0) {
      std::fprintf(stderr, "dsec-aether: cannot reserve fds %d and %d: %s\n", kReattachFd,
                   kDiskFd, std::strerror(errno));
      return 2;
    }
    ::close(null);
  }
  if (::fcntl(kConnFd, F_SETFD, FD_CLOEXEC) < 0) {
    std::fprintf(stderr, "dsec-aether: fd 3 is not open: %s\n", std::strerror(errno));
    return 2;
  }
  // Blocking until the loop starts; the edge may have handed over a
  // nonblocking socket.
  int flags = ::fcntl(kConnFd, F_GETFL);
  if (flags >= 0) ::fcntl(kConnFd, F_SETFL, flags & ~O_NONBLOCK);

  UniqueFd conn(kConnFd);
  proto::FrameDecoder decoder;
  AgentOptions options;
  options.exec.drop_caps = ::geteuid() == 0;
  // Every exec costs aether four or five descriptors; don't let the usual
  // soft limit of 1024 cap concurrency. Children get a bounded limit of their
  // own whatever the edge had (a node may run with a hard limit of 1M): soft
  // 1024, hard at most kChildNofileMax; without CAP_SYS_RESOURCE they cannot
  // raise it.
  constexpr rlim_t kChildNofileMax = 65536;
  struct rlimit nofile;
  if (::getrlimit(RLIMIT_NOFILE, &nofile) == 0) {
    struct rlimit child;
    child.rlim_max = std::min<rlim_t>(nofile.rlim_max, kChildNofileMax);
    child.rlim_cur = std::min<rlim_t>(child.rlim_max, 1024);
    options.exec.child_nofile = child;
    if (nofile.rlim_cur < nofile.rlim_max) {
      struct rlimit raised = nofile;
      raised.rlim_cur = std::min<rlim_t>(nofile.rlim_max, 1u << 20);
      (void)::setrlimit(RLIMIT_NOFILE, &raised);
    }
  }
  if (!no_init) {
    // A spare (container backend): what does not depend on the sandbox is
    // done before the edge hands it one. If that fails (a host without
    // its stage directory, say), init does it all as without --prestage.
    std::string staged;
    if (prestaged) {
      Result<std::string> r = prestage(stage_dir, mask_dir, pivot);
      if (r.isOk()) {
        staged = *r;
      } else {
        std::fprintf(stderr, "dsec-aether: prestage: %s (mounting at init)\n",
                     r.status().toString().c_str());
      }
    }
    UniqueFd rootfsFd, diskFd;
    Result<proto::Frame> first = readFirstFrame(conn.get(), decoder, rootfsFd, diskFd);
    if (!first.isOk()) {
      std::fprintf(stderr, "dsec-aether: %s\n", first.status().toString().c_str());
      return 1;
    }
    if (first->stream != 0 || first->type != proto::FrameType::kInit) {
      return failStartup(conn.get(),
                         invalidArg("type", "the first frame must be init on stream 0"));
    }
    Result<InitConfig> config = parseInitConfig(first->payload);
    if (!config.isOk()) return failStartup(conn.get(), config.status());
    Status st = setupContainer(*config, rootfsFd.get(), staged, mask_dir);
    rootfsFd.reset();  // attached (or refused): the sandbox must not keep it
    if (!st.isOk()) return failStartup(conn.get(), st);
    if (diskFd) {
      if (!config->rootfs || !config->rootfs->diskFd) {
        return failStartup(conn.get(), invalidArg("rootfs.disk_fd",
                                                  "a second fd came with init without disk_fd"));
      }
      if (::dup3(diskFd.get(), kDiskFd, O_CLOEXEC) < 0) {
        return failStartup(conn.get(), sysError("keep the disk clone"));
      }
      diskFd.reset();
    } else if (config->rootfs && config->rootfs->diskFd) {
      return failStartup(conn.get(),
                         invalidArg("rootfs.disk_fd", "disk_fd is set but no disk fd came"));
    }
    if (!config->working_dir.empty()) {
      st = makeDir(config->working_dir, true, 0755);
      if (!st.isOk()) return failStartup(conn.get(), st.withContext("working_dir " + config->working_dir));
    }
    options.exec.default_env = config->env;
    if (config->reattach) options.reattach_fd = kReattachFd;
    options.fncall = config->fncall;
    options.initial_policy = config->policy;
  }

  Agent agent(std::move(conn), std::move(options), std::move(decoder));
  Status st = agent.start();
  if (!st.isOk()) {
    // The connection is still ours (fd 3): the edge hears why.
    if (!no_init) return failStartup(kConnFd, st.withContext("start"));
    std::fprintf(stderr, "dsec-aether: start: %s\n", st.toString().c_str());
    return 1;
  }
  return agent.run();
}

}  // namespace
}  // namespace dsec::aether

int main(int argc, char** argv) {
  try {
    return dsec::aether::realMain(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dsec-aether: %s\n", e.what());
    return 1;
  }
}
