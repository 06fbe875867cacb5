#include "edge/backends/microvm/microvm_backend.h"

#include <dirent.h>
#include <fcntl.h>
#include <linux/kvm.h>
#include <linux/vm_sockets.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <utility>
#include <vector>

#include "common/log.h"
#include "common/util.h"
#include "edge/qemu.h"
#include "edge/sandbox_state.h"
#include "image/layer_builder.h"

namespace dsec::edge {

using json = nlohmann::json;

namespace {

// QEMU's own memory beyond the guest's RAM (device model, TCG's translation
// cache, which -accel tcg,tb-size bounds): added to the cgroup's limit so
// that memory_mb is what the guest gets.
constexpr int64_t kQemuOverheadBytes = 256ll << 20;
constexpr int kTbSizeMb = 64;
constexpr int64_t kMinGuestMemory = 128ll << 20;
// virtio-mmio transports of `-M microvm` with ACPI (the default), which puts
// them on its second IOAPIC: one per virtio device (disks, the agent
// channel, the NIC). Without ACPI there would be 8.
constexpr size_t kMicroVmTransports = 24;
// x86's COMMAND_LINE_SIZE, with the terminating NUL.
constexpr size_t kMaxKernelCmdline = 2047;

// The image's read-only virtio-blk disks and what the guest's init needs to
// find and mount them (guest_init.cc). Per layer i (bottom first), `l<i>m`
// for its metadata image and `l<i>d` for its own data blob; then `x<k>` for
// extra data blobs. Each distinct file is one disk (microvm has few
// transports): a blob several layers read, as their own or as an extra, is
// given once. Except in an image without extra blobs: there every layer
// with a data blob has its `l<i>d`, shared or not, as earlier edges gave
// them, so that a VM one of them hibernated restores with the same devices.
// Kernel parameters: dsec.layers=N; dsec.data=I,J,... the layers whose one
// device is their own disk l<i>d; dsec.devs=I:S+S+...,J:... the serials of
// the devices 1, 2, ... of every other layer that has any.
struct GuestDisks {
  std::vector<std::pair<std::string, std::string>> disks;  // serial, file
  std::string params;  // " dsec.layers=..." for the kernel command line
};

GuestDisks guestDisks(const std::vector<std::pair<std::string, LayerFiles>>& files) {
  GuestDisks g;
  bool extras = std::any_of(files.begin(), files.end(),
                            [](auto& f) { return !f.second.extraData.empty(); });
  std::map<std::string, std::string> serialOf;  // file -> the serial of its disk
  std::vector<std::vector<std::string>> devices(files.size());  // serials, by layer
  for (size_t i = 0; i < files.size(); ++i) {
    std::string l = "l" + std::to_string(i);
    g.disks.push_back({l + "m", files[i].second.meta});
    const std::string& data = files[i].second.data;
    if (data.empty()) continue;
    auto [it, added] = serialOf.emplace(data, l + "d");
    if (added || !extras) g.disks.push_back({l + "d", data});
    devices[i].push_back(added || !extras ? l + "d" : it->second);
  }
  size_t x = 0;
  for (size_t i = 0; i < files.size(); ++i) {
    for (auto& f : files[i].second.extraData) {
      auto [it, added] = serialOf.emplace(f, "x" + std::to_string(x));
      if (added) {
        g.disks.push_back({it->second, f});
        ++x;
      }
      devices[i].push_back(it->second);
    }
  }
  std::string data, devs;
  for (size_t i = 0; i < files.size(); ++i) {
    std::string own = "l" + std::to_string(i) + "d";
    if (devices[i] == std::vector<std::string>{own}) {
      data += (data.empty() ? "" : ",") + std::to_string(i);
    } else if (!devices[i].empty()) {
      std::string serials;
      for (auto& d : devices[i]) serials += (serials.empty() ? "" : "+") + d;
      devs += (devs.empty() ? "" : ",") + std::to_string(i) + ":" + serials;
    }
  }
  g.params = " dsec.layers=" + std::to_string(files.size());
  if (!data.empty()) g.params += " dsec.data=" + data;
  if (!devs.empty()) g.params += " dsec.devs=" + devs;
  return g;
}

using qemu::connectUnix;
using qemu::exited;

// One QMP command; its reply as the caller needs it.
Result<json> qmp(const std::string& dir, const std::string& command) {
  return qemu::qmp(dir, command);
}

std::string tail(const std::string& path, size_t max) { return qemu::tailFile(path, max); }

class MicroVmInstance : public Instance {
 public:
  const std::string& id() const override { return id_; }
  std::shared_ptr<AgentConn> agent() const override {
    std::lock_guard lk(connMu_);
    return conn_;
  }
  Result<CgroupStats> stats() const override { return cgroups_->stats(id_); }
  Result<int64_t> oomKills() const override { return cgroups_->oomKills(id_); }
  // The guest's vCPUs stop in QEMU (its clock too): QMP stop/cont. A
  // hibernated VM has no QEMU to stop (MicroVmBackend::restore runs it).
  Status freeze(bool frozen) override {
    if (hibernated_) return Status::ok();
    Status st = qmp(dir_, frozen ? "stop" : "cont").status();
    if (!st.isOk()) st.withContext("pause " + id_);
    return st;
  }
  // CPU and pids apply to QEMU's cgroup as given. Memory: the guest's RAM is
  // fixed at boot; the cgroup keeps QEMU's overhead above the new value.
  Status setLimits(const CgroupLimits& limits) override {
    CgroupLimits l = limits;
    if (l.memoryBytes > 0) l.memoryBytes += kQemuOverheadBytes;
    return cgroups_->setLimits(id_, l);
  }
  Result<UpperDir> upperDir() const override { return UpperDir{}; }
  bool exportsUpper() const override { return true; }
  Status exportUpper(const std::string& dest) override;
  Result<UniqueFd> openNetns() const override {
    return qemu::openNetns(pid_, pidfd_.get(), network_, "microvm");
  }
  bool hasNetwork() const override { return network_; }
  pid_t initPid() const override { return pid_; }
  bool hibernated() const override { return hibernated_; }
  void setConn(std::shared_ptr<AgentConn> c) {
    std::lock_guard lk(connMu_);
    conn_ = std::move(c);
  }

  std::string id_;
  bool network_ = false;  // booted with a NIC (SandboxSpec::network)
  uint32_t cid_ = 0;      // the guest's vsock CID when the agent channel is vsock, else 0
  int64_t diskBytes_ = 0;
  std::string dir_;
  std::vector<std::string> layers_;
  pid_t pid_ = -1;
  UniqueFd pidfd_;
  std::shared_ptr<AgentConn> conn_;  // replaced (under connMu_) by a restore
  mutable std::mutex connMu_;
  Cgroups* cgroups_ = nullptr;
  std::vector<std::string> args_;  // QEMU's command line (microvmArgs)
  std::mutex lifeMu_;              // serializes hibernate and restore
  std::atomic<bool> hibernated_{false};
};

using qemu::kStateFile;
// What the guest's relay writes to the console once its agent let go of a
// host connection and waits for a reattach (src/aether/guest_init.cc).
constexpr const char* kRelayWaits = "the agent waits for a reattach; waiting for a host";
constexpr double kRelayTimeoutS = 60;

// Waits this long for each piece of a pack_upper stream (TCG is slow).
constexpr double kPackFrameTimeoutS = 120;

// Rejects what a guest's upper dir cannot hold and a layer must not: device
// nodes other than overlayfs whiteouts (character 0:0). A guest's root
// cannot make them (aether drops its capabilities); a guest that sends one
// anyway gets no device node onto the host or into a layer.
Status checkUnpacked(const std::string& root) {
  std::vector<std::string> todo = {""};
  while (!todo.empty()) {
    std::string rel = todo.back();
    todo.pop_back();
    std::string dir = root + (rel.empty() ? "" : "/" + rel);
    DIR* d = ::opendir(dir.c_str());
    if (!d) return sysError("opendir " + dir);
    Status bad = Status::ok();
    while (auto* e = ::readdir(d)) {
      if (!std::strcmp(e->d_name, ".") || !std::strcmp(e->d_name, "..")) continue;
      std::string r = rel.empty() ? e->d_name : rel + "/" + e->d_name;
      struct stat st;
      if (::fstatat(dirfd(d), e->d_name, &st, AT_SYMLINK_NOFOLLOW) != 0) {
        bad = sysError("stat " + r);
        break;
      }
      if (S_ISDIR(st.st_mode)) {
        todo.push_back(r);
      } else if (S_ISBLK(st.st_mode) || (S_ISCHR(st.st_mode) && st.st_rdev != 0)) {
        bad = Status(Code::kPermissionDenied,
                     "the guest's writes hold a device node, /" + r + ": refused");
        break;
      }
    }
    ::closedir(d);
    RETURN_IF_ERROR(bad);
  }
  return Status::ok();
}

Status writeAll(int fd, const char* p, size_t n) {
  while (n > 0) {
    ssize_t w = ::write(fd, p, n);
    if (w < 0 && errno == EINTR) continue;
    if (w < 0) return sysError("write");
    p += w;
    n -= size_t(w);
  }
  return Status::ok();
}

Status MicroVmInstance::exportUpper(const std::string& dest) {
  if (!conn_) return Status(Code::kUnavailable, "no agent connection");
  // The guest's aether freezes its disk, streams its upper dir as a tar and
  // thaws it at the end; a cancel (any error here) thaws it too.
  const std::string tarPath = dest + ".tar";
  auto stream = conn_->openStream();
  bool started = false;
  auto st = [&]() -> Status {
    RETURN_IF_ERROR(conn_->send(stream->id(), proto::FrameType::kPackUpper, "{}"));
    UniqueFd out(::open(tarPath.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600));
    if (!out) return sysError("create " + tarPath);
    // A tar of a disk of diskBytes_ (with headers: two blocks per entry at
    // most); a guest that sends more is refused, not believed.
    const uint64_t cap = uint64_t(std::max<int64_t>(diskBytes_, 0)) * 2 + (64ull << 20);
    uint64_t got = 0;
    for (;;) {
      ASSIGN_OR_RETURN(proto::Frame f, stream->next(monoSeconds() + kPackFrameTimeoutS));
      if (f.type == proto::FrameType::kResult) {
        RETURN_IF_ERROR(resultStatus(f.payload));
        if (started) return internalError("pack_upper: a second result");
        started = true;
        continue;
      }
      if (f.type != proto::FrameType::kData || !started) continue;
      if (f.payload.empty()) break;
      got += f.payload.size();
      if (got > cap) {
        return Status(Code::kResourceExhausted,
                      "the guest sent more than its disk can hold (" + std::to_string(cap) +
                          " bytes)");
      }
      if (Status w = writeAll(out.get(), f.payload.data(), f.payload.size()); !w.isOk()) {
        return w.withContext("write " + tarPath);
      }
    }
    return Status::ok();
  }();
  if (!st.isOk()) (void)conn_->send(stream->id(), proto::FrameType::kCancel, "");
  conn_->closeStream(stream->id());
  if (st.isOk()) {
    // GNU tar as in image::buildLayer: owners and modes exact; of the
    // xattrs only those a layer keeps. Names with ".." or a leading "/" are
    // refused by tar itself, and symlinks are made last.
    st = makeDirs(dest, 0755);
    if (st.isOk()) {
      st = image::runCommand({"tar", "--numeric-owner", "--xattrs", "--xattrs-include=user.*",
                              "--xattrs-include=security.capability",
                              "--xattrs-include=trusted.overlay.opaque", "--same-permissions",
                              "--same-owner", "-xf", tarPath, "-C", dest});
    }
    if (st.isOk()) st = checkUnpacked(dest);
  }
  ::unlink(tarPath.c_str());
  return st;
}

// The guest's vsock CID is kept in the VM's directory: a restarted edge
// reconnects (and a restore from disk boots) with the same one.
constexpr const char* kCidFile = "vsock.cid";

// A vsock connection to `port` of guest `cid`, bounded by timeoutS.
Result<UniqueFd> connectVsock(uint32_t cid, uint32_t port, double timeoutS) {
  UniqueFd fd(::socket(AF_VSOCK, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!fd) return sysError("vsock socket");
  struct timeval tv = {long(timeoutS), long((timeoutS - double(long(timeoutS))) * 1e6)};
  ::setsockopt(fd.get(), AF_VSOCK, SO_VM_SOCKETS_CONNECT_TIMEOUT, &tv, sizeof tv);
  struct sockaddr_vm addr = {};
  addr.svm_family = AF_VSOCK;
  addr.svm_cid = cid;
  addr.svm_port = port;
  if (::connect(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
    return sysError("connect vsock " + std::to_string(cid) + ":" + std::to_string(port));
  }
  return fd;
}

// The host's end of the agent channel: the unix socket QEMU serves for the
// virtio-serial port, or (a vsock CID set) a connection to the guest's vsock
// listener.
Result<UniqueFd> connectAgent(const MicroVmInstance& inst) {
  if (inst.cid_ != 0) return connectVsock(inst.cid_, kAgentVsockPort, 1);
  UniqueFd dirFd(::open(inst.dir_.c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC));
  if (!dirFd) return sysError("open " + inst.dir_);
  return connectUnix(dirFd.get(), "agent.sock");
}

// Connects to the VM's agent again and sends reattach: the guest's relay
// saw the previous host go and waits for it. Until its hello. A vsock
// connect is retried until the deadline: a guest just continued (a restore)
// answers it only once it runs again.
Status reattach(MicroVmInstance& inst, Reactor* reactor, double deadline) {
  auto s = connectAgent(inst);
  while (!s.isOk() && inst.cid_ != 0 && monoSeconds() < deadline) {
    ::usleep(50000);
    s = connectAgent(inst);
  }
  if (!s.isOk()) return s.status();
  UniqueFd sock = std::move(*s);
  auto conn = std::make_shared<AgentConn>(std::move(sock), "vm-" + inst.id_);
  RETURN_IF_ERROR(reactor->add(conn));
  inst.setConn(conn);
  // The guest's relay saw the previous host go and waits for this.
  RETURN_IF_ERROR(conn->send(0, proto::FrameType::kReattach, "{}"));
  return awaitHello(*conn, deadline, Code::kUnavailable, "its guest agent did not answer");
}

Status runMkfs(const std::string& image) {
  pid_t pid = ::fork();
  if (pid < 0) return sysError("fork");
  if (pid == 0) {
    int null = ::open("/dev/null", O_RDWR);
    ::dup2(null, 0);
    ::dup2(null, 1);
    ::execlp("mkfs.ext4", "mkfs.ext4", "-q", "-F", "-m", "0", "-E",
             "nodiscard,lazy_itable_init=1,lazy_journal_init=1", image.c_str(), nullptr);
    ::_exit(127);
  }
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    return internalError("mkfs.ext4 " + image + " failed (status " + std::to_string(status) + ")");
  }
  return Status::ok();
}

}  // namespace

MicroVmProbe probeMicroVm(const MicroVmOptions& opts) {
  MicroVmProbe p;
  p.qemu = qemu::which(opts.qemuPath);
  if (p.qemu.empty()) {
    p.reason = opts.qemuPath + " not found (install qemu-system-x86: scripts/install-deps.sh)";
    return p;
  }
  for (const char* f : {"/vmlinux", "/initramfs.cpio"}) {
    if (::access((opts.guestDir + f).c_str(), R_OK) != 0) {
      p.reason = "no guest kernel/initramfs at " + opts.guestDir + f +
                 " (install linux-image-cloud-amd64 and rebuild: the microvm-guest target)";
      return p;
    }
  }
  p.accelerator =
      qemu::chooseAccel(opts.accel, p.qemu, "microvm", &p.reason, opts.guestDir + "/vmlinux");
  if (p.accelerator.empty()) return p;
  UniqueFd vsock(::open("/dev/vhost-vsock", O_RDWR | O_CLOEXEC));
  p.vhostVsock = bool(vsock);
  std::string why;
  p.agentChannel = chooseAgentChannel(opts.agentChannel, p.vhostVsock, &why);
  if (p.agentChannel.empty()) {
    p.reason = why;
    return p;
  }
  p.reason += "; agent channel " + why;
  p.available = true;
  return p;
}

std::string chooseAgentChannel(const std::string& want, bool vhostVsock, std::string* why) {
  if (want == "virtio-serial") {
    *why = "virtio-serial as configured";
    return want;
  }
  if (want != "vsock" && want != "auto") {
    *why = "unknown agent channel '" + want + "' (auto, vsock or virtio-serial)";
    return "";
  }
  if (vhostVsock) {
    *why = "vsock (/dev/vhost-vsock opened)";
    return "vsock";
  }
  if (want == "vsock") {
    *why = "vsock required but /dev/vhost-vsock could not be opened";
    return "";
  }
  *why = "virtio-serial (no usable /dev/vhost-vsock)";
  return "virtio-serial";
}

struct MicroVmBackend::Boot {
  MicroVmInstance* inst;
  std::vector<std::pair<std::string, LayerFiles>> files;  // bottom layer first
  std::string consoleLog;
};

Result<std::unique_ptr<MicroVmBackend>> MicroVmBackend::make(MicroVmOptions opts,
                                                              MicroVmProbe probe,
                                                              Cgroups* cgroups,
                                                              LayerCache* layers,
                                                              Reactor* reactor,
                                                              const std::set<std::string>& keep) {
  if (!probe.available) return Status(Code::kFailedPrecondition, probe.reason);
  std::unique_ptr<MicroVmBackend> b(new MicroVmBackend(opts, probe, cgroups, layers, reactor));
  RETURN_IF_ERROR(makeDirs(opts.vmRoot, 0700));
  RETURN_IF_ERROR(makeDirs(opts.logDir, 0700));
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

std::vector<std::string> microvmArgs(const MicroVmOptions& opts, const MicroVmProbe& probe,
                                     const SandboxSpec& spec,
                                     const std::vector<std::pair<std::string, LayerFiles>>& files,
                                     uint32_t cid) {
  int vcpus = std::max(1, int(std::ceil(spec.cpu - 1e-9)));
  std::string accel =
      probe.accelerator == "kvm" ? "kvm" : "tcg,tb-size=" + std::to_string(kTbSizeMb);
  GuestDisks g = guestDisks(files);
  std::string append =
      "console=ttyS0 reboot=t panic=-1 quiet loglevel=4 dsec.hostname=" + spec.id + g.params;
  // The guest's init configures the NIC it finds from these (guest_init.cc).
  if (spec.network) {
    append += std::string(" dsec.ip=") + qemu::kGuestAddr + "/" +
              std::to_string(qemu::kGuestPrefix) + " dsec.gw=" + qemu::kGuestGateway;
  }
  // Under TCG there is no PIT/HPET to calibrate the TSC against (microvm has
  // neither) and the boot stalls: give the kernel a frequency instead.
  if (probe.accelerator != "kvm") append += " tsc_early_khz=2000000";
  const bool vsock = cid != 0;  // chosen at create by the probe's agent channel
  if (vsock) append += " dsec.vsock=" + std::to_string(kAgentVsockPort);
  // One option and its value per pair.
  // clang-format off
  std::vector<std::string> args = {
      probe.qemu, "-name", spec.id, "-M",
      "microvm,x-option-roms=off,isa-serial=on,rtc=on",
      "-accel", accel, "-cpu", probe.accelerator == "kvm" ? "host" : "max",
      "-smp", std::to_string(vcpus), "-m", std::to_string(spec.memoryBytes >> 20),
      "-nodefaults", "-no-user-config", "-nographic", "-no-reboot",
      "-sandbox", "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny",
      "-kernel", opts.guestDir + "/vmlinux", "-initrd", opts.guestDir + "/initramfs.cpio",
      "-append", append, "-serial", "file:console.log",
      "-qmp", "unix:qmp.sock,server=on,wait=off"};
  // clang-format on
  // The agent channel: the guest's vsock listener, reached by its CID
  // through the host's vhost-vsock, or a virtio-serial port that QEMU serves
  // as a unix socket.
  std::vector<std::string> channel =
      vsock ? std::vector<std::string>{"-device",
                                       "vhost-vsock-device,guest-cid=" + std::to_string(cid)}
            : std::vector<std::string>{
                  "-chardev", "socket,id=agent,path=agent.sock,server=on,wait=off",
                  "-device",  "virtio-serial-device",
                  "-device",  "virtserialport,chardev=agent,name=dsec.agent"};
  args.insert(args.end(), channel.begin(), channel.end());
  auto disk = [&](const std::string& id, const std::string& file, bool ro) {
    args.push_back("-drive");
    args.push_back("id=" + id + ",file=" + file + ",format=raw,if=none,cache=" +
                   (ro ? "none,readonly=on" : "writeback"));
    args.push_back("-device");
    args.push_back("virtio-blk-device,drive=" + id + ",serial=" + id);
  };
  for (auto& [serial, file] : g.disks) disk(serial, file, true);
  disk("rw", "disk.img", false);
  if (spec.network) {
    for (auto& a : qemu::nicArgs("virtio-net-device")) args.push_back(a);
  }
  return args;
}

Status checkMicrovmArgs(const std::vector<std::string>& args,
                        const std::vector<std::pair<std::string, LayerFiles>>& files) {
  // Every -device but the port on the virtio-serial bus takes a transport.
  size_t transports = 0, disks = 0;
  for (size_t i = 0; i + 1 < args.size(); ++i) {
    if (args[i] != "-device" || startsWith(args[i + 1], "virtserialport")) continue;
    ++transports;
    if (startsWith(args[i + 1], "virtio-blk-device")) ++disks;
  }
  std::string image = std::to_string(files.size()) + " layers" +
                      (files.empty() ? "" : ", top layer " + files.back().first);
  if (transports > kMicroVmTransports) {
    size_t others = transports - disks + 1;  // the agent channel, a NIC, the writable disk
    return invalidArg("image", "the image (" + image + ") needs " + std::to_string(disks - 1) +
                                   " read-only disks in a microvm (metadata images and distinct "
                                   "data blobs), more than the " +
                                   std::to_string(kMicroVmTransports - others) +
                                   " its virtio-mmio transports leave; use fewer layers or the "
                                   "container backend");
  }
  auto append = std::find(args.begin(), args.end(), "-append");
  if (append != args.end() && append + 1 != args.end() &&
      (append + 1)->size() > kMaxKernelCmdline) {
    return invalidArg("image", "the image (" + image + ") needs a kernel command line of " +
                                   std::to_string((append + 1)->size()) +
                                   " bytes in a microvm, more than " +
                                   std::to_string(kMaxKernelCmdline));
  }
  return Status::ok();
}

Status MicroVmBackend::bootOnce(const SandboxSpec& spec, Boot& b, bool* hung) {
  *hung = false;
  MicroVmInstance& inst = *b.inst;
  const std::string& dir = inst.dir_;
  // argv, all of it made before fork; kept for a restore from hibernation.
  inst.args_ = microvmArgs(opts_, probe_, spec, b.files, inst.cid_);
  const std::vector<std::string>& args = inst.args_;
  for (const char* f : {"/agent.sock", "/qmp.sock", "/console.log"}) ::unlink((dir + f).c_str());
  ASSIGN_OR_RETURN(qemu::Process proc, qemu::spawnConfined(args, dir, cgroups_, spec.id));
  inst.pid_ = proc.pid;
  inst.pidfd_ = std::move(proc.pidfd);
  auto abandon = [&](Status st) -> Status {
    if (inst.conn_) {
      reactor_->remove(inst.conn_);
      inst.conn_.reset();
    }
    killAndWait(inst.pidfd_.get());
    inst.pidfd_.reset();
    inst.pid_ = -1;
    return st;
  };
  double deadline = monoSeconds() + opts_.bootTimeoutS;
  auto qemuFailed = [&]() {
    std::string why = tail(dir + "/qemu.log", 600);
    return Status(Code::kInternal, "QEMU exited: " + (why.empty() ? "(no output)" : why) +
                                       " (console log: " + b.consoleLog + ")");
  };
  // QEMU makes the agent socket as it starts; a vsock listener is there
  // once the guest's init made it.
  UniqueFd sock;
  for (;;) {
    auto s = connectAgent(inst);
    if (s.isOk()) {
      sock = std::move(*s);
      break;
    }
    if (exited(inst.pidfd_.get())) return abandon(qemuFailed());
    if (monoSeconds() > deadline) {
      *hung = true;
      return abandon(Status(Code::kUnavailable, inst.cid_ != 0
                                                    ? "the guest's agent never listened on vsock"
                                                    : "QEMU did not open the agent socket"));
    }
    ::usleep(inst.cid_ != 0 ? 50000 : 5000);
  }
  inst.conn_ = std::make_shared<AgentConn>(std::move(sock), "vm-" + spec.id);
  if (Status st = reactor_->add(inst.conn_); !st.isOk()) {
    inst.conn_.reset();
    return abandon(st);
  }
  // The guest speaks only once it has this (guest_init.cc); QEMU holds it
  // until the guest opens its port.
  if (Status st = inst.conn_->send(0, proto::FrameType::kInit, "{}"); !st.isOk()) {
    // A QEMU that failed at once (a bad kernel) may close the socket just
    // after accepting us: say why it exited rather than "broken pipe".
    struct pollfd p = {inst.pidfd_.get(), POLLIN, 0};
    if (::poll(&p, 1, 2000) == 1) return abandon(qemuFailed());
    return abandon(st);
  }
  // Wait for the hello, and notice a QEMU that died meanwhile.
  for (;;) {
    double step = std::min(deadline, monoSeconds() + 0.5);
    Status st = awaitHello(*inst.conn_, step, Code::kUnavailable, "no hello");
    if (st.isOk()) return Status::ok();
    if (exited(inst.pidfd_.get())) return abandon(qemuFailed());
    if (st.code() != Code::kUnavailable) {
      return abandon(st.withContext("guest start-up (console log: " + b.consoleLog + ")"));
    }
    if (monoSeconds() >= deadline) {
      *hung = true;
      return abandon(st);
    }
  }
}

Result<std::unique_ptr<Instance>> MicroVmBackend::create(const SandboxSpec& spec,
                                                         std::function<void()> onDeath) {
  if (spec.memoryBytes < kMinGuestMemory) {
    return invalidArg("memory_mb", "a microvm needs memory_mb >= " +
                                       std::to_string(kMinGuestMemory >> 20));
  }
  if (spec.diskBytes <= 0) return invalidArg("disk_mb", "disk_mb must be positive");
  Laps laps;
  auto inst = std::make_unique<MicroVmInstance>();
  inst->id_ = spec.id;
  inst->network_ = spec.network;
  inst->diskBytes_ = spec.diskBytes;
  inst->cgroups_ = cgroups_;
  inst->dir_ = opts_.vmRoot + "/" + spec.id;
  bool cgroupMade = false;
  Boot b{inst.get(), {}, opts_.logDir + "/" + spec.id + ".console.log"};
  auto fail = [&](Status st) -> Status {
    if (inst->conn_) reactor_->remove(inst->conn_);
    killAndWait(inst->pidfd_.get());
    if (cgroupMade) (void)cgroups_->remove(spec.id);
    for (auto& d : inst->layers_) layers_->release(d);
    // The console log is kept for diagnosis; the rest goes.
    ::rename((inst->dir_ + "/console.log").c_str(), b.consoleLog.c_str());
    (void)removeTree(inst->dir_);
    return st.withContext("create " + spec.id);
  };
  if (::mkdir(inst->dir_.c_str(), 0700) != 0) return fail(sysError("mkdir " + inst->dir_));
  if (probe_.agentChannel == "vsock") {
    // A CID of its own on this host (3 and up; 2^31 of them, so a clash
    // with another VM is unlikely, and QEMU refuses one in use).
    uint32_t cid = 0;
    while (cid < 3) cid = uint32_t(std::strtoul(randomHex(4).c_str(), nullptr, 16) & 0x7fffffff);
    inst->cid_ = cid;
    if (Status st = writeFileAtomic(inst->dir_ + "/" + kCidFile, std::to_string(cid) + "\n");
        !st.isOk()) {
      return fail(st);
    }
  }
  // The writable disk: sparse, disk_mb, ext4 (the guest's upper layer).
  {
    std::string img = inst->dir_ + "/disk.img";
    UniqueFd fd(::open(img.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600));
    if (!fd) return fail(sysError("create " + img));
    if (::ftruncate(fd.get(), spec.diskBytes) != 0) return fail(sysError("truncate " + img));
    fd.reset();
    if (Status st = runMkfs(img); !st.isOk()) return fail(st);
  }
  laps.lap("disk");
  for (auto& d : spec.layers) {
    auto m = layers_->acquireMount(d);
    if (!m.isOk()) return fail(std::move(m).takeStatus());
    inst->layers_.push_back(d);
    b.files.push_back({d, m->files});
  }
  if (Status st = checkMicrovmArgs(microvmArgs(opts_, probe_, spec, b.files, inst->cid_), b.files);
      !st.isOk()) {
    return fail(st);
  }
  laps.lap("layers");
  CgroupLimits limits{spec.cpu, spec.memoryBytes + kQemuOverheadBytes, spec.pids};
  if (Status st = cgroups_->create(spec.id, limits); !st.isOk()) return fail(st);
  cgroupMade = true;
  // A guest that hangs at boot (it happens under TCG) is killed and booted
  // once more.
  if (Status st = qemu::bootWithRetry("microvm", spec.id, inst->dir_, opts_.bootTimeoutS,
                                      b.consoleLog,
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
  log::info("microvm " + spec.id + " booted (" + probe_.accelerator + ") ms: " + laps.str());
  return std::unique_ptr<Instance>(std::move(inst));
}

Result<std::unique_ptr<Instance>> MicroVmBackend::adopt(const SandboxState& state,
                                                        std::function<void()> onDeath) {
  auto inst = std::make_unique<MicroVmInstance>();
  inst->id_ = state.spec.id;
  inst->network_ = state.spec.network;
  inst->diskBytes_ = state.spec.diskBytes;
  inst->cgroups_ = cgroups_;
  inst->dir_ = opts_.vmRoot + "/" + state.spec.id;
  inst->pid_ = state.pid;
  if (auto cid = readFile(inst->dir_ + "/" + kCidFile); cid.isOk()) {
    inst->cid_ = uint32_t(std::strtoul(cid->c_str(), nullptr, 10));
  }
  auto fail = [&](Status st) -> Status {
    if (inst->conn_) reactor_->remove(inst->conn_);
    for (auto& d : inst->layers_) layers_->release(d);
    return st.withContext("adopt " + state.spec.id);
  };
  if (state.hibernated) {
    // Nothing runs: the saved state and the disk are the sandbox. Its layer
    // files are needed again for the restore's QEMU.
    std::string saved = inst->dir_ + "/" + kStateFile;
    if (::access(saved.c_str(), R_OK) != 0) return fail(sysError("its saved state " + saved));
    std::vector<std::pair<std::string, LayerFiles>> files;
    for (auto& d : state.spec.layers) {
      auto m = layers_->acquireMount(d);
      if (!m.isOk()) return fail(std::move(m).takeStatus());
      inst->layers_.push_back(d);
      files.push_back({d, m->files});
    }
    inst->args_ = microvmArgs(opts_, probe_, state.spec, files, inst->cid_);
    inst->pid_ = -1;
    inst->hibernated_ = true;
    inst->conn_ = qemu::hibernatedConn(state.spec.id);
    return std::unique_ptr<Instance>(std::move(inst));
  }
  // The guest's relay noticed the old edge go (its connection closed) and
  // passes the reattach on to its agent, which answers with a hello.
  auto pidfd = qemu::adoptQemu(state, inst->dir_,
                               [&](int) { return reattach(*inst, reactor_, monoSeconds() + 30); });
  if (!pidfd.isOk()) return fail(pidfd.status());
  inst->pidfd_ = std::move(*pidfd);
  for (auto& d : state.spec.layers) {
    if (auto m = layers_->acquire(d); m.isOk()) {
      inst->layers_.push_back(d);
    } else {
      log::warn("adopt " + state.spec.id + ": layer " + d + ": " + m.status().toString());
    }
  }
  if (Status st = reactor_->watchExit(inst->pidfd_.get(), std::move(onDeath)); !st.isOk()) {
    return fail(st);
  }
  return std::unique_ptr<Instance>(std::move(inst));
}

Status MicroVmBackend::hibernate(Instance& base, bool paused,
                                 const std::function<Status()>& persist) {
  auto& inst = static_cast<MicroVmInstance&>(base);
  std::lock_guard life(inst.lifeMu_);
  if (inst.hibernated_) return Status::ok();
  const std::string& dir = inst.dir_;
  const std::string console = dir + "/console.log";
  double t0 = monoSeconds();
  // The guest's agent lets go of this connection first (as when an edge
  // dies), so that the restored guest takes the next edge's reattach: the
  // relay says so on the console.
  size_t waits = qemu::countInFile(console, kRelayWaits);
  if (paused) {
    if (Status st = qemu::qmp(dir, "cont").status(); !st.isOk()) {
      return st.withContext("hibernate " + inst.id_);
    }
  }
  std::shared_ptr<AgentConn> old = inst.agent();
  reactor_->remove(old);
  ::shutdown(old->fd(), SHUT_RDWR);
  old->fail(Status(Code::kUnavailable, "sandbox " + inst.id_ + " is being hibernated"));
  // Back as it was: the guest running (stopped again if it was), the agent
  // reattached.
  auto undo = [&](Status st) -> Status {
    (void)qemu::qmp(dir, "cont");
    if (Status r = reattach(inst, reactor_, monoSeconds() + opts_.bootTimeoutS); !r.isOk()) {
      log::error("hibernate " + inst.id_ + ": reattaching after a failed save: " + r.toString());
    }
    if (paused) (void)qemu::qmp(dir, "stop");
    return Status(qemu::nodeFailure(st.code()),
                  "hibernate " + inst.id_ + " (it keeps running): " + st.message());
  };
  for (double deadline = monoSeconds() + kRelayTimeoutS;
       qemu::countInFile(console, kRelayWaits) <= waits;) {
    if (exited(inst.pidfd_.get())) return Status(Code::kUnavailable, "its QEMU exited");
    if (monoSeconds() > deadline) {
      return undo(Status(Code::kDeadlineExceeded,
                         "the guest's agent did not let go of its connection in time"));
    }
    ::usleep(20000);
  }
  double t1 = monoSeconds();
  auto bytes = qemu::saveToStateFile(dir, persist);
  if (!bytes.isOk()) return undo(bytes.status());
  // The state file is the sandbox from here on: QEMU goes (its disks were
  // flushed when the migration completed).
  double t2 = monoSeconds();
  qemu::endSavedQemu(dir, &inst.pidfd_, reactor_, {"agent.sock", "qmp.sock"});
  inst.pid_ = -1;
  inst.hibernated_ = true;
  char msg[256];
  std::snprintf(msg, sizeof msg,
                "microvm %s hibernated: %.1f MB of state in %.2f s (agent let go in %.2f s, "
                "QEMU gone in %.2f s)",
                inst.id_.c_str(), double(*bytes) / 1e6, t2 - t1, t1 - t0, monoSeconds() - t2);
  log::info(msg);
  return Status::ok();
}

Status MicroVmBackend::restore(Instance& base, std::function<void()> onDeath,
                               const std::function<Status()>& beforeRun) {
  auto& inst = static_cast<MicroVmInstance&>(base);
  std::lock_guard life(inst.lifeMu_);
  if (!inst.hibernated_) return Status::ok();
  const std::string& dir = inst.dir_;
  const std::string saved = dir + "/" + kStateFile;
  const std::string keptLog = opts_.logDir + "/" + inst.id_ + ".console.log";
  double t0 = monoSeconds();
  auto fail = [&](Status st) -> Status {
    if (auto c = inst.agent(); c && !c->dead()) {
      reactor_->remove(c);
      c->fail(Status(Code::kUnavailable, "the restore failed"));
    }
    return qemu::failedRestore(inst.id_, dir, keptLog, &inst.pid_, &inst.pidfd_, st);
  };
  if (::access(saved.c_str(), R_OK) != 0) return fail(sysError("its saved state " + saved));
  if (Status st =
          qemu::startFromStateFile(inst.args_, dir, cgroups_, inst.id_, {"agent.sock", "qmp.sock"},
                                   &inst.pid_, &inst.pidfd_, beforeRun);
      !st.isOk()) {
    return fail(st);
  }
  double t1 = monoSeconds();
  if (Status st = reattach(inst, reactor_, monoSeconds() + opts_.bootTimeoutS); !st.isOk()) {
    return fail(st);
  }
  if (Status st = qemu::recordAndWatch(dir, inst.pid_, inst.pidfd_.get(), reactor_,
                                       std::move(onDeath));
      !st.isOk()) {
    return fail(st);
  }
  ::unlink(saved.c_str());
  inst.hibernated_ = false;
  char msg[200];
  std::snprintf(msg, sizeof msg,
                "microvm %s restored: state loaded in %.2f s, agent back %.2f s later",
                inst.id_.c_str(), t1 - t0, monoSeconds() - t1);
  log::info(msg);
  return Status::ok();
}

Status MicroVmBackend::destroy(Instance& base) {
  auto& inst = static_cast<MicroVmInstance&>(base);
  std::lock_guard life(inst.lifeMu_);  // a hibernate or restore under way ends first
  reactor_->unwatchExit(inst.pidfd_.get());
  if (inst.conn_) {
    reactor_->remove(inst.conn_);
    inst.conn_->fail(Status(Code::kUnavailable, "sandbox destroyed"));
  }
  if (inst.pidfd_) syscall(SYS_pidfd_send_signal, inst.pidfd_.get(), SIGKILL, nullptr, 0);
  for (auto& d : inst.layers_) layers_->release(d);
  inst.layers_.clear();
  cleaner_->add(inst.id_, std::move(inst.pidfd_));
  return Status::ok();
}

void MicroVmBackend::shutdown(bool) {
  // Running VMs are destroyed by the Edge before this (or, with live
  // restore, left running for the next edge): wait for the cleaner only.
  if (cleaner_) cleaner_->drain();
}

MicroVmBackend::~MicroVmBackend() {
  shutdown();
  cleaner_.reset();
}

void MicroVmBackend::removeOrphan(const std::string& id) {
  qemu::removeLeftovers(cgroups_, id, opts_.vmRoot + "/" + id);
}

int MicroVmBackend::cleanupOrphans() { return int(std::exchange(orphans_, {}).size()); }

}  // namespace dsec::edge
