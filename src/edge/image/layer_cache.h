// Node-wide EROFS layer mounts: each layer is mounted once, read-only, and
// shared by every sandbox that stacks it (one page cache for all). Thread-safe.
//
// Mount strategy, detected per node: the blob files are given straight to
// mount(2) (file-backed EROFS, kernel >= 6.12): the metadata image as the
// source, then one device= per data blob (the layer's own, then its extras);
// where the kernel refuses that, a read-only loop device is attached for each
// file (LOOP_CONFIGURE, autoclear).
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "common/fd.h"
#include "common/status.h"
#include "edge/image/node_cache.h"

namespace dsec::edge {

class LayerCache {
 public:
  // mountRoot: directory for mount points (<mountRoot>/<hex>). `cache` gets
  // each layer's files ready (fetch, on-demand loader) and must outlive this.
  LayerCache(std::string mountRoot, NodeCache* cache);
  ~LayerCache();

  // Removes mounts left under mountRoot by an earlier process (crash), then
  // makes mountRoot a shared mount so new layers propagate to agents already
  // cloned.
  Status cleanupStale();
  // Unmounts every layer and mountRoot itself.
  void close();
  // Mounts the layer if needed, takes a reference, returns its mount point.
  // (A sandbox in a user namespace stacks an idmapped clone of it, made
  // through its own range: container_backend.cc.)
  struct Mounted {
    std::string path;
    LayerFiles files;  // what the mount reads (microvms get these as disks)
  };
  Result<Mounted> acquireMount(const std::string& digest);
  Result<std::string> acquire(const std::string& digest) {
    ASSIGN_OR_RETURN(Mounted m, acquireMount(digest));
    return m.path;
  }
  void release(const std::string& digest);
  // Unmounts the layer if it is mounted and unused (ok when not mounted);
  // kFailedPrecondition while a sandbox holds it.
  Status evict(const std::string& digest);
  // Layers with no users are unmounted; with force, all (shutdown).
  Status unmountUnused(bool force = false);
  // "file" or "loop": how the last mount was made.
  std::string mountMethod() const;

 private:
  struct Entry {
    std::string path;
    LayerFiles files;
    int refs = 0;
    double lastUsed = 0;
  };
  Status mountLayer(const LayerFiles& files, const std::string& target);
  // Past the node cache's limit: unmounts unused layers, least recently used
  // first, and lets the cache delete them. mu_ held.
  void trimLocked();

  const std::string mountRoot_;
  NodeCache* cache_;
  mutable std::mutex mu_;  // guards layers_, method_; held across a mount so one layer mounts once
  std::map<std::string, Entry> layers_;
  std::string method_ = "file";
  bool rootBound_ = false;
};

// Mount points under `prefix` in this mount namespace, deepest first.
std::vector<std::string> mountsUnder(const std::string& prefix);

}  // namespace dsec::edge
