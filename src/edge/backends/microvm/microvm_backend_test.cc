// probeMicroVm: what makes the backend unavailable, and that the accelerator
// it picks is one it actually checked; the agent channel's choice and QEMU's
// command line for each channel.
#include "edge/backends/microvm/microvm_backend.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

namespace dsec::edge {
namespace {

std::string tempDir() {
  char tmpl[] = "/tmp/microvm-test-XXXXXX";
  return ::mkdtemp(tmpl);
}

TEST(MicroVmProbe, MissingQemuIsUnavailableWithTheReason) {
  MicroVmOptions o;
  o.qemuPath = "/nonexistent/qemu-system-x86_64";
  o.guestDir = tempDir();
  MicroVmProbe p = probeMicroVm(o);
  EXPECT_FALSE(p.available);
  EXPECT_NE(p.reason.find("/nonexistent/qemu-system-x86_64 not found"), std::string::npos)
      << p.reason;
  ::rmdir(o.guestDir.c_str());
}

TEST(MicroVmProbe, MissingGuestFilesAreUnavailableWithThePath) {
  MicroVmOptions o;
  o.qemuPath = "/bin/true";  // any executable: the guest files are checked next
  o.guestDir = tempDir();
  MicroVmProbe p = probeMicroVm(o);
  EXPECT_FALSE(p.available);
  EXPECT_NE(p.reason.find(o.guestDir + "/vmlinux"), std::string::npos) << p.reason;
  ::rmdir(o.guestDir.c_str());
}

TEST(MicroVmProbe, PicksAnAcceleratorItChecked) {
  MicroVmOptions o;
  o.qemuPath = "/bin/true";
  o.guestDir = tempDir();
  for (const char* f : {"/vmlinux", "/initramfs.cpio"}) std::ofstream(o.guestDir + f) << "x";
  MicroVmProbe p = probeMicroVm(o);
  ASSERT_TRUE(p.available) << p.reason;
  EXPECT_TRUE(p.accelerator == "kvm" || p.accelerator == "tcg") << p.accelerator;
  if (p.accelerator == "tcg") {
    EXPECT_NE(p.reason.find("TCG"), std::string::npos) << p.reason;
  }
  o.accel = "tcg";
  EXPECT_EQ(probeMicroVm(o).accelerator, "tcg");
  for (const char* f : {"/vmlinux", "/initramfs.cpio"}) ::unlink((o.guestDir + f).c_str());
  ::rmdir(o.guestDir.c_str());
}

TEST(MicroVmAgentChannel, VsockWhereVhostVsockOpensElseVirtioSerial) {
  std::string why;
  EXPECT_EQ(chooseAgentChannel("auto", true, &why), "vsock");
  EXPECT_NE(why.find("/dev/vhost-vsock"), std::string::npos) << why;
  EXPECT_EQ(chooseAgentChannel("auto", false, &why), "virtio-serial");
  EXPECT_NE(why.find("no usable /dev/vhost-vsock"), std::string::npos) << why;
  EXPECT_EQ(chooseAgentChannel("virtio-serial", true, &why), "virtio-serial");
  EXPECT_EQ(chooseAgentChannel("vsock", true, &why), "vsock");
  // Required but missing, or unknown: none, and why.
  EXPECT_EQ(chooseAgentChannel("vsock", false, &why), "");
  EXPECT_NE(why.find("vsock required"), std::string::npos) << why;
  EXPECT_EQ(chooseAgentChannel("carrier-pigeon", true, &why), "");
  EXPECT_NE(why.find("carrier-pigeon"), std::string::npos) << why;
}

TEST(MicroVmAgentChannel, ForcedVsockWithoutVhostIsUnavailable) {
  MicroVmOptions o;
  o.qemuPath = "/bin/true";
  o.guestDir = tempDir();
  for (const char* f : {"/vmlinux", "/initramfs.cpio"}) std::ofstream(o.guestDir + f) << "x";
  o.agentChannel = "vsock";
  MicroVmProbe p = probeMicroVm(o);
  if (::access("/dev/vhost-vsock", R_OK | W_OK) != 0) {
    EXPECT_FALSE(p.available);
    EXPECT_NE(p.reason.find("vsock required"), std::string::npos) << p.reason;
  } else {
    EXPECT_EQ(p.agentChannel, "vsock") << p.reason;
  }
  o.agentChannel = "virtio-serial";
  p = probeMicroVm(o);
  ASSERT_TRUE(p.available) << p.reason;
  EXPECT_EQ(p.agentChannel, "virtio-serial");
  EXPECT_NE(p.reason.find("agent channel virtio-serial"), std::string::npos) << p.reason;
  for (const char* f : {"/vmlinux", "/initramfs.cpio"}) ::unlink((o.guestDir + f).c_str());
  ::rmdir(o.guestDir.c_str());
}

// The value after `flag` in args ("" if none), and whether any arg has `part`.
std::string after(const std::vector<std::string>& args, const std::string& flag) {
  auto it = std::find(args.begin(), args.end(), flag);
  return it == args.end() || it + 1 == args.end() ? "" : *(it + 1);
}
bool anyHas(const std::vector<std::string>& args, const std::string& part) {
  return std::any_of(args.begin(), args.end(),
                     [&](const std::string& a) { return a.find(part) != std::string::npos; });
}

TEST(MicroVmArgs, TheAgentChannelIsVsockToTheGuestsCidOrAVirtioSerialPort) {
  MicroVmOptions o;
  o.guestDir = "/g";
  MicroVmProbe p;
  p.qemu = "/usr/bin/qemu-system-x86_64";
  p.accelerator = "tcg";
  SandboxSpec spec;
  spec.id = "sb-0123456789abcdef";
  std::vector<std::pair<std::string, LayerFiles>> files(1);
  files[0].second.meta = "/cache/m";
  // virtio-serial: the port named dsec.agent on agent.sock, no vsock device.
  auto serial = microvmArgs(o, p, spec, files, 0);
  EXPECT_TRUE(anyHas(serial, "virtserialport,chardev=agent,name=dsec.agent"));
  EXPECT_TRUE(anyHas(serial, "path=agent.sock"));
  EXPECT_FALSE(anyHas(serial, "vhost-vsock"));
  EXPECT_EQ(after(serial, "-append").find("dsec.vsock="), std::string::npos);
  // vsock: the device with the guest's CID, the port on the kernel command
  // line for the guest's listener, and no serial port.
  auto vsock = microvmArgs(o, p, spec, files, 1234567);
  EXPECT_TRUE(anyHas(vsock, "vhost-vsock-device,guest-cid=1234567"));
  EXPECT_NE(after(vsock, "-append").find(" dsec.vsock=" + std::to_string(kAgentVsockPort)),
            std::string::npos)
      << after(vsock, "-append");
  EXPECT_FALSE(anyHas(vsock, "virtserialport"));
  EXPECT_FALSE(anyHas(vsock, "agent.sock"));
  // Everything else is the same.
  EXPECT_EQ(after(vsock, "-kernel"), "/g/vmlinux");
  EXPECT_TRUE(anyHas(vsock, "file=/cache/m,format=raw"));
}

}  // namespace
}  // namespace dsec::edge
