#include "edge/port_registry.h"

#include <fcntl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>

namespace dsec::edge {

namespace {
Status notExposed(int port, uint64_t gen) {
  return Status(
      Code::kPermissionDenied,
      "port " + std::to_string(port) + " (generation " + std::to_string(gen) + ") is not exposed",
      0, "port");
}
}  // namespace

bool PortRegistry::allowed(const Sandbox& s, int port, uint64_t gen) {
  if (!s.exposed) return true;
  return std::find(s.exposed->begin(), s.exposed->end(), proto::PortGen{port, gen}) !=
         s.exposed->end();
}

bool PortRegistry::alive(const Conn& c) {
  struct stat st;
  return ::fstat(c.fd, &st) == 0 && S_ISSOCK(st.st_mode) && st.st_dev == c.dev &&
         st.st_ino == c.ino;
}

void PortRegistry::cut(const Conn& c) {
  // A duplicate taken now holds whatever the number refers to at this
  // instant: shut down only if that is still our socket.
  int d = ::fcntl(c.fd, F_DUPFD_CLOEXEC, 0);
  if (d < 0) return;  // closed: nothing to cut
  struct stat st;
  if (::fstat(d, &st) == 0 && st.st_dev == c.dev && st.st_ino == c.ino) {
    (void)::shutdown(d, SHUT_RDWR);
  }
  ::close(d);
}

void PortRegistry::pruneLocked(Sandbox& s) {
  std::erase_if(s.conns, [](const Conn& c) { return !alive(c); });
  s.pruneAt = std::max<size_t>(64, s.conns.size() * 2);
}

Status PortRegistry::check(const std::string& id, int port, uint64_t gen) const {
  std::lock_guard lk(mu_);
  auto it = sandboxes_.find(id);
  if (it == sandboxes_.end() || allowed(it->second, port, gen)) return Status::ok();
  return notExposed(port, gen);
}

Status PortRegistry::add(const std::string& id, int port, uint64_t gen, int fd) {
  struct stat st;
  if (::fstat(fd, &st) != 0) return sysError("fstat (port connection)");
  std::lock_guard lk(mu_);
  Sandbox& s = sandboxes_[id];
  if (!allowed(s, port, gen)) return notExposed(port, gen);
  if (s.conns.size() >= s.pruneAt || s.conns.size() >= kMaxPerSandbox) pruneLocked(s);
  if (s.conns.size() >= kMaxPerSandbox) {
    return Status(Code::kResourceExhausted,
                  "sandbox " + id + " has " + std::to_string(s.conns.size()) +
                      " open port connections (at most " + std::to_string(kMaxPerSandbox) + ")",
                  0, "port");
  }
  s.conns.push_back({port, gen, fd, st.st_dev, st.st_ino});
  return Status::ok();
}

size_t PortRegistry::set(const std::string& id, const std::vector<proto::PortGen>& ports) {
  std::lock_guard lk(mu_);
  Sandbox& s = sandboxes_[id];
  s.exposed = ports;
  size_t n = 0;
  std::erase_if(s.conns, [&](const Conn& c) {
    if (!alive(c)) return true;
    if (allowed(s, c.port, c.gen)) return false;
    cut(c);
    ++n;
    return true;
  });
  return n;
}

size_t PortRegistry::forget(const std::string& id) {
  std::lock_guard lk(mu_);
  auto it = sandboxes_.find(id);
  if (it == sandboxes_.end()) return 0;
  size_t n = 0;
  for (const Conn& c : it->second.conns) {
    if (!alive(c)) continue;
    cut(c);
    ++n;
  }
  sandboxes_.erase(it);
  return n;
}

size_t PortRegistry::connections(const std::string& id) {
  std::lock_guard lk(mu_);
  auto it = sandboxes_.find(id);
  if (it == sandboxes_.end()) return 0;
  pruneLocked(it->second);
  return it->second.conns.size();
}

}  // namespace dsec::edge
