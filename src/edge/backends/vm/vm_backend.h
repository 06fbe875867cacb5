// The vm backend (docs/vm.md): each sandbox is a QEMU q35 machine with a
// full device set (SeaBIOS, std VGA, PS/2 keyboard, virtio-tablet,
// virtio-blk, virtio-serial) booting a disk image that brings its own
// kernel, bootloader and init. The image (kind "disk": qcow2 or raw) is a
// blob of the store, fetched whole to the node and shared read-only as the
// backing file of a per-sandbox qcow2 overlay. exec and files go through
// qemu-guest-agent (backends/vm/qga.h), so any image with qga works as is;
// screenshots and keyboard/mouse input go through QMP.
//
// QEMU runs confined as for microvm (edge/qemu.h): the sandbox's cgroup,
// own mount/net/IPC/UTS namespaces without any network device, `-sandbox
// on` (seccomp), -nodefaults.
#pragma once

#include <sys/types.h>

#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>

#include "common/fd.h"
#include "edge/backend.h"
#include "edge/corpse_cleaner.h"
#include "edge/image/node_cache.h"

namespace dsec::edge {

struct VmOptions {
  std::string qemuPath = "qemu-system-x86_64";  // looked up in PATH unless absolute
  std::string qemuImgPath = "qemu-img";
  std::string vmRoot;   // node-local: one directory per VM (overlay, sockets, logs)
  std::string baseDir;  // node-local: the disk images VMs boot from, by digest
  std::string logDir;   // console logs of VMs that failed to boot, kept
  double bootTimeoutS = 300;   // QEMU start to qemu-guest-agent answering (TCG is slow)
  std::string accel = "auto";  // "auto" (probe KVM, else TCG), "kvm" or "tcg"
  // A Linux kernel the KVM probe boots (qemu::probeQemuKvmBoot): the microvm
  // guest's; empty or missing: the probe only starts QEMU.
  std::string probeKernel;
};

// What start-up found: whether full VMs can run here, on which accelerator,
// and why not (or how the accelerator was chosen).
using proto::VmProbe;

// Looks for QEMU and qemu-img and probes KVM for real (edge/qemu.h).
VmProbe probeVm(const VmOptions& opts);

// What `qemu-img info` says of a disk image: "qcow2" or "raw", and its
// virtual size. A format other than those two, a backing file or an external
// data file (which would let an image read host files) is an error (field
// "image").
struct DiskInfo {
  std::string format;
  int64_t virtualSize = 0;
};
Result<DiskInfo> inspectDisk(const std::string& qemuImg, const std::string& path);

class VmBackend : public Backend {
 public:
  // probe must say available. VMs in `keep` are being re-adopted; other VM
  // directories under vmRoot are orphans (their QEMU killed, removed).
  static Result<std::unique_ptr<VmBackend>> make(VmOptions opts, VmProbe probe, Cgroups* cgroups,
                                                 NodeCache* cache, Reactor* reactor,
                                                 const std::set<std::string>& keep = {});
  ~VmBackend() override;

  std::string name() const override { return "vm"; }
  // spec.layers is the one disk image's digest.
  Result<std::unique_ptr<Instance>> create(const SandboxSpec& spec,
                                           std::function<void()> onDeath) override;
  Result<std::unique_ptr<Instance>> adopt(const SandboxState& state,
                                          std::function<void()> onDeath) override;
  Status destroy(Instance& inst) override;
  bool hibernates() const override { return true; }
  Status hibernate(Instance& inst, bool paused, const std::function<Status()>& persist) override;
  Status restore(Instance& inst, std::function<void()> onDeath,
                 const std::function<Status()>& beforeRun) override;
  void removeOrphan(const std::string& id) override;
  int cleanupOrphans() override;
  void shutdown(bool keepSandboxes = false) override;
  const VmProbe& probe() const { return probe_; }

 private:
  VmBackend(VmOptions opts, VmProbe probe, Cgroups* cgroups, NodeCache* cache, Reactor* reactor)
      : opts_(std::move(opts)),
        probe_(std::move(probe)),
        cgroups_(cgroups),
        cache_(cache),
        reactor_(reactor) {}
  // The node-local base image of a disk digest (fetched, checked, linked).
  Result<std::pair<std::string, DiskInfo>> baseImage(const std::string& digest);
  // QEMU's command line for a VM of `spec` (its overlay is dir/disk.qcow2).
  std::vector<std::string> qemuArgs(const SandboxSpec& spec) const;
  struct Boot;
  // One boot attempt; on error everything it started is gone again, and
  // `hung` says whether the guest simply never answered (worth a retry).
  Status bootOnce(const SandboxSpec& spec, Boot& b, bool* hung);

  const VmOptions opts_;
  const VmProbe probe_;
  Cgroups* cgroups_;   // not owned
  NodeCache* cache_;   // not owned
  Reactor* reactor_;   // not owned
  std::set<std::string> orphans_;
  std::mutex baseMu_;  // serializes making base images

  // Reaps killed sandboxes and removes what they leave (edge/corpse_cleaner.h).
  // Last, so it goes first: its work uses the members above.
  std::unique_ptr<CorpseCleaner> cleaner_;
};

}  // namespace dsec::edge
