#include "edge/net/egress_filter.h"

#include <arpa/inet.h>
#include <bpf/bpf.h>
#include <bpf/libbpf.h>
#include <fcntl.h>
#include <sys/socket.h>

#include <cstdarg>
#include <cstring>

#include "common/log.h"
#include "egress.skel.h"

namespace dsec::edge::net {
namespace {

// Must match egress.bpf.c.
struct SandboxVal {
  uint64_t denied;
  uint32_t lastIp4;
  uint32_t lastPort;
  uint32_t lastIp6[4];
};
struct AllowVal {
  uint16_t lo[proto::kMaxPortRanges];
  uint16_t hi[proto::kMaxPortRanges];
  uint32_t n;
};
#pragma pack(push, 1)
struct Key4 {
  uint32_t prefixlen;
  uint8_t cg[8];
  uint8_t addr[4];
};
struct Key6 {
  uint32_t prefixlen;
  uint8_t cg[8];
  uint8_t addr[16];
};
#pragma pack(pop)
static_assert(sizeof(Key4) == 16 && sizeof(Key6) == 28);

constexpr const char* kProgPrefix = "dsec_";

// libbpf prints its own diagnostics; keep the warnings, in our log.
int libbpfPrint(enum libbpf_print_level level, const char* fmt, va_list ap) {
  if (level == LIBBPF_DEBUG) return 0;
  char buf[512];
  int n = vsnprintf(buf, sizeof buf, fmt, ap);
  std::string_view s(buf, n > 0 ? std::min<size_t>(n, sizeof buf - 1) : 0);
  while (!s.empty() && s.back() == '\n') s.remove_suffix(1);
  if (!s.empty()) log::warn("libbpf: " + std::string(s));
  return 0;
}

// Key bytes as stored in keys_: a family tag, then the raw key.
std::string keyBytes(uint64_t cg, const EgressRule& r) {
  if (r.family == AF_INET) {
    Key4 k{};
    k.prefixlen = 64 + r.prefixLen;
    std::memcpy(k.cg, &cg, 8);
    std::memcpy(k.addr, r.addr.data(), 4);
    return std::string(1, '4') + std::string(reinterpret_cast<char*>(&k), sizeof k);
  }
  Key6 k{};
  k.prefixlen = 64 + r.prefixLen;
  std::memcpy(k.cg, &cg, 8);
  std::memcpy(k.addr, r.addr.data(), 16);
  return std::string(1, '6') + std::string(reinterpret_cast<char*>(&k), sizeof k);
}

}  // namespace

Result<uint64_t> EgressFilter::cgroupId(const std::string& dir) {
  // The cgroup id is the kernfs node id, which name_to_handle_at returns as
  // the 8-byte file handle of the directory.
  struct {
    struct file_handle fh;
    uint64_t id;
  } h{};
  h.fh.handle_bytes = sizeof(uint64_t);
  int mountId = 0;
  if (name_to_handle_at(AT_FDCWD, dir.c_str(), &h.fh, &mountId, 0) != 0) {
    return sysError("name_to_handle_at " + dir);
  }
  uint64_t id;
  std::memcpy(&id, h.fh.f_handle, sizeof id);
  return id;
}

Result<std::unique_ptr<EgressFilter>> EgressFilter::start(const std::string& cgroupDir) {
  static std::once_flag once;
  std::call_once(once, [] { libbpf_set_print(libbpfPrint); });
  std::unique_ptr<EgressFilter> f(new EgressFilter());
  f->dir_ = cgroupDir;
  int fd = ::open(cgroupDir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return sysError("open cgroup " + cgroupDir);
  f->cgFd_ = UniqueFd(fd);
  f->skel_ = egress_bpf::open_and_load();
  if (!f->skel_) {
    int err = errno;
    return Status(Code::kFailedPrecondition,
                  std::string("cannot load the eBPF egress filter: ") + strerror(err), err);
  }
  if (Status st = f->attachAll(); !st.isOk()) return st;
  return f;
}

Status EgressFilter::attachAll() {
  const std::pair<bpf_program*, bpf_attach_type> progs[] = {
      {skel_->progs.dsec_connect4, BPF_CGROUP_INET4_CONNECT},
      {skel_->progs.dsec_connect6, BPF_CGROUP_INET6_CONNECT},
      {skel_->progs.dsec_sendmsg4, BPF_CGROUP_UDP4_SENDMSG},
      {skel_->progs.dsec_sendmsg6, BPF_CGROUP_UDP6_SENDMSG},
      {skel_->progs.dsec_skb_egress, BPF_CGROUP_INET_EGRESS},
  };
  for (auto& [prog, type] : progs) {
    int pfd = bpf_program__fd(prog);
    if (bpf_prog_attach(pfd, cgFd_.get(), type, BPF_F_ALLOW_MULTI) != 0) {
      int err = errno;
      return Status(Code::kFailedPrecondition,
                    "cannot attach the eBPF egress filter to " + dir_ + ": " + strerror(err), err);
    }
    attached_.push_back({pfd, int(type)});
  }
  return Status::ok();
}

// Programs of an earlier run of this edge (it crashed, or was killed) stay
// attached and keep its sandboxes closed; ours are in place now, so drop them.
void EgressFilter::detachStale() {
  for (auto& [mine, type] : attached_) {
    bpf_prog_info myInfo{};
    uint32_t len = sizeof myInfo;
    if (bpf_obj_get_info_by_fd(mine, &myInfo, &len) != 0) continue;
    uint32_t ids[64];
    uint32_t cnt = 64, flags = 0;
    if (bpf_prog_query(cgFd_.get(), bpf_attach_type(type), 0, &flags, ids, &cnt) != 0) continue;
    for (uint32_t i = 0; i < cnt; ++i) {
      if (ids[i] == myInfo.id) continue;
      int pfd = bpf_prog_get_fd_by_id(ids[i]);
      if (pfd < 0) continue;
      bpf_prog_info info{};
      len = sizeof info;
      if (bpf_obj_get_info_by_fd(pfd, &info, &len) == 0 &&
          strncmp(info.name, kProgPrefix, strlen(kProgPrefix)) == 0) {
        if (bpf_prog_detach2(pfd, cgFd_.get(), bpf_attach_type(type)) == 0) {
          log::info("egress: detached a stale filter program (id " + std::to_string(ids[i]) +
                    ") from " + dir_);
        }
      }
      ::close(pfd);
    }
  }
}

EgressFilter::~EgressFilter() {
  for (auto& [pfd, type] : attached_) {
    (void)bpf_prog_detach2(pfd, cgFd_.get(), bpf_attach_type(type));
  }
  if (skel_) egress_bpf::destroy(skel_);
}

Status EgressFilter::addSandbox(uint64_t cg) {
  SandboxVal v{};
  if (bpf_map_update_elem(bpf_map__fd(skel_->maps.sandboxes), &cg, &v, BPF_ANY) != 0) {
    return sysError("egress filter: add sandbox");
  }
  return Status::ok();
}

Status EgressFilter::setRules(uint64_t cg, const std::vector<EgressRule>& rules) {
  std::lock_guard<std::mutex> lock(mu_);
  std::set<std::string> next;
  int fd4 = bpf_map__fd(skel_->maps.allow4), fd6 = bpf_map__fd(skel_->maps.allow6);
  for (auto& r : rules) {
    if (r.ports.empty() || r.ports.size() > proto::kMaxPortRanges) {
      return Status(Code::kInternal, "egress rule without a valid port list");
    }
    AllowVal v{};
    v.n = uint32_t(r.ports.size());
    for (size_t i = 0; i < r.ports.size(); ++i) {
      v.lo[i] = r.ports[i].lo;
      v.hi[i] = r.ports[i].hi;
    }
    std::string k = keyBytes(cg, r);
    int fd = k[0] == '4' ? fd4 : fd6;
    if (bpf_map_update_elem(fd, k.data() + 1, &v, BPF_ANY) != 0) {
      Status st = sysError("egress filter: add rule");
      // Roll back what this call added and was not there before.
      auto& old = keys_[cg];
      for (auto& added : next) {
        if (!old.count(added)) {
          (void)bpf_map_delete_elem(added[0] == '4' ? fd4 : fd6, added.data() + 1);
        }
      }
      return st;
    }
    next.insert(std::move(k));
  }
  auto& old = keys_[cg];
  for (auto& k : old) {
    if (!next.count(k)) (void)bpf_map_delete_elem(k[0] == '4' ? fd4 : fd6, k.data() + 1);
  }
  old = std::move(next);
  return Status::ok();
}

void EgressFilter::removeSandbox(uint64_t cg) {
  (void)setRules(cg, {});
  std::lock_guard<std::mutex> lock(mu_);
  keys_.erase(cg);
  (void)bpf_map_delete_elem(bpf_map__fd(skel_->maps.sandboxes), &cg);
}

Result<EgressDenials> EgressFilter::denials(uint64_t cg) const {
  SandboxVal v{};
  if (bpf_map_lookup_elem(bpf_map__fd(skel_->maps.sandboxes), &cg, &v) != 0) {
    return notFound("sandbox not in the egress filter");
  }
  EgressDenials d;
  d.count = v.denied;
  if (d.count > 0) {
    char buf[INET6_ADDRSTRLEN] = {};
    if (v.lastIp4 != 0 || (v.lastIp6[0] | v.lastIp6[1] | v.lastIp6[2] | v.lastIp6[3]) == 0) {
      inet_ntop(AF_INET, &v.lastIp4, buf, sizeof buf);
      d.last = std::string(buf) + ":" + std::to_string(v.lastPort);
    } else {
      inet_ntop(AF_INET6, v.lastIp6, buf, sizeof buf);
      d.last = "[" + std::string(buf) + "]:" + std::to_string(v.lastPort);
    }
  }
  return d;
}

}  // namespace dsec::edge::net
