#include "edge/net/egress_net.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <spawn.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cstring>

#include "common/fd.h"
#include "common/log.h"
#include "common/sha256.h"
#include "common/util.h"

namespace dsec::edge {
namespace {

constexpr const char* kIpForward = "/proc/sys/net/ipv4/ip_forward";
constexpr const char* kPeerName = "eth0";
constexpr int kSlotPrefix = 30;
constexpr size_t kMaxSandboxId = 128;
constexpr size_t kMaxTag = 32;

struct Subnet {
  uint32_t network = 0;  // host byte order
  int prefixLen = 0;
};

Result<Subnet> parseSubnet(const std::string& cidr) {
  auto bad = [&](const std::string& why) {
    return invalidArg("egress_subnet", "egress subnet \"" + cidr + "\": " + why);
  };
  size_t slash = cidr.find('/');
  if (slash == std::string::npos) return bad("not in CIDR form (like 10.88.0.0/16)");
  in_addr a{};
  if (::inet_pton(AF_INET, cidr.substr(0, slash).c_str(), &a) != 1) {
    return bad("not an IPv4 address");
  }
  const char* first = cidr.data() + slash + 1;
  const char* last = cidr.data() + cidr.size();
  int prefix = -1;
  auto [end, ec] = std::from_chars(first, last, prefix);
  if (first == last || ec != std::errc() || end != last) return bad("bad prefix length");
  if (prefix < 8 || prefix > 24) return bad("prefix length must be 8 to 24");
  uint32_t network = ntohl(a.s_addr);
  if (network & (0xffffffffu >> prefix)) return bad("host bits are set");
  return Subnet{network, prefix};
}

Status checkTag(const std::string& tag) {
  bool ok = !tag.empty() && tag.size() <= kMaxTag;
  for (char c : tag)
    ok = ok && (std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_');
  if (!ok)
    return invalidArg("egress_tag", "egress tag \"" + tag + "\": want 1-32 of [A-Za-z0-9_-]");
  return Status::ok();
}

Status checkSandboxId(const std::string& id) {
  // The id ends the link alias "dsec <tag> <id>", which cleanupOrphans() parses.
  bool ok = !id.empty() && id.size() <= kMaxSandboxId;
  for (char c : id) ok = ok && std::isgraph(static_cast<unsigned char>(c));
  if (!ok) return invalidArg("sandbox_id", "sandbox id \"" + id + "\": want 1-128 printable bytes");
  return Status::ok();
}

std::string trimmed(std::string s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.pop_back();
  return s;
}

Status writeAll(int fd, const std::string& data) {
  size_t off = 0;
  while (off < data.size()) {
    ssize_t n = ::write(fd, data.data() + off, data.size() - off);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return sysError("write");
    off += size_t(n);
  }
  return Status::ok();
}

}  // namespace

std::string ipv4String(uint32_t addr) {
  char buf[INET_ADDRSTRLEN];
  in_addr a{addr};
  return ::inet_ntop(AF_INET, &a, buf, sizeof buf) ? buf : "?";
}

Result<std::unique_ptr<EgressNet>> EgressNet::start(const EgressNetConfig& config) {
  ASSIGN_OR_RETURN(Subnet subnet, parseSubnet(config.subnet));
  RETURN_IF_ERROR(checkTag(config.tag));
  if (::access(config.nftPath.c_str(), X_OK) != 0) {
    return Status(Code::kFailedPrecondition,
                  "nftables (nft) is needed for egress: " + config.nftPath + ": " + strerror(errno),
                  errno);
  }
  ASSIGN_OR_RETURN(Rtnl host, Rtnl::open());
  std::unique_ptr<EgressNet> net(new EgressNet(config, std::move(host)));
  net->subnet_ = ipv4String(htonl(subnet.network)) + "/" + std::to_string(subnet.prefixLen);
  net->network_ = subnet.network;
  net->slots_ = 1u << (kSlotPrefix - subnet.prefixLen);
  net->table_ = "dsec_" + config.tag;
  net->stopped_ = true;  // nothing to remove until the table is in

  ASSIGN_OR_RETURN(std::string forward, readFile(kIpForward));
  if (trimmed(forward) != "1") {
    RETURN_IF_ERROR(writeKnob(kIpForward, "1"));
    net->enabledIpForward_ = true;
  }
  RETURN_IF_ERROR(net->runNft({"-f", "-"}, net->ruleset()));
  net->stopped_ = false;
  return net;
}

bool EgressNet::removeLeftovers(const EgressNetConfig& config,
                                const std::set<std::string>& liveSandboxIds) {
  if (!checkTag(config.tag).isOk() || ::access(config.nftPath.c_str(), X_OK) != 0) return true;
  auto host = Rtnl::open();
  if (!host.isOk()) return true;
  std::unique_ptr<EgressNet> net(new EgressNet(config, std::move(*host)));
  net->table_ = "dsec_" + config.tag;
  const std::string prefix = "dsec " + config.tag + " ";
  if (auto links = net->host_.listLinks(); links.isOk()) {
    for (const Link& link : *links) {
      if (startsWith(link.alias, prefix) &&
          liveSandboxIds.count(link.alias.substr(prefix.size()))) {
        net->stopped_ = true;  // the table stays for start()
        return false;
      }
    }
  }
  if (int n = net->cleanupOrphans(liveSandboxIds); n > 0) {
    log::info("egress: removed " + std::to_string(n) + " links an earlier run left");
  }
  // Declare-then-delete in stop(): nothing to do when there is no table.
  if (Status st = net->stop(); !st.isOk()) log::warn("egress: leftover table: " + st.toString());
  return true;
}

EgressNet::~EgressNet() {
  Status st = stop();
  if (!st.isOk()) log::warn("egress: " + st.toString());
}

std::string EgressNet::ruleset() const {
  const std::string& s = subnet_;
  // "dv*" is every edge's sandbox side, not only this one's: sandboxes of two
  // edges on one host must not reach each other either.
  std::string r;
  // Declaring then deleting the table makes the load replace a table a crashed
  // run left, all in one transaction.
  r += "table inet " + table_ + " {}\n";
  r += "delete table inet " + table_ + "\n";
  r += "table inet " + table_ + " {\n";
  if (config_.enableNat) {
    r += "  chain postrouting {\n";
    r += "    type nat hook postrouting priority srcnat; policy accept;\n";
    r += "    ip saddr " + s + " oifname != \"dv*\" masquerade\n";
    r += "  }\n";
  }
  // Sandboxes never reach the host itself, whatever the address (the gateway,
  // any host address, a broadcast) or listener (one on 0.0.0.0 or ::). By
  // interface first: that also covers IPv6 (link-local addresses are on every
  // veth) and sources a sandbox root may have put on its eth0.
  r += "  chain input {\n";
  r += "    type filter hook input priority filter; policy accept;\n";
  r += "    iifname \"dv*\" drop\n";
  r += "    ip saddr " + s + " drop\n";
  r += "  }\n";
  // Sandboxes don't reach each other; and what a sandbox forwards must come
  // from the address its own veth routes to (strict reverse-path check), so
  // it cannot pose as another sandbox or leave un-NATed as anything else.
  r += "  chain forward {\n";
  r += "    type filter hook forward priority filter; policy accept;\n";
  r += "    iifname \"dv*\" oifname \"dv*\" drop\n";
  r += "    iifname \"dv*\" fib saddr . iif oif missing drop\n";
  r += "  }\n";
  r += "}\n";
  return r;
}

Status EgressNet::runNft(const std::vector<std::string>& args, const std::string& input) const {
  std::string cmd = config_.nftPath;
  for (const auto& a : args) cmd += " " + a;
  // memfds rather than pipes: nothing can block, and no SIGPIPE if nft exits
  // before reading. nft opens /dev/stdin anew, which reads from offset 0.
  UniqueFd in(::memfd_create("dsec-nft-in", MFD_CLOEXEC));
  UniqueFd out(::memfd_create("dsec-nft-out", MFD_CLOEXEC));
  if (!in || !out) return sysError("memfd_create for " + cmd);
  RETURN_IF_ERROR(writeAll(in.get(), input));
  if (::lseek(in.get(), 0, SEEK_SET) != 0) return sysError("lseek");

  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_adddup2(&fa, in.get(), 0);
  posix_spawn_file_actions_adddup2(&fa, out.get(), 1);
  posix_spawn_file_actions_adddup2(&fa, out.get(), 2);
  std::vector<std::string> copy{config_.nftPath};
  copy.insert(copy.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (auto& a : copy) argv.push_back(a.data());
  argv.push_back(nullptr);
  pid_t pid;
  int rc = ::posix_spawn(&pid, config_.nftPath.c_str(), &fa, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&fa);
  if (rc != 0) return sysError("spawn " + cmd, rc);
  int wstatus = 0;
  while (::waitpid(pid, &wstatus, 0) < 0) {
    if (errno != EINTR) return sysError("waitpid " + cmd);
  }
  if (WIFEXITED(wstatus) && WEXITSTATUS(wstatus) == 0) return Status::ok();

  char buf[2048];
  ssize_t n = ::pread(out.get(), buf, sizeof buf, 0);
  std::string output = trimmed(std::string(buf, size_t(n > 0 ? n : 0)));
  std::string how = WIFEXITED(wstatus) ? "exit " + std::to_string(WEXITSTATUS(wstatus))
                                       : "signal " + std::to_string(WTERMSIG(wstatus));
  return internalError(cmd + ": " + how + (output.empty() ? "" : ": " + output));
}

std::string EgressNet::ifnameFor(const std::string& sandboxId) const {
  return "dv" + sha256Hex(config_.tag + "/" + sandboxId).substr(0, 12);
}

uint32_t EgressNet::slotAddress(uint32_t slot, uint32_t offset) const {
  return htonl(network_ + slot * 4 + offset);
}

bool EgressNet::linkGone(const std::string& ifname) {
  std::lock_guard lock(rtnlMu_);
  Result<int> index = host_.ifindex(ifname);
  return !index.isOk() && index.status().code() == Code::kNotFound;
}

Result<uint32_t> EgressNet::allocateLocked() {
  if (!free_.empty()) return free_.extract(free_.begin()).value();
  // Netns teardown is roughly first in, first out: if the oldest forgotten
  // link is not gone yet, the later ones will not be either.
  if (!pending_.empty() && linkGone(pending_.front().second)) {
    uint32_t slot = pending_.front().first;
    pending_.pop_front();
    return slot;
  }
  if (nextFresh_ < slots_) return nextFresh_++;
  for (auto it = pending_.begin(); it != pending_.end(); ++it) {
    if (linkGone(it->second)) {
      uint32_t slot = it->first;
      pending_.erase(it);
      return slot;
    }
  }
  return Status(Code::kResourceExhausted, "egress subnet " + subnet_ + " has no free /30 (" +
                                              std::to_string(attached_.size()) + " attached, " +
                                              std::to_string(pending_.size()) +
                                              " waiting for their link to go)");
}

void EgressNet::releaseLocked(uint32_t slot, const std::string& ifname, bool linkGone) {
  if (linkGone) {
    free_.insert(slot);
  } else {
    pending_.emplace_back(slot, ifname);
  }
}

Status EgressNet::plumb(const std::string& sandboxId, const Attachment& a, int netnsFd,
                        bool* created) {
  {
    std::lock_guard lock(rtnlMu_);
    RETURN_IF_ERROR(host_.createVeth(a.hostIfname, kPeerName, netnsFd));
    *created = true;
    RETURN_IF_ERROR(host_.setAlias(a.hostIfname, "dsec " + config_.tag + " " + sandboxId));
    RETURN_IF_ERROR(host_.addAddress4(a.hostIfname, a.gateway, a.prefixLen));
    RETURN_IF_ERROR(host_.setUp(a.hostIfname));
  }
  ASSIGN_OR_RETURN(Rtnl sandbox, Rtnl::open(netnsFd));
  RETURN_IF_ERROR(sandbox.addAddress4(kPeerName, a.address, a.prefixLen));
  RETURN_IF_ERROR(sandbox.setUp(kPeerName));
  // After setUp: the gateway must be reachable through a link that is up.
  RETURN_IF_ERROR(sandbox.addDefaultRoute4(a.gateway));
  return Status::ok();
}

Result<Attachment> EgressNet::attach(const std::string& sandboxId, int netnsFd) {
  RETURN_IF_ERROR(checkSandboxId(sandboxId));
  Attachment a;
  a.hostIfname = ifnameFor(sandboxId);
  a.prefixLen = kSlotPrefix;
  uint32_t slot = 0;
  {
    std::lock_guard lock(mu_);
    if (stopped_) return Status(Code::kFailedPrecondition, "egress network is stopped");
    if (attached_.count(sandboxId)) {
      return Status(Code::kAlreadyExists,
                    "sandbox " + sandboxId + " already has egress (" + a.hostIfname + ")");
    }
    // A /30 whose host address some link already has (another edge on this
    // host, or the leftovers of one that crashed, on the same subnet) would
    // route the sandbox's traffic into the wrong veth: skip those.
    std::vector<uint32_t> inUse;
    {
      std::lock_guard rl(rtnlMu_);
      ASSIGN_OR_RETURN(inUse, host_.listAddresses4());
    }
    std::vector<uint32_t> skipped;
    Status err;
    for (;;) {
      auto s = allocateLocked();
      if (!s.isOk()) {
        err = s.status();
        break;
      }
      if (std::find(inUse.begin(), inUse.end(), slotAddress(*s, 1)) == inUse.end()) {
        slot = *s;
        break;
      }
      skipped.push_back(*s);
    }
    // Back to the pool: whoever holds them now may let go later.
    for (uint32_t x : skipped) free_.insert(x);
    if (!err.isOk()) return err;
    attached_[sandboxId] = slot;
  }
  a.gateway = slotAddress(slot, 1);
  a.address = slotAddress(slot, 2);

  bool created = false;
  Status st = plumb(sandboxId, a, netnsFd, &created);
  if (st.isOk()) return a;
  bool gone = true;  // a veth we did not create holds no address of this slot
  if (created) {
    std::lock_guard lock(rtnlMu_);
    Status del = host_.deleteLink(a.hostIfname);
    if (!del.isOk()) log::warn("egress: undo of attach: " + del.toString());
    gone = del.isOk();
  }
  std::lock_guard lock(mu_);
  attached_.erase(sandboxId);
  releaseLocked(slot, a.hostIfname, gone);
  return st.withContext("egress for sandbox " + sandboxId);
}

Status EgressNet::detach(const std::string& sandboxId) {
  RETURN_IF_ERROR(checkSandboxId(sandboxId));
  const std::string ifname = ifnameFor(sandboxId);
  Status st;
  {
    std::lock_guard lock(rtnlMu_);
    st = host_.deleteLink(ifname);
  }
  std::lock_guard lock(mu_);
  auto it = attached_.find(sandboxId);
  if (it != attached_.end()) {
    releaseLocked(it->second, ifname, st.isOk());
    attached_.erase(it);
  }
  return st;
}

void EgressNet::forget(const std::string& sandboxId) {
  std::lock_guard lock(mu_);
  auto it = attached_.find(sandboxId);
  if (it == attached_.end()) return;
  releaseLocked(it->second, ifnameFor(sandboxId), false);
  attached_.erase(it);
}

int EgressNet::cleanupOrphans(const std::set<std::string>& liveSandboxIds) {
  const std::string prefix = "dsec " + config_.tag + " ";
  Result<std::vector<Link>> links = [&] {
    std::lock_guard lock(rtnlMu_);
    return host_.listLinks();
  }();
  if (!links.isOk()) {
    log::warn("egress: orphan cleanup: " + links.status().toString());
    return 0;
  }
  int deleted = 0;
  for (const Link& link : *links) {
    if (!startsWith(link.alias, prefix)) continue;
    std::string id = link.alias.substr(prefix.size());
    if (liveSandboxIds.count(id)) continue;
    Status st;
    {
      std::lock_guard lock(rtnlMu_);
      st = host_.deleteLink(link.name);
    }
    if (!st.isOk()) {
      log::warn("egress: orphan cleanup: " + st.toString());
      continue;
    }
    ++deleted;
    std::lock_guard lock(mu_);
    auto it = attached_.find(id);
    if (it != attached_.end() && ifnameFor(id) == link.name) {
      free_.insert(it->second);
      attached_.erase(it);
    }
  }
  return deleted;
}

Status EgressNet::stop() {
  {
    std::lock_guard lock(mu_);
    if (stopped_) return Status::ok();
  }
  // Declare-then-delete: no error when someone removed the table already.
  RETURN_IF_ERROR(
      runNft({"-f", "-"}, "table inet " + table_ + " {}\ndelete table inet " + table_ + "\n"));
  std::lock_guard lock(mu_);
  stopped_ = true;
  return Status::ok();
}

}  // namespace dsec::edge
