// Control protocol between the edge and its `dsec loader fuse` process: one
// JSON object per SOCK_SEQPACKET message. The process first sends
// {"ok":true,"ready":true} once mounted (or {"ok":false,"error":E} and exits);
// then each request is answered in turn:
//   {"op":"add","path":P,"digest":D,"chunks":C} -> {"ok":true} | {"ok":false,"error":E}
//       serve sparse file P (a copy of data blob D, chunk index file C) as <mount>/<hex of D>
//   {"op":"remove","digest":D}                  -> {"ok":true}
//   {"op":"ping"}                               -> {"ok":true,"stats":{D:{...}}}
//   {"op":"order","digest":D}                   -> {"ok":true,"order":[chunk,...]}
//   {"op":"exit"}                               -> {"ok":true}, then it unmounts and exits
// When the edge goes away without "exit" the process keeps serving (sandboxes
// may still read); the next edge on the cache dir kills it and detaches the
// mount.
#include "edge/image/fuse_loader.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <sstream>
#include <nlohmann/json.hpp>

#include "common/log.h"
#include "common/util.h"
#include "edge/image/fuse_server.h"
#include "edge/image/layer_cache.h"
#include "edge/image/loader_control.h"

namespace dsec::edge {

using json = nlohmann::json;

namespace {
std::string hexOf(const std::string& digest) {
  return startsWith(digest, "sha256:") ? digest.substr(7) : digest;
}

// Makes every request of the FUSE connection mounted at `mountPoint` fail at
// once (where fusectl is mounted); killing the process does the same a little
// later, when the kernel closes its /dev/fuse.
void abortConnection(const std::string& mountPoint) {
  auto info = readFile("/proc/self/mountinfo");
  if (!info.isOk()) return;
  std::string id = fuseConnectionOf(*info, mountPoint);
  if (id.empty()) return;
  std::string knob = "/sys/fs/fuse/connections/" + id + "/abort";
  UniqueFd fd(::open(knob.c_str(), O_WRONLY | O_CLOEXEC));
  if (fd) (void)!::write(fd.get(), "1", 1);
}

// Detaches every mount at or under `dir` (a dead connection's mount too).
void detachMounts(const std::string& dir) {
  for (auto& mp : mountsUnder(dir)) {
    if (::umount2(mp.c_str(), MNT_DETACH) == 0) log::info("detached FUSE mount " + mp);
  }
}
}  // namespace

std::string fuseConnectionOf(const std::string& mountinfo, const std::string& mountPoint) {
  std::istringstream in(mountinfo);
  std::string line, found;
  while (std::getline(in, line)) {
    // id parent major:minor root mountpoint opts... - fstype source superopts
    std::istringstream ls(line);
    std::string id, parent, devno, root, mp;
    ls >> id >> parent >> devno >> root >> mp;
    if (mp != mountPoint) continue;
    size_t dash = line.find(" - ");
    if (dash == std::string::npos) continue;
    std::istringstream rest(line.substr(dash + 3));
    std::string fstype;
    rest >> fstype;
    if (fstype != "fuse" && !startsWith(fstype, "fuse.")) continue;
    size_t colon = devno.find(':');
    if (colon == std::string::npos) continue;
    found = devno.substr(colon + 1);  // later lines are mounted on top
  }
  return found;
}

int runFuseLoaderProcess(int ctl, const std::string& storeUri, const std::string& mountDir,
                         const std::string& caFile) {
  ::signal(SIGPIPE, SIG_IGN);
  auto fail = [&](const Status& st) {
    log::error("fuse loader: " + st.toString());
    (void)sendMsg(ctl, json{{"ok", false}, {"error", st.toString()}}.dump());
    return 1;
  };
  image::BlobStoreOptions so;
  so.caFile = caFile;
  auto store = image::BlobStore::open(storeUri, so);
  if (!store.isOk()) return fail(store.status());
  auto started = FuseServer::start(store->get(), mountDir);
  if (!started.isOk()) return fail(started.status());
  // Never destroyed: see FuseServer::unmount().
  FuseServer* server = started->release();
  // The first request waits for the kernel's INIT exchange: a mount that came
  // up but cannot serve (a refused INIT) fails here, not in the first sandbox.
  struct stat st;
  if (::stat(mountDir.c_str(), &st) != 0 || st.st_ino != 1) {
    Status err = sysError("the FUSE mount at " + mountDir + " does not answer");
    server->unmount();
    return fail(err);
  }
  if (!sendMsg(ctl, json{{"ok", true}, {"ready", true}}.dump()).isOk()) {
    server->unmount();
    return 1;
  }
  bool connected = true;
  while (connected) {
    auto m = recvMsg(ctl, -1);
    if (!m.isOk() || m->empty()) break;
    json req = json::parse(*m, nullptr, false);
    json rep = {{"ok", true}};
    std::string op = req.is_object() ? req.value("op", "") : "";
    if (op == "add") {
      auto idx = loadIndex(req.value("chunks", ""));
      Status st = idx.isOk() ? server->add(req.value("path", ""), req.value("digest", ""), *idx)
                             : idx.status();
      if (!st.isOk()) rep = {{"ok", false}, {"error", st.toString()}};
    } else if (op == "remove") {
      server->remove(req.value("digest", ""));
    } else if (op == "ping") {
      json stats = json::object();
      for (auto& [name, s] : server->stats()) stats[name] = statsJson(s);
      rep["stats"] = stats;
    } else if (op == "order") {
      rep["order"] = server->readOrder(req.value("digest", ""));
    } else if (op == "exit") {
      connected = false;
    } else {
      rep = {{"ok", false}, {"error", "unknown op"}};
    }
    if (!sendMsg(ctl, rep.dump()).isOk()) break;
  }
  if (connected) {
    // The edge is gone without saying so: keep serving the sandboxes it left
    // until the next edge ends this process.
    log::warn("fuse loader: edge went away; serving until stopped");
    for (;;) ::pause();
  }
  server->unmount();
  // Exiting closes /dev/fuse: the kernel ends the connection and any request
  // threads blocked on it.
  std::fflush(nullptr);
  ::_exit(0);
}

Result<std::unique_ptr<FuseLoader>> FuseLoader::start(image::BlobStore* store,
                                                      FuseLoaderOptions opts) {
  if (::access("/dev/fuse", R_OK | W_OK) != 0) {
    return Status(Code::kFailedPrecondition,
                  "the fuse loader needs /dev/fuse (" + std::string(strerror(errno)) +
                      "): load the fuse module or pass the device into this container",
                  errno);
  }
  std::unique_ptr<FuseLoader> l(new FuseLoader());
  l->store_ = store;
  l->opts_ = std::move(opts);
  RETURN_IF_ERROR(makeDirs(l->opts_.runDir, 0700));
  // A loader left by an earlier edge serves the mounts of the sandboxes it
  // left over its own FUSE connection: it runs on (its mount detached here)
  // until they are gone (endStaleHelper).
  l->stalePid_ = staleLoaderPid(l->opts_.runDir + "/loader.pid");
  detachMounts(l->opts_.mountDir);
  RETURN_IF_ERROR(makeDirs(l->opts_.mountDir, 0755));
  {
    std::lock_guard lk(l->mu_);
    RETURN_IF_ERROR(l->spawnHelper());
  }
  l->supervisor_ = std::thread([p = l.get()] { p->supervise(); });
  return l;
}

FuseLoader::~FuseLoader() {
  endStaleHelper();
  {
    std::lock_guard lk(mu_);
    stopping_ = true;
    if (keepHelper_) {
      proc_.release();  // it serves on, its mount in place
    } else {
      proc_.stop(opts_.pingTimeoutS, 1.0);
      killHelper();  // the mount and the counters
    }
  }
  stopCv_.notify_all();
  if (supervisor_.joinable()) supervisor_.join();
  if (keepHelper_) return;
  ::unlink((opts_.runDir + "/loader.pid").c_str());
  ::rmdir(opts_.mountDir.c_str());
}

void FuseLoader::keepHelperForNextEdge() {
  std::lock_guard lk(mu_);
  keepHelper_ = true;
}

void FuseLoader::endStaleHelper() {
  std::lock_guard lk(mu_);
  if (stalePid_ <= 0) return;
  // Checked again: the pid was found at start and may have been reused. Its
  // death ends its connection: reads through it fail (EIO), never zeros.
  if (stalePid_ != proc_.pid() && isLoaderProcess(stalePid_)) {
    log::warn("killing the loader process " + std::to_string(stalePid_) + " of an earlier edge");
    ::kill(stalePid_, SIGKILL);
  }
  stalePid_ = -1;
}

Status FuseLoader::spawnHelper() {
  std::vector<std::string> args = {"dsec",  "loader", "fuse",           "--store",
                                   store_->uri(), "--mount", opts_.mountDir, "--control-fd",
                                   "3"};
  if (!store_->options().caFile.empty()) {
    args.insert(args.end(), {"--store-ca", store_->options().caFile});
  }
  RETURN_IF_ERROR(proc_.spawn(opts_.selfExe, args, opts_.runDir + "/loader.pid"));
  int pid = proc_.pid();
  auto hello = proc_.receive(opts_.startTimeoutS);
  json j = hello.isOk() ? json::parse(*hello, nullptr, false) : json();
  if (!j.is_object() || !j.value("ok", false)) {
    std::string why = !hello.isOk()   ? hello.status().message()
                      : hello->empty() ? "it exited"
                      : j.is_object()  ? j.value("error", *hello)
                                       : *hello;
    killHelper();
    return Status(Code::kFailedPrecondition, "fuse loader process did not mount " +
                                                 opts_.mountDir + ": " + why);
  }
  ++generation_;
  for (auto& [_, a] : attached_) {
    if (Status st = helperAdd(a); !st.isOk()) {
      log::warn("fuse loader: re-adding " + a.path + ": " + st.toString());
    }
  }
  log::info("fuse loader process " + std::to_string(pid) + " serving " + opts_.mountDir + " (" +
            std::to_string(attached_.size()) + " files)");
  return Status::ok();
}

void FuseLoader::killHelper() {
  if (proc_.pid() > 0) abortConnection(opts_.mountDir);
  proc_.kill();
  // Counters of the process gone are kept for the layers it served.
  for (auto& [d, s] : helperStats_) past_[d] += s;
  helperStats_.clear();
  detachMounts(opts_.mountDir);
}

bool FuseLoader::helperAlive() { return proc_.alive("fuse loader process"); }

Result<std::string> FuseLoader::call(const std::string& request) {
  auto rep = proc_.call(request, opts_.pingTimeoutS);
  if (!rep.isOk() && proc_.pid() > 0) {
    // A late answer would pair with the next request: this process is done
    // (the supervisor starts the next one).
    log::warn("fuse loader process " + std::to_string(proc_.pid()) + ": " +
              rep.status().message() + "; killing it");
    killHelper();
  }
  return rep;
}

Status FuseLoader::helperAdd(const Attached& a) {
  ASSIGN_OR_RETURN(std::string rep, call(json{{"op", "add"}, {"path", a.path},
                                              {"digest", a.digest}, {"chunks", a.chunksPath}}
                                             .dump()));
  return replyStatus(rep);
}

void FuseLoader::refreshStats() {
  auto rep = call(json{{"op", "ping"}}.dump());
  json j = rep.isOk() ? json::parse(*rep, nullptr, false) : json();
  if (!j.is_object() || !j.value("ok", false)) return;
  auto stats = j.find("stats");
  if (stats == j.end() || !stats->is_object()) return;
  for (auto& [d, a] : attached_) {
    auto it = stats->find(hexOf(d));
    if (it != stats->end()) helperStats_[d] = statsFrom(*it);
  }
}

void FuseLoader::supervise() {
  std::unique_lock lk(mu_);
  while (!stopping_) {
    stopCv_.wait_for(lk, std::chrono::milliseconds(500));
    if (stopping_) break;
    int pid = proc_.pid();
    std::string why;
    if (!helperAlive()) {
      why = "is gone";
    } else {
      auto rep = call(json{{"op", "ping"}}.dump());
      json j = rep.isOk() ? json::parse(*rep, nullptr, false) : json();
      if (j.is_object() && j.value("ok", false)) continue;
      why = rep.isOk() ? "answered badly" : rep.status().message();
    }
    log::warn("fuse loader process " + std::to_string(pid) + " " + why +
              "; restarting it (layers mounted over it fail reads until remounted)");
    double t0 = monoSeconds();
    killHelper();
    if (Status st = spawnHelper(); !st.isOk()) {
      log::error("fuse loader: " + st.toString());
    } else {
      log::info("fuse loader restarted in " + std::to_string(int((monoSeconds() - t0) * 1000)) +
                " ms");
    }
  }
}

Result<std::string> FuseLoader::attach(const LayerDesc& desc, const std::string& cachePath,
                                       std::shared_ptr<const image::ChunkIndex> index) {
  std::lock_guard lk(mu_);
  if (!helperAlive()) {
    // Dead and not yet replaced by the supervisor: replace it now.
    killHelper();
    RETURN_IF_ERROR(spawnHelper());
  }
  Attached a{cachePath, cachePath.substr(0, cachePath.rfind('.')) + ".chunks", desc.dataDigest,
             index->chunkCount()};
  if (Status st = helperAdd(a); !st.isOk()) {
    return Status(Code::kUnavailable, "fuse loader: add " + cachePath + ": " + st.toString());
  }
  attached_[desc.dataDigest] = a;
  return opts_.mountDir + "/" + hexOf(desc.dataDigest);
}

void FuseLoader::detach(const std::string& dataDigest) {
  std::lock_guard lk(mu_);
  auto it = attached_.find(dataDigest);
  if (it == attached_.end()) return;
  (void)call(json{{"op", "remove"}, {"digest", dataDigest}}.dump());
  attached_.erase(it);
  helperStats_.erase(dataDigest);
  past_.erase(dataDigest);
}

LayerStats FuseLoader::stats(const std::string& dataDigest) {
  std::lock_guard lk(mu_);
  auto it = attached_.find(dataDigest);
  if (it == attached_.end()) return {};
  refreshStats();
  LayerStats s;
  if (auto p = past_.find(dataDigest); p != past_.end()) s += p->second;
  if (auto h = helperStats_.find(dataDigest); h != helperStats_.end()) s += h->second;
  s.chunks = it->second.chunks;
  return s;
}

std::vector<int64_t> FuseLoader::readOrder(const std::string& dataDigest) {
  std::lock_guard lk(mu_);
  auto rep = call(json{{"op", "order"}, {"digest", dataDigest}}.dump());
  json j = rep.isOk() ? json::parse(*rep, nullptr, false) : json();
  std::vector<int64_t> out;
  if (j.is_object() && j.contains("order") && j["order"].is_array()) {
    for (auto& v : j["order"]) {
      if (v.is_number_integer()) out.push_back(v.get<int64_t>());
    }
  }
  return out;
}

std::vector<int> FuseLoader::helperPids() const {
  std::lock_guard lk(mu_);
  return proc_.pid() > 0 ? std::vector<int>{proc_.pid()} : std::vector<int>{};
}

uint64_t FuseLoader::generation() {
  std::lock_guard lk(mu_);
  return helperAlive() ? generation_ : UINT64_MAX;
}

}  // namespace dsec::edge
