// Pieces shared by the edge and its loader processes (`dsec loader fanotify`,
// `dsec loader fuse`): the control socket's framing, the stats wire form, and
// the arithmetic of chunks. The protocol itself is described in each loader's
// .cc file.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/fd.h"
#include "common/status.h"
#include "edge/image/loader.h"
#include "image/blob_store.h"
#include "image/chunk_index.h"

namespace dsec::edge {

// Sends one SOCK_SEQPACKET message; an error carries errno.
Status sendMsg(int fd, const std::string& m);
// One message within timeoutS (< 0: wait forever); "" at EOF;
// kDeadlineExceeded when nothing came in time.
Result<std::string> recvMsg(int fd, double timeoutS);

nlohmann::json statsJson(const LayerStats& s);
LayerStats statsFrom(const nlohmann::json& j);

// True when [off, end) of fd has no hole (SEEK_HOLE raises no fanotify event):
// in a sparse cache copy, those bytes were filled and verified.
bool chunkPresent(int fd, int64_t off, int64_t end);

// Fetches chunk i of data blob `dataDigest` from the store, checks it against
// the index (fetching once more on a mismatch; kDataLoss after that), and
// writes it at its offset through writeFd. `what` names the file in errors.
Status fetchChunkInto(image::BlobStore* store, const std::string& dataDigest,
                      const image::ChunkIndex& idx, int64_t i, int writeFd,
                      const std::string& what);

// Ok for an answer {"ok":true,...}; kInternal with its "error" otherwise.
Status replyStatus(const std::string& reply);

// A `dsec loader KIND` child process and its control socket (fd 3 in the
// child), as both loaders run one. Not thread-safe: the owning loader locks.
class LoaderProcess {
 public:
  LoaderProcess() = default;
  LoaderProcess(const LoaderProcess&) = delete;
  LoaderProcess& operator=(const LoaderProcess&) = delete;
  ~LoaderProcess() { kill(); }

  // Spawns selfExe with argv `args` and records its pid in pidFile.
  Status spawn(const std::string& selfExe, const std::vector<std::string>& args,
               const std::string& pidFile);
  // One request, its answer within timeoutS. The caller kills the process on
  // an error: a late answer would pair with the next request.
  Result<std::string> call(const std::string& request, double timeoutS);
  // call() for a request answered {"ok":true} (see replyStatus).
  Status callOk(const nlohmann::json& request, double timeoutS);
  // One message from the process (its start-up answer), "" when it exited.
  Result<std::string> receive(double timeoutS);
  // False, with the reason logged, once it has exited (reaped here).
  bool alive(const std::string& what);
  // Asks it to exit and waits up to waitS for it; kill() if it does not.
  void stop(double timeoutS, double waitS);
  // SIGKILL, reap, close the socket. Fine when there is no process.
  void kill();
  // Closes the socket and forgets the process, leaving it running.
  void release() {
    ctl_.reset();
    pid_ = -1;
  }
  int pid() const { return pid_; }
  bool connected() const { return ctl_.valid(); }

 private:
  int pid_ = -1;
  UniqueFd ctl_;
};

// The node-local sparse copy of one data blob and what is known of its chunks,
// as the fanotify filler and the fuse server both track it. The counters feed
// LayerStats; `order` lists chunks in the order first read (prefetch).
struct SparseCopy {
  std::string path;
  std::string dataDigest;
  std::shared_ptr<const image::ChunkIndex> index;
  UniqueFd fd;
  std::unique_ptr<std::atomic<uint8_t>[]> have;     // chunk present in the copy
  std::unique_ptr<std::atomic<uint8_t>[]> touched;  // chunk read at least once
  std::atomic<int64_t> haveCount{0}, touchedBytes{0}, chunksFetched{0}, bytesFetched{0},
      cacheHits{0}, readRequests{0};
  std::mutex orderMu;  // guards order
  std::vector<int64_t> order;

  // Opens `path` with `flags`, checks it has the size the index says, and
  // finds the chunks already present (filled earlier, by anyone).
  Status open(int flags);
  // True while chunk i is being fetched here.
  bool fetching(int64_t i);
  // Makes chunk i present: waits out a fetch of it in progress, else finds it
  // filled meanwhile (SEEK_HOLE), else fetches it (fetchChunkInto) through
  // writeFd. Counts what it fetched.
  Status ensure(int64_t i, image::BlobStore* store, int writeFd);
  LayerStats stats() const;

 private:
  std::mutex inflightMu_;  // guards inflight_
  std::condition_variable inflightCv_;
  std::set<int64_t> inflight_;
};

// Reads and parses a chunk index file.
Result<std::shared_ptr<const image::ChunkIndex>> loadIndex(const std::string& path);

// The pid written in `pidFile` if that process is still a `dsec loader`
// (either kind), else -1: what an edge that crashed left running.
int staleLoaderPid(const std::string& pidFile);
// Whether `pid` is a `dsec loader` process (either kind).
bool isLoaderProcess(int pid);

// The chunks a read of [off, off+len) touches, clamped to the blob: first..last
// inclusive; empty (first > last) for a read at or past the end or of 0 bytes.
struct ChunkSpan {
  int64_t first = 0;
  int64_t last = -1;
  bool empty() const { return first > last; }
};
ChunkSpan chunkSpan(int64_t chunkSize, int64_t dataSize, int64_t off, int64_t len);

}  // namespace dsec::edge
