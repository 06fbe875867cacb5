// probeMicroVm: what makes the backend unavailable, and that the accelerator
// it picks is one it actually checked.
#include "edge/backends/microvm/microvm_backend.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <string>

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

}  // namespace
}  // namespace dsec::edge
