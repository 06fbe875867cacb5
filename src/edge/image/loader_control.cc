#include "edge/image/loader_control.h"

#include "common/log.h"

#include <unistd.h>

#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <cstdlib>

#include "common/util.h"

namespace dsec::edge {

using json = nlohmann::json;

Status sendMsg(int fd, const std::string& m) {
  if (::send(fd, m.data(), m.size(), MSG_NOSIGNAL) != ssize_t(m.size())) {
    return sysError("loader control send");
  }
  return Status::ok();
}

Result<std::string> recvMsg(int fd, double timeoutS) {
  pollfd p{fd, POLLIN, 0};
  int ms = timeoutS < 0 ? -1 : int(timeoutS * 1000);
  int rc;
  while ((rc = ::poll(&p, 1, ms)) < 0 && errno == EINTR) {
  }
  if (rc == 0) return Status(Code::kDeadlineExceeded, "loader did not answer");
  if (rc < 0) return sysError("loader control poll");
  std::string buf(1 << 20, '\0');
  ssize_t n = ::recv(fd, buf.data(), buf.size(), 0);
  if (n < 0) return sysError("loader control recv");
  buf.resize(size_t(n));
  return buf;
}

json statsJson(const LayerStats& s) {
  return {{"chunks_cached", s.chunksCached}, {"chunks_fetched", s.chunksFetched},
          {"bytes_fetched", s.bytesFetched}, {"cache_hits", s.cacheHits},
          {"read_requests", s.readRequests}, {"bytes_read", s.bytesRead}};
}

LayerStats statsFrom(const json& j) {
  LayerStats s;
  s.chunksCached = j.value("chunks_cached", int64_t(0));
  s.chunksFetched = j.value("chunks_fetched", int64_t(0));
  s.bytesFetched = j.value("bytes_fetched", int64_t(0));
  s.cacheHits = j.value("cache_hits", int64_t(0));
  s.readRequests = j.value("read_requests", int64_t(0));
  s.bytesRead = j.value("bytes_read", int64_t(0));
  return s;
}

Result<std::shared_ptr<const image::ChunkIndex>> loadIndex(const std::string& path) {
  ASSIGN_OR_RETURN(std::string bytes, readFile(path));
  ASSIGN_OR_RETURN(image::ChunkIndex idx, image::ChunkIndex::parse(bytes));
  return std::make_shared<const image::ChunkIndex>(std::move(idx));
}

int staleLoaderPid(const std::string& pidFile) {
  auto s = readFile(pidFile);
  if (!s.isOk()) return -1;
  int pid = std::atoi(s->c_str());
  if (pid <= 1) return -1;
  auto cmd = readFile("/proc/" + std::to_string(pid) + "/cmdline");
  if (!cmd.isOk()) return -1;
  for (const char* kind : {"fanotify", "fuse"}) {
    if (cmd->find(std::string("loader\0", 7) + kind + std::string(1, '\0')) != std::string::npos) {
      return pid;
    }
  }
  return -1;
}

ChunkSpan chunkSpan(int64_t chunkSize, int64_t dataSize, int64_t off, int64_t len) {
  ChunkSpan s;
  if (chunkSize <= 0 || off < 0 || len <= 0 || off >= dataSize) return s;
  int64_t end = std::min(dataSize, off + len);
  s.first = off / chunkSize;
  s.last = (end - 1) / chunkSize;
  return s;
}

bool chunkPresent(int fd, int64_t off, int64_t end) {
  off_t hole = ::lseek(fd, off, SEEK_HOLE);
  return hole >= 0 && hole >= end;
}

Status fetchChunkInto(image::BlobStore* store, const std::string& dataDigest,
                      const image::ChunkIndex& idx, int64_t i, int writeFd,
                      const std::string& what) {
  int64_t off = i * idx.chunkSize;
  int64_t len = idx.chunkLength(i);
  std::string buf(size_t(len), '\0');
  Status st;
  for (int attempt = 0; attempt < 2; ++attempt) {
    st = store->readAt(image::blobName(dataDigest), off, size_t(len), buf.data());
    if (!st.isOk()) return st;
    if (idx.verify(i, buf)) break;
    st = Status(Code::kDataLoss, "chunk " + std::to_string(i) + " of " + dataDigest +
                                     " does not match its checksum");
    log::warn(st.message() + (attempt == 0 ? "; fetching it again" : ""));
  }
  RETURN_IF_ERROR(st);
  for (int64_t w = 0; w < len;) {
    ssize_t r = ::pwrite(writeFd, buf.data() + w, size_t(len - w), off + w);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return sysError("write " + what);
    w += r;
  }
  return Status::ok();
}

}  // namespace dsec::edge
