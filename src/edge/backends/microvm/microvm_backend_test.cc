// probeMicroVm: what makes the backend unavailable, and that the accelerator
// it picks is one it actually checked; the agent channel's choice and QEMU's
// command line for each channel.
#include "edge/backends/microvm/microvm_backend.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <map>
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

// The -drive files of args, by the serial of their disk.
std::map<std::string, std::string> disksOf(const std::vector<std::string>& args) {
  std::map<std::string, std::string> out;
  for (auto& a : args) {
    if (a.rfind("id=", 0) != 0 || a.find(",file=") == std::string::npos) continue;
    std::string id = a.substr(3, a.find(',') - 3);
    size_t f = a.find(",file=") + 6;
    out[id] = a.substr(f, a.find(',', f) - f);
  }
  return out;
}

MicroVmProbe tcgProbe() {
  MicroVmProbe p;
  p.qemu = "/usr/bin/qemu-system-x86_64";
  p.accelerator = "tcg";
  return p;
}

TEST(MicroVmArgs, LayersWithoutExtraDataBlobsKeepTheirDisks) {
  // As earlier edges gave them, a blob two layers share included: a VM
  // hibernated by one restores.
  SandboxSpec spec;
  spec.id = "sb-0123456789abcdef";
  std::vector<std::pair<std::string, LayerFiles>> files(3);
  files[0].second = {"/c/m0", "/c/d0", {}};
  files[1].second = {"/c/m1", "", {}};
  files[2].second = {"/c/m2", "/c/d0", {}};
  auto args = microvmArgs(MicroVmOptions{}, tcgProbe(), spec, files, 0);
  std::map<std::string, std::string> want = {{"l0m", "/c/m0"}, {"l0d", "/c/d0"},
                                             {"l1m", "/c/m1"}, {"l2m", "/c/m2"},
                                             {"l2d", "/c/d0"}, {"rw", "disk.img"}};
  EXPECT_EQ(disksOf(args), want);
  std::string append = after(args, "-append");
  EXPECT_NE(append.find(" dsec.layers=3 dsec.data=0,2"), std::string::npos) << append;
  EXPECT_EQ(append.find("dsec.devs"), std::string::npos) << append;
  EXPECT_TRUE(checkMicrovmArgs(args, files).isOk());
}

TEST(MicroVmArgs, ExtraDataBlobsShareOneDiskPerFile) {
  SandboxSpec spec;
  spec.id = "sb-0123456789abcdef";
  std::vector<std::pair<std::string, LayerFiles>> files(4);
  files[0].second = {"/c/m0", "/c/d0", {}};
  // Layer 1 reads layer 0's blob and one no layer of the image owns; layer 2
  // the same two the other way round, and one more; layer 3's own blob is
  // layer 0's.
  files[1].second = {"/c/m1", "/c/d1", {"/c/d0", "/c/e"}};
  files[2].second = {"/c/m2", "/c/d2", {"/c/e", "/c/d0", "/c/f"}};
  files[3].second = {"/c/m3", "/c/d0", {"/c/f"}};
  auto args = microvmArgs(MicroVmOptions{}, tcgProbe(), spec, files, 0);
  std::map<std::string, std::string> want = {
      {"l0m", "/c/m0"}, {"l0d", "/c/d0"}, {"l1m", "/c/m1"}, {"l1d", "/c/d1"},
      {"l2m", "/c/m2"}, {"l2d", "/c/d2"}, {"l3m", "/c/m3"}, {"x0", "/c/e"},
      {"x1", "/c/f"},   {"rw", "disk.img"}};
  EXPECT_EQ(disksOf(args), want);
  std::string append = after(args, "-append");
  EXPECT_NE(append.find(" dsec.layers=4 dsec.data=0 "
                        "dsec.devs=1:l1d+l0d+x0,2:l2d+x0+l0d+x1,3:l0d+x1"),
            std::string::npos)
      << append;
  // The extra disks come after the layers' (whose order stays as it was).
  auto pos = [&](const std::string& part) {
    return std::find_if(args.begin(), args.end(),
                        [&](auto& a) { return a.find(part) != std::string::npos; }) -
           args.begin();
  };
  EXPECT_LT(pos("serial=l3m"), pos("serial=x0"));
  EXPECT_LT(pos("serial=x1"), pos("serial=rw"));
  EXPECT_TRUE(checkMicrovmArgs(args, files).isOk());
}

TEST(MicroVmArgs, MoreDisksThanMicrovmTransportsIsRefusedNamingTheImage) {
  SandboxSpec spec;
  spec.id = "sb-0123456789abcdef";
  // 11 layers of two disks, the writable disk and the agent channel: all 24
  // virtio-mmio transports.
  std::vector<std::pair<std::string, LayerFiles>> files(11);
  for (size_t i = 0; i < files.size(); ++i) {
    files[i].first = "sha256:layer" + std::to_string(i);
    files[i].second = {"/c/m" + std::to_string(i), "/c/d" + std::to_string(i), {}};
  }
  EXPECT_TRUE(checkMicrovmArgs(microvmArgs(MicroVmOptions{}, tcgProbe(), spec, files, 0), files)
                  .isOk());
  // A NIC takes one more.
  spec.network = true;
  Status st = checkMicrovmArgs(microvmArgs(MicroVmOptions{}, tcgProbe(), spec, files, 0), files);
  EXPECT_EQ(st.code(), Code::kInvalidArgument) << st.toString();
  EXPECT_EQ(st.field(), "image");
  EXPECT_NE(st.message().find("sha256:layer10"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("22 read-only disks"), std::string::npos) << st.message();
  // Without it, an extra blob the layers share takes one disk, not ten.
  spec.network = false;
  files[0].second.data.clear();  // room for one disk
  for (size_t i = 1; i < files.size(); ++i) files[i].second.extraData = {"/c/shared"};
  auto args = microvmArgs(MicroVmOptions{}, tcgProbe(), spec, files, 0);
  EXPECT_TRUE(checkMicrovmArgs(args, files).isOk()) << checkMicrovmArgs(args, files).toString();
  EXPECT_EQ(disksOf(args).size(), 24u - 1);  // all but the agent channel's transport
}

}  // namespace
}  // namespace dsec::edge
