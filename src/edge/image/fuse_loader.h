// The `fuse` loader: a separate `dsec loader fuse` process mounts a read-only
// FUSE file system (edge/image/fuse_server.h) at <cache>/fuse with one file per
// attached data blob, and EROFS mounts that file as the layer's device=. The
// process fetches and verifies chunks into the node's sparse cache copies and
// serves reads from them.
//
// Fails safe: when the process dies (or is killed because it stopped answering
// pings), the kernel aborts its FUSE connection, so every read of its files
// fails with an error; a sandbox never reads zeros or wrong bytes. The edge
// then starts a new process on a fresh mount at the same path and marks the
// layers mounted over the dead one broken (generation() changes): sandboxes
// already running on them keep getting EIO for data not already in their page
// cache (their mounts hold the dead connection), while the next sandbox that
// acquires such a layer gets it remounted over the new process. See
// docs/fuse-loader.md.
#pragma once

#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "common/fd.h"
#include "edge/image/loader.h"
#include "edge/image/loader_control.h"
#include "image/blob_store.h"

namespace dsec::edge {

struct FuseLoaderOptions {
  std::string selfExe = "/proc/self/exe";  // the dsec binary: runs `dsec loader fuse`
  std::string runDir;                      // holds loader.pid
  std::string mountDir;                    // the FUSE mount point (created)
  double pingTimeoutS = 5;   // an unanswered ping this long: abort, kill -9, restart
  double startTimeoutS = 10; // a new process must have mounted within this
};

class FuseLoader final : public Loader {
 public:
  // Kills a loader process and removes a FUSE mount an earlier edge left, then
  // starts the process. kFailedPrecondition when /dev/fuse is missing or the
  // mount is refused, with the reason.
  static Result<std::unique_ptr<FuseLoader>> start(image::BlobStore* store, FuseLoaderOptions opts);
  // Asks the process to unmount and exit (kill -9 if it does not), and
  // detaches the mount.
  ~FuseLoader() override;
  const char* name() const override { return "fuse"; }
  // Returns <mountDir>/<hex of the data digest>. kUnavailable when no loader
  // process can be started.
  Result<std::string> attach(const LayerDesc& desc, const std::string& cachePath,
                             std::shared_ptr<const image::ChunkIndex> index) override;
  void detach(const std::string& dataDigest) override;
  LayerStats stats(const std::string& dataDigest) override;
  std::vector<int64_t> readOrder(const std::string& dataDigest) override;
  std::vector<int> helperPids() const override;
  void keepHelperForNextEdge() override;
  void endStaleHelper() override;
  bool staleHelperServesAdopted() const override { return true; }
  // Bumped by each process started; while the current one is found dead,
  // a value that matches no attachment (mounts over a dead process fail every
  // uncached read until remounted).
  uint64_t generation() override;

 private:
  struct Attached {
    std::string path;        // the sparse cache copy
    std::string chunksPath;  // its chunk index file
    std::string digest;
    int64_t chunks = 0;
  };
  FuseLoader() = default;
  void supervise();
  Status spawnHelper();  // mu_ held
  void killHelper();     // mu_ held; aborts the connection, kills, detaches the mount
  bool helperAlive();    // mu_ held; reaps a dead process
  Result<std::string> call(const std::string& request);  // mu_ held
  Status helperAdd(const Attached& a);                   // mu_ held
  void refreshStats();                                   // mu_ held

  image::BlobStore* store_ = nullptr;
  FuseLoaderOptions opts_;

  mutable std::mutex mu_;  // guards everything below
  std::map<std::string, Attached> attached_;         // by data digest
  std::map<std::string, LayerStats> helperStats_;    // by data digest, current process
  std::map<std::string, LayerStats> past_;           // by data digest, earlier processes
  LoaderProcess proc_;
  uint64_t generation_ = 0;  // bumped by each process started
  bool stopping_ = false;
  bool keepHelper_ = false;  // live restore: leave proc_ running at the end
  int stalePid_ = -1;        // an earlier edge's loader process, until endStaleHelper
  std::thread supervisor_;
  std::condition_variable stopCv_;
};

// `dsec loader fuse`: mounts at `mountDir` and serves the requests of the edge
// on control fd `ctl` (see fuse_loader.cc) until told to exit or killed.
int runFuseLoaderProcess(int ctl, const std::string& storeUri, const std::string& mountDir,
                         const std::string& caFile);

// The FUSE connection id (the minor device number, the name of its directory
// under /sys/fs/fuse/connections) of the topmost mount at `mountPoint` in
// `mountinfo` (the text of /proc/self/mountinfo); "" when there is none.
std::string fuseConnectionOf(const std::string& mountinfo, const std::string& mountPoint);

}  // namespace dsec::edge
