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
#include "image/block_ranges.h"

namespace dsec::edge {

namespace {
std::string hexOf(const std::string& digest) {
  return startsWith(digest, "sha256:") ? digest.substr(7) : digest;
}

// Counters of different data blobs add up (LayerStats::+= merges those of
// one blob over time).
void addBlobStats(LayerStats& into, const LayerStats& b) {
  into.chunks += b.chunks;
  into.chunksCached += b.chunksCached;
  into.chunksFetched += b.chunksFetched;
  into.bytesFetched += b.bytesFetched;
  into.cacheHits += b.cacheHits;
  into.readRequests += b.readRequests;
  into.bytesRead += b.bytesRead;
}

// What Loader::attach reads of a layer: its data blob's fields.
LayerDesc loaderDesc(const proto::DataBlobDesc& b) {
  LayerDesc d;
  d.dataDigest = b.digest;
  d.dataSize = b.size;
  d.chunksDigest = b.chunksDigest;
  return d;
}

// The chunks of b the platform's gc reclaimed (proto::DataBlobDesc::reclaimed):
// empty for a whole blob; kInvalidArgument for text BlockRanges does not parse.
Result<image::BlockRanges> reclaimedOf(const proto::DataBlobDesc& b) {
  if (b.reclaimed.empty()) return image::BlockRanges();
  auto r = image::BlockRanges::parse(b.reclaimed);
  if (!r.isOk()) {
    Status st = r.status();
    return st.withContext("reclaimed chunks of " + b.digest);
  }
  return r;
}

// Whether chunk i lies (even in part) in reclaimed blocks: gc reclaims whole
// chunks, which read as zeros from the store and which no layer reads.
bool chunkReclaimed(const image::BlockRanges& reclaimed, const image::ChunkIndex& idx, int64_t i) {
  if (reclaimed.empty()) return false;
  auto [first, count] = idx.blocksOf(i);
  return reclaimed.intersects(first, count);
}

// An empty sparse copy of `size` bytes at `path` (made aside, renamed into
// place): all holes, which loaders and prestage() fill chunk by chunk.
Status createSparseCopy(const std::string& path, int64_t size) {
  std::string tmp = path + ".new";
  UniqueFd fd(::open(tmp.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600));
  if (!fd) return sysError("create " + tmp);
  if (::ftruncate(fd.get(), size) != 0) return sysError("truncate " + tmp);
  if (::rename(tmp.c_str(), path.c_str()) != 0) return sysError("rename " + path);
  return Status::ok();
}

// EROFS numbers the extra devices after the layer's own data blob.
Status checkDevices(const LayerDesc& d) {
  if (d.dataDigest.empty() && !d.extraData.empty()) {
    return Status(Code::kDataLoss,
                  "layer " + d.digest + " has extra data blobs but no data blob of its own");
  }
  return Status::ok();
}
}  // namespace

Result<std::unique_ptr<NodeCache>> NodeCache::open(NodeCacheOptions opts, LayerLookup lookup) {
  return openWith(std::move(opts), std::move(lookup), nullptr);
}

Result<std::unique_ptr<NodeCache>> NodeCache::openForTest(NodeCacheOptions opts, LayerLookup lookup,
                                                          std::unique_ptr<Loader> loader) {
  return openWith(std::move(opts), std::move(lookup), std::move(loader));
}

Result<std::unique_ptr<NodeCache>> NodeCache::openWith(NodeCacheOptions opts, LayerLookup lookup,
                                                       std::unique_ptr<Loader> loader) {
  std::unique_ptr<NodeCache> c(new NodeCache());
  c->opts_ = std::move(opts);
  c->lookup_ = std::move(lookup);
  RETURN_IF_ERROR(makeDirs(c->opts_.dir, 0700));
  ASSIGN_OR_RETURN(c->store_, image::BlobStore::open(c->opts_.storeUri, c->opts_.storeOptions));
  std::string want = loader ? "given" : c->opts_.loader;
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
  if (want == "given") {
    c->loader_ = std::move(loader);
  } else if (want == "direct") {
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

std::vector<proto::DataBlobDesc> NodeCache::blobsOf(const LayerDesc& d) {
  std::vector<proto::DataBlobDesc> out;
  if (!d.dataDigest.empty()) out.push_back({d.dataDigest, d.dataSize, d.chunksDigest});
  out.insert(out.end(), d.extraData.begin(), d.extraData.end());
  return out;
}

Status NodeCache::writeBlobList(const LayerDesc& d) {
  // A layer's digest names its metadata image, which names its devices: the
  // list never changes.
  std::string path = pathOf(d.digest, ".blobs");
  if (::access(path.c_str(), F_OK) == 0) return Status::ok();
  std::string text;
  for (auto& b : blobsOf(d)) text += b.digest + "\n";
  return writeFileAtomic(path, text, 0600);
}

Status NodeCache::fetchWhole(const std::string& name, const std::string& digest,
                             const std::string& dest, int64_t* fetched) {
  if (::access(dest.c_str(), F_OK) == 0) return Status::ok();
  RETURN_IF_ERROR(store_->fetchVerified(name, hexOf(digest), dest));
  struct stat st;
  if (::stat(dest.c_str(), &st) == 0) *fetched += st.st_size;
  return Status::ok();
}

Result<image::ChunkIndex> NodeCache::loadIndex(const proto::DataBlobDesc& b, int64_t* fetched) {
  std::string chunks = pathOf(b.digest, ".chunks");
  RETURN_IF_ERROR(fetchWhole(image::chunkIndexName(b.digest), b.chunksDigest, chunks, fetched));
  ASSIGN_OR_RETURN(std::string bytes, readFile(chunks));
  ASSIGN_OR_RETURN(image::ChunkIndex idx, image::ChunkIndex::parse(bytes));
  if (idx.dataSize != b.size) {
    return Status(Code::kDataLoss, "chunk index of " + b.digest + " is for " +
                                       std::to_string(idx.dataSize) + " bytes, not " +
                                       std::to_string(b.size));
  }
  return idx;
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
  RETURN_IF_ERROR(checkDevices(d));
  if (!loader_) {
    std::vector<std::string> names = {d.digest};
    for (auto& b : blobsOf(d)) names.push_back(b.digest);
    for (auto& name : names) {
      std::string p = store_->localPath(image::blobName(name));
      if (::access(p.c_str(), R_OK) != 0) {
        return notFound("blob of layer " + digest + " not in the store: " + p);
      }
    }
    return Status::ok();
  }
  {
    std::lock_guard lk(mu_);
    if (preparing_.count(digest) || staging_.count(digest)) return Status::ok();
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
  RETURN_IF_ERROR(
      fetchWhole(image::blobName(d.digest), d.digest, pathOf(d.digest, ".meta"), fetched));
  RETURN_IF_ERROR(writeBlobList(d));
  for (auto& b : blobsOf(d)) RETURN_IF_ERROR(stageBlob(b));
  return Status::ok();
}

Status NodeCache::stageBlob(const proto::DataBlobDesc& b) {
  {
    std::unique_lock lk(mu_);
    cv_.wait(lk, [&] { return !blobBusy_.count(b.digest); });
    Blob& blob = blobs_[b.digest];
    blob.desc = b;
    if (blob.users > 0) return Status::ok();  // its loader fills it as it is read
    blobBusy_.insert(b.digest);
  }
  int64_t fetched = 0;
  auto stage = [&]() -> Status {
    ASSIGN_OR_RETURN(image::BlockRanges reclaimed, reclaimedOf(b));
    ASSIGN_OR_RETURN(image::ChunkIndex idx, loadIndex(b, &fetched));
    std::string data = pathOf(b.digest, ".data");
    if (::access(data.c_str(), F_OK) != 0) {
      if (reclaimed.empty()) {
        // Whole, verified against the data blob's digest, renamed into place.
        RETURN_IF_ERROR(store_->fetchVerified(image::blobName(b.digest), hexOf(b.digest), data));
        fetched += b.size;
        return Status::ok();
      }
      // A partial blob no longer hashes to its digest: an empty sparse copy,
      // filled below chunk by chunk like one from earlier use.
      RETURN_IF_ERROR(createSparseCopy(data, b.size));
    }
    // A sparse copy: its holes, chunk by chunk, each verified; reclaimed
    // chunks stay holes (they would fail verification, and nothing reads them).
    UniqueFd fd(::open(data.c_str(), O_RDWR | O_CLOEXEC));
    if (!fd) return sysError("open " + data);
    struct stat sb;
    if (::fstat(fd.get(), &sb) != 0) return sysError("stat " + data);
    if (sb.st_size != b.size) {
      return Status(Code::kDataLoss, data + " is " + std::to_string(sb.st_size) + " bytes, not " +
                                         std::to_string(b.size));
    }
    for (int64_t i = 0; i < idx.chunkCount(); ++i) {
      int64_t off = i * idx.chunkSize;
      if (chunkReclaimed(reclaimed, idx, i)) continue;
      if (chunkPresent(fd.get(), off, off + idx.chunkLength(i))) continue;
      RETURN_IF_ERROR(fetchChunkInto(store_.get(), b.digest, idx, i, fd.get(), data));
      fetched += idx.chunkLength(i);
    }
    if (::fsync(fd.get()) != 0) return sysError("fsync " + data);
    return Status::ok();
  };
  Status st = stage();
  {
    std::lock_guard lk(mu_);
    blobBusy_.erase(b.digest);
    blobs_[b.digest].bytesFetched += fetched;
  }
  cv_.notify_all();
  return st;
}

Result<LayerFiles> NodeCache::prepareFiles(const std::string& digest) {
  ASSIGN_OR_RETURN(LayerDesc d, lookup_(digest));
  RETURN_IF_ERROR(checkDevices(d));
  if (!loader_) {
    LayerFiles files{store_->localPath(image::blobName(d.digest)), "", {}};
    if (!d.dataDigest.empty()) files.data = store_->localPath(image::blobName(d.dataDigest));
    for (auto& b : d.extraData) {
      files.extraData.push_back(store_->localPath(image::blobName(b.digest)));
    }
    std::vector<std::string> all = {files.meta, files.data};
    all.insert(all.end(), files.extraData.begin(), files.extraData.end());
    for (auto& p : all) {
      if (!p.empty() && ::access(p.c_str(), R_OK) != 0) {
        return notFound("blob of layer " + digest + " not in the store: " + p);
      }
    }
    return files;
  }
  LayerFiles files{pathOf(d.digest, ".meta"), "", {}};
  int64_t whole = 0;
  RETURN_IF_ERROR(fetchWhole(image::blobName(d.digest), d.digest, files.meta, &whole));
  ::utimensat(AT_FDCWD, files.meta.c_str(), nullptr, 0);  // LRU clock for trim()
  {
    std::lock_guard lk(mu_);
    entries_[digest].desc = d;
    entries_[digest].wholeBytesFetched += whole;
  }
  RETURN_IF_ERROR(writeBlobList(d));
  std::vector<std::string> held;  // data digests this call holds a use of
  for (auto& b : blobsOf(d)) {
    auto device = acquireBlob(b);
    if (!device.isOk()) {
      for (auto& h : held) releaseBlob(h);
      return device.status();
    }
    // Device 1 is the layer's own blob (checkDevices), the extras follow.
    if (held.empty()) {
      files.data = *device;
    } else {
      files.extraData.push_back(*device);
    }
    held.push_back(b.digest);
  }
  uint64_t generation = loader_->generation();
  bool again;
  {
    std::lock_guard lk(mu_);
    Entry& e = entries_[digest];
    again = e.attached;
    e.attached = true;
    e.loaderGeneration = generation;
  }
  // Prepared again before unmounted(): the layer holds one use of each blob.
  if (again) {
    for (auto& h : held) releaseBlob(h);
  }
  return files;
}

Result<std::string> NodeCache::acquireBlob(const proto::DataBlobDesc& b) {
  {
    std::unique_lock lk(mu_);
    cv_.wait(lk, [&] { return !blobBusy_.count(b.digest); });
    Blob& blob = blobs_[b.digest];
    blob.desc = b;
    if (blob.users > 0) {
      ++blob.users;
      return blob.device;
    }
    blobBusy_.insert(b.digest);
  }
  int64_t fetched = 0;
  bool cold = false;
  std::shared_ptr<const image::ChunkIndex> index;
  std::vector<int64_t> order;
  auto attach = [&]() -> Result<std::string> {
    ASSIGN_OR_RETURN(image::BlockRanges reclaimed, reclaimedOf(b));
    ASSIGN_OR_RETURN(image::ChunkIndex idx, loadIndex(b, &fetched));
    index = std::make_shared<const image::ChunkIndex>(std::move(idx));
    std::string data = pathOf(b.digest, ".data");
    cold = ::access(data.c_str(), F_OK) != 0;
    if (cold) RETURN_IF_ERROR(createSparseCopy(data, b.size));
    ASSIGN_OR_RETURN(std::string device, loader_->attach(loaderDesc(b), data, index));
    if (auto list = readFile(pathOf(b.digest, ".order")); list.isOk()) {
      // The list may predate gc (recorded while the blob's own layer read
      // it): its reclaimed chunks would only fail verification.
      std::istringstream in(*list);
      for (int64_t i; in >> i;) {
        if (i >= 0 && i < index->chunkCount() && !chunkReclaimed(reclaimed, *index, i)) {
          order.push_back(i);
        }
      }
    }
    return device;
  };
  auto device = attach();
  {
    std::lock_guard lk(mu_);
    blobBusy_.erase(b.digest);
    Blob& blob = blobs_[b.digest];
    blob.bytesFetched += fetched;
    if (device.isOk()) {
      blob.users = 1;
      blob.device = *device;
      blob.attachedAt = monoSeconds();
      blob.recorded = !order.empty();
      if (cold && !order.empty() && !stopping_) {
        prefetchQueue_.push_back({*device, std::move(order), index->chunkSize, blob.prefetched});
      }
    }
  }
  cv_.notify_all();
  return device;
}

void NodeCache::releaseBlob(const std::string& dataDigest) {
  {
    std::unique_lock lk(mu_);
    cv_.wait(lk, [&] { return !blobBusy_.count(dataDigest); });
    auto it = blobs_.find(dataDigest);
    if (it == blobs_.end() || it->second.users == 0 || --it->second.users > 0) return;
    it->second.past += loader_->stats(dataDigest);
    it->second.device.clear();
    blobBusy_.insert(dataDigest);
  }
  loader_->detach(dataDigest);
  {
    std::lock_guard lk(mu_);
    blobBusy_.erase(dataDigest);
  }
  cv_.notify_all();
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
    for (auto& [digest, b] : blobs_) {
      if (b.users == 0 || b.recorded || now - b.attachedAt < opts_.recordWindowS) continue;
      auto order = loader_->readOrder(digest);
      if (order.empty()) continue;  // nothing read yet: record once something is
      b.recorded = true;
      std::string text;
      for (int64_t i : order) text += std::to_string(i) + "\n";
      if (Status st = writeFileAtomic(pathOf(digest, ".order"), text, 0600); !st.isOk()) {
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
    if (it == entries_.end() || !it->second.attached || blobsOf(it->second.desc).empty()) {
      return false;
    }
    attachedAt = it->second.loaderGeneration;
  }
  // Per layer, not per data blob: two layers sharing a blob were mounted
  // separately, and remounting one does not heal the other. (A restarted
  // loader serves every blob still attached again, under the same paths.)
  return loader_->generation() != attachedAt;
}

void NodeCache::unmounted(const std::string& digest) {
  std::vector<proto::DataBlobDesc> blobs;
  {
    std::lock_guard lk(mu_);
    auto it = entries_.find(digest);
    if (it == entries_.end() || !it->second.attached) return;
    it->second.attached = false;
    blobs = blobsOf(it->second.desc);
  }
  if (!loader_) return;
  for (auto& b : blobs) releaseBlob(b.digest);
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
  // Cached layers by last use (the mtime of their metadata image), and the
  // data blobs each reads (its <hex>.blobs; those in memory are the same).
  std::vector<std::pair<timespec, std::string>> lru;
  std::map<std::string, std::vector<std::string>> readers;  // layer -> data digests
  DIR* d = ::opendir(opts_.dir.c_str());
  if (!d) return removed;
  while (dirent* e = ::readdir(d)) {
    std::string name = e->d_name;
    if (name.size() != 64 + 5 || name.substr(64) != ".meta") continue;
    std::string digest = "sha256:" + name.substr(0, 64);
    if (auto list = readFile(opts_.dir + "/" + name.substr(0, 64) + ".blobs"); list.isOk()) {
      for (auto& b : splitString(*list, '\n')) {
        if (!b.empty()) readers[digest].push_back(b);
      }
    }
    struct stat st;
    {
      std::lock_guard lk(mu_);
      if (staging_.count(digest) || preparing_.count(digest)) continue;
    }
    if (mounted.count(digest) || ::fstatat(::dirfd(d), e->d_name, &st, 0) != 0) continue;
    lru.push_back({st.st_mtim, digest});
  }
  ::closedir(d);
  {
    std::lock_guard lk(mu_);
    for (auto& [digest, e] : entries_) {
      auto& list = readers[digest];
      list.clear();
      for (auto& b : blobsOf(e.desc)) list.push_back(b.digest);
    }
  }
  std::sort(lru.begin(), lru.end(), [](auto& a, auto& b) {
    return a.first.tv_sec != b.first.tv_sec ? a.first.tv_sec < b.first.tv_sec
                                            : a.first.tv_nsec < b.first.tv_nsec;
  });
  for (auto& [_, digest] : lru) {
    if (used <= opts_.limitBytes) break;
    {
      std::lock_guard lk(mu_);
      auto it = entries_.find(digest);
      if (it != entries_.end()) {
        if (it->second.attached) continue;
        entries_.erase(it);
      }
    }
    std::vector<std::string> data;
    if (auto r = readers.find(digest); r != readers.end()) {
      data = std::move(r->second);
      readers.erase(r);
    } else if (auto desc = lookup_(digest); desc.isOk()) {
      // Cached by an edge that kept no list.
      for (auto& b : blobsOf(*desc)) data.push_back(b.digest);
    }
    std::vector<std::string> files = {pathOf(digest, ".meta"), pathOf(digest, ".blobs")};
    {
      // Under mu_: no acquireBlob() starts on a blob between the check and
      // the unlink.
      std::lock_guard lk(mu_);
      for (auto& dg : data) {
        // A data blob another cached layer reads (as its own or an extra),
        // or one in use, stays.
        auto b = blobs_.find(dg);
        bool read = blobBusy_.count(dg) || (b != blobs_.end() && b->second.users > 0);
        for (auto& [other, list] : readers) {
          read = read || std::find(list.begin(), list.end(), dg) != list.end();
        }
        if (read) continue;
        if (b != blobs_.end()) blobs_.erase(b);
        files.push_back(pathOf(dg, ".data"));
        files.push_back(pathOf(dg, ".chunks"));
      }
      for (auto& f : files) ::unlink(f.c_str());  // .order stays: it is the prefetch list
    }
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
    LayerInfo li;
    li.digest = digest;
    li.dataDigest = e.desc.dataDigest;
    li.dataSize = e.desc.dataSize;
    li.attached = e.attached;
    li.stats.bytesFetched = e.wholeBytesFetched;
    std::set<std::string> seen;
    for (auto& b : blobsOf(e.desc)) {
      if (!seen.insert(b.digest).second) continue;
      if (b.digest != e.desc.dataDigest) li.extraData.push_back(b.digest);
      auto it = blobs_.find(b.digest);
      if (it == blobs_.end()) continue;
      LayerStats s = it->second.past;
      s.bytesFetched += it->second.bytesFetched;
      if (it->second.users > 0) s += loader_->stats(b.digest);
      addBlobStats(li.stats, s);
      li.chunksPrefetched += it->second.prefetched->load();
    }
    out.push_back(std::move(li));
  }
  return out;
}

}  // namespace dsec::edge
