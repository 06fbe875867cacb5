#define FUSE_USE_VERSION 312
#include "edge/image/fuse_server.h"

#include <fcntl.h>
#include <fuse_lowlevel.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>

#include "common/log.h"
#include "common/util.h"
#include "edge/image/loader_control.h"

namespace dsec::edge {

namespace {
// Blobs are immutable and named by their digest: the kernel may cache names,
// attributes and pages for as long as it likes.
constexpr double kCacheTimeoutS = 86400;
// Chunks fetched ahead of a sequential read, and the threads fetching them.
constexpr int64_t kReadAheadChunks = 2;
constexpr int kReadAheadThreads = 2;


std::string hexOf(const std::string& digest) {
  return startsWith(digest, "sha256:") ? digest.substr(7) : digest;
}
}  // namespace

// The sparse copy (fd read-write: chunks are written and replies spliced from it).
struct FuseServer::File : SparseCopy {
  std::string name;  // hex of the data digest
  uint64_t ino = 0;
};

namespace {

FuseServer* serverOf(fuse_req_t req) { return static_cast<FuseServer*>(fuse_req_userdata(req)); }

void fillAttr(const FuseServer::File* f, uint64_t ino, struct stat* st) {
  std::memset(st, 0, sizeof *st);
  st->st_ino = ino;
  if (!f) {
    st->st_mode = S_IFDIR | 0555;
    st->st_nlink = 2;
    return;
  }
  st->st_mode = S_IFREG | 0444;
  st->st_nlink = 1;
  st->st_size = f->index->dataSize;
  st->st_blksize = 4096;
  st->st_blocks = (f->index->dataSize + 511) / 512;
}

void opInit(void*, fuse_conn_info* conn) {
  if (conn->capable & FUSE_CAP_SPLICE_WRITE) conn->want |= FUSE_CAP_SPLICE_WRITE;
  if (conn->capable & FUSE_CAP_SPLICE_MOVE) conn->want |= FUSE_CAP_SPLICE_MOVE;
  conn->max_read = 1 << 20;  // as the max_read mount option says
  conn->max_readahead = 1 << 20;
}

void opLookup(fuse_req_t req, fuse_ino_t parent, const char* name) {
  if (parent != FUSE_ROOT_ID) return (void)fuse_reply_err(req, ENOENT);
  auto f = serverOf(req)->byName(name);
  // No negative entry: a blob may be added under this name at any time.
  if (!f) return (void)fuse_reply_err(req, ENOENT);
  fuse_entry_param e{};
  e.ino = f->ino;
  e.attr_timeout = kCacheTimeoutS;
  e.entry_timeout = kCacheTimeoutS;
  fillAttr(f.get(), f->ino, &e.attr);
  fuse_reply_entry(req, &e);
}

void opGetattr(fuse_req_t req, fuse_ino_t ino, fuse_file_info*) {
  struct stat st;
  if (ino == FUSE_ROOT_ID) {
    fillAttr(nullptr, ino, &st);
    return (void)fuse_reply_attr(req, &st, 1.0);
  }
  auto f = serverOf(req)->byIno(ino);
  if (!f) return (void)fuse_reply_err(req, ENOENT);
  fillAttr(f.get(), ino, &st);
  fuse_reply_attr(req, &st, kCacheTimeoutS);
}

void opOpen(fuse_req_t req, fuse_ino_t ino, fuse_file_info* fi) {
  if (ino == FUSE_ROOT_ID) return (void)fuse_reply_err(req, EISDIR);
  if ((fi->flags & O_ACCMODE) != O_RDONLY) return (void)fuse_reply_err(req, EROFS);
  auto f = serverOf(req)->byIno(ino);
  if (!f) return (void)fuse_reply_err(req, ENOENT);
  // Each handle keeps its file (and its fd) alive past a remove().
  fi->fh = reinterpret_cast<uint64_t>(new std::shared_ptr<FuseServer::File>(std::move(f)));
  fi->keep_cache = 1;  // immutable: pages read once stay valid
  if (fuse_reply_open(req, fi) != 0) {
    delete reinterpret_cast<std::shared_ptr<FuseServer::File>*>(fi->fh);
  }
}

void opRelease(fuse_req_t req, fuse_ino_t, fuse_file_info* fi) {
  delete reinterpret_cast<std::shared_ptr<FuseServer::File>*>(fi->fh);
  fuse_reply_err(req, 0);
}

void opRead(fuse_req_t req, fuse_ino_t, size_t size, off_t off, fuse_file_info* fi) {
  auto& f = **reinterpret_cast<std::shared_ptr<FuseServer::File>*>(fi->fh);
  const auto& idx = *f.index;
  ChunkSpan span = chunkSpan(idx.chunkSize, idx.dataSize, off, int64_t(size));
  if (span.empty()) return (void)fuse_reply_buf(req, nullptr, 0);
  ++f.readRequests;
  bool hit = true;  // every chunk present before this read
  for (int64_t i = span.first; i <= span.last; ++i) {
    if (f.touched[size_t(i)].exchange(1) == 0) {
      f.touchedBytes += idx.chunkLength(i);
      std::lock_guard lk(f.orderMu);
      f.order.push_back(i);
    }
    if (!f.have[size_t(i)]) hit = false;
  }
  Status st = serverOf(req)->ensureChunks(f, span.first, span.last);
  if (!st.isOk()) {
    log::error("fuse loader: read of " + f.name + " at " + std::to_string(off) + ": " +
               st.toString());
    return (void)fuse_reply_err(req, EIO);
  }
  if (hit) ++f.cacheHits;
  if (span.first > 0 && f.touched[size_t(span.first - 1)]) {
    serverOf(req)->readAhead(*reinterpret_cast<std::shared_ptr<FuseServer::File>*>(fi->fh),
                             span.first, span.last);
  }
  size_t n = size_t(std::min<int64_t>(int64_t(size), idx.dataSize - off));
  fuse_bufvec bv = FUSE_BUFVEC_INIT(n);
  bv.buf[0].flags = fuse_buf_flags(FUSE_BUF_IS_FD | FUSE_BUF_FD_SEEK);
  bv.buf[0].fd = f.fd.get();
  bv.buf[0].pos = off;
  fuse_reply_data(req, &bv, FUSE_BUF_SPLICE_MOVE);
}

void opReaddir(fuse_req_t req, fuse_ino_t ino, size_t size, off_t off, fuse_file_info*) {
  if (ino != FUSE_ROOT_ID) return (void)fuse_reply_err(req, ENOTDIR);
  auto entries = serverOf(req)->listing();
  entries.insert(entries.begin(), {{".", FUSE_ROOT_ID}, {"..", FUSE_ROOT_ID}});
  std::string buf(size, '\0');
  size_t used = 0;
  for (size_t i = size_t(off); i < entries.size(); ++i) {
    struct stat st {};
    st.st_ino = entries[i].second;
    st.st_mode = i < 2 ? S_IFDIR : S_IFREG;
    size_t need = fuse_add_direntry(req, buf.data() + used, size - used, entries[i].first.c_str(),
                                    &st, off_t(i + 1));
    if (need > size - used) break;
    used += need;
  }
  fuse_reply_buf(req, buf.data(), used);
}

const fuse_lowlevel_ops kOps = [] {
  fuse_lowlevel_ops o{};
  o.init = opInit;
  o.lookup = opLookup;
  o.getattr = opGetattr;
  o.open = opOpen;
  o.read = opRead;
  o.release = opRelease;
  o.readdir = opReaddir;
  return o;
}();

}  // namespace

Result<std::unique_ptr<FuseServer>> FuseServer::start(image::BlobStore* store,
                                                      const std::string& mountDir, int threads) {
  if (::access("/dev/fuse", R_OK | W_OK) != 0) {
    return Status(Code::kFailedPrecondition,
                  "the fuse loader needs /dev/fuse (" + std::string(strerror(errno)) +
                      "): load the fuse module or pass the device into this container",
                  errno);
  }
  std::unique_ptr<FuseServer> s(new FuseServer());
  s->store_ = store;
  s->mountDir_ = mountDir;
  // ro: nothing writes here; allow_other: EROFS and the sandboxes read through
  // it whatever their credentials; default_permissions: the kernel checks modes.
  std::string opts = "ro,allow_other,default_permissions,fsname=dsec-loader,subtype=dsec," +
                     std::string("max_read=") + std::to_string(1 << 20);
  const char* argv[] = {"dsec-loader", "-o", opts.c_str(), nullptr};
  fuse_args args = FUSE_ARGS_INIT(3, const_cast<char**>(argv));
  s->se_ = fuse_session_new(&args, &kOps, sizeof kOps, s.get());
  if (!s->se_) return Status(Code::kInternal, "fuse_session_new failed (bad options?)");
  if (fuse_session_mount(s->se_, mountDir.c_str()) != 0) {
    return Status(Code::kFailedPrecondition, "FUSE mount at " + mountDir + " refused");
  }
  s->mounted_ = true;
  s->loop_ = std::thread([se = s->se_, threads] {
    fuse_loop_config* cfg = fuse_loop_cfg_create();
    fuse_loop_cfg_set_max_threads(cfg, unsigned(threads));
    fuse_loop_cfg_set_clone_fd(cfg, 0);
    fuse_session_loop_mt(se, cfg);
    fuse_loop_cfg_destroy(cfg);
  });
  s->loop_.detach();  // see unmount()
  for (int i = 0; i < kReadAheadThreads; ++i) {
    s->aheadThreads_.emplace_back([p = s.get()] { p->readAheadLoop(); });
    s->aheadThreads_.back().detach();
  }
  return s;
}

void FuseServer::unmount() {
  if (!mounted_) return;
  fuse_session_exit(se_);
  fuse_session_unmount(se_);
  mounted_ = false;
}

Status FuseServer::add(const std::string& cachePath, const std::string& dataDigest,
                       std::shared_ptr<const image::ChunkIndex> index) {
  std::string name = hexOf(dataDigest);
  {
    std::lock_guard lk(mu_);
    if (files_.count(name)) return Status::ok();
  }
  auto f = std::make_shared<File>();
  f->name = name;
  f->path = cachePath;
  f->dataDigest = dataDigest;
  f->index = std::move(index);
  RETURN_IF_ERROR(f->open(O_RDWR));
  std::lock_guard lk(mu_);
  if (files_.count(name)) return Status::ok();
  auto ino = inos_.find(name);
  if (ino == inos_.end()) ino = inos_.emplace(name, nextIno_++).first;
  f->ino = ino->second;
  files_[name] = f;
  byIno_[f->ino] = f;
  return Status::ok();
}

void FuseServer::remove(const std::string& dataDigest) {
  std::string name = hexOf(dataDigest);
  uint64_t ino;
  {
    std::lock_guard lk(mu_);
    auto it = files_.find(name);
    if (it == files_.end()) return;
    ino = it->second->ino;
    byIno_.erase(ino);
    files_.erase(it);
  }
  // The kernel forgets the name and the pages it cached: the blob's next copy
  // (after an eviction) must be filled through us, so the node cache and its
  // counters see the reads.
  (void)fuse_lowlevel_notify_inval_entry(se_, FUSE_ROOT_ID, name.c_str(), name.size());
  (void)fuse_lowlevel_notify_inval_inode(se_, ino, 0, 0);
}

std::map<std::string, LayerStats> FuseServer::stats() {
  std::lock_guard lk(mu_);
  std::map<std::string, LayerStats> out;
  for (auto& [name, f] : files_) out[name] = f->stats();
  return out;
}

std::vector<int64_t> FuseServer::readOrder(const std::string& dataDigest) {
  auto f = byName(hexOf(dataDigest));
  if (!f) return {};
  std::lock_guard lk(f->orderMu);
  return f->order;
}

std::shared_ptr<FuseServer::File> FuseServer::byIno(uint64_t ino) {
  std::lock_guard lk(mu_);
  auto it = byIno_.find(ino);
  return it == byIno_.end() ? nullptr : it->second;
}

std::shared_ptr<FuseServer::File> FuseServer::byName(const std::string& name) {
  std::lock_guard lk(mu_);
  auto it = files_.find(name);
  return it == files_.end() ? nullptr : it->second;
}

std::vector<std::pair<std::string, uint64_t>> FuseServer::listing() {
  std::lock_guard lk(mu_);
  std::vector<std::pair<std::string, uint64_t>> out;
  for (auto& [name, f] : files_) out.push_back({name, f->ino});
  return out;
}

void FuseServer::readAhead(const std::shared_ptr<File>& f, int64_t, int64_t last) {
  int64_t end = std::min(f->index->chunkCount(), last + 1 + kReadAheadChunks);
  std::lock_guard lk(mu_);
  for (int64_t i = last + 1; i < end; ++i) {
    if (f->have[size_t(i)] || f->fetching(i)) continue;
    bool queued = false;
    for (auto& [qf, qi] : ahead_) queued = queued || (qf == f && qi == i);
    if (!queued) ahead_.push_back({f, i});
  }
  aheadCv_.notify_all();
}

void FuseServer::readAheadLoop() {
  for (;;) {
    std::pair<std::shared_ptr<File>, int64_t> job;
    {
      std::unique_lock lk(mu_);
      aheadCv_.wait(lk, [this] { return !ahead_.empty(); });
      job = std::move(ahead_.front());
      ahead_.pop_front();
    }
    (void)job.first->ensure(job.second, store_, job.first->fd.get());
  }
}

Status FuseServer::ensureChunks(File& f, int64_t first, int64_t last) {
  for (int64_t i = first; i <= last; ++i) RETURN_IF_ERROR(f.ensure(i, store_, f.fd.get()));
  return Status::ok();
}

}  // namespace dsec::edge
