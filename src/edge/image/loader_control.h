// Pieces shared by the edge and its loader processes (`dsec loader fanotify`,
// `dsec loader fuse`): the control socket's framing, the stats wire form, and
// the arithmetic of chunks. The protocol itself is described in each loader's
// .cc file.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include <nlohmann/json.hpp>

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

// Reads and parses a chunk index file.
Result<std::shared_ptr<const image::ChunkIndex>> loadIndex(const std::string& path);

// The pid written in `pidFile` if that process is still a `dsec loader`
// (either kind), else -1: what an edge that crashed left running.
int staleLoaderPid(const std::string& pidFile);

// The chunks a read of [off, off+len) touches, clamped to the blob: first..last
// inclusive; empty (first > last) for a read at or past the end or of 0 bytes.
struct ChunkSpan {
  int64_t first = 0;
  int64_t last = -1;
  bool empty() const { return first > last; }
};
ChunkSpan chunkSpan(int64_t chunkSize, int64_t dataSize, int64_t off, int64_t len);

}  // namespace dsec::edge
