// The node's layer cache: gets a layer's files ready to mount from the blob
// store. Metadata images and chunk indexes are fetched whole and verified;
// data blobs are read in place (`direct`) or filled on demand into sparse
// copies by a Loader (`fanotify`, `fuse`). Cached layers survive an edge
// restart; past a size limit, layers no sandbox has mounted are evicted, least
// recently used first. Records which chunks a layer's sandboxes read in the
// first seconds after it is attached and, when the layer is attached again with
// a cold cache, fetches those chunks first in the background (prefetch).
// Thread-safe.
#pragma once

#include <condition_variable>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "common/status.h"
#include "edge/image/loader.h"
#include "image/blob_store.h"

namespace dsec::edge {

struct NodeCacheOptions {
  std::string dir;         // node-local cache directory
  std::string storeUri;    // where blobs live: file:///… or http(s)://…
  std::string loader = "auto";  // auto | direct | fanotify | fuse
  int64_t limitBytes = 0;       // cache size limit; 0: none
  std::string selfExe = "/proc/self/exe";  // the dsec binary, for loader processes
  double loaderPingTimeoutS = 5;
  double recordWindowS = 15;    // chunks read this long after attach make the prefetch list
  image::BlobStoreOptions storeOptions;
};

struct LayerFiles {
  std::string meta;  // the EROFS metadata image
  std::string data;  // its data blob (device=), empty for a single-file layer
};

class NodeCache {
 public:
  static Result<std::unique_ptr<NodeCache>> open(NodeCacheOptions opts, LayerLookup lookup);
  ~NodeCache();

  // Fetches what is missing and attaches the data blob to the loader.
  Result<LayerFiles> prepare(const std::string& digest);
  // Pre-stages layer `digest` (docs/cluster.md, node pools): fetches its
  // metadata image, chunk index and every chunk of its data blob into the
  // cache, verified, so sandboxes that stack it later fetch nothing; it is
  // listed by layers() from then on. A layer some sandbox mounts (or is
  // mounting) is left to its loader. With the direct loader the blobs are
  // read in place: it only checks they are there (nothing to fetch; not
  // listed). Errors: the lookup's, the store's (kDataLoss for bad bytes).
  Status prestage(const std::string& digest);
  // True when the layer's mount can no longer read its data (the loader
  // process serving it died): unmount it, then prepare() it again.
  bool broken(const std::string& digest);
  // The layer's mount is gone: the loader stops serving its data blob.
  void unmounted(const std::string& digest);
  // Bytes the cache holds on disk (allocated, so sparse copies count what they hold).
  int64_t usedBytes() const;
  int64_t limitBytes() const { return opts_.limitBytes; }
  // Deletes cached layers outside `mounted`, least recently used first, until
  // the cache is within its limit. Returns the digests deleted.
  std::vector<std::string> trim(const std::set<std::string>& mounted);

  struct LayerInfo {
    std::string digest;
    std::string dataDigest;
    int64_t dataSize = 0;
    bool attached = false;
    int64_t chunksPrefetched = 0;
    LayerStats stats;
  };
  std::vector<LayerInfo> layers();
  const char* loaderName() const { return loader_ ? loader_->name() : "direct"; }
  const std::string& storeUri() const { return opts_.storeUri; }
  std::vector<int> loaderPids() const { return loader_ ? loader_->helperPids() : std::vector<int>{}; }
  // The loader's hand-over between edges (see Loader).
  void keepLoaderForNextEdge() {
    if (loader_) loader_->keepHelperForNextEdge();
  }
  void endStaleLoader() {
    if (loader_) loader_->endStaleHelper();
  }
  bool staleLoaderServesAdopted() const { return loader_ && loader_->staleHelperServesAdopted(); }

 private:
  struct Entry {
    LayerDesc desc;
    bool attached = false;
    double attachedAt = 0;
    bool recorded = false;
    uint64_t loaderGeneration = 0;  // of the loader when attached
    LayerStats past;  // counters of earlier attachments
    int64_t wholeBytesFetched = 0;  // metadata image and chunk index
    std::shared_ptr<std::atomic<int64_t>> prefetched = std::make_shared<std::atomic<int64_t>>(0);
  };
  NodeCache() = default;
  std::string pathOf(const std::string& digest, const char* suffix) const;
  // prepare() once no prestage() of the layer runs.
  Result<LayerFiles> prepareFiles(const std::string& digest);
  // prestage(): the files of `d`, all verified; adds the bytes fetched.
  Status stageFiles(const LayerDesc& d, int64_t* fetched);
  // Fetches name to dest unless it is there; adds the bytes fetched to *fetched.
  Status fetchWhole(const std::string& name, const std::string& digest, const std::string& dest,
                    int64_t* fetched);
  void recorder();
  struct PrefetchJob {
    std::string dataPath;
    std::vector<int64_t> order;
    int64_t chunkSize;
    std::shared_ptr<std::atomic<int64_t>> counter;
  };
  void prefetchLoop();
  void prefetch(const PrefetchJob& job);

  NodeCacheOptions opts_;
  LayerLookup lookup_;
  std::unique_ptr<image::BlobStore> store_;
  std::unique_ptr<Loader> loader_;  // null: direct

  std::mutex mu_;  // guards entries_, stopping_, prefetchQueue_
  std::map<std::string, Entry> entries_;  // by layer digest
  std::map<std::string, int> preparing_;  // digests prepare() is working on (count)
  std::set<std::string> staging_;         // digests prestage() is working on
  bool stopping_ = false;
  std::condition_variable cv_;
  std::thread recorder_;
  std::deque<PrefetchJob> prefetchQueue_;
  std::thread prefetcher_;
};

}  // namespace dsec::edge
