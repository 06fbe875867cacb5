// The `fanotify` loader: two fillers mark every sparse cache file, one inside
// the edge and one in a separate `dsec loader fanotify` process. Each read
// waits for both, so whichever of the two is killed or hangs, the other still
// fetches and verifies the bytes before the read proceeds; the edge restarts a
// dead or unresponsive loader process (pinged every 0.5 s) and re-adds its
// files. Only if both die at once does the kernel let reads through unfilled,
// and then the edge is gone as well and its sandboxes are reaped on restart.
#pragma once

#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "common/fd.h"
#include "edge/image/fanotify_filler.h"
#include "edge/image/loader.h"
#include "edge/image/loader_control.h"
#include "image/blob_store.h"

namespace dsec::edge {

struct FanotifyLoaderOptions {
  std::string selfExe = "/proc/self/exe";  // the dsec binary: runs `dsec loader fanotify`
  std::string runDir;                      // holds loader.pid
  double pingTimeoutS = 5;                 // an unanswered ping this long: kill -9, restart
};

class FanotifyLoader final : public Loader {
 public:
  static Result<std::unique_ptr<FanotifyLoader>> start(image::BlobStore* store,
                                                       FanotifyLoaderOptions opts);
  ~FanotifyLoader() override;
  const char* name() const override { return "fanotify"; }
  Result<std::string> attach(const LayerDesc& desc, const std::string& cachePath,
                             std::shared_ptr<const image::ChunkIndex> index) override;
  void detach(const std::string& dataDigest) override;
  LayerStats stats(const std::string& dataDigest) override;
  std::vector<int> helperPids() const override;
  void keepHelperForNextEdge() override;
  void endStaleHelper() override;
  std::vector<int64_t> readOrder(const std::string& dataDigest) override;

 private:
  struct Attached {
    std::string path;
    std::string chunksPath;  // the chunk index file, for the loader process
    std::string digest;
  };
  FanotifyLoader() = default;
  void supervise();
  Status spawnHelper();  // mu_ held
  void killHelper();     // mu_ held
  // One request/response with the loader process; mu_ held.
  Result<std::string> call(const std::string& request);
  Status helperAdd(const Attached& a);  // mu_ held
  Status refreshHelperStats();          // mu_ held; pings the process

  image::BlobStore* store_ = nullptr;
  FanotifyLoaderOptions opts_;
  std::unique_ptr<FanotifyFiller> local_;

  mutable std::mutex mu_;  // guards everything below
  std::map<std::string, Attached> attached_;  // by data digest
  std::map<std::string, LayerStats> helperStats_;  // by data digest, from the last ping
  LoaderProcess proc_;
  bool stopping_ = false;
  bool keepHelper_ = false;  // live restore: leave proc_ running at the end
  int stalePid_ = -1;        // an earlier edge's loader process, until endStaleHelper
  std::thread supervisor_;
  std::condition_variable stopCv_;
};

// `dsec loader fanotify`: serves the requests of the edge on control fd `ctl`
// (see fanotify_loader.cc) until told to exit or killed.
int runFanotifyLoaderProcess(int ctl, const std::string& storeUri, const std::string& caFile);

}  // namespace dsec::edge
