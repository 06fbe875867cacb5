#include "edge/backends/vm/vm_backend.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/sendfile.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cmath>
#include <cstring>
#include <mutex>
#include <nlohmann/json.hpp>
#include <utility>
#include <vector>

#include "common/base64.h"
#include "common/log.h"
#include "common/util.h"
#include "edge/backends/vm/qga.h"
#include "edge/backends/vm/vm_input.h"
#include "edge/qemu.h"
#include "edge/sandbox_state.h"

namespace dsec::edge {

using json = nlohmann::json;

namespace {

// QEMU's own memory beyond the guest's RAM (device model, 16 MiB of VGA
// memory, firmware, TCG's translation cache): added to the cgroup's limit so
// that memory_mb is what the guest gets.
constexpr int64_t kQemuOverheadBytes = 320ll << 20;
constexpr int kTbSizeMb = 64;
constexpr int64_t kMinGuestMemory = 256ll << 20;
// Between two keys typed: the guest's PS/2 queue is short, and under TCG
// the guest drains it slowly.
constexpr useconds_t kKeyGapUs = 15000;

Status copyFile(const std::string& from, const std::string& to) {
  UniqueFd in(::open(from.c_str(), O_RDONLY | O_CLOEXEC));
  if (!in) return sysError("open " + from);
  struct stat st;
  if (::fstat(in.get(), &st) != 0) return sysError("stat " + from);
  UniqueFd out(::open(to.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600));
  if (!out) return sysError("create " + to);
  off_t left = st.st_size;
  while (left > 0) {
    ssize_t n = ::copy_file_range(in.get(), nullptr, out.get(), nullptr, size_t(left), 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return sysError("copy " + from);
    left -= n;
  }
  if (::fsync(out.get()) != 0) return sysError("fsync " + to);
  return Status::ok();
}

// Width and height from a PNG's IHDR.
bool pngSize(const std::string& png, int* w, int* h) {
  if (png.size() < 24 || png.compare(1, 3, "PNG") != 0) return false;
  auto be32 = [&](size_t off) {
    return int(uint32_t(uint8_t(png[off])) << 24 | uint32_t(uint8_t(png[off + 1])) << 16 |
               uint32_t(uint8_t(png[off + 2])) << 8 | uint32_t(uint8_t(png[off + 3])));
  };
  *w = be32(16);
  *h = be32(20);
  return *w > 0 && *h > 0;
}

class VmInstance : public Instance {
 public:
  ~VmInstance() override {
    if (auto b = link().bridge) b->stop();
  }
  const std::string& id() const override { return id_; }
  std::shared_ptr<AgentConn> agent() const override { return link().conn; }
  Result<CgroupStats> stats() const override { return cgroups_->stats(id_); }
  Result<int64_t> oomKills() const override { return cgroups_->oomKills(id_); }
  // A hibernated VM has no QEMU to stop (VmBackend::restore runs it).
  Status freeze(bool frozen) override {
    if (hibernated_) return Status::ok();
    Status st = qemu::qmp(dir_, frozen ? "stop" : "cont").status();
    if (!st.isOk()) st.withContext("pause " + id_);
    return st;
  }
  Status setLimits(const CgroupLimits& limits) override {
    CgroupLimits l = limits;
    if (l.memoryBytes > 0) l.memoryBytes += kQemuOverheadBytes;
    return cgroups_->setLimits(id_, l);
  }
  Result<UpperDir> upperDir() const override { return UpperDir{}; }
  bool snapshotsDisk() const override { return true; }
  Status snapshotDisk(const std::string& dest) override;
  Result<UniqueFd> openNetns() const override {
    return qemu::openNetns(pid_, pidfd_.get(), network_, "vm");
  }
  bool hasNetwork() const override { return network_; }
  pid_t initPid() const override { return pid_; }
  bool hibernated() const override { return hibernated_; }

  // The guest link: the edge's connection, the bridge that serves it, and
  // the bridge's qga client (for fsfreeze). Replaced as one (attachBridge,
  // dropLink) while other threads use it.
  struct Link {
    std::shared_ptr<AgentConn> conn;
    std::shared_ptr<QgaBridge> bridge;
    std::shared_ptr<QgaClient> qga;
  };
  Link link() const {
    std::lock_guard lk(linkMu_);
    return link_;
  }
  void setLink(Link l) {
    std::lock_guard lk(linkMu_);
    link_ = std::move(l);
  }
  // The link, replaced by `next` alone (none: the old connection stays, for
  // the caller to fail).
  Link takeLink(std::shared_ptr<AgentConn> next) {
    std::lock_guard lk(linkMu_);
    Link old = link_;
    link_ = {next ? std::move(next) : old.conn, nullptr, nullptr};
    return old;
  }

  // QMP screendump into the VM's directory (QEMU's cwd), read back, removed.
  Result<std::string> screenshot() override {
    std::lock_guard lk(screenMu_);
    std::string name = "screen-" + randomHex(4) + ".png";
    auto r = qemu::qmp(dir_, "screendump", {{"filename", name}, {"format", "png"}}, 20);
    std::string path = dir_ + "/" + name;
    if (!r.isOk()) {
      ::unlink(path.c_str());
      return Status(r.status()).withContext("screenshot " + id_);
    }
    auto png = readFile(path);
    ::unlink(path.c_str());
    if (!png.isOk()) return Status(png.status()).withContext("screenshot " + id_);
    int w = 0, h = 0;
    if (pngSize(*png, &w, &h)) {
      width_ = w;
      height_ = h;
    }
    return png;
  }

  Status input(const InputAction& a) override {
    if (a.kind == "type") {
      ASSIGN_OR_RETURN(auto batches, vminput::typeText(a.text));
      for (auto& ev : batches) {
        RETURN_IF_ERROR(qemu::qmp(dir_, "input-send-event", {{"events", ev}}).status());
        ::usleep(kKeyGapUs);
      }
      return Status::ok();
    }
    if (a.kind == "key") {
      ASSIGN_OR_RETURN(json ev, vminput::keyCombo(a.key));
      return qemu::qmp(dir_, "input-send-event", {{"events", ev}}).status();
    }
    if (a.kind == "mouse") {
      int w = 0, h = 0;
      {
        std::lock_guard lk(screenMu_);
        w = width_;
        h = height_;
      }
      if (w == 0) {
        RETURN_IF_ERROR(screenshot().status());  // learns the screen size
        std::lock_guard lk(screenMu_);
        w = width_;
        h = height_;
      }
      ASSIGN_OR_RETURN(json ev, vminput::mouse(a.x, a.y, a.button, w, h));
      // Move first, then press and release: a click needs the pointer there.
      json move(ev.begin(), ev.begin() + 2);
      RETURN_IF_ERROR(qemu::qmp(dir_, "input-send-event", {{"events", move}}).status());
      for (size_t i = 2; i < ev.size(); ++i) {
        ::usleep(kKeyGapUs);
        RETURN_IF_ERROR(
            qemu::qmp(dir_, "input-send-event", {{"events", json::array({ev[i]})}}).status());
      }
      return Status::ok();
    }
    return invalidArg("kind", "input kind must be type, key or mouse");
  }

  std::string id_;
  bool network_ = false;  // booted with a NIC (SandboxSpec::network)
  std::string dir_;
  pid_t pid_ = -1;
  UniqueFd pidfd_;
  mutable std::mutex linkMu_;  // guards link_
  Link link_;
  std::string qemuImg_;
  std::vector<std::string> args_;  // QEMU's command line (VmBackend::qemuArgs)
  std::mutex lifeMu_;              // serializes hibernate, restore and destroy
  std::atomic<bool> hibernated_{false};
  Cgroups* cgroups_ = nullptr;
  std::mutex screenMu_;  // guards width_, height_; one screendump at a time
  int width_ = 0;
  int height_ = 0;
};

// Waits for qemu-guest-agent behind dir/qga.sock to answer, until deadline;
// `alive` says whether QEMU still runs.
Result<std::shared_ptr<QgaClient>> awaitQga(const std::string& dir, double deadline,
                                            const std::function<bool()>& alive) {
  UniqueFd dirFd(::open(dir.c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC));
  if (!dirFd) return sysError("open " + dir);
  std::shared_ptr<QgaClient> qga;
  for (;;) {
    if (!alive()) return Status(Code::kInternal, "QEMU exited");
    if (monoSeconds() > deadline) {
      return Status(Code::kDeadlineExceeded, "qemu-guest-agent did not answer");
    }
    if (!qga) {
      auto s = qemu::connectUnix(dirFd.get(), "qga.sock");
      if (!s.isOk()) {
        ::usleep(20000);
        continue;
      }
      qga = std::make_shared<QgaClient>(std::move(*s));
    }
    Status st = qga->sync(std::min(deadline, monoSeconds() + 2));
    if (st.isOk() && qga->call("guest-ping", json::object(), 10).isOk()) return qga;
    if (st.code() != Code::kDeadlineExceeded) {
      qga.reset();  // connection dropped: connect again
      ::usleep(100000);
    }
  }
}

// Whether the guest's interface with the NIC's MAC has an IPv4 address.
Result<bool> nicHasAddress(QgaClient& qga) {
  ASSIGN_OR_RETURN(json ifs, qga.call("guest-network-get-interfaces", json::object(), 10));
  if (!ifs.is_array()) return false;
  for (auto& i : ifs) {
    if (i.value("hardware-address", "") != qemu::kGuestMac) continue;
    auto a = i.find("ip-addresses");
    if (a == i.end() || !a->is_array()) continue;
    for (auto& x : *a) {
      if (x.value("ip-address-type", "") == "ipv4") return true;
    }
  }
  return false;
}

// One guest command through qga, to its end (or deadline): its exit code and
// output. For the edge's own set-up; a sandbox's execs go through QgaBridge.
Result<std::pair<int, std::string>> qgaRun(QgaClient& qga, const std::vector<std::string>& argv,
                                           double deadline) {
  json args = {{"path", argv[0]},
               {"arg", std::vector<std::string>(argv.begin() + 1, argv.end())},
               {"capture-output", true}};
  ASSIGN_OR_RETURN(json started, qga.call("guest-exec", args));
  json pid = started.value("pid", json(-1));
  for (;;) {
    ASSIGN_OR_RETURN(json st, qga.call("guest-exec-status", {{"pid", pid}}));
    if (st.value("exited", false)) {
      std::string out;
      for (const char* k : {"out-data", "err-data"}) {
        if (auto d = base64Decode(st.value(k, "")); d.isOk()) out += *d;
      }
      return std::make_pair(st.value("exitcode", -1), out);
    }
    if (monoSeconds() > deadline) return Status(Code::kDeadlineExceeded, argv[0] + " did not end");
    ::usleep(50000);
  }
}

// The guest's NIC up with QEMU user-mode networking's address (qemu.h). An
// ordinary cloud image configures it itself (DHCP: slirp answers with the
// same address); one that has not when qga answers, like the test image
// (systemd, no network configuration), gets a runtime systemd-networkd file
// for that MAC, which changes nothing on its disk. kUnavailable, with the
// reason, when the guest has no address on it by `deadline`.
Status guestNetUp(QgaClient& qga, double deadline) {
  ASSIGN_OR_RETURN(bool has, nicHasAddress(qga));
  if (has) return Status::ok();
  std::string unit = std::string("[Match]\nMACAddress=") + qemu::kGuestMac +
                     "\n[Network]\nAddress=" + qemu::kGuestAddr + "/" +
                     std::to_string(qemu::kGuestPrefix) + "\nGateway=" + qemu::kGuestGateway +
                     "\nLinkLocalAddressing=no\nIPv6AcceptRA=no\n";
  auto r = qgaRun(qga,
                  {"/bin/sh", "-c",
                   "mkdir -p /run/systemd/network && printf \"$1\" "
                   ">/run/systemd/network/10-dsec-nic.network && "
                   "systemctl restart systemd-networkd.service",
                   "sh", unit},
                  deadline);
  if (!r.isOk()) return Status(r.status()).withContext("configure the guest's NIC");
  if (r->first != 0) {
    return Status(Code::kUnavailable,
                  "the guest configured no address on its NIC and systemd-networkd could not "
                  "(exit " + std::to_string(r->first) + "): " + r->second);
  }
  for (;;) {
    ASSIGN_OR_RETURN(has, nicHasAddress(qga));
    if (has) return Status::ok();
    if (monoSeconds() > deadline) {
      return Status(Code::kUnavailable, std::string("the guest's NIC (") + qemu::kGuestMac +
                                            ") got no IPv4 address");
    }
    ::usleep(200000);
  }
}

// Grows the guest's root partition (growpart, where the guest has it) and
// file system (resize2fs, xfs_growfs or btrfs) to the disk, as cloud-init's
// growpart and resizefs modules do; a grown one is left as it is. Exit 3 with
// the reason when the guest's layout or tools do not allow it.
constexpr const char* kGrowRootScript = R"(src= fs=
while read -r d m t rest; do [ "$m" = / ] && src=$d && fs=$t; done </proc/self/mounts
dev=$(readlink -f "$src")
[ -b "$dev" ] || { echo "the root file system is on $src, not a block device"; exit 3; }
name=${dev##*/}
if [ -e "/sys/class/block/$name/partition" ]; then
  part=$(cat "/sys/class/block/$name/partition")
  disk=$(readlink -f "/sys/class/block/$name/..")
  disk=${disk##*/}
  command -v growpart >/dev/null ||
    { echo "the root file system is on partition $part of $disk and the guest has no growpart"; exit 3; }
  growpart "/dev/$disk" "$part" || [ $? -eq 1 ] || exit 3
fi
case $fs in
  ext2|ext3|ext4) resize2fs "$dev" ;;
  xfs) xfs_growfs / ;;
  btrfs) btrfs filesystem resize max / ;;
  *) echo "the guest's root file system is $fs, which this cannot grow"; exit 3 ;;
esac
)";

// Grows the guest's root file system to its disk (kGrowRootScript). Not
// fatal: a guest that cannot is logged and keeps the image's size.
void growGuestRoot(QgaClient& qga, const std::string& id, double deadline) {
  double t0 = monoSeconds();
  auto r = qgaRun(qga, {"/bin/sh", "-c", kGrowRootScript}, deadline);
  if (!r.isOk() || r->first != 0) {
    std::string why =
        r.isOk() ? "exit " + std::to_string(r->first) + ": " + r->second : r.status().toString();
    while (!why.empty() && why.back() == '\n') why.pop_back();
    log::warn("vm " + id + ": the root file system keeps the image's size (" + why + ")");
    return;
  }
  char took[32];
  std::snprintf(took, sizeof took, "%.1f", monoSeconds() - t0);
  log::info("vm " + id + ": root file system grown to the disk in " + took + " s");
}

// The bridge between the edge's AgentConn and qga, running.
Status attachBridge(VmInstance& inst, std::shared_ptr<QgaClient> qga, Reactor* reactor) {
  int sv[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) return sysError("socketpair");
  UniqueFd edgeEnd(sv[0]), guestEnd(sv[1]);
  VmInstance::Link l;
  l.qga = qga;
  l.bridge = std::make_shared<QgaBridge>(std::move(guestEnd), std::move(qga));
  l.conn = std::make_shared<AgentConn>(std::move(edgeEnd), "vm-" + inst.id_);
  inst.setLink(l);
  RETURN_IF_ERROR(reactor->add(l.conn));
  RETURN_IF_ERROR(l.bridge->start());
  return awaitHello(*l.conn, monoSeconds() + 10, Code::kUnavailable, "qga bridge");
}

// Takes the guest link down: the bridge stops (qga closed), the edge's
// connection leaves the reactor and fails every call with `why`. What is
// left is that failed connection, or `next`.
void dropLink(VmInstance& inst, Reactor* reactor, const Status& why,
              std::shared_ptr<AgentConn> next = nullptr) {
  VmInstance::Link old = inst.takeLink(std::move(next));
  if (old.bridge) old.bridge->stop();
  if (old.conn) {
    reactor->remove(old.conn);
    old.conn->fail(why);
  }
}

Status VmInstance::snapshotDisk(const std::string& dest) {
  // A running guest's file systems are frozen through qemu-guest-agent
  // (its dirty pages written, writers waiting), then its vCPUs stopped,
  // which flushes QEMU's own caches of the overlay to the file; the overlay
  // and its base are then read as one standalone qcow2. A paused guest
  // cannot answer qga: its disk is taken as it stands, as after a power cut.
  ASSIGN_OR_RETURN(json status, qemu::qmp(dir_, "query-status"));
  bool running = status.value("running", false);
  bool frozen = false;
  std::shared_ptr<QgaClient> qga = link().qga;
  auto thaw = [&]() {
    if (running) {
      if (auto r = qemu::qmp(dir_, "cont"); !r.isOk()) {
        log::error("pack_diff " + id_ + ": cont: " + r.status().toString());
      }
    }
    if (frozen) {
      if (auto r = qga->call("guest-fsfreeze-thaw", json::object(), 60); !r.isOk()) {
        log::error("pack_diff " + id_ + ": thaw: " + r.status().toString());
      }
    }
  };
  if (running) {
    if (!qga) return Status(Code::kUnavailable, "no qemu-guest-agent connection");
    auto r = qga->call("guest-fsfreeze-freeze", json::object(), 120);
    if (!r.isOk()) {
      return Status(r.status()).withContext("freeze the guest's file systems (guest-fsfreeze-freeze)");
    }
    frozen = true;
    if (auto stop = qemu::qmp(dir_, "stop", nullptr, 60); !stop.isOk()) {
      running = false;  // not stopped: nothing to cont
      thaw();
      return stop.status();
    }
  }
  auto made =
      qemu::runCapture({qemuImg_, "convert", "-U", "-O", "qcow2", dir_ + "/disk.qcow2", dest});
  thaw();
  if (!made.isOk()) {
    ::unlink(dest.c_str());
    return Status(made.status()).withContext("qemu-img convert");
  }
  return Status::ok();
}

}  // namespace

VmProbe probeVm(const VmOptions& opts) {
  VmProbe p;
  p.qemu = qemu::which(opts.qemuPath);
  if (p.qemu.empty()) {
    p.reason = opts.qemuPath + " not found (install qemu-system-x86: scripts/install-deps.sh)";
    return p;
  }
  p.qemuImg = qemu::which(opts.qemuImgPath);
  if (p.qemuImg.empty()) {
    p.reason = opts.qemuImgPath + " not found (install qemu-utils: scripts/install-deps.sh)";
    return p;
  }
  p.accelerator = qemu::chooseAccel(opts.accel, p.qemu, "q35", &p.reason, opts.probeKernel);
  if (p.accelerator.empty()) return p;
  p.available = true;
  return p;
}

Result<DiskInfo> inspectDisk(const std::string& qemuImg, const std::string& path) {
  auto out = qemu::runCapture({qemuImg, "info", "--output=json", "-U", path});
  if (!out.isOk()) return invalidArg("image", "not a disk image qemu-img can read: " +
                                                  out.status().message());
  json j = json::parse(*out, nullptr, false);
  if (!j.is_object()) return invalidArg("image", "qemu-img info gave no JSON");
  DiskInfo d;
  d.format = j.value("format", "");
  d.virtualSize = j.value("virtual-size", int64_t(0));
  if (d.format != "qcow2" && d.format != "raw") {
    return invalidArg("image", "disk format " + d.format + " is not supported (qcow2 or raw)");
  }
  if (j.contains("backing-filename") || j.contains("full-backing-filename")) {
    return invalidArg("image", "a disk image with a backing file is refused (flatten it: "
                               "qemu-img convert -O qcow2 IN OUT)");
  }
  if (auto fs = j.find("format-specific"); fs != j.end() && fs->is_object()) {
    if (auto data = fs->find("data"); data != fs->end() && data->is_object() &&
                                      data->contains("data-file")) {
      return invalidArg("image", "a qcow2 image with an external data file is refused");
    }
  }
  if (d.virtualSize <= 0) return invalidArg("image", "disk image has no size");
  return d;
}

struct VmBackend::Boot {
  VmInstance* inst;
  std::string base;
  DiskInfo info;
  std::string consoleLog;
};

Result<std::unique_ptr<VmBackend>> VmBackend::make(VmOptions opts, VmProbe probe,
                                                    Cgroups* cgroups, NodeCache* cache,
                                                    Reactor* reactor,
                                                    const std::set<std::string>& keep) {
  if (!probe.available) return Status(Code::kFailedPrecondition, probe.reason);
  std::unique_ptr<VmBackend> b(new VmBackend(opts, probe, cgroups, cache, reactor));
  RETURN_IF_ERROR(makeDirs(opts.vmRoot, 0700));
  RETURN_IF_ERROR(makeDirs(opts.logDir, 0700));
  RETURN_IF_ERROR(makeDirs(opts.baseDir, 0700));
  for (auto& id : qemu::sandboxDirs(opts.vmRoot)) {
    if (keep.count(id)) continue;
    b->removeOrphan(id);
    b->orphans_.insert(id);
  }
  // QEMU reaped, then its cgroup and directory go.
  b->cleaner_ = std::make_unique<CorpseCleaner>([raw = b.get()](const std::string& id) {
    if (Status st = raw->cgroups_->remove(id); !st.isOk()) {
      log::error("cleanup " + id + ": " + st.toString());
    }
    if (Status st = removeTree(raw->opts_.vmRoot + "/" + id); !st.isOk()) {
      log::error("cleanup " + id + ": " + st.toString());
    }
  });
  return b;
}

Result<std::pair<std::string, DiskInfo>> VmBackend::baseImage(const std::string& digest) {
  if (!startsWith(digest, "sha256:") || digest.size() != 71) {
    return invalidArg("image", "a vm boots one disk image (kind disk), not " + digest);
  }
  std::lock_guard lk(baseMu_);
  std::string base = opts_.baseDir + "/" + digest.substr(7);
  if (::access(base.c_str(), R_OK) != 0) {
    // A link of the node cache's verified copy (or of the blob in a local
    // store): its own name, so that the cache evicting the blob does not
    // pull the backing file from under running overlays.
    ASSIGN_OR_RETURN(LayerFiles files, cache_->prepare(digest));
    std::string tmp = base + ".new";
    ::unlink(tmp.c_str());
    if (::link(files.meta.c_str(), tmp.c_str()) != 0) {
      if (errno != EXDEV && errno != EPERM) return sysError("link " + files.meta);
      RETURN_IF_ERROR(copyFile(files.meta, tmp));
    }
    auto info = inspectDisk(probe_.qemuImg, tmp);
    if (!info.isOk()) {
      ::unlink(tmp.c_str());
      return info.status();
    }
    // "FORMAT VIRTUAL-SIZE": what the next create needs without qemu-img.
    RETURN_IF_ERROR(writeFileAtomic(
        base + ".format", info->format + " " + std::to_string(info->virtualSize) + "\n", 0600));
    if (::rename(tmp.c_str(), base.c_str()) != 0) return sysError("rename " + tmp);
    return std::pair{base, *info};
  }
  DiskInfo d;
  if (auto fmt = readFile(base + ".format"); fmt.isOk()) {
    auto words = splitString(fmt->substr(0, fmt->find('\n')), ' ');
    if (words.size() == 2) {
      d.format = words[0];
      d.virtualSize = std::atoll(words[1].c_str());
    }
  }
  // Missing, or written by an edge that recorded no size.
  if ((d.format != "qcow2" && d.format != "raw") || d.virtualSize <= 0) {
    ASSIGN_OR_RETURN(d, inspectDisk(probe_.qemuImg, base));
  }
  return std::pair{base, d};
}

std::vector<std::string> VmBackend::qemuArgs(const SandboxSpec& spec) const {
  int vcpus = std::max(1, int(std::ceil(spec.cpu - 1e-9)));
  std::string accel =
      probe_.accelerator == "kvm" ? "kvm" : "tcg,tb-size=" + std::to_string(kTbSizeMb);
  // One option and its value per pair.
  // clang-format off
  std::vector<std::string> args = {
      probe_.qemu, "-name", spec.id, "-machine", "q35", "-accel", accel,
      "-cpu", probe_.accelerator == "kvm" ? "host" : "max",
      "-smp", std::to_string(vcpus), "-m", std::to_string(spec.memoryBytes >> 20),
      "-nodefaults", "-no-user-config", "-no-reboot", "-display", "none",
      "-sandbox", "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny",
      "-device", "VGA",
      "-device", "virtio-tablet-pci",
      "-drive", "id=disk0,file=disk.qcow2,format=qcow2,if=none,cache=writeback",
      "-device", "virtio-blk-pci,drive=disk0,bootindex=0",
      "-serial", "file:console.log",
      "-qmp", "unix:qmp.sock,server=on,wait=off",
      "-chardev", "socket,id=qga,path=qga.sock,server=on,wait=off",
      "-device", "virtio-serial-pci",
      "-device", "virtserialport,chardev=qga,name=org.qemu.guest_agent.0"};
  // clang-format on
  if (spec.network) {
    for (auto& a : qemu::nicArgs("virtio-net-pci")) args.push_back(a);
  }
  return args;
}

Status VmBackend::bootOnce(const SandboxSpec& spec, Boot& b, bool* hung) {
  *hung = false;
  VmInstance& inst = *b.inst;
  const std::string& dir = inst.dir_;
  // A fresh overlay each attempt: a retried boot starts from the image. Its
  // virtual size is disk_mb where that is more than the image's (a disk
  // cannot shrink under its file system): the guest sees a larger disk and
  // grows its partition and file system itself (cloud-init's growpart), or
  // not (docs/vm.md).
  ::unlink((dir + "/disk.qcow2").c_str());
  int64_t size = std::max(b.info.virtualSize, spec.diskBytes);
  if (auto made =
          qemu::runCapture({probe_.qemuImg, "create", "-q", "-f", "qcow2", "-b", b.base, "-F",
                            b.info.format, dir + "/disk.qcow2", std::to_string(size)});
      !made.isOk()) {
    return Status(made.status()).withContext("overlay");
  }
  inst.args_ = qemuArgs(spec);
  for (const char* f : {"/qga.sock", "/qmp.sock", "/console.log"}) ::unlink((dir + f).c_str());
  ASSIGN_OR_RETURN(qemu::Process proc, qemu::spawnConfined(inst.args_, dir, cgroups_, spec.id));
  inst.pid_ = proc.pid;
  inst.pidfd_ = std::move(proc.pidfd);
  auto abandon = [&](Status st) -> Status {
    dropLink(inst, reactor_, st);
    killAndWait(inst.pidfd_.get());
    inst.pidfd_.reset();
    inst.pid_ = -1;
    return st;
  };
  auto qemuFailed = [&]() {
    std::string why = qemu::tailFile(dir + "/qemu.log", 600);
    return Status(Code::kInternal, "QEMU exited: " + (why.empty() ? "(no output)" : why) +
                                       " (console log: " + b.consoleLog + ")");
  };
  double deadline = monoSeconds() + opts_.bootTimeoutS;
  auto qga = awaitQga(dir, deadline, [&] { return !qemu::exited(inst.pidfd_.get()); });
  if (!qga.isOk()) {
    if (qemu::exited(inst.pidfd_.get())) return abandon(qemuFailed());
    *hung = true;
    return abandon(qga.status());
  }
  if (spec.network) {
    if (Status st = guestNetUp(**qga, deadline + 60); !st.isOk()) return abandon(st);
  }
  // A disk larger than the image: its file system grows to it at first boot.
  if (size > b.info.virtualSize) growGuestRoot(**qga, spec.id, monoSeconds() + 120);
  if (Status st = attachBridge(inst, std::move(*qga), reactor_); !st.isOk()) return abandon(st);
  return Status::ok();
}

Result<std::unique_ptr<Instance>> VmBackend::create(const SandboxSpec& spec,
                                                    std::function<void()> onDeath) {
  if (spec.memoryBytes < kMinGuestMemory) {
    return invalidArg("memory_mb", "a vm needs memory_mb >= " +
                                       std::to_string(kMinGuestMemory >> 20));
  }
  if (spec.layers.size() != 1) {
    return invalidArg("image", "a vm boots exactly one disk image (kind disk); workspaces, "
                               "toolkits and diffs do not apply");
  }
  Laps laps;
  auto inst = std::make_unique<VmInstance>();
  inst->id_ = spec.id;
  inst->network_ = spec.network;
  inst->qemuImg_ = probe_.qemuImg;
  inst->cgroups_ = cgroups_;
  inst->dir_ = opts_.vmRoot + "/" + spec.id;
  bool cgroupMade = false;
  Boot b{inst.get(), "", {}, opts_.logDir + "/" + spec.id + ".console.log"};
  auto fail = [&](Status st) -> Status {
    dropLink(*inst, reactor_, st);
    killAndWait(inst->pidfd_.get());
    if (cgroupMade) (void)cgroups_->remove(spec.id);
    // The console log is kept for diagnosis; the rest (overlay, sockets) goes.
    ::rename((inst->dir_ + "/console.log").c_str(), b.consoleLog.c_str());
    (void)removeTree(inst->dir_);
    return st.withContext("create " + spec.id);
  };
  auto base = baseImage(spec.layers[0]);
  if (!base.isOk()) return Status(base.status()).withContext("create " + spec.id);
  b.base = base->first;
  b.info = base->second;
  // A disk cannot shrink under the image's file system: a smaller disk_mb
  // asked for is refused; the default gives the image's size.
  if (spec.diskExplicit && spec.diskBytes < b.info.virtualSize) {
    int64_t needMb = (b.info.virtualSize + (1 << 20) - 1) >> 20;
    return invalidArg("disk_mb", "disk_mb " + std::to_string(spec.diskBytes >> 20) +
                                     " is smaller than the disk image (" + std::to_string(needMb) +
                                     " MiB): ask for at least " + std::to_string(needMb) +
                                     ", or leave disk_mb out for the image's size");
  }
  laps.lap("base");
  if (::mkdir(inst->dir_.c_str(), 0700) != 0) return fail(sysError("mkdir " + inst->dir_));
  CgroupLimits limits{spec.cpu, spec.memoryBytes + kQemuOverheadBytes, spec.pids};
  if (Status st = cgroups_->create(spec.id, limits); !st.isOk()) return fail(st);
  cgroupMade = true;
  // A guest that hangs at boot is killed and booted once more.
  if (Status st = qemu::bootWithRetry("vm", spec.id, inst->dir_, opts_.bootTimeoutS, b.consoleLog,
                                      [&](bool* hung) { return bootOnce(spec, b, hung); });
      !st.isOk()) {
    return fail(st);
  }
  laps.lap("boot");
  if (Status w = qemu::recordAndWatch(inst->dir_, inst->pid_, inst->pidfd_.get(), reactor_,
                                      std::move(onDeath));
      !w.isOk()) {
    return fail(w);
  }
  log::info("vm " + spec.id + " booted (" + probe_.accelerator + ") ms: " + laps.str());
  return std::unique_ptr<Instance>(std::move(inst));
}

Result<std::unique_ptr<Instance>> VmBackend::adopt(const SandboxState& state,
                                                   std::function<void()> onDeath) {
  auto inst = std::make_unique<VmInstance>();
  inst->id_ = state.spec.id;
  inst->network_ = state.spec.network;
  inst->qemuImg_ = probe_.qemuImg;
  inst->cgroups_ = cgroups_;
  inst->dir_ = opts_.vmRoot + "/" + state.spec.id;
  inst->pid_ = state.pid;
  auto fail = [&](Status st) -> Status {
    dropLink(*inst, reactor_, st);
    return st.withContext("adopt " + state.spec.id);
  };
  if (state.hibernated) {
    // Nothing runs: the saved state and the overlay are the sandbox.
    std::string saved = inst->dir_ + "/" + qemu::kStateFile;
    if (::access(saved.c_str(), R_OK) != 0) return fail(sysError("its saved state " + saved));
    inst->args_ = qemuArgs(state.spec);
    inst->pid_ = -1;
    inst->hibernated_ = true;
    inst->setLink({qemu::hibernatedConn(state.spec.id), nullptr, nullptr});
    return std::unique_ptr<Instance>(std::move(inst));
  }
  auto pidfd = qemu::adoptQemu(state, inst->dir_, [&](int qemuFd) -> Status {
    // The earlier edge's qga connection closed with it; QEMU takes a new one.
    auto qga = awaitQga(inst->dir_, monoSeconds() + 30,
                        [&] { return !qemu::exited(qemuFd); });
    if (!qga.isOk()) return qga.status();
    return attachBridge(*inst, std::move(*qga), reactor_);
  });
  if (!pidfd.isOk()) return fail(pidfd.status());
  inst->pidfd_ = std::move(*pidfd);
  if (Status st = reactor_->watchExit(inst->pidfd_.get(), std::move(onDeath)); !st.isOk()) {
    return fail(st);
  }
  return std::unique_ptr<Instance>(std::move(inst));
}

Status VmBackend::hibernate(Instance& base, bool paused, const std::function<Status()>& persist) {
  auto& inst = static_cast<VmInstance&>(base);
  std::lock_guard life(inst.lifeMu_);
  if (inst.hibernated_) return Status::ok();
  const std::string& dir = inst.dir_;
  double t0 = monoSeconds();
  // No qga request may be in flight while the guest is saved: its reply
  // would be lost with this connection. Commands the guest runs go on
  // (their output stays in its /run/dsec-exec until they end).
  dropLink(inst, reactor_,
           Status(Code::kUnavailable, "sandbox " + inst.id_ + " is being hibernated"));
  // Back as it was: qga answers only while the vCPUs run, so the guest is
  // continued to reconnect and stopped again if it was paused.
  auto undo = [&](Status st) -> Status {
    (void)qemu::qmp(dir, "cont");
    auto qga = awaitQga(dir, monoSeconds() + opts_.bootTimeoutS,
                        [&] { return !qemu::exited(inst.pidfd_.get()); });
    Status r = qga.isOk() ? attachBridge(inst, std::move(*qga), reactor_) : qga.status();
    if (!r.isOk()) {
      log::error("hibernate " + inst.id_ + ": reconnecting after a failed save: " + r.toString());
    }
    if (paused) (void)qemu::qmp(dir, "stop");
    return Status(qemu::nodeFailure(st.code()),
                  "hibernate " + inst.id_ + " (it keeps running): " + st.message());
  };
  double t1 = monoSeconds();
  auto bytes = qemu::saveToStateFile(dir, persist);
  if (!bytes.isOk()) return undo(bytes.status());
  // The state file is the sandbox from here on: QEMU goes (it flushed the
  // overlay when the migration completed).
  double t2 = monoSeconds();
  qemu::endSavedQemu(dir, &inst.pidfd_, reactor_, {"qga.sock", "qmp.sock"});
  inst.pid_ = -1;
  inst.setLink({qemu::hibernatedConn(inst.id_), nullptr, nullptr});
  inst.hibernated_ = true;
  char msg[256];
  std::snprintf(msg, sizeof msg,
                "vm %s hibernated: %.1f MB of state in %.2f s (qga let go in %.2f s, QEMU gone in "
                "%.2f s)",
                inst.id_.c_str(), double(*bytes) / 1e6, t2 - t1, t1 - t0, monoSeconds() - t2);
  log::info(msg);
  return Status::ok();
}

Status VmBackend::restore(Instance& base, std::function<void()> onDeath,
                          const std::function<Status()>& beforeRun) {
  auto& inst = static_cast<VmInstance&>(base);
  std::lock_guard life(inst.lifeMu_);
  if (!inst.hibernated_) return Status::ok();
  const std::string& dir = inst.dir_;
  const std::string saved = dir + "/" + qemu::kStateFile;
  const std::string keptLog = opts_.logDir + "/" + inst.id_ + ".console.log";
  double t0 = monoSeconds();
  auto fail = [&](Status st) -> Status {
    dropLink(inst, reactor_, Status(Code::kUnavailable, "the restore failed"));
    return qemu::failedRestore(inst.id_, dir, keptLog, &inst.pid_, &inst.pidfd_, st);
  };
  if (::access(saved.c_str(), R_OK) != 0) return fail(sysError("its saved state " + saved));
  if (Status st =
          qemu::startFromStateFile(inst.args_, dir, cgroups_, inst.id_, {"qga.sock", "qmp.sock"},
                                   &inst.pid_, &inst.pidfd_, beforeRun);
      !st.isOk()) {
    return fail(st);
  }
  double t1 = monoSeconds();
  auto qga = awaitQga(dir, monoSeconds() + opts_.bootTimeoutS,
                      [&] { return !qemu::exited(inst.pidfd_.get()); });
  if (!qga.isOk()) return fail(qga.status());
  // The guest's clock stood still while it was saved: set it to the host's,
  // as libvirt does after a restore (a guest without the command runs late).
  struct timespec now;
  ::clock_gettime(CLOCK_REALTIME, &now);
  if (auto r = (*qga)->call("guest-set-time",
                            {{"time", int64_t(now.tv_sec) * 1000000000 + now.tv_nsec}}, 30);
      !r.isOk()) {
    log::warn("vm " + inst.id_ + ": guest clock not set after restore: " + r.status().toString());
  }
  if (Status st = attachBridge(inst, std::move(*qga), reactor_); !st.isOk()) return fail(st);
  if (Status st =
          qemu::recordAndWatch(dir, inst.pid_, inst.pidfd_.get(), reactor_, std::move(onDeath));
      !st.isOk()) {
    return fail(st);
  }
  ::unlink(saved.c_str());
  inst.hibernated_ = false;
  char msg[200];
  std::snprintf(msg, sizeof msg, "vm %s restored: state loaded in %.2f s, qga back %.2f s later",
                inst.id_.c_str(), t1 - t0, monoSeconds() - t1);
  log::info(msg);
  return Status::ok();
}

Status VmBackend::destroy(Instance& base) {
  auto& inst = static_cast<VmInstance&>(base);
  std::lock_guard life(inst.lifeMu_);  // a hibernate or restore under way ends first
  reactor_->unwatchExit(inst.pidfd_.get());
  dropLink(inst, reactor_, Status(Code::kUnavailable, "sandbox destroyed"));
  if (inst.pidfd_) syscall(SYS_pidfd_send_signal, inst.pidfd_.get(), SIGKILL, nullptr, 0);
  cleaner_->add(inst.id_, std::move(inst.pidfd_));
  return Status::ok();
}

void VmBackend::shutdown(bool) {
  if (cleaner_) cleaner_->drain();
}

VmBackend::~VmBackend() {
  shutdown();
  cleaner_.reset();
}

void VmBackend::removeOrphan(const std::string& id) {
  qemu::removeLeftovers(cgroups_, id, opts_.vmRoot + "/" + id);
}

int VmBackend::cleanupOrphans() { return int(std::exchange(orphans_, {}).size()); }

}  // namespace dsec::edge
