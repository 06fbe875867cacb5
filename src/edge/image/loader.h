// On-demand loaders: how a layer's data blob reaches the kernel. A node keeps
// each layer's metadata image whole in its cache; the data blob is either read
// in place (`direct`: the blob store is a shared POSIX mount) or filled chunk by
// chunk into a sparse node-local copy as the sandboxes read it (`fanotify`,
// `fuse`). Every fetched chunk is checked against the layer's chunk index
// before any reader sees it; a loader that cannot fetch or verify a chunk makes
// the read fail (EIO), never return zeros or wrong bytes.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "common/status.h"
#include "image/chunk_index.h"
#include "proto/types.h"

namespace dsec::edge {

using proto::LayerDesc;
using proto::LayerLookup;

// Counters of one layer's data on this node.
struct LayerStats {
  int64_t chunks = 0;         // chunks in the data blob
  int64_t chunksCached = 0;   // of them, present in the node cache
  int64_t chunksFetched = 0;  // fetched from the blob store by this node
  int64_t bytesFetched = 0;
  int64_t cacheHits = 0;      // reads served from chunks already cached
  int64_t readRequests = 0;   // reads that reached the loader
  int64_t bytesRead = 0;      // distinct bytes of the blob read (chunk granular)
  LayerStats& operator+=(const LayerStats& o);
};

class Loader {
 public:
  virtual ~Loader() = default;
  virtual const char* name() const = 0;
  // Serves the sparse node-local copy `cachePath` of desc's data blob on
  // demand; returns the path to give EROFS as its device=.
  virtual Result<std::string> attach(const LayerDesc& desc, const std::string& cachePath,
                                     std::shared_ptr<const image::ChunkIndex> index) = 0;
  // After the layer is unmounted.
  virtual void detach(const std::string& dataDigest) = 0;
  virtual LayerStats stats(const std::string& dataDigest) = 0;
  // Chunks of the data blob read so far, in the order first read.
  virtual std::vector<int64_t> readOrder(const std::string& dataDigest) = 0;
  // Processes serving reads outside this one (for operators and tests).
  virtual std::vector<int> helperPids() const { return {}; }
  // Changes whenever the paths attach() returned so far stop serving reads
  // (their server died): a mount made over such a path, under an older
  // generation, must be unmounted and its layer attached again.
  virtual uint64_t generation() { return 0; }
  // Live restore: leaves the loader process serving what is attached so far
  // to the sandboxes that outlive this edge (it keeps serving once its
  // control socket closes); the next edge's loader ends it.
  virtual void keepHelperForNextEdge() {}
  // Ends the loader process an earlier edge left (found at start, and left
  // running meanwhile so that the sandboxes it served never read unfilled
  // bytes).
  virtual void endStaleHelper() {}
  // Whether that process must live until the sandboxes adopted from the
  // earlier edge are gone: true when their layer mounts read through a
  // connection only it serves (FUSE); false when this loader serves the same
  // files as soon as they are attached again (fanotify).
  virtual bool staleHelperServesAdopted() const { return false; }
};

}  // namespace dsec::edge
