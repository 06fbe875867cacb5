#include "edge/image/fanotify_filler.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/fanotify.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <tuple>

#include "common/log.h"
#include "common/util.h"
#include "edge/image/loader_control.h"

// Debian 12's headers predate pre-content events (Linux 6.14).
#ifndef FAN_PRE_ACCESS
#define FAN_PRE_ACCESS 0x00100000
#endif
#ifndef FAN_EVENT_INFO_TYPE_RANGE
#define FAN_EVENT_INFO_TYPE_RANGE 6
#endif
#ifndef FAN_ERRNO_SHIFT
#define FAN_ERRNO_SHIFT 24
#endif

namespace dsec::edge {

namespace {
struct RangeInfo {
  fanotify_event_info_header hdr;
  uint32_t pad;
  uint64_t offset;
  uint64_t count;
};

}  // namespace

LayerStats& LayerStats::operator+=(const LayerStats& o) {
  chunks = std::max(chunks, o.chunks);
  chunksCached = std::max(chunksCached, o.chunksCached);
  chunksFetched += o.chunksFetched;
  bytesFetched += o.bytesFetched;
  cacheHits += o.cacheHits;
  readRequests += o.readRequests;
  bytesRead = std::max(bytesRead, o.bytesRead);
  return *this;
}

// fd is opened read-only, for SEEK_HOLE probes (lseek raises no events);
// chunks are written through an event's fd, whose writes raise none either.
struct FanotifyFiller::File : SparseCopy {
  std::mutex writeMu;
  UniqueFd writeFd;  // a copy of an event's fd, for read-ahead
  bool marked = false;
  std::unique_ptr<std::atomic<uint8_t>[]> ordered;  // chunk in `order`
};

Status FanotifyFiller::probe(const std::string& dir) {
  UniqueFd fan(::fanotify_init(FAN_CLOEXEC | FAN_CLASS_PRE_CONTENT, O_RDWR | O_LARGEFILE));
  if (!fan) {
    return Status(Code::kFailedPrecondition,
                  std::string("fanotify_init(FAN_CLASS_PRE_CONTENT): ") + strerror(errno));
  }
  std::string f = dir + "/.fanotify-probe-" + randomHex(4);
  UniqueFd file(::open(f.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600));
  if (!file) return sysError("create " + f);
  int rc = ::fanotify_mark(fan.get(), FAN_MARK_ADD, FAN_PRE_ACCESS, AT_FDCWD, f.c_str());
  int err = errno;
  ::unlink(f.c_str());
  if (rc != 0) {
    return Status(Code::kFailedPrecondition,
                  "pre-content marks refused on " + dir + ": " + strerror(err), err);
  }
  return Status::ok();
}

Result<std::unique_ptr<FanotifyFiller>> FanotifyFiller::start(image::BlobStore* store,
                                                              int workers, int readAhead) {
  std::unique_ptr<FanotifyFiller> f(new FanotifyFiller());
  f->store_ = store;
  f->readAhead_ = readAhead;
  f->fan_.reset(::fanotify_init(FAN_CLOEXEC | FAN_NONBLOCK | FAN_CLASS_PRE_CONTENT,
                                O_RDWR | O_LARGEFILE | O_CLOEXEC));
  if (!f->fan_) return sysError("fanotify_init");
  f->stopFd_.reset(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!f->stopFd_) return sysError("eventfd");
  f->reader_ = std::thread([p = f.get()] { p->readLoop(); });
  for (int i = 0; i < workers; ++i) f->workers_.emplace_back([p = f.get()] { p->workLoop(); });
  return f;
}

FanotifyFiller::~FanotifyFiller() {
  {
    std::lock_guard lk(mu_);
    stopping_ = true;
  }
  uint64_t one = 1;
  (void)!::write(stopFd_.get(), &one, sizeof one);
  cv_.notify_all();
  if (reader_.joinable()) reader_.join();
  for (auto& t : workers_) t.join();
  // Events still queued are allowed: the other filler (or, past both, the
  // kernel when the group closes) answers for the bytes.
  for (auto& ev : queue_) respond(ev.fd, true);
}

Status FanotifyFiller::add(const std::string& path, const std::string& dataDigest,
                           std::shared_ptr<const image::ChunkIndex> index) {
  auto f = std::make_shared<File>();
  f->path = path;
  f->dataDigest = dataDigest;
  f->index = std::move(index);
  RETURN_IF_ERROR(f->open(O_RDONLY));
  int64_t n = f->index->chunkCount();
  f->ordered.reset(new std::atomic<uint8_t>[size_t(n)]());
  struct stat st;
  if (::fstat(f->fd.get(), &st) != 0) return sysError("stat " + path);
  std::lock_guard lk(mu_);
  if (byPath_.count(path)) return Status::ok();
  if (f->haveCount < n) {
    if (::fanotify_mark(fan_.get(), FAN_MARK_ADD, FAN_PRE_ACCESS, AT_FDCWD, path.c_str()) != 0) {
      return sysError("fanotify_mark " + path);
    }
    f->marked = true;
  }
  files_[{st.st_dev, st.st_ino}] = f;
  byPath_[path] = f;
  return Status::ok();
}

void FanotifyFiller::remove(const std::string& path) {
  std::lock_guard lk(mu_);
  auto it = byPath_.find(path);
  if (it == byPath_.end()) return;
  if (it->second->marked) {
    (void)::fanotify_mark(fan_.get(), FAN_MARK_REMOVE, FAN_PRE_ACCESS, AT_FDCWD, path.c_str());
  }
  for (auto f = files_.begin(); f != files_.end(); ++f) {
    if (f->second == it->second) {
      files_.erase(f);
      break;
    }
  }
  byPath_.erase(it);
}

void FanotifyFiller::drain(double timeoutS) {
  {
    std::lock_guard lk(mu_);
    if (::fanotify_mark(fan_.get(), FAN_MARK_FLUSH, 0, AT_FDCWD, nullptr) != 0) {
      log::warn(std::string("fanotify flush: ") + strerror(errno));
    }
    for (auto& [_, f] : byPath_) f->marked = false;
  }
  double deadline = monoSeconds() + timeoutS;
  for (;;) {
    // Events raised before the flush wait in the group (until the reader
    // takes them), in queue_, or with a worker.
    pollfd p = {fan_.get(), POLLIN, 0};
    bool pending = ::poll(&p, 1, 0) > 0;
    {
      std::lock_guard lk(mu_);
      if (!pending && queue_.empty() && handling_ == 0) return;
    }
    if (monoSeconds() > deadline) {
      log::warn("fanotify filler: events still pending at the end of the hand-over");
      return;
    }
    ::usleep(5000);
  }
}

LayerStats FanotifyFiller::stats(const std::string& path) {
  std::shared_ptr<File> f;
  {
    std::lock_guard lk(mu_);
    auto it = byPath_.find(path);
    if (it == byPath_.end()) return {};
    f = it->second;
  }
  return f->stats();
}

std::vector<int64_t> FanotifyFiller::readOrder(const std::string& path) {
  std::shared_ptr<File> f;
  {
    std::lock_guard lk(mu_);
    auto it = byPath_.find(path);
    if (it == byPath_.end()) return {};
    f = it->second;
  }
  std::lock_guard lk(f->orderMu);
  return f->order;
}

void FanotifyFiller::readLoop() {
  alignas(fanotify_event_metadata) char buf[16384];
  for (;;) {
    pollfd p[2] = {{fan_.get(), POLLIN, 0}, {stopFd_.get(), POLLIN, 0}};
    if (::poll(p, 2, -1) < 0) {
      if (errno == EINTR) continue;
      log::error(std::string("fanotify poll: ") + strerror(errno));
      return;
    }
    if (p[1].revents) return;
    ssize_t n = ::read(fan_.get(), buf, sizeof buf);
    if (n < 0) {
      if (errno == EAGAIN || errno == EINTR) continue;
      log::error(std::string("fanotify read: ") + strerror(errno));
      return;
    }
    std::vector<Event> batch;
    auto* m = reinterpret_cast<fanotify_event_metadata*>(buf);
    for (; FAN_EVENT_OK(m, n); m = FAN_EVENT_NEXT(m, n)) {
      if (m->fd < 0) continue;  // queue overflow: nothing to answer
      Event ev{m->fd, 0, -1};
      char* p = reinterpret_cast<char*>(m) + m->metadata_len;
      char* end = reinterpret_cast<char*>(m) + m->event_len;
      while (p + sizeof(fanotify_event_info_header) <= end) {
        auto* h = reinterpret_cast<fanotify_event_info_header*>(p);
        if (h->len == 0) break;
        if (h->info_type == FAN_EVENT_INFO_TYPE_RANGE && h->len >= sizeof(RangeInfo)) {
          auto* r = reinterpret_cast<RangeInfo*>(p);
          ev.off = int64_t(r->offset);
          ev.count = int64_t(r->count);
        }
        p += h->len;
      }
      batch.push_back(ev);
    }
    std::lock_guard lk(mu_);
    for (auto& ev : batch) queue_.push_back(ev);
    cv_.notify_all();
  }
}

void FanotifyFiller::workLoop() {
  for (;;) {
    Event ev;
    std::shared_ptr<File> aheadFile;
    int64_t aheadChunk = -1;
    {
      std::unique_lock lk(mu_);
      cv_.wait(lk, [this] { return stopping_ || !queue_.empty() || !ahead_.empty(); });
      if (stopping_) return;
      if (!queue_.empty()) {
        ev = queue_.front();
        queue_.pop_front();
        ++handling_;
      } else {
        std::tie(aheadFile, aheadChunk) = ahead_.front();
        ahead_.pop_front();
      }
    }
    if (!aheadFile) {
      handle(ev);
      std::lock_guard lk(mu_);
      --handling_;
      continue;
    }
    int fd;
    {
      std::lock_guard lk(aheadFile->writeMu);
      fd = aheadFile->writeFd.get();
    }
    // Best effort: a reader that needs the chunk fetches it again if this fails.
    if (Status st = aheadFile->ensure(aheadChunk, store_, fd); !st.isOk()) {
      log::warn("read-ahead " + aheadFile->path + " chunk " + std::to_string(aheadChunk) + ": " +
                st.toString());
    } else if (aheadFile->ordered[size_t(aheadChunk)].exchange(1) == 0) {
      // Part of what a start reads (its reads may never reach us once the
      // copy is complete): it belongs in the prefetch list, not in bytes read.
      std::lock_guard lk(aheadFile->orderMu);
      aheadFile->order.push_back(aheadChunk);
    }
  }
}

void FanotifyFiller::respond(int fd, bool allow) {
  fanotify_response r{fd, allow ? uint32_t(FAN_ALLOW) : uint32_t(FAN_DENY) | (uint32_t(EIO) << FAN_ERRNO_SHIFT)};
  if (::write(fan_.get(), &r, sizeof r) != sizeof r && !allow) {
    // Kernels without FAN_DENY_ERRNO: a plain deny (the reader sees EPERM).
    r.response = FAN_DENY;
    (void)!::write(fan_.get(), &r, sizeof r);
  }
  ::close(fd);
}

void FanotifyFiller::handle(const Event& ev) {
  struct stat st;
  std::shared_ptr<File> f;
  if (::fstat(ev.fd, &st) == 0) {
    std::lock_guard lk(mu_);
    auto it = files_.find({st.st_dev, st.st_ino});
    if (it != files_.end()) f = it->second;
  }
  if (!f || ev.count <= 0) return respond(ev.fd, true);
  ++f->readRequests;
  const auto& idx = *f->index;
  int64_t first = ev.off / idx.chunkSize;
  int64_t last = std::min(idx.chunkCount() - 1, (ev.off + ev.count - 1) / idx.chunkSize);
  bool hit = true;  // every chunk known present before this read
  for (int64_t i = first; i <= last; ++i) {
    if (f->touched[size_t(i)].exchange(1) == 0) f->touchedBytes += idx.chunkLength(i);
    if (f->ordered[size_t(i)].exchange(1) == 0) {
      std::lock_guard lk(f->orderMu);
      f->order.push_back(i);
    }
    if (!f->have[size_t(i)]) hit = false;
    Status st = f->ensure(i, store_, ev.fd);
    if (!st.isOk()) {
      log::error("fill " + f->path + " chunk " + std::to_string(i) + ": " + st.toString());
      return respond(ev.fd, false);
    }
  }
  if (hit) ++f->cacheHits;
  bool sequential = first > 0 && f->touched[size_t(first - 1)];
  for (int64_t i = first; i < last && !sequential; ++i) sequential = f->have[size_t(i)] != 0;
  if (readAhead_ > 0 && sequential) {
    {
      std::lock_guard lk(f->writeMu);
      if (!f->writeFd) f->writeFd.reset(::fcntl(ev.fd, F_DUPFD_CLOEXEC, 0));
    }
    std::lock_guard lk(mu_);
    for (int64_t i = last + 1; i <= std::min(idx.chunkCount() - 1, last + readAhead_); ++i) {
      if (!f->have[size_t(i)] && !f->fetching(i)) ahead_.push_back({f, i});
    }
    cv_.notify_all();
  }
  respond(ev.fd, true);
  if (f->haveCount == idx.chunkCount()) {
    // Complete: reads need no more events from this filler.
    std::lock_guard lk(mu_);
    if (f->marked) {
      (void)::fanotify_mark(fan_.get(), FAN_MARK_REMOVE, FAN_PRE_ACCESS, AT_FDCWD,
                            f->path.c_str());
      f->marked = false;
    }
  }
}

}  // namespace dsec::edge
