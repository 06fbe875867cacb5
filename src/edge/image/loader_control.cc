#include "edge/image/loader_control.h"

#include "common/log.h"

#include <unistd.h>

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>

#include <algorithm>
#include <cstdlib>

#include "common/util.h"

extern char** environ;

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

bool isLoaderProcess(int pid) {
  if (pid <= 1) return false;
  auto cmd = readFile("/proc/" + std::to_string(pid) + "/cmdline");
  if (!cmd.isOk()) return false;
  for (const char* kind : {"fanotify", "fuse"}) {
    if (cmd->find(std::string("loader\0", 7) + kind + std::string(1, '\0')) != std::string::npos) {
      return true;
    }
  }
  return false;
}

int staleLoaderPid(const std::string& pidFile) {
  auto s = readFile(pidFile);
  if (!s.isOk()) return -1;
  int pid = std::atoi(s->c_str());
  return isLoaderProcess(pid) ? pid : -1;
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

Status LoaderProcess::spawn(const std::string& selfExe, const std::vector<std::string>& args,
                            const std::string& pidFile) {
  kill();
  int sv[2];
  if (::socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv) != 0) {
    return sysError("socketpair");
  }
  UniqueFd mine(sv[0]), theirs(sv[1]);
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_adddup2(&fa, theirs.get(), 3);
  posix_spawn_file_actions_addopen(&fa, 0, "/dev/null", O_RDONLY, 0);
  std::vector<std::string> copy = args;
  std::vector<char*> argv;
  for (auto& a : copy) argv.push_back(a.data());
  argv.push_back(nullptr);
  pid_t pid;
  int rc = posix_spawn(&pid, selfExe.c_str(), &fa, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&fa);
  if (rc != 0) return sysError("spawn " + selfExe + " loader", rc);
  pid_ = pid;
  ctl_ = std::move(mine);
  (void)writeFileAtomic(pidFile, std::to_string(pid) + "\n", 0600);
  return Status::ok();
}

Result<std::string> LoaderProcess::call(const std::string& request, double timeoutS) {
  if (!ctl_) return Status(Code::kUnavailable, "no loader process");
  RETURN_IF_ERROR(sendMsg(ctl_.get(), request));
  ASSIGN_OR_RETURN(std::string rep, recvMsg(ctl_.get(), timeoutS));
  if (rep.empty()) return Status(Code::kUnavailable, "loader process closed its control socket");
  return rep;
}

Status replyStatus(const std::string& reply) {
  json j = json::parse(reply, nullptr, false);
  if (!j.is_object() || !j.value("ok", false)) {
    return Status(Code::kInternal, j.is_object() ? j.value("error", reply) : reply);
  }
  return Status::ok();
}

Status LoaderProcess::callOk(const json& request, double timeoutS) {
  ASSIGN_OR_RETURN(std::string rep, call(request.dump(), timeoutS));
  return replyStatus(rep);
}

Result<std::string> LoaderProcess::receive(double timeoutS) {
  if (!ctl_) return Status(Code::kUnavailable, "no loader process");
  return recvMsg(ctl_.get(), timeoutS);
}

bool LoaderProcess::alive(const std::string& what) {
  if (pid_ <= 0) return false;
  int status;
  if (::waitpid(pid_, &status, WNOHANG) != pid_) return true;
  log::warn(what + " " + std::to_string(pid_) + " died (" +
            (WIFSIGNALED(status) ? "signal " + std::to_string(WTERMSIG(status))
                                 : "exit " + std::to_string(WEXITSTATUS(status))) +
            ")");
  pid_ = -1;
  ctl_.reset();
  return false;
}

void LoaderProcess::stop(double timeoutS, double waitS) {
  if (ctl_ && pid_ > 0 && callOk(json{{"op", "exit"}}, timeoutS).isOk()) {
    int status;
    for (double waited = 0; waited < waitS; waited += 0.005) {
      if (::waitpid(pid_, &status, WNOHANG) == pid_) {
        pid_ = -1;
        break;
      }
      ::usleep(5000);
    }
  }
  kill();
}

void LoaderProcess::kill() {
  ctl_.reset();
  if (pid_ > 0) {
    ::kill(pid_, SIGKILL);
    int status;
    while (::waitpid(pid_, &status, 0) < 0 && errno == EINTR) {
    }
    pid_ = -1;
  }
}

Status SparseCopy::open(int flags) {
  fd.reset(::open(path.c_str(), flags | O_CLOEXEC));
  if (!fd) return sysError("open " + path);
  struct stat st;
  if (::fstat(fd.get(), &st) != 0) return sysError("stat " + path);
  if (st.st_size != index->dataSize) {
    return Status(Code::kFailedPrecondition, path + " is " + std::to_string(st.st_size) +
                                                 " bytes, its chunk index says " +
                                                 std::to_string(index->dataSize));
  }
  int64_t n = index->chunkCount();
  have.reset(new std::atomic<uint8_t>[size_t(n)]());
  touched.reset(new std::atomic<uint8_t>[size_t(n)]());
  for (int64_t i = 0; i < n; ++i) {
    int64_t off = i * index->chunkSize;
    if (chunkPresent(fd.get(), off, off + index->chunkLength(i))) {
      have[size_t(i)] = 1;
      ++haveCount;
    }
  }
  return Status::ok();
}

bool SparseCopy::fetching(int64_t i) {
  std::lock_guard lk(inflightMu_);
  return inflight_.count(i) > 0;
}

Status SparseCopy::ensure(int64_t i, image::BlobStore* store, int writeFd) {
  if (have[size_t(i)]) return Status::ok();
  {
    std::unique_lock lk(inflightMu_);
    inflightCv_.wait(lk, [&] { return !inflight_.count(i); });
    if (have[size_t(i)]) return Status::ok();
    inflight_.insert(i);
  }
  auto done = [&](Status st) {
    std::lock_guard lk(inflightMu_);
    inflight_.erase(i);
    inflightCv_.notify_all();
    return st;
  };
  int64_t off = i * index->chunkSize;
  int64_t len = index->chunkLength(i);
  if (chunkPresent(fd.get(), off, off + len)) {  // filled by another loader meanwhile
    have[size_t(i)] = 1;
    ++haveCount;
    return done(Status::ok());
  }
  if (Status st = fetchChunkInto(store, dataDigest, *index, i, writeFd, path); !st.isOk()) {
    return done(st);
  }
  have[size_t(i)] = 1;
  ++haveCount;
  ++chunksFetched;
  bytesFetched += len;
  return done(Status::ok());
}

LayerStats SparseCopy::stats() const {
  LayerStats s;
  s.chunks = index->chunkCount();
  s.chunksCached = haveCount;
  s.chunksFetched = chunksFetched;
  s.bytesFetched = bytesFetched;
  s.cacheHits = cacheHits;
  s.readRequests = readRequests;
  s.bytesRead = touchedBytes;
  return s;
}

}  // namespace dsec::edge
