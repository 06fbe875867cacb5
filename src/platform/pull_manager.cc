#include "platform/pull_manager.h"

#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <chrono>

#include "common/log.h"
#include "common/util.h"

namespace dsec::platform {

const char* layerPhaseName(LayerPhase p) {
  switch (p) {
    case LayerPhase::kExists: return "exists";
    case LayerPhase::kWaiting: return "waiting";
    case LayerPhase::kDownloading: return "downloading";
    case LayerPhase::kConverting: return "converting";
    case LayerPhase::kDone: return "done";
  }
  return "unknown";
}

// One pull: its callbacks and the layers it still waits for.
struct PullManager::Job {
  ProgressFn progress;
  DoneFn done;
  std::mutex mu;  // serializes the callbacks; guards the fields below
  std::vector<std::string> layers;
  size_t remaining = 0;
  bool finished = false;

  void report(const LayerProgress& p) {
    std::lock_guard lk(mu);
    if (!finished && progress) progress(p);
  }
};

// One registry layer being fetched and converted, for every pull waiting.
struct PullManager::Task {
  image::RegistryRef ref;
  image::RegistryLayer layer;
  std::shared_ptr<image::RegistryClient> client;
  std::atomic<bool> cancel{false};
  // Guarded by PullManager::mu_.
  std::vector<std::pair<std::shared_ptr<Job>, size_t>> waiters;
  LayerPhase phase = LayerPhase::kWaiting;
  int64_t bytes = 0;

  std::vector<std::shared_ptr<Job>> jobs(std::mutex& mu) {
    std::lock_guard lk(mu);
    std::vector<std::shared_ptr<Job>> out;
    for (auto& [j, i] : waiters) out.push_back(j);
    return out;
  }
};

// The cluster-wide claim on fetching one registry layer (PullHooks::claim):
// renewed every third of its time to live while held, given up when
// destroyed.
class LayerClaim {
 public:
  static constexpr double kTtlS = 30;
  LayerClaim(const PullHooks& hooks, std::string source)
      : hooks_(hooks), source_(std::move(source)) {}
  ~LayerClaim() {
    {
      std::lock_guard lk(mu_);
      done_ = true;
    }
    cv_.notify_all();
    if (renewer_.joinable()) renewer_.join();
    if (held_ && hooks_.unclaim) hooks_.unclaim(source_);
  }
  Result<bool> take() {
    ASSIGN_OR_RETURN(bool mine, hooks_.claim(source_, kTtlS));
    if (mine && !held_) {
      held_ = true;
      renewer_ = std::thread([this] {
        std::unique_lock lk(mu_);
        while (!cv_.wait_for(lk, std::chrono::duration<double>(kTtlS / 3), [&] { return done_; })) {
          lk.unlock();
          auto r = hooks_.claim(source_, kTtlS);
          if (!r.isOk() || !*r) {
            log::warn("pull: renewing the claim on layer " + source_ + ": " +
                      (r.isOk() ? "taken by another replica" : r.status().toString()));
          }
          lk.lock();
        }
      });
    }
    return mine;
  }

 private:
  const PullHooks& hooks_;
  const std::string source_;
  bool held_ = false;
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  std::thread renewer_;
};

PullManager::PullManager(std::string workRoot, std::string convertPrefix, PullHooks hooks,
                         int workers)
    : workRoot_(std::move(workRoot)), convertPrefix_(std::move(convertPrefix)), hooks_(std::move(hooks)) {
  for (int i = 0; i < std::max(1, workers); ++i) workers_.emplace_back([this] { worker(); });
}

PullManager::~PullManager() {
  std::deque<std::shared_ptr<Task>> queued;
  {
    std::lock_guard lk(mu_);
    stopping_ = true;
    for (auto& [d, t] : inflight_) t->cancel = true;
    queued.swap(queue_);
  }
  cv_.notify_all();
  for (auto& t : queued) finishTask(t, Status(Code::kUnavailable, "the platform is stopping"));
  for (auto& w : workers_) w.join();
}

PullStats PullManager::stats() const {
  std::lock_guard lk(mu_);
  PullStats s = stats_;
  s.inFlight = int64_t(inflight_.size());
  return s;
}

std::set<std::string> PullManager::heldLayers() const {
  std::lock_guard lk(mu_);
  return std::set<std::string>(held_.begin(), held_.end());
}

void PullManager::hold(const std::string& layer) {
  std::lock_guard lk(mu_);
  held_.insert(layer);
}

void PullManager::release(const std::vector<std::string>& layers) {
  std::lock_guard lk(mu_);
  for (auto& l : layers) {
    if (l.empty()) continue;
    if (auto it = held_.find(l); it != held_.end()) held_.erase(it);
  }
}

void PullManager::settle(const std::shared_ptr<Job>& job, size_t index,
                         const Result<std::string>& r) {
  // Called with neither mu_ nor job->mu held. The job holds each layer it
  // has until `done` (which names them in an image) returns.
  std::lock_guard lk(job->mu);
  if (job->finished) return;
  if (!r.isOk()) {
    job->finished = true;
    if (job->done) job->done(r.status());
    release(job->layers);
    return;
  }
  hold(*r);
  job->layers[index] = *r;
  if (--job->remaining == 0) {
    job->finished = true;
    if (job->done) job->done(job->layers);
    release(job->layers);
  }
}

void PullManager::pullLayers(std::shared_ptr<image::RegistryClient> client,
                             const image::ResolvedImage& image, ProgressFn progress,
                             DoneFn done) {
  auto job = std::make_shared<Job>();
  job->progress = std::move(progress);
  job->done = std::move(done);
  job->layers.resize(image.layers.size());
  job->remaining = image.layers.size();
  if (image.layers.empty()) {
    return settle(job, 0, Status(Code::kInvalidArgument, "the image has no layers", 0, "ref"));
  }
  for (size_t i = 0; i < image.layers.size(); ++i) {
    const image::RegistryLayer& l = image.layers[i];
    LayerProgress p{l.digest, LayerPhase::kExists, 0, l.size, ""};
    // A few rounds: a layer another pull was fetching may finish (or fail)
    // between looking and joining.
    for (int round = 0;; ++round) {
      if (auto known = hooks_.knownLayer ? hooks_.knownLayer(l.digest) : std::nullopt) {
        {
          std::lock_guard lk(mu_);
          ++stats_.layersReused;
        }
        p.layer = *known;
        p.bytes = l.size;
        job->report(p);
        settle(job, i, *known);
        break;
      }
      std::shared_ptr<Task> running;
      bool stopping = false;
      {
        std::lock_guard lk(mu_);
        stopping = stopping_;
      }
      if (stopping) {
        settle(job, i, Status(Code::kUnavailable, "the platform is stopping"));
        return;
      }
      {
        std::lock_guard lk(mu_);
        auto it = inflight_.find(l.digest);
        if (it == inflight_.end()) {
          auto t = std::make_shared<Task>();
          t->ref = image.ref;
          t->layer = l;
          t->client = client;
          t->waiters.emplace_back(job, i);
          inflight_[l.digest] = t;
          queue_.push_back(t);
          cv_.notify_one();
          p.phase = LayerPhase::kWaiting;
          running = nullptr;
        } else {
          running = it->second;
        }
      }
      if (!running) {
        job->report(p);
        break;
      }
      // Another pull is fetching it: this caller must be allowed to read it.
      if (Status st = client->checkBlob(image.ref, l.digest); !st.isOk()) {
        settle(job, i, st);
        break;
      }
      bool joined = false;
      {
        std::lock_guard lk(mu_);
        auto it = inflight_.find(l.digest);
        if (it != inflight_.end() && it->second == running) {
          running->waiters.emplace_back(job, i);
          ++stats_.layersJoined;
          p.phase = running->phase;
          p.bytes = running->bytes;
          joined = true;
        }
      }
      if (joined) {
        job->report(p);
        break;
      }
      if (round >= 3) {
        settle(job, i, Status(Code::kUnavailable, "layer " + l.digest + " keeps failing"));
        break;
      }
    }
    std::lock_guard lk(job->mu);
    if (job->finished) return;
  }
}

void PullManager::worker() {
  for (;;) {
    std::shared_ptr<Task> t;
    {
      std::unique_lock lk(mu_);
      cv_.wait(lk, [&] { return stopping_ || !queue_.empty(); });
      if (stopping_) return;
      t = queue_.front();
      queue_.pop_front();
    }
    runTask(t);
  }
}

void PullManager::runTask(const std::shared_ptr<Task>& t) {
  const std::string hex = t->layer.digest.substr(t->layer.digest.find(':') + 1);
  const std::string spoolDir = workRoot_ + "/spool";
  if (Status st = makeDirs(spoolDir, 0700); !st.isOk()) return finishTask(t, st);
  const std::string spool = spoolDir + "/" + hex + ".part";
  auto tell = [&](LayerPhase phase, int64_t bytes) {
    {
      std::lock_guard lk(mu_);
      t->phase = phase;
      t->bytes = bytes;
    }
    for (auto& j : t->jobs(mu_)) j->report({t->layer.digest, phase, bytes, t->layer.size, ""});
  };
  LayerClaim claim(hooks_, t->layer.digest);
  if (!claimOrAwait(t, claim, tell)) return;
  struct stat st;
  int64_t start = ::stat(spool.c_str(), &st) == 0 ? st.st_size : 0;
  tell(LayerPhase::kDownloading, start);
  auto last = std::chrono::steady_clock::now();
  int64_t counted = start;
  Status fetched = t->client->fetchBlob(
      t->ref, t->layer, spool,
      [&](int64_t bytes) {
        {
          std::lock_guard lk(mu_);
          if (bytes > counted) stats_.bytesFetched += bytes - counted;
          counted = bytes;
        }
        auto now = std::chrono::steady_clock::now();
        if (now - last < std::chrono::milliseconds(500) && bytes < t->layer.size) return;
        last = now;
        tell(LayerPhase::kDownloading, bytes);
      },
      &t->cancel);
  if (!fetched.isOk()) return finishTask(t, fetched);
  tell(LayerPhase::kConverting, t->layer.size);
  const std::string work = convertPrefix_ + "-" + randomHex(6);
  std::string taskHold;
  auto convertAndCommit = [&]() -> Result<std::string> {
    ASSIGN_OR_RETURN(image::ConvertedLayer built, hooks_.convert(spool, t->layer, work));
    // Held from before it is in the store until the pulls waiting for it
    // hold it themselves (finishTask): a collection in between keeps it.
    hold(built.layer.digest);
    taskHold = built.layer.digest;
    RETURN_IF_ERROR(hooks_.commit(built, t->layer.digest));
    return built.layer.digest;
  };
  Result<std::string> out = convertAndCommit();
  (void)removeTree(work);
  // The spool is kept only to resume a download; a conversion that failed
  // would fail again on the same bytes.
  ::unlink(spool.c_str());
  finishTask(t, std::move(out));
  release({taskHold});
}

bool PullManager::claimOrAwait(const std::shared_ptr<Task>& t, LayerClaim& claim,
                               const std::function<void(LayerPhase, int64_t)>& tell) {
  if (!hooks_.claim) return true;
  bool told = false;
  for (;;) {
    auto mine = claim.take();
    if (!mine.isOk()) {
      finishTask(t, mine.status());
      return false;
    }
    // Taken or not, the layer may be there already: the replica that held
    // the claim made it and let go.
    if (auto known = hooks_.knownLayer ? hooks_.knownLayer(t->layer.digest) : std::nullopt) {
      finishTask(t, *known, /*here=*/false);
      return false;
    }
    if (*mine) return true;
    if (!told) {
      tell(LayerPhase::kWaiting, 0);
      told = true;
    }
    std::unique_lock lk(mu_);
    if (cv_.wait_for(lk, std::chrono::milliseconds(250), [&] { return stopping_ || t->cancel; })) {
      lk.unlock();
      finishTask(t, Status(Code::kUnavailable, "the platform is stopping"));
      return false;
    }
  }
}

void PullManager::finishTask(const std::shared_ptr<Task>& t, Result<std::string> r, bool here) {
  std::vector<std::pair<std::shared_ptr<Job>, size_t>> waiters;
  {
    std::lock_guard lk(mu_);
    auto it = inflight_.find(t->layer.digest);
    if (it != inflight_.end() && it->second == t) inflight_.erase(it);
    waiters.swap(t->waiters);
    if (r.isOk() && here) {
      ++stats_.layersFetched;
    } else if (r.isOk()) {
      ++stats_.layersAwaited;
    } else {
      ++stats_.failures;
    }
  }
  if (!r.isOk()) {
    log::warn("pull: layer " + t->layer.digest + " of " + t->ref.str() + ": " +
              r.status().toString());
  }
  for (auto& [job, index] : waiters) {
    if (r.isOk()) {
      job->report({t->layer.digest, LayerPhase::kDone, t->layer.size, t->layer.size, *r});
      settle(job, index, *r);
    } else {
      Status st = r.status();
      // Name the layer; keep the code and field.
      settle(job, index,
             Status(st.code(), "layer " + t->layer.digest + ": " + st.message(), st.sysErrno(),
                    st.field()));
    }
  }
}

}  // namespace dsec::platform
