// The microvm backend (docs/microvm.md): each sandbox is a QEMU `-M microvm`
// guest booting the node's guest kernel and the project's initramfs, whose
// init is dsec-aether. The image's EROFS layers are read-only virtio-blk
// disks straight from the node's layer cache (on-demand loading reaches the
// guest's reads), the writes land on an ext4 disk of disk_mb, and the agent
// protocol runs over a virtio-serial port that QEMU exposes as a unix socket.
//
// QEMU runs in the sandbox's cgroup (so limits, stats and OOM counts work as
// for containers), in its own mount, network, IPC and UTS namespaces (no host
// network at all), under `-sandbox on` (seccomp), with -nodefaults.
#pragma once

#include <sys/types.h>

#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "common/fd.h"
#include "edge/backend.h"
#include "edge/corpse_cleaner.h"
#include "edge/image/layer_cache.h"

namespace dsec::edge {

struct MicroVmOptions {
  std::string qemuPath = "qemu-system-x86_64";  // looked up in PATH unless absolute
  std::string guestDir;   // vmlinux + initramfs.cpio (scripts/microvm-guest.py)
  std::string vmRoot;     // node-local: one directory per VM (disk, sockets, logs)
  std::string logDir;     // console logs of VMs that failed to boot, kept
  double bootTimeoutS = 120;  // kernel start to the agent's hello (TCG is slow)
  std::string accel = "auto";  // "auto" (probe KVM, else TCG), "kvm" or "tcg"
  // The agent channel: "auto" (vsock where /dev/vhost-vsock opens, else
  // virtio-serial), "vsock" or "virtio-serial".
  std::string agentChannel = "auto";
};

// The guest port of the agent's vsock listener (dsec.vsock= on the kernel
// command line).
inline constexpr uint32_t kAgentVsockPort = 1024;

// What start-up found: whether microvms can run here, on which accelerator,
// and why not (or how the accelerator was chosen).
using proto::MicroVmProbe;

// The agent channel for `want` ("auto", "vsock", "virtio-serial") on a node
// where /dev/vhost-vsock did (not) open: "vsock" for vsock, or auto with
// vhost-vsock; "virtio-serial" for virtio-serial, or auto without. "" when
// vsock is wanted but there is no vhost-vsock, or `want` is none of those;
// *why says how the choice was made (or why none).
std::string chooseAgentChannel(const std::string& want, bool vhostVsock, std::string* why);

// Looks for QEMU and the guest files and probes KVM for real: a tiny guest
// run through /dev/kvm (in a child process, bounded in time) must execute and
// report back, else the backend uses TCG.
MicroVmProbe probeMicroVm(const MicroVmOptions& opts);

// QEMU's command line for a microvm of `spec` with these layer files
// (bottom first), on the accelerator of `probe`; the agent channel is vsock
// to guest CID `cid`, or virtio-serial when `cid` is 0. Each distinct file is
// one read-only virtio-blk disk (a data blob several layers read is given
// once), and the kernel command line tells the guest's init which disks each
// layer mounts (microvm_backend.cc, GuestDisks). The backend's, and its
// tests'.
std::vector<std::string> microvmArgs(const MicroVmOptions& opts, const MicroVmProbe& probe,
                                     const SandboxSpec& spec,
                                     const std::vector<std::pair<std::string, LayerFiles>>& files,
                                     uint32_t cid);
// kInvalidArgument (field image) when `args` (microvmArgs of `files`) need
// more virtio devices than `-M microvm` has transports (24), or a longer
// kernel command line than x86 takes.
Status checkMicrovmArgs(const std::vector<std::string>& args,
                        const std::vector<std::pair<std::string, LayerFiles>>& files);

class MicroVmBackend : public Backend {
 public:
  // probe must say available. The VMs in `keep` are being re-adopted; other
  // VM directories under vmRoot are orphans (their QEMU killed, removed).
  static Result<std::unique_ptr<MicroVmBackend>> make(MicroVmOptions opts, MicroVmProbe probe,
                                                      Cgroups* cgroups, LayerCache* layers,
                                                      Reactor* reactor,
                                                      const std::set<std::string>& keep = {});
  ~MicroVmBackend() override;

  std::string name() const override { return "microvm"; }
  Result<std::unique_ptr<Instance>> create(const SandboxSpec& spec,
                                           std::function<void()> onDeath) override;
  Result<std::unique_ptr<Instance>> adopt(const SandboxState& state,
                                          std::function<void()> onDeath) override;
  Status destroy(Instance& inst) override;
  void removeOrphan(const std::string& id) override;
  int cleanupOrphans() override;
  void shutdown(bool keepSandboxes = false) override;
  bool hibernates() const override { return true; }
  Status hibernate(Instance& inst, bool paused, const std::function<Status()>& persist) override;
  Status restore(Instance& inst, std::function<void()> onDeath,
                 const std::function<Status()>& beforeRun) override;
  const MicroVmProbe& probe() const { return probe_; }

 private:
  MicroVmBackend(MicroVmOptions opts, MicroVmProbe probe, Cgroups* cgroups, LayerCache* layers,
                 Reactor* reactor)
      : opts_(std::move(opts)),
        probe_(std::move(probe)),
        cgroups_(cgroups),
        layers_(layers),
        reactor_(reactor) {}
  struct Boot;
  // One boot attempt; on error everything it started is gone again, and
  // `hung` says whether the guest simply never answered (worth a retry).
  Status bootOnce(const SandboxSpec& spec, Boot& b, bool* hung);

  const MicroVmOptions opts_;
  const MicroVmProbe probe_;
  Cgroups* cgroups_;    // not owned
  LayerCache* layers_;  // not owned
  Reactor* reactor_;    // not owned
  std::set<std::string> orphans_;

  // Reaps killed sandboxes and removes what they leave (edge/corpse_cleaner.h).
  // Last, so it goes first: its work uses the members above.
  std::unique_ptr<CorpseCleaner> cleaner_;
};

}  // namespace dsec::edge
