// EgressNet: the host side of one edge's sandbox egress. Each egress sandbox
// gets a veth pair, "dv<12 hex>" on the host and "eth0" in its netns, on a /30
// of the edge's subnet (host .1, sandbox .2), with a default route via the
// host side. An nftables table `inet dsec_<tag>` masquerades the subnet out of
// the host (optional), keeps sandboxes off the host itself (input: anything
// that arrives on a dv* link, IPv6 link-local included, is dropped, so no host
// service is reachable, not even one on 0.0.0.0 or ::), and keeps them off
// each other and from posing as anyone else (forward: no dv* to dv*, and a
// strict reverse-path check on what a dv* link sends). Sandboxes get IPv4
// egress only. A host firewall whose forward policy is drop (Docker's
// iptables FORWARD chain) still drops their traffic: that is its call.
//
// start() sets net.ipv4.ip_forward to 1 and leaves it so at stop(): another
// edge or service may depend on it by then (Docker does the same);
// enabledIpForward() says whether this start turned it on.
//
// Everything runs in the netns of the thread that calls start(): the netlink
// socket is opened there, and nft runs from the thread that calls start() or
// stop(), so call those from the host netns.
//
// Thread-safe: attach, detach, forget and cleanupOrphans may run concurrently,
// as long as calls for one sandbox id do not overlap.
#pragma once

#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "common/status.h"
#include "edge/net/rtnl.h"

namespace dsec::edge {

struct EgressNetConfig {
  // IPv4 network the /30s come from: a /8 to /24 with no host bits set.
  std::string subnet = "10.88.0.0/16";
  // Short and unique to this edge: 1-32 of [A-Za-z0-9_-]. Names the nftables
  // table (dsec_<tag>) and marks the links' aliases ("dsec <tag> <sandbox>"),
  // so two edges on one host never touch each other's.
  std::string tag;
  bool enableNat = true;
  // A seam for tests.
  std::string nftPath = "/usr/sbin/nft";
};

struct Attachment {
  uint32_t address = 0;  // sandbox side (eth0), network byte order
  uint32_t gateway = 0;  // host side, network byte order
  int prefixLen = 30;
  std::string hostIfname;
};

// "10.88.0.2" from a network-order address.
std::string ipv4String(uint32_t addr);

class EgressNet {
 public:
  // Validates `config`: kInvalidArgument with field "egress_subnet" or
  // "egress_tag". kFailedPrecondition when config.nftPath is not executable.
  // Then turns on ip_forward and installs the nftables table (replacing one a
  // previous run of the same tag left, in the same transaction). Errors of the
  // sysctl write and of nft (its stderr in the message) as they come.
  static Result<std::unique_ptr<EgressNet>> start(const EgressNetConfig& config);
  // What a run of the same tag that died with egress set up left, when the
  // edge starting now has no use for it: its host links (aliases "dsec <tag>
  // <id>") and its nftables table. Does nothing (returns false) if one of
  // those links belongs to a sandbox in `liveSandboxIds`: the caller then
  // start()s, which replaces the table and keeps that link. True when
  // nothing of the tag is left (or there was nothing to remove); errors are
  // logged, and a host without nft or netlink has nothing to remove.
  static bool removeLeftovers(const EgressNetConfig& config,
                              const std::set<std::string>& liveSandboxIds);
  // stop(), errors ignored.
  ~EgressNet();
  EgressNet(const EgressNet&) = delete;
  EgressNet& operator=(const EgressNet&) = delete;

  // Gives the sandbox whose netns is `netnsFd` (not owned) an eth0 with an
  // address, up, and a default route; the netns's lo is left alone. Needs a
  // free /30 (kResourceExhausted when none) and no attachment for the id yet
  // (kAlreadyExists). kInvalidArgument (field "sandbox_id") for an empty id,
  // one with a space or control character, or one over 128 bytes. On failure nothing is left: the
  // host link is deleted (with its peer) and the /30 freed. Netlink errors
  // name the step and the link.
  Result<Attachment> attach(const std::string& sandboxId, int netnsFd);
  // Deletes the host link (its peer goes with it; some 15-30 ms, mostly the
  // kernel's synchronize_net) and frees the /30. An unknown id or missing link is ok. If the
  // delete fails, the /30 stays out of use until its link is seen gone.
  Status detach(const std::string& sandboxId);
  // For a sandbox whose netns is about to be destroyed: the kernel deletes
  // the pair with the netns, at no cost to the caller. The /30 is reused only
  // once the link is gone (checked at allocation).
  void forget(const std::string& sandboxId);
  // Deletes host links whose alias is "dsec <tag> <id>" for an id not in
  // `liveSandboxIds` (left by a crashed run, or attached and never detached),
  // freeing their /30 if this run handed it out. Returns how many it deleted.
  // Call it before the first attach() of a restarted edge, so that no new
  // sandbox gets the /30 an orphan still holds.
  int cleanupOrphans(const std::set<std::string>& liveSandboxIds);
  // Deletes the nftables table (a missing one is ok). Idempotent. Leaves
  // ip_forward and the links as they are.
  Status stop();
  // Live restore: leaves the table (and the links) for the next edge, whose
  // start() replaces the table in one transaction; stop() then does nothing.
  void keepForNextEdge() {
    std::lock_guard lock(mu_);
    stopped_ = true;
  }
  // Whether the host link of the sandbox exists (one a re-adopted sandbox
  // kept from the edge before).
  bool hasLink(const std::string& sandboxId) { return !linkGone(ifnameFor(sandboxId)); }

  // Whether start() found ip_forward at 0 and set it to 1.
  bool enabledIpForward() const { return enabledIpForward_; }
  const std::string& tableName() const { return table_; }
  // "dv" + 12 hex digits of SHA-256(tag "/" sandboxId): 14 characters, below
  // IFNAMSIZ, the same for the same edge and sandbox across restarts.
  std::string ifnameFor(const std::string& sandboxId) const;
  // The nftables ruleset start() loads (for tests and debugging).
  std::string ruleset() const;

 private:
  EgressNet(EgressNetConfig config, Rtnl host)
      : config_(std::move(config)), host_(std::move(host)) {}
  // Runs config_.nftPath with `args` and `input` on its stdin; kInternal with
  // nft's output when it fails.
  Status runNft(const std::vector<std::string>& args, const std::string& input) const;
  // The netlink steps of attach(); sets *created once the veth exists.
  Status plumb(const std::string& sandboxId, const Attachment& a, int netnsFd, bool* created);
  // Index of a /30 no link holds: a freed one, else the oldest forgotten one if
  // its link is gone, else a never-used one, else any forgotten one whose link
  // is gone; kResourceExhausted when none. Needs mu_ held; takes rtnlMu_.
  Result<uint32_t> allocateLocked();
  // Whether no link `ifname` exists (lookup errors count as "still there").
  bool linkGone(const std::string& ifname);
  // Needs mu_ held: puts `slot` back, free at once when its link is gone, else
  // pending until it is.
  void releaseLocked(uint32_t slot, const std::string& ifname, bool linkGone);
  // Network-order address `offset` into the /30 `slot` (1: host, 2: sandbox).
  uint32_t slotAddress(uint32_t slot, uint32_t offset) const;

  const EgressNetConfig config_;
  std::string subnet_;    // canonical CIDR ("10.88.0.0/16")
  uint32_t network_ = 0;  // host byte order
  uint32_t slots_ = 0;    // number of /30s in the subnet
  std::string table_;
  bool enabledIpForward_ = false;

  std::mutex rtnlMu_;  // guards host_: one request at a time
  Rtnl host_;          // in the netns start() ran in

  std::mutex mu_;  // guards everything below
  bool stopped_ = false;
  std::map<std::string, uint32_t> attached_;  // sandbox id -> slot
  std::set<uint32_t> free_;                   // released, reusable now
  uint32_t nextFresh_ = 0;                    // slots at and above were never used
  // Forgotten (or failed to delete) slots and the link that may still hold
  // them, oldest first.
  std::deque<std::pair<uint32_t, std::string>> pending_;
};

}  // namespace dsec::edge
