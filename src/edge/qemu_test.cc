#include "edge/qemu.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <string>

namespace dsec::edge::qemu {
namespace {

// A stand-in for qemu-system-x86_64: a script that behaves as QEMU does on
// a host whose KVM runs a probe guest but not QEMU's vCPU set-up (or one
// where it works), so the probe's reading of it is tested without KVM.
class FakeQemu : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/dsec-fakeqemu-XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override { std::system(("rm -rf " + dir_).c_str()); }
  std::string script(const std::string& body) {
    std::string path = dir_ + "/qemu";
    std::ofstream(path) << "#!/bin/sh\n" << body << "\n";
    ::chmod(path.c_str(), 0755);
    return path;
  }
  std::string dir_;
};

TEST_F(FakeQemu, AQemuThatQuitsWhenToldPasses) {
  // Checks it was asked for KVM, stopped, with the machine given, and quits
  // on the monitor's "quit".
  std::string q = script(
      "case \"$*\" in *'-M microvm -accel kvm -cpu host'*'-S -monitor stdio'*) ;; *) exit 3;; "
      "esac\n"
      "read line; [ \"$line\" = quit ] && exit 0; exit 4");
  EXPECT_EQ(probeQemuKvm(q, "microvm"), "");
}

TEST_F(FakeQemu, AQemuThatAbortsGivesItsFirstErrorLine) {
  std::string q = script(
      "echo 'qemu-system-x86_64: error: failed to set MSR 0x10a to 0x69' >&2\n"
      "echo 'qemu-system-x86_64: kvm.c:3183: kvm_buf_set_msrs: Assertion failed.' >&2\n"
      "kill -ABRT $$");
  EXPECT_EQ(probeQemuKvm(q, "q35"),
            "QEMU under KVM failed to start: qemu-system-x86_64: error: failed to set MSR 0x10a "
            "to 0x69");
}

TEST_F(FakeQemu, ASilentFailureSaysHowItEnded) {
  EXPECT_EQ(probeQemuKvm(script("exit 1"), "q35"), "QEMU under KVM failed to start: exit 1");
  EXPECT_EQ(probeQemuKvm(dir_ + "/missing", "q35"), "QEMU under KVM failed to start: exit 127");
}

TEST_F(FakeQemu, RunGivesInputAndTakesOutputAndKillsAtTheDeadline) {
  auto r = run({script("read a; echo \"out $a\"; echo err >&2; exit 3")}, "x\n");
  ASSERT_TRUE(r.isOk()) << r.status().toString();
  EXPECT_EQ(r->out, "out x\n");
  EXPECT_EQ(r->err, "err\n");
  EXPECT_FALSE(r->timedOut);
  EXPECT_TRUE(WIFEXITED(r->status) && WEXITSTATUS(r->status) == 3);
  // A program that holds its output open past the deadline, and one that
  // closes it but goes on running: both killed.
  for (const char* body : {"exec sleep 30", "exec >&- 2>&-; exec sleep 30"}) {
    auto hung = run({script(body)}, "", 0.3);
    ASSERT_TRUE(hung.isOk());
    EXPECT_TRUE(hung->timedOut) << body;
    EXPECT_TRUE(WIFSIGNALED(hung->status) && WTERMSIG(hung->status) == SIGKILL) << body;
  }
  EXPECT_EQ(runCapture({script("echo no >&2; exit 1")}).status().message(),
            dir_ + "/qemu failed: no");
}

TEST_F(FakeQemu, InputToAProgramThatIsGoneDoesNotKillTheCaller) {
  // The write meets a pipe whose reader is gone: its SIGPIPE, default-fatal
  // in a test binary, must not reach us. More input than a pipe holds, so
  // the write is still blocked when the program closes its stdin.
  auto r = run({script("exec 0<&-; exit 5")}, std::string(1 << 20, 'x'), 10);
  ASSERT_TRUE(r.isOk()) << r.status().toString();
  EXPECT_TRUE(WIFEXITED(r->status) && WEXITSTATUS(r->status) == 5);
}

TEST_F(FakeQemu, RunStopsAProgramWhenToldTo) {
  auto r = run({script("echo ready >&2; exec sleep 30")}, "", 10,
               [](const RunResult& so) { return so.err.find("ready") != std::string::npos; });
  ASSERT_TRUE(r.isOk()) << r.status().toString();
  EXPECT_TRUE(r->stopped);
  EXPECT_FALSE(r->timedOut);
  EXPECT_EQ(r->err, "ready\n");
  EXPECT_TRUE(WIFSIGNALED(r->status) && WTERMSIG(r->status) == SIGKILL);
}

TEST_F(FakeQemu, AKernelThatBootsToItsPanicPasses) {
  // Asked for KVM with the machine, kernel and a console on stdout; the
  // guest's panic (no root filesystem) reboots it and -no-reboot ends QEMU.
  std::string q = script(
      "case \"$*\" in *'-M microvm -accel kvm -cpu host'*'-no-reboot -kernel /k/vmlinux'*"
      "'panic=-1'*'-serial stdio'*) ;; *) exit 3;; esac\n"
      "echo '[    0.72] Kernel panic - not syncing: VFS: Unable to mount root fs'; exit 0");
  EXPECT_EQ(probeQemuKvmBoot(q, "microvm", "/k/vmlinux"), "");
}

TEST_F(FakeQemu, AKvmInternalErrorFailsTheBootProbeAtOnce) {
  // What nested KVM on some hosts does: an emulation failure early in the
  // guest's boot, after which QEMU stops the vCPU and waits for ever.
  std::string q = script(
      "echo 'KVM internal error. Suberror: 1' >&2\n"
      "echo 'extra data[0]: 0x0000000000000001' >&2\n"
      "echo 'emulation failure' >&2\n"
      "exec sleep 30");
  auto start = std::chrono::steady_clock::now();
  EXPECT_EQ(probeQemuKvmBoot(q, "q35", "/k/vmlinux", 20),
            "the guest kernel failed under KVM: KVM internal error. Suberror: 1");
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10));
}

TEST_F(FakeQemu, ABootThatHangsOrEndsEarlyFailsTheProbe) {
  EXPECT_EQ(probeQemuKvmBoot(script("exec sleep 30"), "q35", "/k/vmlinux", 0.3),
            "the guest kernel did not boot to its end under KVM within 0.3 s");
  EXPECT_EQ(probeQemuKvmBoot(script("echo booting; exit 0"), "q35", "/k/vmlinux"),
            "the guest kernel under KVM ended without reaching its root-filesystem panic");
  EXPECT_EQ(probeQemuKvmBoot(script("echo 'qemu: no kernel' >&2; exit 1"), "q35", "/k/vmlinux"),
            "QEMU booting the guest kernel under KVM failed: qemu: no kernel");
}

TEST(ChooseAccel, TcgAsConfiguredProbesNothing) {
  std::string why;
  EXPECT_EQ(chooseAccel("tcg", "/nonexistent/qemu", "microvm", &why), "tcg");
  EXPECT_EQ(why, "TCG as configured");
}

}  // namespace
}  // namespace dsec::edge::qemu
