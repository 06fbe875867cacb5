// What the platform and the edges say to each other, as plain data: sandbox
// specs, exec and limits types, layer descriptors, node reports, egress rules.
// Both sides include this; neither side's code is needed to use it. The
// codecs that put these on the wire are in proto/codec.h, the interface
// through which the platform drives a node in proto/edge_link.h.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace dsec::proto {

// ----- kinds and states --------------------------------------------------------

// A sandbox's backend (DESIGN.md section 3).
enum class BackendKind : uint8_t { kFncall, kContainer, kMicrovm, kVm };
inline constexpr BackendKind kAllBackends[] = {BackendKind::kFncall, BackendKind::kContainer,
                                               BackendKind::kMicrovm, BackendKind::kVm};
// "fncall", "container", "microvm", "vm".
const char* backendName(BackendKind b);
// nullopt for any other name.
std::optional<BackendKind> parseBackend(std::string_view name);
// Whether the backend runs a guest kernel under QEMU (microvm, vm).
inline bool isVm(BackendKind b) { return b == BackendKind::kMicrovm || b == BackendKind::kVm; }

// A sandbox's life (DESIGN.md section 3): pending (a batch's, not yet being
// created) -> creating -> running <-> paused -> stopping -> stopped | failed;
// lost while its node is down (it may come back).
enum class SandboxState : uint8_t {
  kPending,
  kCreating,
  kRunning,
  kPaused,
  kLost,
  kStopping,
  kStopped,
  kFailed,
};
inline constexpr SandboxState kAllStates[] = {
    SandboxState::kPending,  SandboxState::kCreating, SandboxState::kRunning,
    SandboxState::kPaused,   SandboxState::kLost,     SandboxState::kStopping,
    SandboxState::kStopped,  SandboxState::kFailed};
// "pending", "creating", "running", ... as the API and the store spell them.
const char* stateName(SandboxState s);
std::optional<SandboxState> parseState(std::string_view name);
// stopped or failed: nothing of the sandbox runs and nothing will.
inline bool isFinal(SandboxState s) {
  return s == SandboxState::kStopped || s == SandboxState::kFailed;
}
// running or paused: it exists on its node and takes calls (a paused one is
// resumed by them).
inline bool isUp(SandboxState s) {
  return s == SandboxState::kRunning || s == SandboxState::kPaused;
}

// ----- sandboxes ---------------------------------------------------------------

struct SandboxSpec {
  std::string id;                   // "sb-<16 hex>", also the hostname
  std::vector<std::string> layers;  // "sha256:<hex>", bottom layer first
  double cpu = 1.0;                 // cores
  // Cores the backend's own processes in the sandbox need on top of `cpu`,
  // added to the cgroup's CPU quota (at create and at every later limit
  // change) as the QEMU overhead is to a VM's memory; not part of `cpu` for
  // admission or placement. fncall: its zygote, spares and clean-up. Set by
  // the node's backend, not sent.
  double cpuOverhead = 0;
  int64_t memoryBytes = 512ll << 20;
  int64_t diskBytes = 1ll << 30;
  // Whether the create asked for diskBytes (disk_mb) rather than taking the
  // default. Backend vm: a disk image larger than the default gets its own
  // size, while one larger than what was asked for is refused (field
  // disk_mb).
  bool diskExplicit = false;
  int64_t pids = 1024;
  // fncall sandboxes: the init frame's "fncall" object (docs/agent-protocol.md,
  // fncallInitJson), set by the platform's Cluster; empty for a container
  // sandbox (and a fncall one: the node's own).
  std::string fncallInit;
  // The first phase's policy: a policy frame's body (docs/agent-protocol.md),
  // or empty for none. Backends that take an init policy hand it to the agent
  // with init; for the others the edge sends it as a policy frame.
  std::string initPolicy;
  // Made (mkdir -p, root's, 0755) before the policy applies, as Docker makes
  // an image's WorkingDir that the image lacks; empty for none.
  std::string workingDir;
  // Backends microvm and vm: give the guest a NIC (QEMU user-mode networking
  // inside QEMU's own netns, so that the edge's veth, nftables and eBPF filter
  // govern its traffic as a container's). Set when the first phase's policy
  // grants egress; without it the guest has no network device at all, and a
  // later grant is refused. Containers always have a netns to plumb into.
  bool network = false;
  // Placement hints for the platform's scheduler (platform/scheduler.h); the
  // nodes ignore them and they are not sent.
  std::string pool = "default";
  std::string tenant;
  bool spread = true;
  bool burstable = false;  // may go to the burst pool when its pool is busy
};

// A terminal's window in character cells (each 1..65535).
struct TermSize {
  uint16_t rows = 24;
  uint16_t cols = 80;
};

struct ExecSpec {
  std::vector<std::string> argv;
  std::vector<std::string> env;  // "K=V", the whole environment
  std::string cwd;               // empty: agent default
  std::string user;              // empty: root
  int64_t timeoutMs = 60000;     // 0 = none
  int64_t maxOutput = 1 << 20;   // per stream
  std::optional<std::string> stdinData;
  // Its stdin stays open for ExecCall::sendInput (stdinData must be unset).
  bool interactive = false;
  // Run on a fresh pseudo-terminal of this size (implies interactive):
  // stdout and stderr are the terminal's output, one stream.
  std::optional<TermSize> pty;
  // fncall sandboxes: the exec frame's "fncall" object (language, code,
  // fresh_dir, files, limits; docs/fncall.md); empty: run argv as the call.
  std::string fncallJson;
};

struct ExecResult {
  int exitCode = 0;
  int signal = 0;
  bool timedOut = false;
  bool truncated = false;
  bool oomKilled = false;
  double durationMs = 0;
  // fncall: the agent reported the exec as a call; `limit` names the limit
  // that stopped it ("timeout", "cpu", "memory", "file_size", "output"), or
  // is empty.
  bool call = false;
  std::string limit;
  bool zygoteStarted = false;  // fncall: the call had to start a zygote first
  std::string out;  // left empty when streamed to a sink
  std::string err;
};

// Receives exec output as it arrives. An error return cancels the exec.
using OutputSink = std::function<Status(bool isStderr, std::string_view data)>;
// Supplies file bytes: fills buf, returns the count, 0 at the end.
using ByteSource = std::function<Result<size_t>(char* buf, size_t n)>;
// Receives file bytes in order.
using ByteSink = std::function<Status(std::string_view data)>;

// A small request to a sandbox's agent answered with one JSON result
// (docs/agent-protocol.md): file metadata calls, the policy frame of a phase
// switch, the audit counters.
enum class AgentOp : uint8_t { kList, kStat, kMkdir, kRemove, kPolicy, kAudit, kSetMeta };
const char* agentOpName(AgentOp op);
std::optional<AgentOp> parseAgentOp(std::string_view name);

struct CgroupLimits {
  double cpu = 1.0;         // cores; quota = cpu * period
  int64_t memoryBytes = 0;  // 0 = unlimited
  int64_t pids = 0;         // 0 = unlimited
};

struct CgroupStats {
  int64_t oomKills = 0;       // processes killed by the OOM killer in this cgroup
  int64_t pidsLimitHits = 0;  // fork/clone refused by pids.max
  int64_t memoryBytes = 0;    // current usage
  // CPU time used by the sandbox's processes since its cgroup was made
  // (v2 cpu.stat usage_usec; v1 cpuacct.usage / 1000): a counter.
  int64_t cpuUsec = 0;
  int64_t pids = 0;  // tasks now (pids.current)
};

// One reading of a sandbox's cgroup figures, kept by its node
// (EdgeLink::statsHistory).
struct StatsSample {
  double t = 0;             // unix seconds
  int64_t cpuUsec = 0;      // CgroupStats::cpuUsec: a counter
  int64_t memoryBytes = 0;  // at t
  int64_t pids = 0;         // at t
};

// A sandbox's recent readings, oldest first. intervalS is the node's sampling
// interval (0: a node that keeps no history, whose answer is one reading now).
struct StatsSeries {
  double intervalS = 0;
  std::vector<StatsSample> samples;
};

// The CPU cores used between each sample and the one before it: cpu time over
// wall time. nullopt for the first sample, and where the time did not advance
// or the counter went back (a cgroup made anew, as by a VM restored from disk).
std::vector<std::optional<double>> cpuCores(const std::vector<StatsSample>& samples);

// One computer-use action on a sandbox's screen (backend vm, docs/vm.md):
// kind "type" (text), "key" (key: a combination like "ctrl+c"), or "mouse"
// (x, y in screen pixels; button "left"/"right"/"middle"/"wheel-up"/
// "wheel-down", or empty to only move).
struct InputAction {
  std::string kind;
  std::string text;
  std::string key;
  int x = 0;
  int y = 0;
  std::string button;
};

// ----- egress ------------------------------------------------------------------

struct PortRange {
  uint16_t lo = 0;
  uint16_t hi = 65535;
  bool operator==(const PortRange&) const = default;
};

// What a node's egress filter stores: one per distinct (family, masked
// prefix), with the port ranges that apply there (proto/egress.h compiles a
// policy's entries into these).
// An exposed port of a sandbox and its generation (a rotation bumps it).
struct PortGen {
  int port = 0;
  uint64_t gen = 0;
  bool operator==(const PortGen&) const = default;
};

struct EgressRule {
  int family = 0;                  // AF_INET or AF_INET6
  std::array<uint8_t, 16> addr{};  // masked to prefixLen
  int prefixLen = 0;
  std::vector<PortRange> ports;  // sorted, merged, never empty
  bool operator==(const EgressRule&) const = default;
};

struct EgressDenials {
  uint64_t count = 0;  // connects and sends refused since the sandbox started
  std::string last;    // the last refused destination, "1.2.3.4:80" or "[::1]:80"
};

// ----- layers and nodes --------------------------------------------------------

// What a node needs to fetch and mount a layer (from the platform).
// A chunked data blob and its chunk index (image/chunk_index.h).
struct DataBlobDesc {
  std::string digest;
  int64_t size = 0;
  std::string chunksDigest;
  // Chunks the platform's gc removed from the blob (image::BlockRanges text,
  // in 4 KiB blocks; "" for a whole blob): they read as zeros from the store
  // and no layer reads them, so a node never fetches them.
  std::string reclaimed;
};

struct LayerDesc {
  std::string digest;        // the EROFS metadata image: the layer's identity
  int64_t size = 0;
  std::string dataDigest;    // its chunked data blob; empty for a single-file layer
  int64_t dataSize = 0;
  std::string chunksDigest;  // the data blob's chunk index
  // Data blobs of other layers that some of this layer's chunks point into
  // (chunks deduplicated across layers, docs/images.md): EROFS devices 2, 3,
  // ... in this order (device 1 is dataDigest). Mounted with one `device=`
  // per blob, after dataDigest's. Empty for most layers.
  std::vector<DataBlobDesc> extraData;
};
using LayerLookup = std::function<Result<LayerDesc>(const std::string& digest)>;

// Counters of one layer's data on a node.
struct LayerStats {
  int64_t chunks = 0;         // chunks in the data blob
  int64_t chunksCached = 0;   // of them, present in the node cache
  int64_t chunksFetched = 0;  // fetched from the blob store by this node
  int64_t bytesFetched = 0;
  int64_t cacheHits = 0;      // reads served from chunks already cached
  int64_t readRequests = 0;   // reads that reached the loader
  int64_t bytesRead = 0;      // distinct bytes of the blob read (chunk granular)
};

// A layer in a node's cache.
struct LayerReport {
  std::string digest;
  std::string dataDigest;
  int64_t dataSize = 0;
  bool attached = false;  // its loader serves it now
  int64_t chunksPrefetched = 0;
  LayerStats stats;
};

// User namespaces of a node's container sandboxes (edge/userns.h): each maps
// ids 0..length-1 to a host range of its own from the window (issue 31).
struct UsernsInfo {
  bool enabled = false;
  uint32_t length = 0;  // ids each sandbox maps
  uint32_t windowFirst = 0, windowLast = 0;
  // Ranges: how many the window holds (less /etc/subuid and /etc/subgid),
  // in use (sandboxes, live or being torn down, and spare agents), and of
  // those the sandboxes' and the spares'.
  uint64_t capacity = 0, inUse = 0, sandboxes = 0, spares = 0;
  std::string reason;  // why it is off (or the ranges)
};

// Whether microvms run on a node, on which accelerator, and why.
struct MicroVmProbe {
  bool available = false;
  std::string accelerator;  // "kvm" or "tcg"
  std::string reason;
  std::string qemu;         // resolved binary
  // Whether /dev/vhost-vsock opened (a vsock agent channel is possible), and
  // the channel chosen: "vsock" or "virtio-serial".
  bool vhostVsock = false;
  std::string agentChannel;
};

// Whether full VMs (backend vm) run on a node.
struct VmProbe {
  bool available = false;
  std::string accelerator;  // "kvm" or "tcg"
  std::string reason;
  std::string qemu;     // resolved binaries
  std::string qemuImg;
};

// What a node says of itself (GET /v1/node, /v1/metrics): its layer cache and
// loader, what its kernel offers, and its counters.
struct NodeReport {
  std::string loader;      // "fanotify", "fuse", "direct"
  std::string blobStore;   // the store URI layers come from
  std::vector<int> loaderPids;
  int64_t cacheUsedBytes = 0;
  int64_t cacheLimitBytes = 0;  // 0: none
  std::vector<LayerReport> layers;
  UsernsInfo userns;
  MicroVmProbe microvm;
  VmProbe vm;
  std::string egressUnavailable;  // empty: egress filtering works here
  std::string egressTag;
  // Per sandbox, only those with any.
  std::map<std::string, uint64_t> egressDenials;
  std::map<std::string, uint64_t> syscallDenials;
  // Leftovers of earlier runs removed at start, by kind (sandbox, veth, ...).
  std::map<std::string, int> orphansRemoved;
  // Sandboxes taken over at start from an earlier edge and still running.
  std::vector<std::string> adopted;
};

}  // namespace dsec::proto
