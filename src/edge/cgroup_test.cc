#include "edge/cgroup.h"

#include <gtest/gtest.h>
#include <linux/magic.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <map>
#include <set>
#include <sstream>

#include "common/util.h"
#include "edge/stats_history.h"

namespace dsec::edge {
namespace {

// An in-memory cgroup2 tree with the kernel rules Cgroups relies on: mkdir
// makes the knobs of the controllers the parent delegates; subtree_control
// only takes controllers the group has and obeys the no-internal-processes
// rule; cgroup.procs moves processes; cgroup.kill empties a subtree; rmdir
// refuses a populated group. `nsRoot`: the root is the root of a cgroup
// namespace, not the real root, so the no-internal-processes rule applies to
// it too. Not thread-safe (the tests are single-threaded).
class FakeCgroup2Fs : public CgroupFs {
 public:
  FakeCgroup2Fs(std::string root, std::string controllers, bool nsRoot, bool hasKill = true)
      : root_(std::move(root)), nsRoot_(nsRoot), hasKill_(hasKill) {
    nodes_[root_] = Node{true, ""};
    rootControllers_ = controllers;
    for (const char* k : {"cgroup.procs", "cgroup.controllers", "cgroup.subtree_control"}) {
      nodes_[root_ + "/" + k] = Node{false, ""};
    }
  }

  // --- the seam ---
  Result<int64_t> fsType(const std::string& path) override {
    if (!nodes_.count(path)) return sysError("statfs " + path, ENOENT);
    return int64_t(CGROUP2_SUPER_MAGIC);
  }
  bool isDir(const std::string& path) override {
    auto it = nodes_.find(path);
    return it != nodes_.end() && it->second.dir;
  }
  bool writable(const std::string& path) override {
    auto it = nodes_.find(path);
    return it != nodes_.end() && !it->second.dir;
  }
  Status mkdir(const std::string& path) override {
    if (nodes_.count(path)) return sysError("mkdir " + path, EEXIST);
    std::string parent = parentOf(path);
    if (!isDir(parent)) return sysError("mkdir " + path, ENOENT);
    nodes_[path] = Node{true, ""};
    auto knob = [&](const std::string& name, const std::string& v) {
      nodes_[path + "/" + name] = Node{false, v};
    };
    for (const char* k : {"cgroup.procs", "cgroup.controllers", "cgroup.subtree_control",
                          "cgroup.freeze", "cgroup.events"}) {
      knob(k, "");
    }
    if (hasKill_) knob("cgroup.kill", "");
    auto on = tokens(nodes_[parent + "/cgroup.subtree_control"].data);
    if (has(on, "memory")) {
      knob("memory.max", "max\n");
      knob("memory.swap.max", "max\n");
      knob("memory.current", "0\n");
      knob("memory.events", "low 0\nhigh 0\nmax 0\noom 0\noom_kill 0\noom_group_kill 0\n");
    }
    if (has(on, "cpu")) knob("cpu.max", "max 100000\n");
    // cpu.stat is there without the cpu controller too (its usage part).
    knob("cpu.stat", "usage_usec 0\nuser_usec 0\nsystem_usec 0\n");
    if (has(on, "pids")) {
      knob("pids.max", "max\n");
      knob("pids.current", "0\n");
      knob("pids.events", "max 0\n");
    }
    return Status::ok();
  }
  Status rmdir(const std::string& path) override {
    if (!nodes_.count(path)) return sysError("rmdir " + path, ENOENT);
    if (!isDir(path)) return sysError("rmdir " + path, ENOTDIR);
    if (path == root_ || !childDirs(path).empty() || !procsIn(path).empty()) {
      return sysError("rmdir " + path, EBUSY);
    }
    for (auto it = nodes_.begin(); it != nodes_.end();) {
      if (it->first == path || startsWith(it->first, path + "/")) {
        it = nodes_.erase(it);
      } else {
        ++it;
      }
    }
    return Status::ok();
  }
  Result<std::string> read(const std::string& path) override {
    auto it = nodes_.find(path);
    if (it == nodes_.end()) return sysError("open " + path, ENOENT);
    if (it->second.dir) return sysError("read " + path, EISDIR);
    std::string dir = parentOf(path), name = path.substr(dir.size() + 1);
    if (name == "cgroup.procs") {
      std::string out;
      for (pid_t p : procsIn(dir)) out += std::to_string(p) + "\n";
      return out;
    }
    if (name == "cgroup.controllers") {
      return dir == root_ ? rootControllers_
                          : nodes_[parentOf(dir) + "/cgroup.subtree_control"].data;
    }
    return it->second.data;
  }
  Status write(const std::string& path, std::string_view data) override {
    std::string what = "write " + path + " <- " + std::string(data);
    writes_.push_back(path + " <- " + std::string(data));
    if (auto f = failWrites_.find(path); f != failWrites_.end()) return sysError(what, f->second);
    auto it = nodes_.find(path);
    if (it == nodes_.end()) return sysError("open " + path, ENOENT);
    if (it->second.dir) return sysError("open " + path, EISDIR);
    std::string dir = parentOf(path), name = path.substr(dir.size() + 1);
    if (name == "cgroup.subtree_control") {
      auto have = tokens(*read(dir + "/cgroup.controllers"));
      auto on = tokens(it->second.data);
      bool enabling = false;
      for (auto& t : tokens(std::string(data))) {
        std::string c = t.substr(1);
        if (t[0] != '+' && t[0] != '-') return sysError(what, EINVAL);
        if (!has(have, c)) return sysError(what, ENOENT);
        if (t[0] == '+' && !has(on, c)) enabling = true;
      }
      if (enabling && (dir != root_ || nsRoot_) && !procsIn(dir).empty()) {
        return sysError(what, EBUSY);
      }
      for (auto& t : tokens(std::string(data))) {
        std::string c = t.substr(1);
        on.erase(std::remove(on.begin(), on.end(), c), on.end());
        if (t[0] == '+') on.push_back(c);
      }
      std::sort(on.begin(), on.end());
      std::string joined;
      for (auto& c : on) joined += (joined.empty() ? "" : " ") + c;
      it->second.data = joined;
      return Status::ok();
    }
    if (name == "cgroup.procs") {
      pid_t pid = std::atoi(std::string(data).c_str());
      if (!procs_.count(pid)) return sysError(what, ESRCH);
      if ((dir != root_ || nsRoot_) &&
          !tokens(nodes_[dir + "/cgroup.subtree_control"].data).empty()) {
        return sysError(what, EBUSY);
      }
      procs_[pid] = dir;
      return Status::ok();
    }
    if (name == "cgroup.kill") {
      if (data != "1") return sysError(what, EINVAL);
      for (auto p = procs_.begin(); p != procs_.end();) {
        if (p->second == dir || startsWith(p->second, dir + "/")) {
          groupKilled_.push_back(p->first);
          p = procs_.erase(p);
        } else {
          ++p;
        }
      }
      return Status::ok();
    }
    it->second.data = std::string(data);
    return Status::ok();
  }
  // cgroup v2 refuses to rename groups.
  Status rename(const std::string& from, const std::string&) override {
    return sysError("rename " + from, EPERM);
  }
  std::vector<std::string> list(const std::string& dir) override {
    std::vector<std::string> out;
    for (auto& [p, n] : nodes_) {
      if (parentOf(p) == dir && p != dir) out.push_back(p.substr(dir.size() + 1));
    }
    return out;
  }
  void killPid(pid_t pid) override {
    killed_.push_back(pid);
    procs_.erase(pid);
  }

  // --- test controls ---
  void addProcess(pid_t pid, const std::string& dir) { procs_[pid] = dir; }
  std::string groupOf(pid_t pid) const {
    auto it = procs_.find(pid);
    return it == procs_.end() ? "" : it->second;
  }
  void setKnob(const std::string& path, const std::string& v) { nodes_.at(path).data = v; }
  std::string knob(const std::string& path) const {
    auto it = nodes_.find(path);
    return it == nodes_.end() ? "<missing>" : it->second.data;
  }
  std::map<std::string, int> failWrites_;  // path -> errno for its writes
  std::vector<std::string> writes_;        // "path <- data", in order
  std::vector<pid_t> killed_;              // through killPid
  std::vector<pid_t> groupKilled_;         // through cgroup.kill

 private:
  struct Node {
    bool dir = false;
    std::string data;
  };
  static std::string parentOf(const std::string& p) { return p.substr(0, p.rfind('/')); }
  static std::vector<std::string> tokens(const std::string& s) {
    std::istringstream in(s);
    std::vector<std::string> out;
    for (std::string t; in >> t;) out.push_back(t);
    return out;
  }
  static bool has(const std::vector<std::string>& v, const std::string& x) {
    return std::find(v.begin(), v.end(), x) != v.end();
  }
  std::vector<std::string> childDirs(const std::string& dir) const {
    std::vector<std::string> out;
    for (auto& [p, n] : nodes_) {
      if (n.dir && p != dir && parentOf(p) == dir) out.push_back(p);
    }
    return out;
  }
  std::vector<pid_t> procsIn(const std::string& dir) const {
    std::vector<pid_t> out;
    for (auto& [pid, d] : procs_) {
      if (d == dir) out.push_back(pid);
    }
    return out;
  }

  std::string root_;
  bool nsRoot_;
  bool hasKill_;
  std::string rootControllers_;
  std::map<std::string, Node> nodes_;
  std::map<pid_t, std::string> procs_;  // pid -> its cgroup
};

constexpr const char* kRoot = "/fake/cgroup";
constexpr const char* kAll = "cpuset cpu io memory hugetlb pids rdma misc";

TEST(CgroupV2FakeTest, ControllersAreWholeNames) {
  // "cpuset" must not pass for "cpu".
  auto fs = std::make_shared<FakeCgroup2Fs>(kRoot, "cpuset io memory pids", false);
  auto cg = Cgroups::detectForTest(fs, kRoot, "dsec/e-1");
  ASSERT_FALSE(cg.isOk());
  EXPECT_EQ(cg.status().code(), Code::kFailedPrecondition);
  EXPECT_NE(cg.status().message().find("controller cpu not available"), std::string::npos)
      << cg.status().toString();

  auto ok = Cgroups::detectForTest(std::make_shared<FakeCgroup2Fs>(kRoot, kAll, false), kRoot,
                                   "dsec/e-1");
  ASSERT_TRUE(ok.isOk()) << ok.status().toString();
  EXPECT_EQ((*ok)->mode(), Cgroups::Mode::kV2);
}

TEST(CgroupV2FakeTest, DelegatesControllersDownToTheParent) {
  auto fs = std::make_shared<FakeCgroup2Fs>(kRoot, kAll, false);
  fs->addProcess(1, kRoot);  // the real root may hold processes
  auto cg = Cgroups::detectForTest(fs, kRoot, "dsec/e-1");
  ASSERT_TRUE(cg.isOk()) << cg.status().toString();
  for (std::string d :
       {std::string(kRoot), std::string(kRoot) + "/dsec", std::string(kRoot) + "/dsec/e-1"}) {
    EXPECT_EQ(fs->knob(d + "/cgroup.subtree_control"), "cpu memory pids") << d;
  }
  EXPECT_FALSE(fs->isDir(std::string(kRoot) + "/" + Cgroups::kInitLeaf));
  EXPECT_EQ(fs->groupOf(1), kRoot);
}

TEST(CgroupV2FakeTest, MovesProcessesOutOfANamespaceRoot) {
  // dsec in a container with a private cgroup namespace: the root holds dsec
  // itself, so enabling controllers there fails with EBUSY until it is empty.
  auto fs = std::make_shared<FakeCgroup2Fs>(kRoot, kAll, /*nsRoot=*/true);
  fs->addProcess(1, kRoot);
  fs->addProcess(57, kRoot);
  auto cg = Cgroups::detectForTest(fs, kRoot, "dsec/e-1");
  ASSERT_TRUE(cg.isOk()) << cg.status().toString();
  std::string leaf = std::string(kRoot) + "/" + Cgroups::kInitLeaf;
  EXPECT_EQ(fs->groupOf(1), leaf);
  EXPECT_EQ(fs->groupOf(57), leaf);
  EXPECT_EQ(fs->knob(std::string(kRoot) + "/cgroup.subtree_control"), "cpu memory pids");
  EXPECT_EQ(fs->knob(std::string(kRoot) + "/dsec/e-1/cgroup.subtree_control"), "cpu memory pids");
  // And sandboxes then work below.
  ASSERT_TRUE((*cg)->create("sb-a", CgroupLimits{1.0, 1 << 20, 8}).isOk());
  EXPECT_EQ(fs->knob(std::string(kRoot) + "/dsec/e-1/sb-a/pids.max"), "8");
}

TEST(CgroupV2FakeTest, ClearErrorWhenTheRootStaysBusy) {
  auto fs = std::make_shared<FakeCgroup2Fs>(kRoot, kAll, /*nsRoot=*/true);
  fs->addProcess(1, kRoot);
  fs->failWrites_[std::string(kRoot) + "/cgroup.subtree_control"] = EBUSY;
  auto cg = Cgroups::detectForTest(fs, kRoot, "dsec/e-1");
  ASSERT_FALSE(cg.isOk());
  EXPECT_EQ(cg.status().code(), Code::kFailedPrecondition);
  EXPECT_EQ(cg.status().sysErrno(), EBUSY);
  EXPECT_NE(cg.status().message().find(std::string(kRoot) + "/cgroup.subtree_control"),
            std::string::npos)
      << cg.status().toString();
  EXPECT_NE(cg.status().message().find(Cgroups::kInitLeaf), std::string::npos);

  // Other errors are not papered over either.
  auto fs2 = std::make_shared<FakeCgroup2Fs>(kRoot, kAll, false);
  fs2->failWrites_[std::string(kRoot) + "/cgroup.subtree_control"] = EACCES;
  auto cg2 = Cgroups::detectForTest(fs2, kRoot, "dsec/e-1");
  ASSERT_FALSE(cg2.isOk());
  EXPECT_EQ(cg2.status().sysErrno(), EACCES);
}

TEST(CgroupV2FakeTest, CreateLimitsStatsRemove) {
  auto fs = std::make_shared<FakeCgroup2Fs>(kRoot, kAll, false);
  auto made = Cgroups::detectForTest(fs, kRoot, "dsec/e-1");
  ASSERT_TRUE(made.isOk()) << made.status().toString();
  auto& cg = *made;
  ASSERT_TRUE(cg->create("sb-1", CgroupLimits{0.5, 64 << 20, 32}).isOk());
  auto dirs = cg->dirsOf("sb-1");
  ASSERT_EQ(dirs.size(), 1u);
  const std::string d = dirs[0];
  EXPECT_EQ(d, std::string(kRoot) + "/dsec/e-1/sb-1");
  EXPECT_EQ(fs->knob(d + "/memory.max"), std::to_string(64 << 20));
  EXPECT_EQ(fs->knob(d + "/memory.swap.max"), "0");
  EXPECT_EQ(fs->knob(d + "/cpu.max"), "50000 100000");
  EXPECT_EQ(fs->knob(d + "/pids.max"), "32");

  // Unlimited memory and pids are written as "max" (so setLimits can lift a
  // limit again); cpu is always set.
  ASSERT_TRUE(cg->create("sb-2", CgroupLimits{2.0, 0, 0}).isOk());
  const std::string d2 = cg->dirsOf("sb-2")[0];
  EXPECT_EQ(fs->knob(d2 + "/memory.max"), "max");
  EXPECT_EQ(fs->knob(d2 + "/pids.max"), "max");
  EXPECT_EQ(fs->knob(d2 + "/cpu.max"), "200000 100000");

  // Limits change in place.
  ASSERT_TRUE(cg->setLimits("sb-1", CgroupLimits{0.25, 64 << 20, 16}).isOk());
  EXPECT_EQ(fs->knob(d + "/memory.max"), std::to_string(64 << 20));
  EXPECT_EQ(fs->knob(d + "/cpu.max"), "25000 100000");
  EXPECT_EQ(fs->knob(d + "/pids.max"), "16");

  fs->addProcess(4242, kRoot);
  fs->addProcess(4243, kRoot);
  ASSERT_TRUE(cg->attach("sb-1", 4242).isOk());
  ASSERT_TRUE(cg->attach("sb-1", 4243).isOk());
  EXPECT_EQ(fs->groupOf(4242), d);

  fs->setKnob(d + "/memory.events", "low 0\nhigh 0\nmax 12\noom 4\noom_kill 3\noom_group_kill 1\n");
  fs->setKnob(d + "/pids.events", "max 7\n");
  fs->setKnob(d + "/memory.current", "1048576\n");
  auto s = cg->stats("sb-1");
  ASSERT_TRUE(s.isOk()) << s.status().toString();
  EXPECT_EQ(s->oomKills, 3);
  EXPECT_EQ(s->pidsLimitHits, 7);
  EXPECT_EQ(s->memoryBytes, 1048576);

  auto ids = cg->list();
  std::sort(ids.begin(), ids.end());
  EXPECT_EQ(ids, (std::vector<std::string>{"sb-1", "sb-2"}));

  // remove() goes through cgroup.kill, never kill(2) on pids it read.
  ASSERT_TRUE(cg->remove("sb-1").isOk());
  EXPECT_TRUE(fs->killed_.empty());
  std::sort(fs->groupKilled_.begin(), fs->groupKilled_.end());
  EXPECT_EQ(fs->groupKilled_, (std::vector<pid_t>{4242, 4243}));
  EXPECT_FALSE(fs->isDir(d));
  EXPECT_EQ(cg->stats("sb-1").status().code(), Code::kNotFound);
  EXPECT_TRUE(cg->remove("sb-1").isOk()) << "a missing group is fine";
  ASSERT_TRUE(cg->remove("sb-2").isOk());
  EXPECT_TRUE(cg->list().empty());

  cg->removeParent();
  EXPECT_FALSE(fs->isDir(std::string(kRoot) + "/dsec"));
}

// CPU time (cpu.stat usage_usec) and tasks (pids.current) as the sampler
// reads them into a sandbox's ring, and the cores used between readings.
TEST(CgroupV2FakeTest, CpuAndPidsIntoTheHistoryRing) {
  auto fs = std::make_shared<FakeCgroup2Fs>(kRoot, kAll, false);
  auto made = Cgroups::detectForTest(fs, kRoot, "dsec/e-1");
  ASSERT_TRUE(made.isOk()) << made.status().toString();
  auto& cg = *made;
  ASSERT_TRUE(cg->create("sb-1", CgroupLimits{2.0, 64 << 20, 32}).isOk());
  const std::string d = cg->dirsOf("sb-1")[0];
  StatsHistory history(4);
  // t, usage_usec, memory.current, pids.current: 0.5 core, then 2 cores,
  // then idle, then a counter that went back (the group made anew).
  struct Tick {
    double t;
    int64_t usec, mem, pids;
  };
  const Tick ticks[] = {{1000, 0, 4096, 1},
                        {1015, 7'500'000, 8192, 3},
                        {1030, 37'500'000, 1 << 20, 7},
                        {1045, 37'500'000, 1 << 20, 7},
                        {1060, 100, 4096, 1}};
  for (auto& k : ticks) {
    fs->setKnob(d + "/cpu.stat", "usage_usec " + std::to_string(k.usec) +
                                     "\nuser_usec 1\nsystem_usec 2\nnr_periods 0\n");
    fs->setKnob(d + "/memory.current", std::to_string(k.mem) + "\n");
    fs->setKnob(d + "/pids.current", std::to_string(k.pids) + "\n");
    auto s = cg->stats("sb-1");
    ASSERT_TRUE(s.isOk()) << s.status().toString();
    EXPECT_EQ(s->cpuUsec, k.usec);
    EXPECT_EQ(s->memoryBytes, k.mem);
    EXPECT_EQ(s->pids, k.pids);
    history.record("sb-1", {k.t, s->cpuUsec, s->memoryBytes, s->pids});
  }
  // A ring of 4: the first reading went.
  auto all = history.query("sb-1", 3600, 1060);
  ASSERT_EQ(all.size(), 4u);
  EXPECT_DOUBLE_EQ(all[0].t, 1015);
  EXPECT_EQ(all[1].memoryBytes, 1 << 20);
  EXPECT_EQ(all[1].pids, 7);
  auto cores = proto::cpuCores(all);
  ASSERT_EQ(cores.size(), 4u);
  EXPECT_FALSE(cores[0].has_value()) << "no reading before the first";
  ASSERT_TRUE(cores[1].has_value());
  EXPECT_DOUBLE_EQ(*cores[1], 2.0);
  ASSERT_TRUE(cores[2].has_value());
  EXPECT_DOUBLE_EQ(*cores[2], 0.0);
  EXPECT_FALSE(cores[3].has_value()) << "a counter that went back is no rate";
  // The window counts back from now.
  EXPECT_EQ(history.query("sb-1", 30, 1060).size(), 3u);
  EXPECT_TRUE(history.query("sb-1", 30, 5000).empty());
  ASSERT_TRUE(cg->remove("sb-1").isOk());
}

TEST(CgroupV2FakeTest, RemoveWithoutCgroupKillFreezesAndKillsListedPids) {
  // Kernels before 5.14 have no cgroup.kill.
  auto fs = std::make_shared<FakeCgroup2Fs>(kRoot, kAll, false, /*hasKill=*/false);
  auto cg = Cgroups::detectForTest(fs, kRoot, "dsec");
  ASSERT_TRUE(cg.isOk()) << cg.status().toString();
  ASSERT_TRUE((*cg)->create("sb-1", CgroupLimits{}).isOk());
  fs->addProcess(99, kRoot);
  fs->addProcess(4242, kRoot);
  ASSERT_TRUE((*cg)->attach("sb-1", 4242).isOk());
  ASSERT_TRUE((*cg)->remove("sb-1").isOk());
  EXPECT_EQ(fs->killed_, (std::vector<pid_t>{4242})) << "only pids listed in the group";
  EXPECT_EQ(fs->groupOf(99), kRoot);
  auto& w = fs->writes_;
  EXPECT_NE(std::find(w.begin(), w.end(), std::string(kRoot) + "/dsec/sb-1/cgroup.freeze <- 1"),
            w.end());
}

TEST(CgroupV2FakeTest, FailedLimitLeavesNoGroup) {
  auto fs = std::make_shared<FakeCgroup2Fs>(kRoot, kAll, false);
  auto cg = Cgroups::detectForTest(fs, kRoot, "dsec");
  ASSERT_TRUE(cg.isOk()) << cg.status().toString();
  fs->failWrites_[std::string(kRoot) + "/dsec/sb-1/pids.max"] = EINVAL;
  Status st = (*cg)->create("sb-1", CgroupLimits{1.0, 1 << 20, 5});
  ASSERT_FALSE(st.isOk());
  EXPECT_EQ(st.sysErrno(), EINVAL);
  EXPECT_NE(st.message().find("pids.max"), std::string::npos) << st.toString();
  EXPECT_FALSE(fs->isDir(std::string(kRoot) + "/dsec/sb-1"));
}

TEST(CgroupTest, CreateLimitAttachRemove) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to manage cgroups";
  auto cg = Cgroups::detect("/sys/fs/cgroup", "dsec-unittest");
  if (!cg.isOk()) GTEST_SKIP() << "no usable cgroups: " << cg.status().toString();
  std::string id = "sb-test" + randomHex(4);
  ASSERT_TRUE((*cg)->create(id, CgroupLimits{0.5, 64 << 20, 32}).isOk());
  auto dirs = (*cg)->dirsOf(id);
  struct stat st;
  for (auto& d : dirs) ASSERT_EQ(stat(d.c_str(), &st), 0) << d;
  if ((*cg)->mode() == Cgroups::Mode::kV1) {
    EXPECT_EQ(*readFile(dirs[0] + "/memory.limit_in_bytes"), std::to_string(64 << 20) + "\n");
    EXPECT_EQ(*readFile(dirs[2] + "/pids.max"), "32\n");
    EXPECT_EQ(*readFile(dirs[1] + "/cpu.cfs_quota_us"), "50000\n");
  } else {
    EXPECT_EQ(*readFile(dirs[0] + "/pids.max"), "32\n");
  }
  pid_t child = fork();
  if (child == 0) {
    pause();
    _exit(0);
  }
  ASSERT_TRUE((*cg)->attach(id, child).isOk());
  auto ids = (*cg)->list();
  EXPECT_NE(std::find(ids.begin(), ids.end(), id), ids.end());
  EXPECT_TRUE((*cg)->stats(id).isOk());
  // A child that burns CPU for 300 ms counts in the group's CPU time (v1:
  // cpuacct, co-mounted with cpu or a hierarchy of its own) and tasks.
  pid_t busy = fork();
  {
    if (busy == 0) {
      auto end = std::chrono::steady_clock::now() + std::chrono::milliseconds(300);
      while (std::chrono::steady_clock::now() < end) {
      }
      pause();
      _exit(0);
    }
    ASSERT_TRUE((*cg)->attach(id, busy).isOk());
    usleep(600 * 1000);
    auto s = (*cg)->stats(id);
    ASSERT_TRUE(s.isOk()) << s.status().toString();
    EXPECT_GT(s->cpuUsec, 50'000) << "the busy child's CPU time (0.5 cores at most)";
    EXPECT_LT(s->cpuUsec, 5'000'000);
    EXPECT_EQ(s->pids, 2);
  }
  // remove() must kill what still runs inside.
  ASSERT_TRUE((*cg)->remove(id).isOk());
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFSIGNALED(status));
  ASSERT_EQ(waitpid(busy, &status, 0), busy);
  for (auto& d : dirs) EXPECT_NE(stat(d.c_str(), &st), 0) << d;
  EXPECT_EQ((*cg)->stats(id).status().code(), Code::kNotFound);
  (*cg)->removeParent();  // and the memory group the pool kept (v1)
  for (auto& d : dirs) EXPECT_NE(stat(d.substr(0, d.rfind('/')).c_str(), &st), 0) << d;
}

// A child in `id`'s groups that touches `bytes` of memory when told (one
// byte on `go`), then waits to be killed.
pid_t childThatAllocates(Cgroups& cg, const std::string& id, size_t bytes, int go[2]) {
  if (::pipe(go) != 0) return -1;
  pid_t child = fork();
  if (child == 0) {
    char c;
    if (::read(go[0], &c, 1) != 1) _exit(1);
    if (bytes > 0) {
      auto* p = static_cast<char*>(::malloc(bytes));
      for (size_t i = 0; p && i < bytes; i += 4096) p[i] = 1;
    }
    pause();
    _exit(0);
  }
  if (!cg.attach(id, child).isOk()) {
    ::kill(child, SIGKILL);
    ::waitpid(child, nullptr, 0);
    return -1;
  }
  return child;
}

uint64_t inodeOf(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 ? st.st_ino : 0;
}

// cgroup v1: a destroyed sandbox's memory group is kept, renamed, and given
// to the next create (no memory cgroup removal, no creation); one that saw an
// OOM kill is removed; a new Cgroups on the same parent takes the pool over.
TEST(CgroupTest, MemoryPoolReusesEmptyMemoryGroups) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to manage cgroups";
  const std::string parent = "dsec-unittest-pool-" + randomHex(3);
  auto cg = Cgroups::detect("/sys/fs/cgroup", parent);
  if (!cg.isOk()) GTEST_SKIP() << "no usable cgroups: " << cg.status().toString();
  if ((*cg)->mode() != Cgroups::Mode::kV1) {
    (*cg)->removeParent();
    GTEST_SKIP() << "the memory cgroup pool is for cgroup v1 (v2 groups cannot be renamed)";
  }
  std::string a = "sb-a" + randomHex(4), b = "sb-b" + randomHex(4), c = "sb-c" + randomHex(4);
  ASSERT_TRUE((*cg)->create(a, CgroupLimits{0.5, 64 << 20, 32}).isOk());
  const std::string memA = (*cg)->dirsOf(a)[0];
  const uint64_t inoA = inodeOf(memA);
  int go[2];
  pid_t child = childThatAllocates(**cg, a, 0, go);
  ASSERT_GT(child, 0);
  ASSERT_TRUE((*cg)->remove(a).isOk());
  ASSERT_EQ(waitpid(child, nullptr, 0), child);
  ::close(go[0]);
  ::close(go[1]);
  EXPECT_EQ(inodeOf(memA), 0u);
  EXPECT_EQ((*cg)->memoryPoolSize(), 1u);

  // The next create takes it: same group, new name, new limit.
  ASSERT_TRUE((*cg)->create(b, CgroupLimits{0.5, 32 << 20, 32}).isOk());
  const std::string memB = (*cg)->dirsOf(b)[0];
  EXPECT_EQ(inodeOf(memB), inoA);
  EXPECT_EQ((*cg)->memoryPoolSize(), 0u);
  EXPECT_EQ(*readFile(memB + "/memory.limit_in_bytes"), std::to_string(32 << 20) + "\n");
  EXPECT_EQ(*readFile(memB + "/memory.failcnt"), "0\n");
  for (auto& d : (*cg)->dirsOf(b)) EXPECT_NE(inodeOf(d), 0u) << d;
  ASSERT_TRUE((*cg)->remove(b).isOk());
  EXPECT_EQ((*cg)->memoryPoolSize(), 1u);

  // An OOM kill's count cannot be reset: that group is removed, not kept.
  ASSERT_TRUE((*cg)->create(c, CgroupLimits{0.5, 16 << 20, 32}).isOk());
  const uint64_t inoC = inodeOf((*cg)->dirsOf(c)[0]);
  EXPECT_EQ((*cg)->memoryPoolSize(), 0u);
  child = childThatAllocates(**cg, c, 64 << 20, go);
  ASSERT_GT(child, 0);
  ASSERT_EQ(::write(go[1], "x", 1), 1);
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ::close(go[0]);
  ::close(go[1]);
  ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) << status;
  EXPECT_EQ(*(*cg)->oomKills(c), 1);
  ASSERT_TRUE((*cg)->remove(c).isOk());
  EXPECT_EQ((*cg)->memoryPoolSize(), 0u);
  EXPECT_EQ(inodeOf((*cg)->dirsOf(c)[0]), 0u);
  (void)inoC;

  // Kept across edges: a new Cgroups on the same parent adopts the pool.
  ASSERT_TRUE((*cg)->create(a, CgroupLimits{0.5, 64 << 20, 32}).isOk());
  ASSERT_TRUE((*cg)->remove(a).isOk());
  EXPECT_EQ((*cg)->memoryPoolSize(), 1u);
  cg->reset();
  auto again = Cgroups::detect("/sys/fs/cgroup", parent);
  ASSERT_TRUE(again.isOk());
  EXPECT_EQ((*again)->memoryPoolSize(), 1u);
  (*again)->setMemoryPoolMax(0);
  EXPECT_EQ((*again)->memoryPoolSize(), 0u);
  (*again)->removeParent();
  struct stat st;
  EXPECT_NE(stat(memA.substr(0, memA.rfind('/')).c_str(), &st), 0);
}

}  // namespace
}  // namespace dsec::edge
