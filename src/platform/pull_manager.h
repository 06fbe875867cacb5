// Registry pulls on the platform (POST /v1/images/pull, api_pull.cc): fetches
// an image's layers from its registry and makes each a dsec layer, on a
// bounded pool of workers of its own (not the HTTP threads).
//
// One fetch per registry layer however many pulls want it: a layer already
// converted (its source digest recorded in the store) is reused at once, and
// a layer another pull is fetching right now is joined, after this pull's
// own credentials have been checked against the registry (HEAD of the blob),
// so joining never lets a caller read what it may not.
//
// Downloads go to <workRoot>/spool/<hex>.part and are resumed from there by a
// later pull after a failure (RegistryClient::fetchBlob); conversions run in
// <workRoot>/../blobs/pull-*/ so their results are renamed, not copied, into
// the blob store by `commit`.
//
// Thread-safety: every public method may be called from any thread. The
// callbacks of one pull run on the manager's workers (or on the caller's
// thread, for layers already there), one at a time per pull.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "common/status.h"
#include "image/layer_converter.h"
#include "image/registry_client.h"

namespace dsec::platform {

class LayerClaim;  // pull_manager.cc

enum class LayerPhase { kExists, kWaiting, kDownloading, kConverting, kDone };
const char* layerPhaseName(LayerPhase p);

struct LayerProgress {
  std::string digest;  // the registry layer's (compressed) digest
  LayerPhase phase = LayerPhase::kWaiting;
  int64_t bytes = 0;   // downloaded so far
  int64_t total = 0;   // the layer's size per the manifest
  std::string layer;   // the dsec layer (its metadata image digest), once there
};

// The manager's seams to the platform (fakes in unit tests).
struct PullHooks {
  // The dsec layer made earlier from registry layer `source`, if it is still
  // in the store with its data; nullopt otherwise.
  std::function<std::optional<std::string>(const std::string& source)> knownLayer;
  // Makes the (compressed) registry layer downloaded to `spool` a layer in
  // `workDir` (a fresh directory).
  std::function<Result<image::ConvertedLayer>(const std::string& spool,
                                              const image::RegistryLayer& layer,
                                              const std::string& workDir)>
      convert;
  // Moves a converted layer into the blob store and records that it came
  // from registry layer `source`.
  std::function<Status(const image::ConvertedLayer& built, const std::string& source)> commit;
  // One fetch per cluster: takes or renews, for ttlS seconds, this replica's
  // claim on fetching registry layer `source`; false while another replica
  // holds it (this one then waits for knownLayer to find that replica's
  // layer, or for the claim to lapse). Null: this replica is alone.
  std::function<Result<bool>(const std::string& source, double ttlS)> claim;
  std::function<void(const std::string& source)> unclaim;
};

struct PullStats {
  int64_t layersFetched = 0;    // downloaded and converted
  int64_t layersReused = 0;     // known already (no fetch)
  int64_t layersJoined = 0;     // in flight for another pull, joined
  int64_t layersAwaited = 0;    // fetched by another replica while this one waited
  int64_t bytesFetched = 0;     // from registries (compressed)
  int64_t failures = 0;         // layers that failed
  int64_t inFlight = 0;         // layers being fetched or converted now
};

class PullManager {
 public:
  // `workRoot`: a directory on the blob store's filesystem; `workers`:
  // layers fetched and converted at once, over all pulls.
  // `convertPrefix`: conversions run in fresh directories named
  // <convertPrefix>-<random> (Platform::startPulls removes those a crash
  // left).
  PullManager(std::string workRoot, std::string convertPrefix, PullHooks hooks, int workers);
  // Stops the workers: layers not started yet fail with kUnavailable; those
  // running are cancelled (their spools stay for a later pull).
  ~PullManager();
  PullManager(const PullManager&) = delete;
  PullManager& operator=(const PullManager&) = delete;

  using ProgressFn = std::function<void(const LayerProgress&)>;
  // The dsec layers, bottom first, or the first layer's error.
  using DoneFn = std::function<void(Result<std::vector<std::string>>)>;

  // Makes every layer of `image` a dsec layer, with `client` (its
  // credentials) for the registry. `progress` sees each layer's phases
  // (downloads at most every 0.5 s); `done` runs once. Layers done before a
  // failure stay in the store (a retry reuses them; gc collects them
  // otherwise). Never blocks on a download.
  void pullLayers(std::shared_ptr<image::RegistryClient> client,
                  const image::ResolvedImage& image, ProgressFn progress, DoneFn done);

  PullStats stats() const;

  // Layers pulls in flight have made or found and not yet named in an
  // image: garbage collection must keep them (and their data blobs), however
  // old, until the pull ends.
  std::set<std::string> heldLayers() const;

 private:
  struct Job;
  struct Task;
  void worker();
  void runTask(const std::shared_ptr<Task>& t);
  // `here`: this replica fetched the layer (else another did, or it failed).
  void finishTask(const std::shared_ptr<Task>& t, Result<std::string> r, bool here = true);
  // Until this replica holds the claim on t's layer (PullHooks::claim):
  // true to go on fetching; false when t is finished (another replica's
  // layer found, an error, the platform stopping).
  bool claimOrAwait(const std::shared_ptr<Task>& t, LayerClaim& claim,
                    const std::function<void(LayerPhase, int64_t)>& tell);
  void settle(const std::shared_ptr<Job>& job, size_t index, const Result<std::string>& r);
  void hold(const std::string& layer);
  void release(const std::vector<std::string>& layers);

  const std::string workRoot_;
  const std::string convertPrefix_;
  const PullHooks hooks_;

  mutable std::mutex mu_;  // guards everything below
  std::condition_variable cv_;
  bool stopping_ = false;
  std::deque<std::shared_ptr<Task>> queue_;
  std::map<std::string, std::shared_ptr<Task>> inflight_;  // by registry layer digest
  std::multiset<std::string> held_;                        // heldLayers(), counted
  PullStats stats_;
  std::vector<std::thread> workers_;
};

}  // namespace dsec::platform
