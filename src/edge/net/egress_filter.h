// The edge's eBPF egress filter (egress.bpf.c): cgroup connect4/6 and
// sendmsg4/6 programs, and a cgroup_skb/egress program for the packets of
// connections opened earlier, attached once, with BPF_F_ALLOW_MULTI, to the
// edge's cgroup v2 parent group, so they cover every sandbox process. A sandbox is
// an entry keyed by its own cgroup id; its allow-list is a set of LPM-trie
// entries. Anything not allowed fails with EPERM (connect) or is dropped with
// EPERM (sendmsg), and is counted per sandbox.
//
// Closed by default: a process in a group under the parent that is not (yet)
// a known sandbox, or a sandbox with no rules, reaches only its own loopback.
// The programs are attached with BPF_PROG_ATTACH, which outlives this process:
// after a crash the sandboxes stay filtered by the last rules they had (never
// opened up); the next start() detaches such leftovers once its own programs
// are in place. Thread-safe.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "common/fd.h"
#include "common/status.h"
#include "proto/egress.h"

struct egress_bpf;

namespace dsec::edge::net {

using proto::EgressDenials;
using proto::EgressRule;
using proto::PortRange;


class EgressFilter {
 public:
  // Loads the programs and attaches them to `cgroupDir` (a cgroup v2 dir).
  // kFailedPrecondition when the kernel refuses (no BPF, no cgroup v2, not
  // privileged), with the kernel's reason. Programs an earlier run left
  // attached stay until detachStale().
  static Result<std::unique_ptr<EgressFilter>> start(const std::string& cgroupDir);
  // Detaches the programs (unless keepAttachedForNextEdge).
  ~EgressFilter();
  // Detaches the programs an earlier run of this edge left attached (it
  // crashed, or stopped with live restore): they keep its sandboxes to their
  // rules (and unknown groups closed) until this filter knows the sandboxes
  // re-adopted, so call it after their addSandbox/setRules.
  void detachStale();
  // Live restore: leaves the programs attached, with their maps, so the
  // sandboxes that outlive this edge keep their egress until the next edge's
  // filter takes over.
  void keepAttachedForNextEdge() { attached_.clear(); }

  // The cgroup id of a cgroup v2 directory (what bpf_get_current_cgroup_id gives).
  static Result<uint64_t> cgroupId(const std::string& dir);

  // Makes the group a known sandbox with no rules (loopback only).
  Status addSandbox(uint64_t cg);
  // Replaces the sandbox's allow-list. New entries are in place before old
  // ones go, so a connect racing with the switch sees the old or the new
  // rules, never none; a process's next connect sees the new ones.
  Status setRules(uint64_t cg, const std::vector<EgressRule>& rules);
  // Forgets the sandbox and its rules (its group is going away).
  void removeSandbox(uint64_t cg);
  Result<EgressDenials> denials(uint64_t cg) const;

 private:
  EgressFilter() = default;
  Status attachAll();

  std::string dir_;
  UniqueFd cgFd_;
  egress_bpf* skel_ = nullptr;
  std::vector<std::pair<int, int>> attached_;  // (prog fd, attach type)

  mutable std::mutex mu_;  // guards keys_
  // Per sandbox the LPM keys it has now (raw key bytes; family in the first byte of the tag).
  std::map<uint64_t, std::set<std::string>> keys_;
};

}  // namespace dsec::edge::net
