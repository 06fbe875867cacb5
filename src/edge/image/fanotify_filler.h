// Fills sparse node-local copies of data blobs as they are read, answering
// fanotify pre-content events (FAN_PRE_ACCESS, kernel >= 6.14): before a read
// of a marked file proceeds, the filler fetches every chunk the read touches
// that the file lacks, verifies it against the chunk index, writes it through
// the event's fd (which raises no further events), and only then allows the
// read. A chunk it cannot fetch or verify denies the read with EIO.
//
// The sparse file is the node's chunk cache: a chunk is present when its bytes
// have no hole (SEEK_HOLE), so the cache survives restarts and is shared by
// every filler that marks the file. dsec runs two fillers on each file, one in
// the edge and one in a `dsec loader` process; each read waits for both, so
// either alone keeps reads correct if the other is killed.
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

namespace dsec::edge {

class FanotifyFiller {
 public:
  // `workers` threads fetch in parallel. `store` must outlive the filler.
  // readAhead: when a read goes on sequentially (it starts in or right after
  // a chunk read before), the next readAhead chunks are fetched in the
  // background too. Only one of the fillers on a file should read ahead.
  static Result<std::unique_ptr<FanotifyFiller>> start(image::BlobStore* store, int workers = 8,
                                                       int readAhead = 0);
  ~FanotifyFiller();

  // Whether this kernel and the file system holding `dir` support pre-content
  // marks: kFailedPrecondition with the reason otherwise.
  static Status probe(const std::string& dir);

  // Marks `path` (a sparse copy of data blob `dataDigest`) and serves it.
  Status add(const std::string& path, const std::string& dataDigest,
             std::shared_ptr<const image::ChunkIndex> index);
  void remove(const std::string& path);
  // Hands over to another filler that marks the same files: drops every mark
  // (no new events come here), then answers, filling first, every event
  // raised before that. Returns once none is left (or after timeoutS). A
  // filler that simply stopped would let those reads see holes: their events
  // went to this group alone.
  void drain(double timeoutS);
  LayerStats stats(const std::string& path);
  // Chunks read at least once, in the order first read.
  std::vector<int64_t> readOrder(const std::string& path);

 private:
  struct File;
  struct Event {
    int fd;
    int64_t off;
    int64_t count;
  };
  FanotifyFiller() = default;
  void readLoop();
  void workLoop();
  void handle(const Event& ev);
  void respond(int fd, bool allow);

  image::BlobStore* store_ = nullptr;
  UniqueFd fan_;
  UniqueFd stopFd_;  // eventfd: wakes the reader to exit
  std::thread reader_;
  std::vector<std::thread> workers_;

  std::mutex mu_;  // guards files_, queue_, ahead_, stopping_
  std::condition_variable cv_;
  std::map<std::pair<dev_t, ino_t>, std::shared_ptr<File>> files_;
  std::map<std::string, std::shared_ptr<File>> byPath_;
  std::deque<Event> queue_;
  std::deque<std::pair<std::shared_ptr<File>, int64_t>> ahead_;  // served when queue_ is empty
  int readAhead_ = 0;
  int handling_ = 0;  // events taken off queue_ and not answered yet
  bool stopping_ = false;
};

}  // namespace dsec::edge
