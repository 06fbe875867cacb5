// The node daemon's core: owns the backends, the layer cache and the agent
// reactor, and the map of live sandboxes on this node. exec and file calls go
// through each sandbox's agent. Thread-safe: calls on different sandboxes run
// in parallel; a sandbox being destroyed fails its in-flight calls.
#pragma once

#include <condition_variable>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "common/metrics.h"
#include "common/status.h"
#include "edge/backend.h"
#include "edge/backends/microvm/microvm_backend.h"
#include "edge/backends/vm/vm_backend.h"
#include "edge/cgroup.h"
#include "edge/image/layer_cache.h"
#include "edge/loop_device.h"
#include "edge/net/egress_filter.h"
#include "edge/net/egress_net.h"
#include "edge/port_registry.h"
#include "edge/sandbox_state.h"
#include "edge/stats_history.h"
#include "edge/userns.h"
#include "image/layer_builder.h"
#include "proto/edge_link.h"

namespace dsec::edge {

class ContainerBackend;

struct EdgeOptions {
  std::string dataDir;     // node-local: <dataDir>/layers, <dataDir>/sandboxes
  std::string aetherPath;  // static dsec-aether
  LayerLookup lookup;   // layer digest -> what to fetch (from the platform)
  NodeCacheOptions cache;  // dir defaults to <dataDir>/cache
  std::string cgroupRoot = "/sys/fs/cgroup";
  // Cgroup subtree of this edge; empty: "dsec/e-<hash of dataDir>".
  std::string cgroupParent;
  // How each sandbox's writable layer is bounded by its disk_mb: "auto",
  // "btrfs", "tmpfs" or "none" (disk_quota.h); the btrfs pool image's size
  // where one is made (0: the free space of the data dir's filesystem).
  std::string diskQuota = "auto";
  int64_t diskPoolBytes = 0;
  // Sandbox egress (policies with an allow-list): the IPv4 subnet their veth
  // /30s come from, and whether the host masquerades them (edge/net/egress_net.h).
  std::string egressSubnet = "10.88.0.0/16";
  bool egressNat = true;
  // User namespaces for container sandboxes (edge/userns.h): "auto" (on where
  // the kernel supports it, detected at start) or "off". Each sandbox maps
  // ids 0..usernsWidth-1 to a range of host ids of its own, from the window
  // usernsFirst..usernsLast less the host's /etc/subuid and /etc/subgid
  // entries (edge/id_range_pool.h).
  std::string userns = "auto";
  uint32_t usernsFirst = kDefaultUsernsFirst;
  uint32_t usernsLast = kDefaultUsernsLast;
  uint32_t usernsWidth = kDefaultUsernsWidth;
  // Live restore (like Docker's live-restore): a graceful stop leaves the
  // sandboxes running, with what they need (mounts, loader process, egress
  // filter and path), for the next edge on this data dir to re-adopt. A crash
  // leaves them running either way.
  bool liveRestore = false;
  // fncall: languages exec'd per call besides python and bash, name -> argv
  // the code is appended to (say "node" -> {"node", "-e"}).
  std::map<std::string, std::vector<std::string>> fncallLanguages;
  // fncall: calls a python zygote forks before it is retired (the init
  // frame's fncall.zygote_max_calls); 0: aether's default (1024).
  int64_t fncallZygoteMaxCalls = 0;
  // The microvm backend (docs/microvm.md): guest kernel and initramfs
  // (empty: microvm-guest/ beside aetherPath), QEMU binary, boot deadline,
  // accelerator ("auto" probes KVM and falls back to TCG, "kvm", "tcg").
  std::string microvmGuestDir;
  std::string qemuPath = "qemu-system-x86_64";
  double microvmBootTimeoutS = 120;
  std::string microvmAccel = "auto";
  // The microvm agent channel: "auto" (vsock where /dev/vhost-vsock opens,
  // else virtio-serial), "vsock" or "virtio-serial".
  std::string microvmAgentChannel = "auto";
  // The vm backend (docs/vm.md): QEMU as above, qemu-img, the deadline for
  // qemu-guest-agent to answer after QEMU starts; the accelerator is
  // microvmAccel's choice.
  std::string qemuImgPath = "qemu-img";
  double vmBootTimeoutS = 300;
  // Where the node's own figures go (dsec_edge_loop_*): the edge adds its
  // collector at start and removes it when destroyed. Not owned; must
  // outlive the edge. Null: not exported.
  metrics::Registry* registry = nullptr;
  // Unbound loop devices kept for reuse (LoopPoolOptions::maxFree).
  size_t loopFreeMax = 16;
  // Every this often a thread reads each live sandbox's cgroup figures into
  // its ring of the last StatsHistory::kDefaultPoints readings (an hour at
  // the default): statsHistory(). 0: no sampling (one reading now only).
  double statsIntervalS = StatsHistory::kDefaultIntervalS;
};

// The node: every EdgeLink method is the one below; as a LocalNode it reports
// on itself to the platform of `dsec up`.
class Edge : public proto::EdgeLink, public proto::LocalNode {
 public:
  static Result<std::unique_ptr<Edge>> start(EdgeOptions opts);
  ~Edge();

  // Called (once, on another thread) when a sandbox dies on its own.
  void setDeathHandler(
      std::function<void(const std::string& id, const std::string& why)> h) override;

  Status create(BackendKind backend, const SandboxSpec& spec) override;
  // Idempotent: an unknown id is fine.
  Status destroy(const std::string& id) override;
  // The exec frame goes to the sandbox's agent; its stdout, stderr and exit
  // frames complete the call on the agent reactor's thread. The agent
  // enforces the exec's timeout; the edge's own guard (timeout + 30 s) only
  // catches a wedged agent (kDeadlineExceeded). cancel() sends the agent a
  // cancel frame (it SIGKILLs the process group and still reports the exit).
  std::shared_ptr<proto::ExecCall> startExec(const std::string& id, const ExecSpec& spec,
                                             proto::ExecCallbacks cb) override;

  Result<uint64_t> writeFile(const std::string& id, const std::string& path, int mode,
                             const ByteSource& src) override;
  // Calls onSize before the first byte with the file's size, so an HTTP
  // response can be started with a Content-Length; nullopt when the size is
  // not known up front (pseudo-files of /proc and /sys report 0).
  Status readFile(const std::string& id, const std::string& path,
                  const std::function<Status(std::optional<uint64_t> size)>& onSize,
                  const ByteSink& sink) override;
  // list/stat/mkdir/remove/policy/audit: the agent's JSON result.
  Result<std::string> agentOp(const std::string& id, proto::AgentOp op,
                              const std::string& json) override;

  Result<CgroupStats> stats(const std::string& id) override;
  // What the sampler recorded of the sandbox over the last windowS seconds
  // (EdgeOptions::statsIntervalS; a sandbox re-adopted at start has readings
  // from then on), then a reading now. The failed precondition of stats()
  // for a sandbox not on this node; stats()'s error when there is neither a
  // recorded reading nor one now.
  Result<proto::StatsSeries> statsHistory(const std::string& id, double windowS) override;
  // Freezes (no CPU used, memory kept) or thaws every process of a sandbox.
  // A paused sandbox is thawed before it is destroyed or snapshotted.
  Status pause(const std::string& id, bool paused) override;
  // Pauses a VM sandbox (microvm, vm) to disk: its whole state saved to a
  // file in its directory, its QEMU gone (docs/microvm.md, "Hibernate").
  // pause(id, false) restores it; a restore that fails destroys the sandbox
  // and reports its death. kFailedPrecondition (field "memory") for other
  // backends; on any error the sandbox runs (or stays paused) as before.
  Status hibernate(const std::string& id) override;
  // Changes a running sandbox's CPU, memory and pids limits.
  Status setLimits(const std::string& id, const CgroupLimits& limits) override;

  // Replaces the sandbox's egress allow-list; running processes' next
  // connect/sendmsg sees it. Empty: no egress (its own loopback only). The
  // first non-empty list gives the sandbox a veth (edge/net/egress_net.h); it
  // keeps it, closed by the filter, when the list empties again.
  // kFailedPrecondition when this node cannot filter egress (no cgroup v2
  // hierarchy, eBPF refused): then no sandbox here gets any.
  Status setEgress(const std::string& id, const std::vector<proto::EgressRule>& rules) override;
  // Connects and sends the egress filter refused so far, and the last target.
  Result<net::EgressDenials> egressDenials(const std::string& id) override;
  // Why egress is unavailable on this node, or empty when it is available.
  std::string egressUnavailable() const { return egressWhy_; }
  // Marks this edge's veth aliases ("dsec <tag> <id>") and names its
  // nftables table (dsec_<tag>).
  std::string egressTag() const;
  EgressNetConfig egressConfig() const;
  // EgressNet::removeLeftovers for this edge's tag: false when a sandbox in
  // `live` still has its link (the path must be started for it).
  bool removeEgressLeftovers(const std::set<std::string>& live);
  // Egress denials of every sandbox that has any (for metrics).
  std::map<std::string, uint64_t> egressDenialCounts();
  // Refused syscalls of every sandbox that has any, as its agent last said.
  std::map<std::string, uint64_t> syscallDenialCounts() const;
  // pack_diff: freezes the sandbox, builds an EROFS layer of its writes (its
  // overlay upper dir, whiteouts and opaque dirs included) under workDir,
  // thaws it. The sandbox keeps running.
  Result<image::BuiltLayer> packDiff(const std::string& id, const std::string& workDir) override;
  // Drops the node's mount of a layer no sandbox uses (before its blob goes).
  Status evictLayer(const std::string& digest) override { return layers_->evict(digest); }
  // Exposed ports (EdgeLink::openPort): backend container only; the socket is
  // made in the sandbox's netns (net/netns_socket.h) and recorded in ports_
  // under (port, gen) until its holder closes it, setPorts() drops the pair,
  // or the sandbox is destroyed (or paused to disk): then it is cut. The
  // holder must keep the descriptor at the number it was returned under
  // (edge/port_registry.h). Errors as EdgeLink's: kNotFound (no such
  // sandbox); kFailedPrecondition field "backend" (fncall; microvm and vm
  // not yet); kInvalidArgument / kPermissionDenied / kResourceExhausted
  // (4,096 open to one sandbox) field "port"; kUnavailable "nothing listens
  // on port P"; kDeadlineExceeded; the netns's open/setns errors.
  Result<UniqueFd> openPort(const std::string& id, int port, uint64_t gen,
                            double connectTimeoutS = 10) override;
  // Kept in memory only: after an edge restart a sandbox's set is unknown
  // (every gen is taken on trust) until the platform gives it again.
  // kInvalidArgument field "ports" for a port outside 1..65535; an unknown
  // sandbox is fine (nothing recorded).
  Status setPorts(const std::string& id, const std::vector<proto::PortGen>& ports) override;
  NodeCache& nodeCache() { return *cache_; }
  std::vector<std::string> sandboxIds() const override;
  // LocalNode: the cache, the loader, what the kernel offers, the counters.
  proto::NodeReport report() override;
  // Sandboxes this edge took over at start from an earlier one.
  std::vector<std::string> adoptedIds() const;
  // What start() found of earlier runs that no record owned, or whose
  // sandbox could not be re-adopted, and removed: by kind ("sandbox": its
  // processes, cgroups and directory; "veth": a host link of its egress).
  std::map<std::string, int> orphansRemoved() const;
  // Destroys every sandbox and unmounts every layer; with live restore,
  // leaves running sandboxes (and what they need) to the next edge.
  void shutdown();

  std::string describe() const;
  // fncall languages besides python and bash (EdgeOptions::fncallLanguages).
  const std::map<std::string, std::vector<std::string>>& fncallLanguages() const {
    return opts_.fncallLanguages;
  }
  // Whether sandboxes run in user namespaces, their range, and why (not) -
  // fixed at start.
  const Userns& userns() const { return userns_; }
  // Whether microvms run here, on which accelerator, and why - fixed at start.
  const MicroVmProbe& microvm() const { return microvm_; }
  // Whether full VMs (backend vm) run here, on which accelerator, and why.
  const VmProbe& vm() const { return vm_; }
  // Computer use on a sandbox with a display (backend vm): the screen as
  // PNG, and one input action. kFailedPrecondition for other backends.
  Result<std::string> screenshot(const std::string& id) override;
  Status input(const std::string& id, const InputAction& action) override;

 private:
  Edge() = default;
  std::shared_ptr<Instance> find(const std::string& id) const;
  // start(): takes over the sandboxes an earlier edge left (their states).
  void adoptAll(std::vector<SandboxState> live);
  // The callback a backend runs when a sandbox dies on its own.
  std::function<void()> deathHandlerFor(const std::string& id);
  // Rewrites a sandbox's state file after `change` (mu_ not held).
  void updateState(const std::string& id, const std::function<void(SandboxState&)>& change);
  void countOrphans(const std::string& kind, int n);
  // The sampler thread: one reading of every live sandbox into history_,
  // then every opts_.statsIntervalS until stopSampler().
  void sampleLoop();
  void sampleOnce();
  void stopSampler();
  // Starts egressNet_ if it is not yet (egressMu_ held).
  Status startEgressNetLocked();
  // Gives the sandbox `inst` its veth in its (VM process's) netns now, if
  // its recorded egress grants any, replacing one a previous netns had: a
  // VM restored from disk runs in a new netns (docs/microvm.md, "Pause to
  // disk").
  Status plumbEgress(const std::string& id, Instance& inst);

  EdgeOptions opts_;
  // The loop devices this edge makes (per-sandbox ext4 disks): before every
  // user of it, so it is destroyed after them. Its ledger is
  // <dataDir>/loop-devices.
  std::unique_ptr<LoopPool> loops_;
  uint64_t metricsId_ = 0;  // the collector in opts_.registry (0: none)
  std::unique_ptr<Cgroups> cgroups_;
  std::unique_ptr<NodeCache> cache_;
  std::unique_ptr<LayerCache> layers_;
  std::unique_ptr<Reactor> reactor_;
  std::map<BackendKind, std::unique_ptr<Backend>> backends_;
  std::string diskQuotaInfo_;  // the container backend's, set at start
  ContainerBackend* container_ = nullptr;  // backends_'s, for its id ranges
  Userns userns_;              // detected at start, then read-only
  MicroVmProbe microvm_;       // probed at start, then read-only
  VmProbe vm_;                 // probed at start, then read-only
  std::unique_ptr<net::EgressFilter> filter_;  // null when egressWhy_ says why
  std::string egressWhy_;

  PortRegistry ports_;  // exposed sets and open connections (its own lock)
  StatsHistory history_;  // the sandboxes' resource readings (its own lock)

  std::mutex samplerMu_;  // guards samplerStop_
  std::condition_variable samplerCv_;
  bool samplerStop_ = false;
  std::thread sampler_;  // sampleLoop(), while statsIntervalS > 0

  std::mutex egressMu_;  // guards egressNet_, veths_
  std::unique_ptr<EgressNet> egressNet_;  // started with the first veth
  std::set<std::string> veths_;           // sandboxes that have one

  mutable std::mutex mu_;  // guards sandboxes_, backendOf_, egressCg_, paused_, onDeath_
  // Set by shutdown(): creates are refused, and one in flight is undone when
  // its backend returns; creatingCv_ tells shutdown() when the last has.
  bool stopping_ = false;
  std::condition_variable creatingCv_;
  std::map<std::string, std::shared_ptr<Instance>> sandboxes_;
  std::map<std::string, Backend*> backendOf_;
  std::map<std::string, uint64_t> egressCg_;  // sandbox -> cgroup id in the filter
  std::set<std::string> paused_;
  std::function<void(const std::string&, const std::string&)> onDeath_;
  std::map<std::string, SandboxState> states_;  // what stateDir_ holds, per sandbox
  std::set<std::string> adopted_;               // taken over at start, still here
  std::map<std::string, int> orphans_;          // set in start(), read-only after

  std::unique_ptr<SandboxStateDir> stateDir_;
  bool staleLoaderHeld_ = false;  // an earlier edge's loader process serves adopted_
};

}  // namespace dsec::edge
