#include "aether/guest_init.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <fcntl.h>
#include <linux/vm_sockets.h>
#include <net/if.h>
#include <net/route.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <sys/ioctl.h>
#include <sys/mount.h>
#include <sys/reboot.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "aether/agent.h"
#include "aether/json_fields.h"
#include "common/fd.h"
#include "common/frame.h"

namespace dsec::aether {
namespace {

constexpr int kReattachFd = 9;  // as in main.cc: the agent's reattach descriptor
constexpr const char* kPortName = "dsec.agent";

void say(const std::string& msg) { std::fprintf(stderr, "dsec-aether(guest): %s\n", msg.c_str()); }

std::string readSmall(const std::string& path) {
  std::string out;
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return out;
  char buf[4096];
  ssize_t n;
  while ((n = ::read(fd, buf, sizeof buf)) > 0) out.append(buf, size_t(n));
  ::close(fd);
  while (!out.empty() && (out.back() == '\n' || out.back() == ' ')) out.pop_back();
  return out;
}

Status mountOrFail(const char* src, const std::string& target, const char* type,
                   unsigned long flags, const std::string& data) {
  ::mkdir(target.c_str(), 0755);
  if (::mount(src, target.c_str(), type, flags, data.empty() ? nullptr : data.c_str()) != 0) {
    return sysError(std::string("mount ") + type + " " + src + " on " + target +
                    (data.empty() ? "" : " (" + data + ")"));
  }
  return Status::ok();
}

// Loads /modules/<name> in /modules/order (dependencies first). Modules the
// kernel has built in are not in the initramfs at all. The vsock transport
// only when the host gave the guest a vsock device for the agent.
Status loadModules(bool vsock) {
  std::string order = readSmall("/modules/order");
  size_t pos = 0;
  while (pos < order.size()) {
    size_t nl = order.find('\n', pos);
    std::string name = order.substr(pos, nl == std::string::npos ? std::string::npos : nl - pos);
    pos = nl == std::string::npos ? order.size() : nl + 1;
    if (name.empty()) continue;
    if (!vsock && name.find("vsock") != std::string::npos) continue;
    std::string path = "/modules/" + name;
    UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
    if (!fd) return sysError("open " + path);
    if (::syscall(SYS_finit_module, fd.get(), "", 0) != 0 && errno != EEXIST) {
      return sysError("load module " + name);
    }
  }
  return Status::ok();
}

std::map<std::string, std::string> kernelParams() {
  std::map<std::string, std::string> out;
  std::string cmdline = readSmall("/proc/cmdline");
  size_t pos = 0;
  while (pos < cmdline.size()) {
    size_t sp = cmdline.find(' ', pos);
    std::string w = cmdline.substr(pos, sp == std::string::npos ? std::string::npos : sp - pos);
    pos = sp == std::string::npos ? cmdline.size() : sp + 1;
    if (w.rfind("dsec.", 0) != 0) continue;
    size_t eq = w.find('=');
    out[w.substr(5, eq == std::string::npos ? std::string::npos : eq - 5)] =
        eq == std::string::npos ? "" : w.substr(eq + 1);
  }
  return out;
}

// virtio-blk disks by serial ("l<i>m", "l<i>d", "x<k>", "rw") -> /dev/vdX, waiting
// (the drivers probe asynchronously) until `want` of them are there.
Result<std::map<std::string, std::string>> findDisks(size_t want) {
  std::map<std::string, std::string> disks;
  for (int tries = 0; tries < 1000; ++tries) {
    disks.clear();
    if (DIR* d = ::opendir("/sys/block")) {
      while (auto* e = ::readdir(d)) {
        std::string name = e->d_name;
        if (name.rfind("vd", 0) != 0) continue;
        std::string serial = readSmall("/sys/block/" + name + "/serial");
        if (!serial.empty()) disks[serial] = "/dev/" + name;
      }
      ::closedir(d);
    }
    if (disks.size() >= want) return disks;
    ::usleep(10000);
  }
  return Status(Code::kUnavailable, "only " + std::to_string(disks.size()) + " of " +
                                        std::to_string(want) + " disks appeared");
}

// /dev/vportNpM of the port named kPortName.
Result<std::string> findPort() {
  for (int tries = 0; tries < 1000; ++tries) {
    if (DIR* d = ::opendir("/sys/class/virtio-ports")) {
      std::string found;
      while (auto* e = ::readdir(d)) {
        if (e->d_name[0] == '.') continue;
        if (readSmall(std::string("/sys/class/virtio-ports/") + e->d_name + "/name") == kPortName) {
          found = std::string("/dev/") + e->d_name;
        }
      }
      ::closedir(d);
      if (!found.empty()) return found;
    }
    ::usleep(10000);
  }
  return notFound(std::string("no virtio-serial port named ") + kPortName);
}

// Everything up to the switch into the sandbox's root.
// *upper: the overlay's upper dir, kept open for pack_upper (the chroot
// hides it from everything else).
// Brings lo up and, when the host gave the guest a NIC (dsec.ip=ADDR/PREFIX
// dsec.gw=GW on the command line: QEMU's user-mode network, qemu.h), sets
// that address on the first other interface with a default route via GW.
// Plain ioctls: the guest's init has no netlink library and needs none.
Status setupNet(const std::map<std::string, std::string>& params) {
  UniqueFd s(::socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0));
  if (!s) return sysError("socket");
  auto up = [&](const std::string& name) -> Status {
    struct ifreq ifr = {};
    std::strncpy(ifr.ifr_name, name.c_str(), IFNAMSIZ - 1);
    if (::ioctl(s.get(), SIOCGIFFLAGS, &ifr) != 0) return sysError("SIOCGIFFLAGS " + name);
    ifr.ifr_flags |= IFF_UP;
    if (::ioctl(s.get(), SIOCSIFFLAGS, &ifr) != 0) return sysError("SIOCSIFFLAGS " + name);
    return Status::ok();
  };
  RETURN_IF_ERROR(up("lo"));
  auto ip = params.find("ip");
  auto gw = params.find("gw");
  if (ip == params.end()) return Status::ok();
  size_t slash = ip->second.find('/');
  std::string addr = ip->second.substr(0, slash);
  int prefix = slash == std::string::npos ? 24 : std::atoi(ip->second.c_str() + slash + 1);
  if (prefix < 1 || prefix > 32) return invalidArg("dsec.ip", "bad prefix in " + ip->second);
  std::string nic;
  if (DIR* d = ::opendir("/sys/class/net")) {
    std::vector<std::string> names;
    while (struct dirent* e = ::readdir(d)) {
      std::string n = e->d_name;
      if (n != "." && n != ".." && n != "lo") names.push_back(n);
    }
    ::closedir(d);
    std::sort(names.begin(), names.end());
    if (!names.empty()) nic = names.front();
  }
  if (nic.empty()) return notFound("the host gave a NIC but the guest sees no network device");
  auto sin = [](const std::string& text, struct sockaddr* out) -> bool {
    auto* a = reinterpret_cast<struct sockaddr_in*>(out);
    a->sin_family = AF_INET;
    return ::inet_pton(AF_INET, text.c_str(), &a->sin_addr) == 1;
  };
  struct ifreq ifr = {};
  std::strncpy(ifr.ifr_name, nic.c_str(), IFNAMSIZ - 1);
  if (!sin(addr, &ifr.ifr_addr)) return invalidArg("dsec.ip", "bad address " + addr);
  if (::ioctl(s.get(), SIOCSIFADDR, &ifr) != 0) return sysError("SIOCSIFADDR " + nic);
  uint32_t mask = prefix == 32 ? 0xffffffffu : ~(0xffffffffu >> prefix);
  auto* m = reinterpret_cast<struct sockaddr_in*>(&ifr.ifr_netmask);
  m->sin_family = AF_INET;
  m->sin_addr.s_addr = htonl(mask);
  if (::ioctl(s.get(), SIOCSIFNETMASK, &ifr) != 0) return sysError("SIOCSIFNETMASK " + nic);
  RETURN_IF_ERROR(up(nic));
  if (gw != params.end()) {
    struct rtentry rt = {};
    if (!sin(gw->second, &rt.rt_gateway)) return invalidArg("dsec.gw", "bad gateway " + gw->second);
    sin("0.0.0.0", &rt.rt_dst);
    sin("0.0.0.0", &rt.rt_genmask);
    rt.rt_flags = RTF_UP | RTF_GATEWAY;
    if (::ioctl(s.get(), SIOCADDRT, &rt) != 0) return sysError("default route via " + gw->second);
  }
  return Status::ok();
}

Status setupGuest(const std::map<std::string, std::string>& params, UniqueFd* upper) {
  RETURN_IF_ERROR(loadModules(params.count("vsock") > 0));
  int layers = 0;
  if (auto it = params.find("layers"); it != params.end()) layers = std::atoi(it->second.c_str());
  layers = std::max(layers, 0);
  auto split = [](const std::string& s, char sep) {
    std::vector<std::string> out;
    size_t pos = 0;
    while (pos < s.size()) {
      size_t c = s.find(sep, pos);
      out.push_back(s.substr(pos, c == std::string::npos ? std::string::npos : c - pos));
      pos = c == std::string::npos ? s.size() : c + 1;
    }
    return out;
  };
  // The serials of each layer's EROFS devices 1, 2, ... (microvm_backend.cc,
  // GuestDisks): dsec.data=I,J,... names the layers whose one device is
  // their own disk l<i>d; dsec.devs=I:S+S+...,J:... gives those of the others
  // (a disk may serve several layers).
  std::vector<std::vector<std::string>> devices(static_cast<size_t>(layers));
  if (auto it = params.find("data"); it != params.end()) {
    for (auto& w : split(it->second, ',')) {
      int i = std::atoi(w.c_str());
      if (i >= 0 && i < layers) devices[size_t(i)] = {"l" + std::to_string(i) + "d"};
    }
  }
  if (auto it = params.find("devs"); it != params.end()) {
    for (auto& w : split(it->second, ',')) {
      size_t colon = w.find(':');
      int i = std::atoi(w.substr(0, colon).c_str());
      if (colon == std::string::npos || i < 0 || i >= layers) {
        return invalidArg("dsec.devs", "bad entry " + w + " (LAYER:SERIAL+SERIAL...)");
      }
      devices[size_t(i)] = split(w.substr(colon + 1), '+');
    }
  }
  std::set<std::string> serials = {"rw"};
  for (int i = 0; i < layers; ++i) {
    serials.insert("l" + std::to_string(i) + "m");
    serials.insert(devices[size_t(i)].begin(), devices[size_t(i)].end());
  }
  ASSIGN_OR_RETURN(auto disks, findDisks(serials.size()));
  std::string lower;
  for (int i = 0; i < layers; ++i) {
    std::string id = "l" + std::to_string(i);
    auto meta = disks.find(id + "m");
    if (meta == disks.end()) return notFound("no disk with serial " + id + "m");
    std::string opts;
    for (auto& serial : devices[size_t(i)]) {
      auto dev = disks.find(serial);
      if (dev == disks.end()) return notFound("no disk with serial " + serial);
      opts += (opts.empty() ? "device=" : ",device=") + dev->second;
    }
    std::string target = "/layers/" + std::to_string(i);
    RETURN_IF_ERROR(mountOrFail(meta->second.c_str(), target, "erofs", MS_RDONLY, opts));
    // overlayfs wants the top layer first.
    lower = lower.empty() ? target : target + ":" + lower;
  }
  auto rw = disks.find("rw");
  if (rw == disks.end()) return notFound("no disk with serial rw");
  RETURN_IF_ERROR(mountOrFail(rw->second.c_str(), "/rw", "ext4", MS_NOATIME, ""));
  ::mkdir("/rw/upper", 0755);
  ::mkdir("/rw/work", 0755);
  if (lower.empty()) {
    // An image of no layers: an empty read-only lower.
    ::mkdir("/layers/empty", 0755);
    lower = "/layers/empty";
  }
  // As for containers (container_init.cc): without index, metacopy and
  // redirect_dir the upper dir is a plain tree of the sandbox's writes that
  // pack_diff can turn into a layer; xino=on keeps readdir's inode numbers
  // equal to stat's (edge/userns.cc, overlayOf).
  RETURN_IF_ERROR(mountOrFail("overlay", "/newroot", "overlay", 0,
                              "lowerdir=" + lower +
                                  ",upperdir=/rw/upper,workdir=/rw/work,index=off,metacopy=off,"
                                  "redirect_dir=off,xino=on"));
  upper->reset(::open("/rw/upper", O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (!*upper) return sysError("open /rw/upper");
  for (const char* d : {"/newroot/dev", "/newroot/proc", "/newroot/sys", "/newroot/tmp"}) {
    ::mkdir(d, 0755);
  }
  if (::mount("/dev", "/newroot/dev", nullptr, MS_MOVE, nullptr) != 0) return sysError("move /dev");
  if (::mount("/proc", "/newroot/proc", nullptr, MS_MOVE, nullptr) != 0) {
    return sysError("move /proc");
  }
  if (::mount("/sys", "/newroot/sys", nullptr, MS_MOVE, nullptr) != 0) return sysError("move /sys");
  // The initramfs is the root of the mount tree and cannot be pivoted away
  // from; as switch_root does, move the new root over it and chroot. Its
  // files stay (a few MB of RAM); the layer mounts under it stay in use.
  if (::chdir("/newroot") != 0) return sysError("chdir /newroot");
  if (::mount(".", "/", nullptr, MS_MOVE, nullptr) != 0) return sysError("move root");
  if (::chroot(".") != 0) return sysError("chroot");
  if (::chdir("/") != 0) return sysError("chdir /");
  (void)mountOrFail("devpts", "/dev/pts", "devpts", MS_NOSUID | MS_NOEXEC,
                    "newinstance,ptmxmode=0666,mode=0620");
  (void)mountOrFail("shm", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777");
  if (auto it = params.find("hostname"); it != params.end()) {
    ::sethostname(it->second.data(), it->second.size());
  }
  return setupNet(params);
}

// The guest's end of the agent channel (docs/microvm.md): the virtio-serial
// port named kPortName, or, where the host gave the guest a vhost-vsock
// device (dsec.vsock=PORT), a vsock socket listening on PORT. A port is
// always open and sees a host come and go (POLLHUP while none); a vsock
// listener accepts one host connection at a time, which closes when that
// host goes.
struct HostLink {
  int fd = -1;        // the port, or the accepted connection (-1: none yet)
  int listenFd = -1;  // vsock only
};

// Until a host is there: the port without POLLHUP, or an accepted vsock
// connection.
void awaitHost(HostLink& link) {
  if (link.listenFd < 0) {
    // Without a host the port polls POLLIN|POLLHUP (a read would return
    // 0): a host is there once POLLHUP is gone.
    struct pollfd p = {link.fd, POLLIN, 0};
    for (;;) {
      p.revents = 0;
      int rc = ::poll(&p, 1, 100);
      if (rc > 0 && (p.revents & POLLIN) && !(p.revents & POLLHUP)) return;
      if (rc > 0) ::usleep(20000);
    }
  }
  while (link.fd < 0) {
    int c = ::accept4(link.listenFd, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (c >= 0) {
      link.fd = c;
    } else if (errno != EINTR) {
      ::usleep(20000);
    }
  }
}

// The host went: a vsock connection is closed (the next host is accepted);
// a port stays, reading 0 until a host is back.
void letHostGo(HostLink& link) {
  if (link.listenFd >= 0 && link.fd >= 0) {
    ::close(link.fd);
    link.fd = -1;
  }
}

// Waits for a host to connect and send its first frame (init on stream 0):
// the guest speaks only once the host listens, since what the guest writes
// while no host is connected is lost.
Result<proto::Frame> awaitHostFrame(HostLink& link) {
  proto::FrameDecoder decoder;
  proto::Frame f;
  char buf[4096];
  while (!decoder.next(f)) {
    if (link.fd < 0) awaitHost(link);
    struct pollfd p = {link.fd, POLLIN, 0};
    int rc = ::poll(&p, 1, 100);
    if (rc < 0 && errno != EINTR) return sysError("poll port");
    if (rc <= 0 || !(p.revents & POLLIN)) {
      if (p.revents & POLLHUP) {
        letHostGo(link);
        ::usleep(20000);  // no host connected yet
      }
      continue;
    }
    ssize_t n = ::read(link.fd, buf, sizeof buf);
    if (n < 0) {
      if (errno == EINTR || errno == EAGAIN) continue;
      if (link.listenFd < 0) return sysError("read port");
    }
    if (n <= 0) {
      decoder = proto::FrameDecoder{};  // the host went away mid-frame
      letHostGo(link);
      ::usleep(20000);
      continue;
    }
    RETURN_IF_ERROR(decoder.feed(buf, size_t(n)));
  }
  return f;
}

// A vsock socket listening on `port` for the host (VMADDR_CID_HOST).
Result<int> listenVsock(unsigned port) {
  int fd = ::socket(AF_VSOCK, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) return sysError("vsock socket");
  struct sockaddr_vm addr = {};
  addr.svm_family = AF_VSOCK;
  addr.svm_cid = VMADDR_CID_ANY;
  addr.svm_port = port;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 || ::listen(fd, 1) != 0) {
    Status st = sysError("vsock bind/listen port " + std::to_string(port));
    ::close(fd);
    return st;
  }
  return fd;
}

bool writeAll(int fd, const char* p, size_t n) {
  while (n > 0) {
    ssize_t w = ::write(fd, p, n);
    if (w < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN) {
        struct pollfd pf = {fd, POLLOUT, 0};
        ::poll(&pf, 1, 100);
        continue;
      }
      return false;
    }
    p += w;
    n -= size_t(w);
  }
  return true;
}

// Copies bytes between the host link (HostLink) and the agent's socket.
// The link sees the host disconnect (POLLHUP, read 0): the relay then closes
// its end of the socket, which the agent takes for the edge's death
// (edgeGone: in-flight execs killed, a fresh socket pair, one end on
// kReattachFd). The relay takes that end once a host is back, and the new
// edge's reattach frame reaches the agent through it.
[[noreturn]] void relayLoop(HostLink link, UniqueFd sock) {
  char buf[65536];
  for (;;) {
    if (!sock) {
      // Wait for the agent's fresh end, then for a host to connect.
      // A socket there is the agent's end for the next edge: fresh after an
      // edge went, or the same one again if a host came and went without
      // sending reattach (after a reattach the agent puts /dev/null back).
      struct stat st;
      if (::fstat(kReattachFd, &st) != 0 || !S_ISSOCK(st.st_mode)) {
        ::usleep(20000);
        continue;
      }
      int fd = ::fcntl(kReattachFd, F_DUPFD_CLOEXEC, 10);
      if (fd < 0) {
        ::usleep(20000);
        continue;
      }
      sock.reset(fd);
      say("the agent waits for a reattach; waiting for a host");
      awaitHost(link);
      say("a host connected");
    }
    const int port = link.fd;
    struct pollfd p[2] = {{port, POLLIN, 0}, {sock.get(), POLLIN, 0}};
    if (::poll(p, 2, -1) < 0) continue;
    bool hostGone = false;
    if (p[0].revents & (POLLIN | POLLHUP | POLLERR)) {
      ssize_t n = ::read(port, buf, sizeof buf);
      if (n > 0) {
        if (!writeAll(sock.get(), buf, size_t(n))) hostGone = true;  // agent side broken
      } else if (n == 0 || (errno != EINTR && errno != EAGAIN)) {
        hostGone = true;
      }
    }
    if (!hostGone && (p[1].revents & (POLLIN | POLLHUP | POLLERR))) {
      ssize_t n = ::read(sock.get(), buf, sizeof buf);
      if (n > 0) {
        if (!writeAll(port, buf, size_t(n))) hostGone = true;
      } else if (n == 0) {
        ::_exit(0);  // the agent ended
      }
    }
    if (hostGone) {
      say("the host went away");
      sock.reset();
      // Drain nothing: a disconnected port reads 0 until a host is back.
      letHostGo(link);
    }
  }
}

[[noreturn]] void powerOff() {
  ::sync();
  ::reboot(RB_AUTOBOOT);  // QEMU runs with -no-reboot: the VM ends
  for (;;) ::pause();
}

}  // namespace

int guestMain() {
  ::mount("devtmpfs", "/dev", "devtmpfs", MS_NOSUID, "mode=0755");
  int console = ::open("/dev/console", O_RDWR);
  if (console >= 0) {
    for (int fd = 0; fd < 3; ++fd) ::dup2(console, fd);
    if (console > 2) ::close(console);
  }
  int null = ::open("/dev/null", O_RDWR | O_CLOEXEC);
  if (null < 0 || ::dup3(null, kReattachFd, O_CLOEXEC) < 0) {
    say("cannot reserve the reattach descriptor");
    powerOff();
  }
  ::close(null);
  ::mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, nullptr);
  ::mount("sysfs", "/sys", "sysfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, nullptr);
  auto params = kernelParams();
  // The host link first: a failed set-up is reported over it.
  Status setup = Status::ok();
  HostLink link;
  auto vsockPort = params.find("vsock");
  if (Status st = loadModules(vsockPort != params.end()); !st.isOk()) setup = st;
  if (vsockPort != params.end()) {
    auto fd = listenVsock(unsigned(std::strtoul(vsockPort->second.c_str(), nullptr, 10)));
    if (!fd.isOk()) {
      say(fd.status().toString());
      powerOff();
    }
    link.listenFd = *fd;
  } else {
    Result<std::string> portPath = findPort();
    if (!portPath.isOk()) {
      say(portPath.status().toString());
      powerOff();
    }
    link.fd = ::open(portPath->c_str(), O_RDWR | O_CLOEXEC | O_NONBLOCK);
    if (link.fd < 0) {
      say("open " + *portPath + ": " + std::strerror(errno));
      powerOff();
    }
  }
  UniqueFd upper;
  if (setup.isOk()) setup = setupGuest(params, &upper);
  if (!setup.isOk()) say(setup.toString());
  else say("root switched; waiting for the host");
  Result<proto::Frame> first = awaitHostFrame(link);
  if (!first.isOk()) {
    say(first.status().toString());
    powerOff();
  }
  if (setup.isOk() && (first->stream != 0 || first->type != proto::FrameType::kInit)) {
    setup = invalidArg("type", "the first frame must be init on stream 0");
  }
  if (!setup.isOk()) {
    std::string wire;
    proto::appendFrame(wire, 0, proto::FrameType::kResult, errorJson(setup));
    writeAll(link.fd, wire.data(), wire.size());
    ::sleep(1);
    powerOff();
  }
  int sv[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) {
    say("socketpair failed");
    powerOff();
  }
  {
    // The relay takes no signals: the agent's signalfd (SIGCHLD) needs them
    // blocked in every thread, or a child's exit may go unnoticed.
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, &old);
    std::thread([link, fd = sv[1]] { relayLoop(link, UniqueFd(fd)); }).detach();
    pthread_sigmask(SIG_SETMASK, &old, nullptr);
  }
  AgentOptions options;
  options.exec.drop_caps = true;
  options.reattach_fd = kReattachFd;
  options.upper_fd = upper.get();
  options.exec.default_env = {"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                              "HOME=/root"};
  Agent agent(UniqueFd(sv[0]), std::move(options));
  Status st = agent.start();
  if (!st.isOk()) {
    say("start: " + st.toString());
    powerOff();
  }
  int rc = agent.run();
  say("agent ended with " + std::to_string(rc));
  powerOff();
}

}  // namespace dsec::aether
