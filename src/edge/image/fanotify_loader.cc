// Control protocol between the edge and its `dsec loader fanotify` process:
// one JSON object per SOCK_SEQPACKET message, each request answered in turn.
//   {"op":"add","path":P,"digest":D,"chunks":C}  -> {"ok":true} | {"ok":false,"error":E}
//       mark sparse file P (a copy of data blob D, chunk index file C) and serve it
//   {"op":"remove","path":P}                     -> {"ok":true}
//   {"op":"ping"}                                -> {"ok":true,"stats":{P:{...}}}
//   {"op":"exit"}                                -> {"ok":true}, then the process exits
// When the edge goes away without "exit" the process keeps serving its files
// (sandboxes may still read them); the next edge on the data dir ends it.
#include "edge/image/fanotify_loader.h"

#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstring>
#include <nlohmann/json.hpp>

#include "common/log.h"
#include "common/util.h"
#include "edge/image/loader_control.h"

namespace dsec::edge {

using json = nlohmann::json;


int runFanotifyLoaderProcess(int ctl, const std::string& storeUri, const std::string& caFile) {
  ::signal(SIGPIPE, SIG_IGN);
  // SIGTERM is how the next edge ends us once it serves the same files (see
  // below); blocked before the filler's threads start, so they inherit that.
  sigset_t term;
  sigemptyset(&term);
  sigaddset(&term, SIGTERM);
  ::pthread_sigmask(SIG_BLOCK, &term, nullptr);
  image::BlobStoreOptions so;
  so.caFile = caFile;
  auto store = image::BlobStore::open(storeUri, so);
  if (!store.isOk()) {
    log::error("loader: " + store.status().toString());
    return 1;
  }
  auto filler = FanotifyFiller::start(store->get());
  if (!filler.isOk()) {
    log::error("loader: " + filler.status().toString());
    return 1;
  }
  std::map<std::string, bool> paths;
  bool connected = true;
  while (connected) {
    auto m = recvMsg(ctl, -1);
    if (!m.isOk() || m->empty()) break;
    json req = json::parse(*m, nullptr, false);
    json rep = {{"ok", true}};
    std::string op = req.is_object() ? req.value("op", "") : "";
    if (op == "add") {
      std::string path = req.value("path", "");
      auto idx = loadIndex(req.value("chunks", ""));
      Status st = idx.isOk() ? (*filler)->add(path, req.value("digest", ""), *idx) : idx.status();
      if (st.isOk()) {
        paths[path] = true;
      } else {
        rep = {{"ok", false}, {"error", st.toString()}};
      }
    } else if (op == "remove") {
      (*filler)->remove(req.value("path", ""));
      paths.erase(req.value("path", ""));
    } else if (op == "ping") {
      json stats = json::object();
      for (auto& [p, _] : paths) stats[p] = statsJson((*filler)->stats(p));
      rep["stats"] = stats;
    } else if (op == "exit") {
      connected = false;
    } else {
      rep = {{"ok", false}, {"error", "unknown op"}};
    }
    if (!sendMsg(ctl, rep.dump()).isOk()) break;
  }
  if (connected) {
    // The edge is gone without saying so: keep filling for the sandboxes it
    // left until the next edge ends this process.
    log::warn("loader: edge went away; serving " + std::to_string(paths.size()) +
              " files until stopped");
    // The next edge marks the same files, then sends SIGTERM: reads whose
    // events came to us alone must still be filled before we go.
    int sig = 0;
    while (::sigwait(&term, &sig) != 0) {
    }
    (*filler)->drain(60);
    log::info("loader: handed over to the next edge");
    return 0;
  }
  return 0;
}

Result<std::unique_ptr<FanotifyLoader>> FanotifyLoader::start(image::BlobStore* store,
                                                              FanotifyLoaderOptions opts) {
  std::unique_ptr<FanotifyLoader> l(new FanotifyLoader());
  l->store_ = store;
  l->opts_ = std::move(opts);
  RETURN_IF_ERROR(makeDirs(l->opts_.runDir, 0700));
  // A loader left by an earlier edge keeps filling for the sandboxes it
  // left, until ours marks the same files (endStaleHelper).
  l->stalePid_ = staleLoaderPid(l->opts_.runDir + "/loader.pid");
  // The edge's filler reads ahead; the loader process's only fills what is read.
  ASSIGN_OR_RETURN(l->local_, FanotifyFiller::start(store, 8, 2));
  {
    std::lock_guard lk(l->mu_);
    RETURN_IF_ERROR(l->spawnHelper());
  }
  l->supervisor_ = std::thread([p = l.get()] { p->supervise(); });
  return l;
}

FanotifyLoader::~FanotifyLoader() {
  endStaleHelper();
  {
    std::lock_guard lk(mu_);
    stopping_ = true;
    if (keepHelper_) {
      proc_.release();
    } else {
      proc_.stop(opts_.pingTimeoutS, 1.0);
    }
  }
  stopCv_.notify_all();
  if (supervisor_.joinable()) supervisor_.join();
  if (!keepHelper_) ::unlink((opts_.runDir + "/loader.pid").c_str());
}

void FanotifyLoader::keepHelperForNextEdge() {
  std::lock_guard lk(mu_);
  keepHelper_ = true;
}

void FanotifyLoader::endStaleHelper() {
  std::lock_guard lk(mu_);
  if (stalePid_ <= 0) return;
  // Checked again: the pid was found at start and may have been reused.
  if (stalePid_ != proc_.pid() && isLoaderProcess(stalePid_)) {
    // Our fillers mark its files now; SIGTERM lets it answer the reads it
    // alone was asked about (their bytes filled first) before it exits.
    // Not our child: its exit shows on a pidfd.
    log::info("ending the loader process " + std::to_string(stalePid_) + " of an earlier edge");
    UniqueFd pidfd(int(::syscall(SYS_pidfd_open, stalePid_, 0)));
    ::kill(stalePid_, SIGTERM);
    pollfd p = {pidfd.get(), POLLIN, 0};
    if (!pidfd || ::poll(&p, 1, 65000) <= 0) {
      log::warn("loader process " + std::to_string(stalePid_) + " did not hand over; killing it");
      ::kill(stalePid_, SIGKILL);
    }
  }
  stalePid_ = -1;
}

Status FanotifyLoader::spawnHelper() {
  std::vector<std::string> args = {"dsec", "loader", "fanotify", "--store", store_->uri(),
                                   "--control-fd", "3"};
  if (!store_->options().caFile.empty()) {
    args.insert(args.end(), {"--store-ca", store_->options().caFile});
  }
  RETURN_IF_ERROR(proc_.spawn(opts_.selfExe, args, opts_.runDir + "/loader.pid"));
  for (auto& [_, a] : attached_) {
    if (Status st = helperAdd(a); !st.isOk()) {
      log::warn("loader process: re-adding " + a.path + ": " + st.toString());
    }
  }
  log::info("loader process " + std::to_string(proc_.pid()) + " started (" +
            std::to_string(attached_.size()) + " files)");
  return Status::ok();
}

void FanotifyLoader::killHelper() { proc_.kill(); }

Result<std::string> FanotifyLoader::call(const std::string& request) {
  auto rep = proc_.call(request, opts_.pingTimeoutS);
  if (!rep.isOk() && proc_.pid() > 0) {
    // A late answer would pair with the next request: this process is done
    // (the edge's filler serves alone until the supervisor starts the next).
    log::warn("loader process " + std::to_string(proc_.pid()) + ": " + rep.status().message() +
              "; killing it");
    killHelper();
  }
  return rep;
}

Status FanotifyLoader::helperAdd(const Attached& a) {
  ASSIGN_OR_RETURN(std::string rep, call(json{{"op", "add"}, {"path", a.path},
                                              {"digest", a.digest}, {"chunks", a.chunksPath}}
                                             .dump()));
  return replyStatus(rep);
}

void FanotifyLoader::supervise() {
  std::unique_lock lk(mu_);
  while (!stopping_) {
    stopCv_.wait_for(lk, std::chrono::milliseconds(500));
    if (stopping_) break;
    int pid = proc_.pid();
    std::string why = "is gone";
    if (proc_.alive("loader process")) {
      Status ping = refreshHelperStats();
      if (ping.isOk()) continue;
      why = ping.message();
    }
    log::warn("loader process " + std::to_string(pid) + " " + why + "; restarting it");
    killHelper();
    if (Status st = spawnHelper(); !st.isOk()) log::error("loader process: " + st.toString());
  }
}

Result<std::string> FanotifyLoader::attach(const LayerDesc& desc, const std::string& cachePath,
                                           std::shared_ptr<const image::ChunkIndex> index) {
  RETURN_IF_ERROR(local_->add(cachePath, desc.dataDigest, index));
  std::lock_guard lk(mu_);
  Attached a{cachePath, cachePath.substr(0, cachePath.rfind('.')) + ".chunks", desc.dataDigest};
  attached_[desc.dataDigest] = a;
  // Without the loader process the edge's filler still serves every read; the
  // supervisor re-adds the file when it restarts the process.
  if (Status st = helperAdd(a); !st.isOk()) {
    log::warn("loader process: add " + cachePath + ": " + st.toString());
  }
  return cachePath;
}

void FanotifyLoader::detach(const std::string& dataDigest) {
  std::lock_guard lk(mu_);
  auto it = attached_.find(dataDigest);
  if (it == attached_.end()) return;
  local_->remove(it->second.path);
  (void)call(json{{"op", "remove"}, {"path", it->second.path}}.dump());
  attached_.erase(it);
  helperStats_.erase(dataDigest);
}

Status FanotifyLoader::refreshHelperStats() {
  ASSIGN_OR_RETURN(std::string rep, call(json{{"op", "ping"}}.dump()));
  json j = json::parse(rep, nullptr, false);
  if (!j.is_object() || !j.value("ok", false)) return Status(Code::kInternal, "answered badly");
  std::map<std::string, std::string> digestOf;
  for (auto& [d, a] : attached_) digestOf[a.path] = d;
  auto stats = j.find("stats");
  if (stats != j.end() && stats->is_object()) {
    for (auto it = stats->begin(); it != stats->end(); ++it) {
      if (digestOf.count(it.key())) helperStats_[digestOf[it.key()]] = statsFrom(*it);
    }
  }
  return Status::ok();
}

LayerStats FanotifyLoader::stats(const std::string& dataDigest) {
  std::string path;
  LayerStats helper;
  {
    std::lock_guard lk(mu_);
    auto it = attached_.find(dataDigest);
    if (it == attached_.end()) return {};
    path = it->second.path;
    (void)refreshHelperStats();
    if (helperStats_.count(dataDigest)) helper = helperStats_[dataDigest];
  }
  LayerStats s = local_->stats(path);
  // Both fillers see every read: fetches add up, reads and hits are the edge's.
  s.chunksFetched += helper.chunksFetched;
  s.bytesFetched += helper.bytesFetched;
  s.chunksCached = std::max(s.chunksCached, helper.chunksCached);
  return s;
}

std::vector<int> FanotifyLoader::helperPids() const {
  std::lock_guard lk(mu_);
  return proc_.pid() > 0 ? std::vector<int>{proc_.pid()} : std::vector<int>{};
}

std::vector<int64_t> FanotifyLoader::readOrder(const std::string& dataDigest) {
  std::string path;
  {
    std::lock_guard lk(mu_);
    auto it = attached_.find(dataDigest);
    if (it == attached_.end()) return {};
    path = it->second.path;
  }
  return local_->readOrder(path);
}

}  // namespace dsec::edge
