#include "edge/image/node_cache.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <sstream>

#include "common/fd.h"
#include "common/log.h"
#include "common/util.h"
#include "edge/image/fanotify_loader.h"
#include "edge/image/fuse_loader.h"
#include "edge/image/loader_control.h"

namespace dsec::edge {

namespace {
std::string hexOf(const std::string& digest) {
  return startsWith(digest, "sha256:") ? digest.substr(7) : digest;
}
}  // namespace

Result<std::unique_ptr<NodeCache>> NodeCache::open(NodeCacheOptions opts, LayerLookup lookup) {
  std::unique_ptr<NodeCache> c(new NodeCache());
  c->opts_ = std::move(opts);
  c->lookup_ = std::move(lookup);
  RETURN_IF_ERROR(makeDirs(c->opts_.dir, 0700));
  ASSIGN_OR_RETURN(c->store_, image::BlobStore::open(c->opts_.storeUri, c->opts_.storeOptions));
  std::string want = c->opts_.loader;
  if (want == "auto") {
    // A POSIX store is read in place; a remote one is filled on demand by the
    // best loader this kernel and cache file system allow.
    if (std::string(c->store_->scheme()) == "file") {
      want = "direct";
    } else if (Status p = FanotifyFiller::probe(c->opts_.dir); p.isOk()) {
      want = "fanotify";
    } else {
      log::info("fanotify loader unavailable (" + p.message() + ")");
      want = "fuse";
    }
  }
  if (want == "direct") {
    if (std::string(c->store_->scheme()) != "file") {
      return invalidArg("loader", "the direct loader needs a file:// blob store, not " +
                                      c->opts_.storeUri);
    }
  } else if (want == "fanotify") {
    RETURN_IF_ERROR(FanotifyFiller::probe(c->opts_.dir));
    FanotifyLoaderOptions fo;
    fo.selfExe = c->opts_.selfExe;
    fo.runDir = c->opts_.dir;
    fo.pingTimeoutS = c->opts_.loaderPingTimeoutS;
    ASSIGN_OR_RETURN(auto l, FanotifyLoader::start(c->store_.get(), fo));
    c->loader_ = std::move(l);
  } else if (want == "fuse") {
    FuseLoaderOptions fo;
    fo.selfExe = c->opts_.selfExe;
    fo.runDir = c->opts_.dir;
    fo.mountDir = c->opts_.dir + "/fuse";
    fo.pingTimeoutS = c->opts_.loaderPingTimeoutS;
    ASSIGN_OR_RETURN(auto l, FuseLoader::start(c->store_.get(), fo));
    c->loader_ = std::move(l);
  } else {
    return invalidArg("loader", "loader must be auto, direct, fanotify or fuse, not " + want);
  }
  if (c->loader_) {
    c->recorder_ = std::thread([p = c.get()] { p->recorder(); });
    c->prefetcher_ = std::thread([p = c.get()] { p->prefetchLoop(); });
  }
  log::info("node cache " + c->opts_.dir + ": store " + c->opts_.storeUri + ", loader " +
            c->loaderName() +
            (c->opts_.limitBytes > 0 ? ", limit " + std::to_string(c->opts_.limitBytes >> 20) + " MiB"
                                     : ""));
  return c;
}

NodeCache::~NodeCache() {
  {
    std::lock_guard lk(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  if (recorder_.joinable()) recorder_.join();
  if (prefetcher_.joinable()) prefetcher_.join();
  std::vector<std::string> attached;
  {
    std::lock_guard lk(mu_);
    for (auto& [d, e] : entries_) {
      if (e.attached) attached.push_back(d);
    }
  }
  for (auto& d : attached) unmounted(d);
  loader_.reset();
}

std::string NodeCache::pathOf(const std::string& digest, const char* suffix) const {
  return opts_.dir + "/" + hexOf(digest) + suffix;
}

Status NodeCache::fetchWhole(const std::string& name, const std::string& digest,
                             const std::string& dest, int64_t* fetched) {
  if (::access(dest.c_str(), F_OK) == 0) return Status::ok();
  RETURN_IF_ERROR(store_->fetchVerified(name, hexOf(digest), dest));
  struct stat st;
  if (::stat(dest.c_str(), &st) == 0) *fetched += st.st_size;
  return Status::ok();
}

Result<LayerFiles> NodeCache::prepare(const std::string& digest) {
  // Not while prestage() fills the same files; prestage() leaves alone what
  // is being prepared.
  {
    std::unique_lock lk(mu_);
    cv_.wait(lk, [&] { return stopping_ || !staging_.count(digest); });
    preparing_[digest]++;
  }
  auto r = prepareFiles(digest);
  {
    std::lock_guard lk(mu_);
    if (--preparing_[digest] == 0) preparing_.erase(digest);
  }
  return r;
}

Status NodeCache::prestage(const std::string& digest) {
  ASSIGN_OR_RETURN(LayerDesc d, lookup_(digest));
  if (!loader_) {
    for (auto& name : {d.digest, d.dataDigest}) {
      if (name.empty()) continue;
      std::string p = store_->localPath(image::blobName(name));
      if (::access(p.c_str(), R_OK) != 0) return notFound("blob of layer " + digest + " not in the store: " + p);
    }
    return Status::ok();
  }
  {
    std::lock_guard lk(mu_);
    bool inUse = preparing_.count(digest) || staging_.count(digest);
    for (auto& [other, e] : entries_) {
      // This layer, or another on the same data blob, is attached.
      inUse = inUse || (e.attached && (other == digest ||
                                       (!d.dataDigest.empty() && e.desc.dataDigest == d.dataDigest)));
    }
    if (inUse) return Status::ok();  // its loader fills it as it is read
    staging_.insert(digest);
  }
  int64_t fetched = 0;
  Status st = stageFiles(d, &fetched);
  {
    std::lock_guard lk(mu_);
    staging_.erase(digest);
    if (st.isOk()) {
      Entry& e = entries_[digest];
      e.desc = d;
      e.wholeBytesFetched += fetched;
    }
  }
  cv_.notify_all();
  return st;
}

Status NodeCache::stageFiles(const LayerDesc& d, int64_t* fetched) {
  RETURN_IF_ERROR(fetchWhole(image::blobName(d.digest), d.digest, pathOf(d.digest, ".meta"), fetched));
  if (d.dataDigest.empty()) return Status::ok();
  std::string chunks = pathOf(d.dataDigest, ".chunks");
  RETURN_IF_ERROR(fetchWhole(image::chunkIndexName(d.dataDigest), d.chunksDigest, chunks, fetched));
  ASSIGN_OR_RETURN(std::string bytes, readFile(chunks));
  ASSIGN_OR_RETURN(image::ChunkIndex idx, image::ChunkIndex::parse(bytes));
  if (idx.dataSize != d.dataSize) {
    return Status(Code::kDataLoss, "chunk index of " + d.dataDigest + " is for " +
                                       std::to_string(idx.dataSize) + " bytes, not " +
                                       std::to_string(d.dataSize));
  }
  std::string data = pathOf(d.dataDigest, ".data");
  if (::access(data.c_str(), F_OK) != 0) {
    // Whole, verified against the data blob's digest, renamed into place.
    RETURN_IF_ERROR(store_->fetchVerified(image::blobName(d.dataDigest), hexOf(d.dataDigest), data));
    *fetched += d.dataSize;
    return Status::ok();
  }
  // A sparse copy from earlier use: its holes, chunk by chunk, each verified.
  UniqueFd fd(::open(data.c_str(), O_RDWR | O_CLOEXEC));
  if (!fd) return sysError("open " + data);
  struct stat sb;
  if (::fstat(fd.get(), &sb) != 0) return sysError("stat " + data);
  if (sb.st_size != d.dataSize) {
    return Status(Code::kDataLoss, data + " is " + std::to_string(sb.st_size) + " bytes, not " +
                                       std::to_string(d.dataSize));
  }
  for (int64_t i = 0; i < idx.chunkCount(); ++i) {
    int64_t off = i * idx.chunkSize;
    if (chunkPresent(fd.get(), off, off + idx.chunkLength(i))) continue;
    RETURN_IF_ERROR(fetchChunkInto(store_.get(), d.dataDigest, idx, i, fd.get(), data));
    *fetched += idx.chunkLength(i);
  }
  if (::fsync(fd.get()) != 0) return sysError("fsync " + data);
  return Status::ok();
}

Result<LayerFiles> NodeCache::prepareFiles(const std::string& digest) {
  ASSIGN_OR_RETURN(LayerDesc d, lookup_(digest));
  if (!loader_) {
    LayerFiles files{store_->localPath(image::blobName(d.digest)), ""};
    if (!d.dataDigest.empty()) files.data = store_->localPath(image::blobName(d.dataDigest));
    for (auto* p : {&files.meta, &files.data}) {
      if (!p->empty() && ::access(p->c_str(), R_OK) != 0) {
        return notFound("blob of layer " + digest + " not in the store: " + *p);
      }
    }
    return files;
  }
  LayerFiles files{pathOf(d.digest, ".meta"), ""};
  int64_t whole = 0;
  RETURN_IF_ERROR(fetchWhole(image::blobName(d.digest), d.digest, files.meta, &whole));
  ::utimensat(AT_FDCWD, files.meta.c_str(), nullptr, 0);  // LRU clock for trim()
  auto account = [&] {
    std::lock_guard lk(mu_);
    entries_[digest].desc = d;
    entries_[digest].wholeBytesFetched += whole;
    whole = 0;
  };
  account();
  if (d.dataDigest.empty()) return files;
  std::string chunks = pathOf(d.dataDigest, ".chunks");
  Status ci = fetchWhole(image::chunkIndexName(d.dataDigest), d.chunksDigest, chunks, &whole);
  account();
  RETURN_IF_ERROR(ci);
  ASSIGN_OR_RETURN(std::string bytes, readFile(chunks));
  ASSIGN_OR_RETURN(image::ChunkIndex idx, image::ChunkIndex::parse(bytes));
  if (idx.dataSize != d.dataSize) {
    return Status(Code::kDataLoss, "chunk index of " + d.dataDigest + " is for " +
                                       std::to_string(idx.dataSize) + " bytes, not " +
                                       std::to_string(d.dataSize));
  }
  auto index = std::make_shared<const image::ChunkIndex>(std::move(idx));
  std::string data = pathOf(d.dataDigest, ".data");
  bool cold = ::access(data.c_str(), F_OK) != 0;
  if (cold) {
    std::string tmp = data + ".new";
    UniqueFd fd(::open(tmp.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600));
    if (!fd) return sysError("create " + tmp);
    if (::ftruncate(fd.get(), d.dataSize) != 0) return sysError("truncate " + tmp);
    if (::rename(tmp.c_str(), data.c_str()) != 0) return sysError("rename " + data);
  }
  ASSIGN_OR_RETURN(files.data, loader_->attach(d, data, index));
  uint64_t generation = loader_->generation();
  std::vector<int64_t> order;
  if (auto list = readFile(pathOf(d.dataDigest, ".order")); list.isOk()) {
    std::istringstream in(*list);
    for (int64_t i; in >> i;) {
      if (i >= 0 && i < index->chunkCount()) order.push_back(i);
    }
  }
  std::lock_guard lk(mu_);
  Entry& e = entries_[digest];
  e.attached = true;
  e.loaderGeneration = generation;
  e.attachedAt = monoSeconds();
  e.recorded = !order.empty();
  if (cold && !order.empty() && !stopping_) {
    prefetchQueue_.push_back({files.data, std::move(order), index->chunkSize, e.prefetched});
    cv_.notify_all();
  }
  return files;
}

void NodeCache::prefetchLoop() {
  std::unique_lock lk(mu_);
  for (;;) {
    cv_.wait(lk, [this] { return stopping_ || !prefetchQueue_.empty(); });
    if (stopping_) return;
    PrefetchJob job = std::move(prefetchQueue_.front());
    prefetchQueue_.pop_front();
    lk.unlock();
    prefetch(job);
    lk.lock();
  }
}

void NodeCache::prefetch(const PrefetchJob& job) {
  // A plain read of each chunk: the loader fetches (and verifies) it as for
  // any reader. A few readers at once, taking chunks in the recorded order, so
  // a store with high latency still streams.
  std::atomic<size_t> next{0};
  auto reader = [&] {
    UniqueFd fd(::open(job.dataPath.c_str(), O_RDONLY | O_CLOEXEC));
    if (!fd) return;
    char byte;
    for (size_t k; (k = next++) < job.order.size();) {
      {
        std::lock_guard lk(mu_);
        if (stopping_) return;
      }
      if (::pread(fd.get(), &byte, 1, job.order[k] * job.chunkSize) == 1) ++*job.counter;
    }
  };
  std::vector<std::thread> readers;
  for (int i = 0; i < 4; ++i) readers.emplace_back(reader);
  for (auto& t : readers) t.join();
  log::info("prefetched " + std::to_string(job.counter->load()) + " chunks of " + job.dataPath);
}

void NodeCache::recorder() {
  std::unique_lock lk(mu_);
  while (!stopping_) {
    cv_.wait_for(lk, std::chrono::seconds(1));
    double now = monoSeconds();
    for (auto& [digest, e] : entries_) {
      if (!e.attached || e.recorded || e.desc.dataDigest.empty() ||
          now - e.attachedAt < opts_.recordWindowS) {
        continue;
      }
      auto order = loader_->readOrder(e.desc.dataDigest);
      if (order.empty()) continue;  // nothing read yet: record once something is
      e.recorded = true;
      std::string text;
      for (int64_t i : order) text += std::to_string(i) + "\n";
      if (Status st = writeFileAtomic(pathOf(e.desc.dataDigest, ".order"), text, 0600);
          !st.isOk()) {
        log::warn("prefetch list: " + st.toString());
      }
    }
  }
}

bool NodeCache::broken(const std::string& digest) {
  if (!loader_) return false;
  uint64_t attachedAt;
  {
    std::lock_guard lk(mu_);
    auto it = entries_.find(digest);
    if (it == entries_.end() || !it->second.attached || it->second.desc.dataDigest.empty()) {
      return false;
    }
    attachedAt = it->second.loaderGeneration;
  }
  // Per layer, not per data blob: two layers sharing a blob were mounted
  // separately, and remounting one does not heal the other.
  return loader_->generation() != attachedAt;
}

void NodeCache::unmounted(const std::string& digest) {
  std::string data;
  {
    std::lock_guard lk(mu_);
    auto it = entries_.find(digest);
    if (it == entries_.end() || !it->second.attached) return;
    it->second.attached = false;
    data = it->second.desc.dataDigest;
    if (loader_ && !data.empty()) it->second.past += loader_->stats(data);
  }
  if (loader_ && !data.empty()) loader_->detach(data);
}

int64_t NodeCache::usedBytes() const {
  int64_t total = 0;
  DIR* d = ::opendir(opts_.dir.c_str());
  if (!d) return 0;
  while (dirent* e = ::readdir(d)) {
    // Regular files only: a stat of the fuse loader's mount point would wait
    // on a hung loader.
    if (e->d_type != DT_REG && e->d_type != DT_UNKNOWN) continue;
    struct stat st;
    if (::fstatat(::dirfd(d), e->d_name, &st, AT_SYMLINK_NOFOLLOW) == 0 && S_ISREG(st.st_mode)) {
      total += int64_t(st.st_blocks) * 512;
    }
  }
  ::closedir(d);
  return total;
}

std::vector<std::string> NodeCache::trim(const std::set<std::string>& mounted) {
  std::vector<std::string> removed;
  if (opts_.limitBytes <= 0 || !loader_) return removed;
  int64_t used = usedBytes();
  if (used <= opts_.limitBytes) return removed;
  // Cached layers by last use (the mtime of their metadata image).
  std::vector<std::pair<timespec, std::string>> lru;
  DIR* d = ::opendir(opts_.dir.c_str());
  if (!d) return removed;
  while (dirent* e = ::readdir(d)) {
    std::string name = e->d_name;
    if (name.size() != 64 + 5 || name.substr(64) != ".meta") continue;
    std::string digest = "sha256:" + name.substr(0, 64);
    struct stat st;
    {
      std::lock_guard lk(mu_);
      if (staging_.count(digest) || preparing_.count(digest)) continue;
    }
    if (mounted.count(digest) || ::fstatat(::dirfd(d), e->d_name, &st, 0) != 0) continue;
    lru.push_back({st.st_mtim, digest});
  }
  ::closedir(d);
  std::sort(lru.begin(), lru.end(), [](auto& a, auto& b) {
    return a.first.tv_sec != b.first.tv_sec ? a.first.tv_sec < b.first.tv_sec
                                            : a.first.tv_nsec < b.first.tv_nsec;
  });
  for (auto& [_, digest] : lru) {
    if (used <= opts_.limitBytes) break;
    std::string data;
    {
      std::lock_guard lk(mu_);
      auto it = entries_.find(digest);
      if (it != entries_.end()) {
        if (it->second.attached) continue;
        data = it->second.desc.dataDigest;
        entries_.erase(it);
      }
    }
    if (data.empty()) {
      if (auto desc = lookup_(digest); desc.isOk()) data = desc->dataDigest;
    }
    std::vector<std::string> files = {pathOf(digest, ".meta")};
    if (!data.empty()) {
      // A data blob shared by another cached layer stays.
      bool shared = false;
      {
        std::lock_guard lk(mu_);
        for (auto& [d2, e] : entries_) shared = shared || e.desc.dataDigest == data;
      }
      if (!shared) {
        files.push_back(pathOf(data, ".data"));
        files.push_back(pathOf(data, ".chunks"));
      }
    }
    for (auto& f : files) ::unlink(f.c_str());  // .order stays: it is the prefetch list
    removed.push_back(digest);
    used = usedBytes();
  }
  if (!removed.empty()) {
    log::info("node cache: evicted " + std::to_string(removed.size()) + " layers, " +
              std::to_string(used >> 20) + " MiB used");
  }
  return removed;
}

std::vector<NodeCache::LayerInfo> NodeCache::layers() {
  std::vector<LayerInfo> out;
  std::lock_guard lk(mu_);
  for (auto& [digest, e] : entries_) {
    LayerInfo li{digest, e.desc.dataDigest, e.desc.dataSize, e.attached, *e.prefetched, e.past};
    li.stats.bytesFetched += e.wholeBytesFetched;
    if (loader_ && e.attached && !e.desc.dataDigest.empty()) {
      li.stats += loader_->stats(e.desc.dataDigest);
    }
    out.push_back(li);
  }
  return out;
}

}  // namespace dsec::edge
