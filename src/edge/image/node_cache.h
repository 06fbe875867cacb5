// The node's layer cache: gets a layer's files ready to mount from the blob
// store. Metadata images and chunk indexes are fetched whole and verified;
// data blobs are read in place (`direct`) or filled on demand into sparse
// copies by a Loader (`fanotify`, `fuse`), each chunk verified against the
// blob's chunk index. A data blob may be partial (DataBlobDesc::reclaimed:
// chunks the platform's gc reclaimed, which read as zeros and which no layer
// reads): it no longer hashes to its digest, so it is only ever fetched chunk
// by chunk, and its reclaimed chunks never. A layer reads its own data blob and
// possibly extra ones (chunks deduplicated across layers: other layers' data
// blobs, LayerDesc::extraData); each data blob is one cache entity, attached
// to the loader once while any attached layer reads it (reference counted)
// and detached when the last such layer is unmounted. Cached layers survive
// an edge restart; past a size limit, layers no sandbox has mounted are
// evicted, least recently used first (a data blob another cached layer still
// reads stays). Records which chunks of a data blob the sandboxes read in the
// first seconds after it is attached and, when it is attached again with a
// cold cache, fetches those chunks first in the background (prefetch).
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
  // The extra data blobs (LayerDesc::extraData), in that order: EROFS devices
  // 2, 3, ... (one device= each, after `data`'s).
  std::vector<std::string> extraData;
};

class NodeCache {
 public:
  static Result<std::unique_ptr<NodeCache>> open(NodeCacheOptions opts, LayerLookup lookup);
  // With `loader` (a fake) in place of the one opts.loader names.
  static Result<std::unique_ptr<NodeCache>> openForTest(NodeCacheOptions opts, LayerLookup lookup,
                                                        std::unique_ptr<Loader> loader);
  ~NodeCache();

  // Fetches what is missing and attaches the layer's data blobs (its own and
  // extras) to the loader; a blob some attached layer already reads is
  // shared, not attached again. The layer holds its blobs until unmounted().
  // Errors: the lookup's, the store's (kDataLoss for bad bytes; a layer with
  // extra data blobs but none of its own), kInvalidArgument for reclaimed
  // chunks that do not parse, the loader's; on error the layer holds nothing.
  Result<LayerFiles> prepare(const std::string& digest);
  // Pre-stages layer `digest` (docs/cluster.md, node pools): fetches its
  // metadata image, and the chunk index and every chunk of each of its data
  // blobs (own and extras) into the cache, verified, so sandboxes that stack
  // it later fetch nothing; it is listed by layers() from then on. A whole
  // data blob the node has no copy of is fetched in one piece and checked
  // against its digest; a partial one (reclaimed chunks), or the holes of a
  // sparse copy from earlier use, chunk by chunk, each checked against the
  // chunk index, reclaimed chunks left as holes. A data blob some mounted
  // layer reads is left to its loader. With the direct loader the blobs are
  // read in place: it only checks they are there (nothing to fetch; not
  // listed). Errors: the lookup's, the store's (kDataLoss for bad bytes),
  // kInvalidArgument for reclaimed chunks that do not parse.
  Status prestage(const std::string& digest);
  // True when the layer's mount can no longer read its data (the loader
  // process serving any of its blobs died since it was prepared): unmount
  // it, then prepare() it again.
  bool broken(const std::string& digest);
  // The layer's mount is gone: it lets go of its data blobs; the loader stops
  // serving each one no other attached layer reads.
  void unmounted(const std::string& digest);
  // Bytes the cache holds on disk (allocated, so sparse copies count what they hold).
  int64_t usedBytes() const;
  int64_t limitBytes() const { return opts_.limitBytes; }
  // Deletes cached layers outside `mounted`, least recently used first, until
  // the cache is within its limit, with each data blob no other cached layer
  // reads (as its own or an extra). Returns the layer digests deleted.
  std::vector<std::string> trim(const std::set<std::string>& mounted);

  struct LayerInfo {
    std::string digest;
    std::string dataDigest;
    int64_t dataSize = 0;
    bool attached = false;
    int64_t chunksPrefetched = 0;  // of all its data blobs
    // Counters of everything the layer's mount reads: its metadata image and
    // its data blobs, own and extras, summed (a blob several layers read
    // counts in each of them).
    LayerStats stats;
    std::vector<std::string> extraData;  // digests of its extra data blobs
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
  // A data blob: one layer's own, read by others as an extra, or both.
  struct Blob {
    proto::DataBlobDesc desc;
    int users = 0;       // attached layers reading it; attached to the loader while > 0
    std::string device;  // the loader's path for it, while attached
    double attachedAt = 0;
    bool recorded = false;
    LayerStats past;           // counters of earlier attachments
    int64_t bytesFetched = 0;  // fetched outside the loader: chunk index, prestaged chunks
    std::shared_ptr<std::atomic<int64_t>> prefetched = std::make_shared<std::atomic<int64_t>>(0);
  };
  struct Entry {
    LayerDesc desc;
    bool attached = false;          // holds a use of each of its data blobs
    uint64_t loaderGeneration = 0;  // of the loader when prepared
    int64_t wholeBytesFetched = 0;  // metadata image
  };
  NodeCache() = default;
  // open(), with `loader` when not null.
  static Result<std::unique_ptr<NodeCache>> openWith(NodeCacheOptions opts, LayerLookup lookup,
                                                     std::unique_ptr<Loader> loader);
  std::string pathOf(const std::string& digest, const char* suffix) const;
  // The layer's data blobs: its own, then its extras (EROFS device order).
  static std::vector<proto::DataBlobDesc> blobsOf(const LayerDesc& d);
  // Records the layer's data blobs beside its metadata image (<hex>.blobs),
  // so trim() knows what every cached layer reads, across edge restarts.
  Status writeBlobList(const LayerDesc& d);
  // prepare() once no prestage() of the layer runs.
  Result<LayerFiles> prepareFiles(const std::string& digest);
  // A use of blob b: attached (fetching its chunk index, making its sparse
  // copy) unless some layer uses it already; a cold copy gets the recorded
  // prefetch list, less b's reclaimed chunks. Returns the loader's path.
  Result<std::string> acquireBlob(const proto::DataBlobDesc& b);
  // Lets go of a use; the last one detaches the blob from the loader.
  void releaseBlob(const std::string& dataDigest);
  // Fetches and verifies b's chunk index; adds the bytes fetched.
  Result<image::ChunkIndex> loadIndex(const proto::DataBlobDesc& b, int64_t* fetched);
  // prestage(): the files of `d`, all verified; adds the bytes fetched.
  Status stageFiles(const LayerDesc& d, int64_t* fetched);
  // prestage() of one data blob (left alone while attached): whole when b is
  // (no reclaimed chunks) and not cached at all, else chunk by chunk into a
  // sparse copy, skipping reclaimed chunks.
  Status stageBlob(const proto::DataBlobDesc& b);
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

  std::mutex mu_;  // guards the maps and sets below, stopping_ and prefetchQueue_
  std::map<std::string, Entry> entries_;  // by layer digest
  std::map<std::string, Blob> blobs_;     // by data digest
  // Data digests being fetched, attached, detached or staged: others wait.
  std::set<std::string> blobBusy_;
  std::map<std::string, int> preparing_;  // digests prepare() is working on (count)
  std::set<std::string> staging_;         // digests prestage() is working on
  bool stopping_ = false;
  std::condition_variable cv_;
  std::thread recorder_;
  std::deque<PrefetchJob> prefetchQueue_;
  std::thread prefetcher_;
};

}  // namespace dsec::edge
