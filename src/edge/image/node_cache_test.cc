// NodeCache's data blobs as shared, reference-counted entities: a layer reads
// its own data blob and extras (other layers' blobs); each blob is attached to
// the loader once while any attached layer reads it, detached with the last,
// and kept on disk while any cached layer reads it. Against a file:// store in
// a temp dir and a fake loader that records what the cache asks of it.
#include "edge/image/node_cache.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <map>
#include <mutex>
#include <set>
#include <string>

#include "common/fd.h"
#include "common/sha256.h"
#include "common/util.h"
#include "image/blob_store.h"
#include "image/chunk_index.h"

namespace dsec::edge {
namespace {

// What the cache asked of the loader; shared with the test, since the cache
// owns the loader.
struct LoaderCalls {
  std::mutex mu;
  std::map<std::string, int> attaches, detaches;  // by data digest
  std::set<std::string> live;                     // attached now
  uint64_t generation = 1;
  std::set<std::string> refuse;  // data digests attach fails for
};

class FakeLoader final : public Loader {
 public:
  explicit FakeLoader(std::shared_ptr<LoaderCalls> c) : c_(std::move(c)) {}
  const char* name() const override { return "fake"; }
  Result<std::string> attach(const LayerDesc& desc, const std::string& cachePath,
                             std::shared_ptr<const image::ChunkIndex> index) override {
    std::lock_guard lk(c_->mu);
    if (c_->refuse.count(desc.dataDigest)) return Status(Code::kUnavailable, "refused");
    // The loaders serve one copy per data digest: a second attach would
    // replace the first, and one detach would end both.
    if (c_->live.count(desc.dataDigest)) {
      return Status(Code::kInternal, desc.dataDigest + " attached twice");
    }
    if (index->dataSize != desc.dataSize) return Status(Code::kInternal, "index of another blob");
    ++c_->attaches[desc.dataDigest];
    c_->live.insert(desc.dataDigest);
    return cachePath;
  }
  void detach(const std::string& dataDigest) override {
    std::lock_guard lk(c_->mu);
    ++c_->detaches[dataDigest];
    c_->live.erase(dataDigest);
  }
  LayerStats stats(const std::string&) override {
    LayerStats s;
    s.chunks = 3;
    s.readRequests = 1;
    return s;
  }
  std::vector<int64_t> readOrder(const std::string&) override { return {}; }
  uint64_t generation() override {
    std::lock_guard lk(c_->mu);
    return c_->generation;
  }

 private:
  std::shared_ptr<LoaderCalls> c_;
};

class NodeCacheTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/node-cache-test-XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
    ASSERT_TRUE(makeDirs(dir_ + "/store/sha256").isOk());
    x_ = putData(std::string(10000, 'x'));
    y_ = putData(std::string(9000, 'y'));
    z_ = putData(std::string(5000, 'z'));
    // A and B each read their own blob and C's (Z) as an extra.
    a_ = putLayer("meta of A", x_, {z_});
    b_ = putLayer("meta of B", y_, {z_});
    c_ = putLayer("meta of C", z_, {});
  }
  void TearDown() override {
    cache_.reset();
    (void)removeTree(dir_);
  }

  std::string put(const std::string& name, const std::string& bytes) {
    EXPECT_TRUE(writeFileAtomic(dir_ + "/store/" + name, bytes, 0644).isOk());
    return "sha256:" + sha256Hex(bytes);
  }
  proto::DataBlobDesc putData(const std::string& bytes) {
    proto::DataBlobDesc d;
    d.digest = put(image::blobName("sha256:" + sha256Hex(bytes)), bytes);
    d.size = int64_t(bytes.size());
    auto idx = image::ChunkIndex::build(dir_ + "/store/" + image::blobName(d.digest), 4096);
    EXPECT_TRUE(idx.isOk());
    d.chunksDigest = put(image::chunkIndexName(d.digest), idx->serialize());
    return d;
  }
  // A data blob of 5 chunks of 4 KiB (the last short), each of other bytes,
  // whose copy in the store then has chunk `hole` zeroed, as the platform's gc
  // leaves a chunk it reclaimed. `original` gets the bytes before that.
  proto::DataBlobDesc putPartialData(int64_t hole, std::string* original) {
    std::string bytes;
    for (int i = 0; i < 5; ++i) bytes += std::string(i < 4 ? 4096 : 1000, char('a' + i));
    *original = bytes;
    proto::DataBlobDesc d = putData(bytes);
    std::fill_n(bytes.begin() + hole * 4096, 4096, '\0');
    EXPECT_TRUE(writeFileAtomic(dir_ + "/store/" + image::blobName(d.digest), bytes, 0644).isOk());
    return d;
  }
  int64_t storeSize(const std::string& name) {
    struct stat st;
    EXPECT_EQ(::stat((dir_ + "/store/" + name).c_str(), &st), 0) << name;
    return st.st_size;
  }
  std::string putLayer(const std::string& meta, const proto::DataBlobDesc& own,
                       std::vector<proto::DataBlobDesc> extras) {
    LayerDesc d;
    d.digest = put(image::blobName("sha256:" + sha256Hex(meta)), meta);
    d.size = int64_t(meta.size());
    d.dataDigest = own.digest;
    d.dataSize = own.size;
    d.chunksDigest = own.chunksDigest;
    d.extraData = std::move(extras);
    descs_[d.digest] = d;
    return d.digest;
  }
  void open(int64_t limitBytes = 0) {
    cache_.reset();
    NodeCacheOptions o;
    o.dir = dir_ + "/cache";
    o.storeUri = "file://" + dir_ + "/store";
    o.limitBytes = limitBytes;
    auto c = NodeCache::openForTest(
        o,
        [this](const std::string& digest) -> Result<LayerDesc> {
          auto it = descs_.find(digest);
          if (it == descs_.end()) return notFound("layer " + digest);
          return it->second;
        },
        std::make_unique<FakeLoader>(calls_));
    ASSERT_TRUE(c.isOk()) << c.status().toString();
    cache_ = std::move(*c);
  }
  std::string cached(const std::string& digest, const char* suffix) {
    return dir_ + "/cache/" + digest.substr(7) + suffix;
  }
  bool exists(const std::string& path) { return ::access(path.c_str(), F_OK) == 0; }
  int attaches(const std::string& d) {
    std::lock_guard lk(calls_->mu);
    return calls_->attaches[d];
  }
  int detaches(const std::string& d) {
    std::lock_guard lk(calls_->mu);
    return calls_->detaches[d];
  }
  std::set<std::string> live() {
    std::lock_guard lk(calls_->mu);
    return calls_->live;
  }

  std::string dir_;
  proto::DataBlobDesc x_, y_, z_;
  std::string a_, b_, c_;
  std::map<std::string, LayerDesc> descs_;
  std::shared_ptr<LoaderCalls> calls_ = std::make_shared<LoaderCalls>();
  std::unique_ptr<NodeCache> cache_;
};

TEST_F(NodeCacheTest, ASharedBlobIsAttachedOnceAndDetachedWithItsLastLayer) {
  open();
  auto fa = cache_->prepare(a_);
  ASSERT_TRUE(fa.isOk()) << fa.status().toString();
  EXPECT_EQ(fa->meta, cached(a_, ".meta"));
  EXPECT_EQ(fa->data, cached(x_.digest, ".data"));
  EXPECT_EQ(fa->extraData, std::vector<std::string>{cached(z_.digest, ".data")});
  auto fb = cache_->prepare(b_);
  ASSERT_TRUE(fb.isOk()) << fb.status().toString();
  EXPECT_EQ(fb->data, cached(y_.digest, ".data"));
  EXPECT_EQ(fb->extraData, fa->extraData);  // one sparse copy of Z
  EXPECT_EQ(attaches(z_.digest), 1);
  // C's own blob is Z: shared as well.
  auto fc = cache_->prepare(c_);
  ASSERT_TRUE(fc.isOk()) << fc.status().toString();
  EXPECT_EQ(fc->data, fa->extraData[0]);
  EXPECT_TRUE(fc->extraData.empty());
  EXPECT_EQ(attaches(z_.digest), 1);

  cache_->unmounted(a_);
  EXPECT_EQ(detaches(x_.digest), 1);
  EXPECT_EQ(detaches(z_.digest), 0);
  cache_->unmounted(c_);
  EXPECT_EQ(live(), (std::set<std::string>{y_.digest, z_.digest}));  // B still reads Z
  cache_->unmounted(a_);  // twice: nothing more
  EXPECT_EQ(detaches(z_.digest), 0);

  auto layers = cache_->layers();
  ASSERT_EQ(layers.size(), 3u);
  for (auto& l : layers) {
    EXPECT_EQ(l.attached, l.digest == b_) << l.digest;
    if (l.digest == b_) {
      EXPECT_EQ(l.dataDigest, y_.digest);
      EXPECT_EQ(l.extraData, std::vector<std::string>{z_.digest});
      EXPECT_EQ(l.stats.chunks, 6);  // its two blobs' (3 each, from the fake)
    }
  }

  cache_->unmounted(b_);
  EXPECT_EQ(detaches(z_.digest), 1);
  EXPECT_TRUE(live().empty());
  // Attached again when next needed.
  ASSERT_TRUE(cache_->prepare(b_).isOk());
  EXPECT_EQ(attaches(z_.digest), 2);
}

TEST_F(NodeCacheTest, PreparingAnAttachedLayerAgainTakesNoFurtherUse) {
  open();
  ASSERT_TRUE(cache_->prepare(a_).isOk());
  ASSERT_TRUE(cache_->prepare(a_).isOk());
  cache_->unmounted(a_);
  EXPECT_TRUE(live().empty());
}

TEST_F(NodeCacheTest, AFailedAttachLeavesTheLayerHoldingNothing) {
  open();
  ASSERT_TRUE(cache_->prepare(b_).isOk());
  {
    std::lock_guard lk(calls_->mu);
    calls_->refuse.insert(x_.digest);
  }
  // A's own blob fails: Z, which B holds, stays attached, and A holds nothing.
  auto fa = cache_->prepare(a_);
  EXPECT_EQ(fa.status().code(), Code::kUnavailable) << fa.status().toString();
  EXPECT_EQ(live(), (std::set<std::string>{y_.digest, z_.digest}));
  cache_->unmounted(b_);
  EXPECT_TRUE(live().empty());
  // An extra missing from the store: the blobs attached before it go again.
  proto::DataBlobDesc gone = z_;
  gone.digest = "sha256:" + std::string(64, '0');
  std::string d = putLayer("meta of D", y_, {gone});
  auto fd = cache_->prepare(d);
  EXPECT_FALSE(fd.isOk());
  EXPECT_TRUE(live().empty());
  EXPECT_EQ(detaches(y_.digest), 2);
}

TEST_F(NodeCacheTest, ExtrasWithoutAnOwnBlobAreRefused) {
  open();
  std::string e = putLayer("meta of E", proto::DataBlobDesc{}, {z_});
  auto fe = cache_->prepare(e);
  EXPECT_EQ(fe.status().code(), Code::kDataLoss) << fe.status().toString();
  EXPECT_TRUE(live().empty());
}

TEST_F(NodeCacheTest, BrokenCoversTheLayerAfterALoaderRestart) {
  open();
  ASSERT_TRUE(cache_->prepare(a_).isOk());
  ASSERT_TRUE(cache_->prepare(b_).isOk());
  EXPECT_FALSE(cache_->broken(a_));
  {
    std::lock_guard lk(calls_->mu);
    calls_->generation = 2;
  }
  EXPECT_TRUE(cache_->broken(a_));
  EXPECT_TRUE(cache_->broken(b_));
  // Remounting A heals A (Z stays attached for B meanwhile), not B.
  cache_->unmounted(a_);
  EXPECT_TRUE(live().count(z_.digest));
  ASSERT_TRUE(cache_->prepare(a_).isOk());
  EXPECT_FALSE(cache_->broken(a_));
  EXPECT_TRUE(cache_->broken(b_));
  EXPECT_EQ(attaches(z_.digest), 1);
}

TEST_F(NodeCacheTest, TrimKeepsABlobAnotherCachedLayerReads) {
  open(1);  // any cached byte is over the limit
  ASSERT_TRUE(cache_->prepare(a_).isOk());
  ASSERT_TRUE(cache_->prepare(b_).isOk());
  cache_->unmounted(a_);
  cache_->unmounted(b_);
  // An edge restart: the cache knows its layers' blobs from disk alone.
  open(1);
  auto removed = cache_->trim({b_});
  EXPECT_EQ(removed, std::vector<std::string>{a_});
  EXPECT_FALSE(exists(cached(a_, ".meta")));
  EXPECT_FALSE(exists(cached(x_.digest, ".data")));
  EXPECT_FALSE(exists(cached(x_.digest, ".chunks")));
  // Z is B's extra.
  EXPECT_TRUE(exists(cached(z_.digest, ".data")));
  EXPECT_TRUE(exists(cached(z_.digest, ".chunks")));
  EXPECT_TRUE(exists(cached(b_, ".meta")));
  // Once B goes too, so does Z.
  removed = cache_->trim({});
  EXPECT_EQ(removed, std::vector<std::string>{b_});
  EXPECT_FALSE(exists(cached(z_.digest, ".data")));
  EXPECT_FALSE(exists(cached(y_.digest, ".data")));
}

TEST_F(NodeCacheTest, TrimKeepsABlobAnAttachedLayerReads) {
  open(1);
  ASSERT_TRUE(cache_->prepare(a_).isOk());
  ASSERT_TRUE(cache_->prepare(c_).isOk());
  cache_->unmounted(a_);
  // C is attached though not in `mounted` (a caller of prepare() of its own).
  auto removed = cache_->trim({});
  EXPECT_EQ(removed, std::vector<std::string>{a_});
  EXPECT_TRUE(exists(cached(z_.digest, ".data")));
  EXPECT_FALSE(exists(cached(x_.digest, ".data")));
}

TEST_F(NodeCacheTest, PrestageFetchesEveryBlobButThoseAttached) {
  open();
  ASSERT_TRUE(cache_->prestage(a_).isOk());
  auto data = [&](const proto::DataBlobDesc& b) { return readFile(cached(b.digest, ".data")); };
  EXPECT_EQ(*data(x_), std::string(10000, 'x'));
  EXPECT_EQ(*data(z_), std::string(5000, 'z'));
  EXPECT_TRUE(live().empty());
  // B's own blob is fetched; Z is already whole.
  ASSERT_TRUE(cache_->prestage(b_).isOk());
  EXPECT_EQ(*data(y_), std::string(9000, 'y'));
  // With C attached (the fake fills nothing), Z's copy is left to the loader.
  ::unlink(cached(z_.digest, ".data").c_str());
  ASSERT_TRUE(cache_->prepare(c_).isOk());
  ASSERT_TRUE(cache_->prestage(b_).isOk());
  struct stat st;
  ASSERT_EQ(::stat(cached(z_.digest, ".data").c_str(), &st), 0);
  EXPECT_EQ(st.st_size, 5000);
  EXPECT_EQ(st.st_blocks, 0);  // still sparse
  bool listed = false;
  for (auto& l : cache_->layers()) listed = listed || l.digest == b_;
  EXPECT_TRUE(listed);
}

TEST_F(NodeCacheTest, PrestageFetchesAPartialBlobChunkByChunkLeavingReclaimedOnesHoles) {
  std::string original;
  proto::DataBlobDesc w = putPartialData(2, &original);
  w.reclaimed = "2+1";  // chunk 2: blocks [2, 3)
  std::string p = putLayer("meta of P", x_, {w});
  open();
  Status st = cache_->prestage(p);
  ASSERT_TRUE(st.isOk()) << st.toString();
  std::string path = cached(w.digest, ".data");
  auto copy = readFile(path);
  ASSERT_TRUE(copy.isOk()) << copy.status().toString();
  ASSERT_EQ(copy->size(), original.size());
  for (int64_t i = 0; i < 5; ++i) {
    int64_t off = i * 4096, len = i < 4 ? 4096 : 1000;
    if (i == 2) {
      EXPECT_EQ(copy->substr(off, len), std::string(4096, '\0'));
    } else {
      EXPECT_EQ(copy->substr(off, len), original.substr(off, len)) << "chunk " << i;
    }
  }
  // Chunk 2 was never fetched: a hole, and everything else data.
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  ASSERT_TRUE(fd);
  EXPECT_EQ(::lseek(fd.get(), 0, SEEK_HOLE), 2 * 4096);
  EXPECT_EQ(::lseek(fd.get(), 2 * 4096, SEEK_DATA), 3 * 4096);
  EXPECT_EQ(::lseek(fd.get(), 3 * 4096, SEEK_HOLE), off_t(original.size()));
  // Bytes fetched: the metadata image, X whole, both chunk indexes and the
  // four chunks of W it has.
  int64_t want = storeSize(image::blobName(p)) + x_.size +
                 storeSize(image::chunkIndexName(x_.digest)) +
                 storeSize(image::chunkIndexName(w.digest)) + w.size - 4096;
  auto stats = [&] {
    for (auto& l : cache_->layers()) {
      if (l.digest == p) return l.stats;
    }
    return LayerStats{};
  };
  EXPECT_EQ(stats().bytesFetched, want);
  // Again: the copy from earlier use is complete but for its reclaimed chunk.
  st = cache_->prestage(p);
  ASSERT_TRUE(st.isOk()) << st.toString();
  EXPECT_EQ(::lseek(fd.get(), 2 * 4096, SEEK_DATA), 3 * 4096);
  EXPECT_EQ(stats().bytesFetched, want);
}

TEST_F(NodeCacheTest, PrestageOfAZeroedBlobNotSaidToBePartialIsDataLoss) {
  std::string original;
  proto::DataBlobDesc w = putPartialData(2, &original);
  std::string p = putLayer("meta of P", x_, {w});
  open();
  EXPECT_EQ(cache_->prestage(p).code(), Code::kDataLoss);
  // Nor chunk by chunk into a sparse copy from earlier use.
  ASSERT_TRUE(makeDirs(dir_ + "/cache", 0700).isOk());
  ASSERT_TRUE(writeFileAtomic(cached(w.digest, ".data"), "", 0600).isOk());
  ASSERT_EQ(::truncate(cached(w.digest, ".data").c_str(), w.size), 0);
  EXPECT_EQ(cache_->prestage(p).code(), Code::kDataLoss);
}

TEST_F(NodeCacheTest, AColdAttachPrefetchesNoReclaimedChunk) {
  std::string original;
  proto::DataBlobDesc w = putPartialData(2, &original);
  w.reclaimed = "2+1";
  std::string p = putLayer("meta of P", x_, {w});
  open();
  // Recorded while W's own layer still read chunk 2, before gc reclaimed it.
  ASSERT_TRUE(makeDirs(dir_ + "/cache", 0700).isOk());
  ASSERT_TRUE(writeFileAtomic(cached(w.digest, ".order"), "0\n2\n3\n", 0600).isOk());
  ASSERT_TRUE(cache_->prepare(p).isOk());
  auto prefetched = [&] {
    for (auto& l : cache_->layers()) {
      if (l.digest == p) return l.chunksPrefetched;
    }
    return int64_t(-1);
  };
  for (int i = 0; i < 500 && prefetched() < 2; ++i) ::usleep(10000);
  ::usleep(200000);  // a third read, if any, lands meanwhile
  EXPECT_EQ(prefetched(), 2);
  cache_->unmounted(p);
}

TEST_F(NodeCacheTest, ReclaimedChunksThatDoNotParseAreRefused) {
  proto::DataBlobDesc w = z_;
  w.reclaimed = "1+0";
  std::string p = putLayer("meta of P", x_, {w});
  open();
  Status st = cache_->prestage(p);
  EXPECT_EQ(st.code(), Code::kInvalidArgument) << st.toString();
  EXPECT_FALSE(exists(cached(z_.digest, ".data")));
  EXPECT_EQ(cache_->prepare(p).status().code(), Code::kInvalidArgument);
  EXPECT_TRUE(live().empty());
}

TEST_F(NodeCacheTest, TheDirectLoaderReadsEveryBlobInPlace) {
  NodeCacheOptions o;
  o.dir = dir_ + "/cache";
  o.storeUri = "file://" + dir_ + "/store";
  o.loader = "direct";
  auto c = NodeCache::open(o, [this](const std::string& digest) -> Result<LayerDesc> {
    return descs_.at(digest);
  });
  ASSERT_TRUE(c.isOk()) << c.status().toString();
  auto fa = (*c)->prepare(a_);
  ASSERT_TRUE(fa.isOk()) << fa.status().toString();
  std::string store = dir_ + "/store/";
  EXPECT_EQ(fa->meta, store + image::blobName(a_));
  EXPECT_EQ(fa->data, store + image::blobName(x_.digest));
  EXPECT_EQ(fa->extraData, std::vector<std::string>{store + image::blobName(z_.digest)});
  EXPECT_TRUE((*c)->prestage(a_).isOk());
  ::unlink((store + image::blobName(z_.digest)).c_str());
  EXPECT_EQ((*c)->prepare(a_).status().code(), Code::kNotFound);
  EXPECT_EQ((*c)->prestage(b_).code(), Code::kNotFound);
}

}  // namespace
}  // namespace dsec::edge
