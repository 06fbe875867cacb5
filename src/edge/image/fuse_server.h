// The file system inside `dsec loader fuse`: a read-only FUSE mount (libfuse3
// low-level API, multi-threaded) with one regular file per attached data blob,
// named by the blob's hex digest. A read of a range first makes every 1 MiB
// chunk it touches present in the blob's sparse node-local copy (a chunk is
// present when its bytes have no hole, SEEK_HOLE, as for the fanotify loader,
// so the cache is shared by both loaders and survives restarts): missing
// chunks are fetched from the blob store, verified against the chunk index and
// written into the copy; then the bytes are served from the copy. A chunk that
// cannot be fetched or verified fails the read with EIO.
//
// If the process dies, the kernel aborts the FUSE connection: reads of its
// files fail (ENOTCONN/ECONNABORTED, EIO through EROFS), never return zeros.
#pragma once

#include <atomic>
#include <condition_variable>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "common/fd.h"
#include "common/status.h"
#include "edge/image/loader.h"
#include "image/blob_store.h"
#include "image/chunk_index.h"

struct fuse_session;

namespace dsec::edge {

class FuseServer {
 public:
  // Mounts at `mountDir` (which must exist and be empty) and starts serving
  // with up to `threads` request threads. `store` must outlive the server.
  // kFailedPrecondition when /dev/fuse is missing or the mount is refused.
  static Result<std::unique_ptr<FuseServer>> start(image::BlobStore* store,
                                                   const std::string& mountDir, int threads = 16);
  // The server lives until its process exits: its request threads may be
  // blocked in /dev/fuse for as long as a mount holds the connection, so it is
  // never destroyed. unmount() detaches the mount; process exit then aborts
  // the connection.
  void unmount();

  // Serves sparse file `cachePath` (a copy of data blob `dataDigest`) as
  // <mountDir>/<hex of dataDigest>. Ok if it is already served.
  Status add(const std::string& cachePath, const std::string& dataDigest,
             std::shared_ptr<const image::ChunkIndex> index);
  // The file disappears from the mount (open handles keep working).
  void remove(const std::string& dataDigest);
  // By hex name: the counters of every file served.
  std::map<std::string, LayerStats> stats();
  std::vector<int64_t> readOrder(const std::string& dataDigest);

  // FUSE operations (called by libfuse threads; public for the C callbacks).
  struct File;
  std::shared_ptr<File> byIno(uint64_t ino);
  std::shared_ptr<File> byName(const std::string& name);
  std::vector<std::pair<std::string, uint64_t>> listing();
  // Makes chunks first..last of f present; the error fails the read.
  Status ensureChunks(File& f, int64_t first, int64_t last);
  // A read of first..last continued a sequential read: fetch the chunks after
  // it in the background, so the next read finds them (or their fetch under
  // way). Best effort: a failed fetch is retried, and reported, by the read.
  void readAhead(const std::shared_ptr<File>& f, int64_t first, int64_t last);

 private:
  FuseServer() = default;
  void readAheadLoop();

  image::BlobStore* store_ = nullptr;
  std::string mountDir_;
  fuse_session* se_ = nullptr;
  bool mounted_ = false;
  std::thread loop_;

  std::mutex mu_;  // guards files_, inos_, nextIno_, ahead_
  std::map<std::string, std::shared_ptr<File>> files_;  // by hex name
  std::map<std::string, uint64_t> inos_;  // by hex name: kept across remove, so a
                                          // dentry the kernel cached stays valid
  std::map<uint64_t, std::shared_ptr<File>> byIno_;
  uint64_t nextIno_ = 2;
  std::condition_variable aheadCv_;
  std::deque<std::pair<std::shared_ptr<File>, int64_t>> ahead_;  // chunks to read ahead
  std::vector<std::thread> aheadThreads_;  // detached, like loop_
};

}  // namespace dsec::edge
