#include "platform/chunk_keys.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <thread>

#include "common/metrics.h"
#include "common/sha256.h"
#include "common/util.h"
#include "image/chunk_index.h"
#include "image/build_context.h"
#include "image/layer_converter.h"
#include "platform/cluster.h"
#include "platform/platform.h"
#include "platform/store_test_util.h"

namespace dsec::platform {
namespace {

// A sha whose first 16 hex digits (the key's part) vary with i.
std::string spreadSha(uint64_t i) {
  char buf[65];
  snprintf(buf, sizeof buf, "%016llx%048x", (unsigned long long)(i * 0x9e3779b97f4a7c15ull), 7);
  return buf;
}

TEST(ChunkKeysTest, KeyIsTheShaPrefixWithTheLengthFoldedIn) {
  auto a = ChunkKeys::keyOf(spreadSha(1), 4096);
  ASSERT_TRUE(a);
  EXPECT_EQ(ChunkKeys::keyOf(spreadSha(1), 4096), a);
  // Another length is another chunk.
  EXPECT_NE(ChunkKeys::keyOf(spreadSha(1), 4097), a);
  // Only the first 16 digits count: shas alike that far share a key (the
  // store tells them apart).
  std::string other = spreadSha(1);
  other[63] = other[63] == '0' ? '1' : '0';
  EXPECT_EQ(ChunkKeys::keyOf(other, 4096), a);
  // What no chunk can be.
  EXPECT_FALSE(ChunkKeys::keyOf("0123456789abcde", 1));
  EXPECT_FALSE(ChunkKeys::keyOf("0123456789ABCDEF" + std::string(48, '0'), 1));
  EXPECT_FALSE(ChunkKeys::keyOf("", 1));
  // Never 0 (the empty slot), even for the sha and length that would make it.
  EXPECT_EQ(ChunkKeys::keyOf(std::string(64, '0'), 0), 1u);
}

TEST(ChunkKeysTest, BeforeItIsLoadedEveryLookupAsksTheStore) {
  ChunkKeys k;
  EXPECT_TRUE(k.mayContain(spreadSha(1), 10));
  k.add(spreadSha(2), 10);
  EXPECT_TRUE(k.mayContain(spreadSha(1), 10));
  EXPECT_TRUE(k.mayContain(spreadSha(2), 10));
  auto s = k.stats();
  EXPECT_FALSE(s.loaded);
  EXPECT_EQ(s.keys, 1);
  EXPECT_EQ(s.absent, 0);
  EXPECT_EQ(s.passed, 3);
}

// Loading from either store: what is stored may be there, anything else is
// answered with no query. Then the two ways the set lags the store.
class ChunkKeysStoreTest : public ::testing::TestWithParam<StoreKind> {
 protected:
  void SetUp() override { DSEC_MAKE_TEST_STORE_ENV(env_, GetParam()); }
  void TearDown() override { env_.reset(); }
  std::unique_ptr<TestStoreEnv> env_;
};
DSEC_INSTANTIATE_FOR_BOTH_STORES(ChunkKeysStoreTest);

TEST_P(ChunkKeysStoreTest, LoadedFromTheStoreAnswersNewChunksWithoutAQuery) {
  auto opened = env_->open();
  ASSERT_TRUE(opened.isOk()) << opened.status().toString();
  std::unique_ptr<Store> s = std::move(*opened);
  std::vector<ChunkLoc> stored;
  for (int i = 0; i < 2500; ++i) stored.push_back({spreadSha(uint64_t(i) + 500000), 4096, "", 0});
  ASSERT_TRUE(s->putChunks("sha256:d1", stored).isOk());
  ChunkKeys k;
  // Three pages: 1000, 1000, 500.
  Status st = k.load(s.get(), 1000);
  ASSERT_TRUE(st.isOk()) << st.toString();
  EXPECT_TRUE(k.stats().loaded);
  EXPECT_EQ(k.stats().keys, 2500);
  for (auto& c : stored) EXPECT_TRUE(k.mayContain(c.sha, c.length)) << c.sha;
  int absent = 0;
  for (int i = 0; i < 10000; ++i) absent += !k.mayContain(spreadSha(uint64_t(i) + 1), 4096);
  EXPECT_EQ(absent, 10000);
  // A stored sha at another length is another chunk.
  EXPECT_FALSE(k.mayContain(stored[0].sha, 4095));
  EXPECT_EQ(k.stats().absent, 10001);
  EXPECT_EQ(k.stats().passed, 2500);
  // Chunks this platform stores are added; chunks stored behind its back
  // (another replica) are not: a lost dedup chance, until the next load.
  k.add({{spreadSha(100001), 10, "", 0}});
  EXPECT_TRUE(k.mayContain(spreadSha(100001), 10));
  ASSERT_TRUE(s->putChunks("sha256:d2", {{spreadSha(100002), 10, "", 0}}).isOk());
  EXPECT_FALSE(k.mayContain(spreadSha(100002), 10));
  ChunkKeys fresh;
  ASSERT_TRUE(fresh.load(s.get()).isOk());
  EXPECT_TRUE(fresh.mayContain(spreadSha(100002), 10));
  // Keys of chunks gc forgot stay: they cost a query, never a wrong answer
  // (the store has the last word).
  ASSERT_TRUE(s->deleteChunksOf("sha256:d1").isOk());
  EXPECT_TRUE(k.mayContain(stored[0].sha, 4096));
  EXPECT_FALSE(s->findChunk(stored[0].sha, 4096)->has_value());
}

TEST_P(ChunkKeysStoreTest, LoadsOnItsOwnThread) {
  auto opened = env_->open();
  ASSERT_TRUE(opened.isOk()) << opened.status().toString();
  std::unique_ptr<Store> s = std::move(*opened);
  ASSERT_TRUE(s->putChunks("sha256:d1", {{spreadSha(1), 10, "", 0}}).isOk());
  {
    ChunkKeys k;
    k.startLoading(s.get());
    for (int i = 0; i < 500 && !k.stats().loaded; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    ASSERT_TRUE(k.stats().loaded);
    EXPECT_TRUE(k.mayContain(spreadSha(1), 10));
    EXPECT_FALSE(k.mayContain(spreadSha(2), 10));
  }
  // Destroyed at once after starting: the load stops (or finishes) and its
  // thread is joined, before the store goes.
  for (int i = 0; i < 20; ++i) {
    ChunkKeys k;
    k.startLoading(s.get());
  }
}

TEST(ChunkKeysTest, GrowsAndKeepsEveryKey) {
  ChunkKeys k;
  std::string dir = "/tmp/dsec-chunk-keys-test-" + randomHex(4);
  ASSERT_TRUE(makeDirs(dir).isOk());
  {
    auto s = SqliteStore::open(dir + "/state.db");
    ASSERT_TRUE(s.isOk());
    ASSERT_TRUE(k.load(s->get()).isOk());  // empty: loaded at once
  }
  (void)removeTree(dir);
  constexpr int kN = 300000;  // the table doubles ~9 times
  std::vector<ChunkLoc> batch;
  for (int i = 0; i < kN; ++i) {
    batch.push_back({spreadSha(uint64_t(i)), 131072, "", 0});
    if (batch.size() == 8192) {
      k.add(batch);
      batch.clear();
    }
  }
  k.add(batch);
  EXPECT_EQ(k.stats().keys, kN);
  for (int i = 0; i < kN; ++i) ASSERT_TRUE(k.mayContain(spreadSha(uint64_t(i)), 131072)) << i;
  int absent = 0;
  for (int i = 0; i < kN; ++i) absent += !k.mayContain(spreadSha(uint64_t(i) + kN), 131072);
  EXPECT_EQ(absent, kN);
  // Adding again adds nothing.
  k.add(spreadSha(0), 131072);
  EXPECT_EQ(k.stats().keys, kN);
}

// Pull workers convert in parallel: lookups and additions at once.
TEST(ChunkKeysTest, LookupsAndAdditionsFromManyThreads) {
  ChunkKeys k;
  std::string dir = "/tmp/dsec-chunk-keys-test-" + randomHex(4);
  ASSERT_TRUE(makeDirs(dir).isOk());
  {
    auto s = SqliteStore::open(dir + "/state.db");
    ASSERT_TRUE(s.isOk());
    ASSERT_TRUE(k.load(s->get()).isOk());
  }
  (void)removeTree(dir);
  constexpr int kThreads = 4, kPer = 20000;
  std::atomic<int> wrongMisses{0};
  std::vector<std::thread> ts;
  for (int t = 0; t < kThreads; ++t) {
    ts.emplace_back([&, t] {
      for (int i = 0; i < kPer; ++i) {
        uint64_t id = uint64_t(t) * kPer + uint64_t(i);
        k.add(spreadSha(id), 4096);
        // What this thread added is there at once.
        if (!k.mayContain(spreadSha(id), 4096)) ++wrongMisses;
        (void)k.mayContain(spreadSha(id + 1000000), 4096);
      }
    });
  }
  for (auto& t : ts) t.join();
  EXPECT_EQ(wrongMisses.load(), 0);
  EXPECT_EQ(k.stats().keys, kThreads * kPer);
  EXPECT_EQ(k.stats().absent + k.stats().passed, 2 * kThreads * kPer);
}

// ---------------------------------------------------------------- in a platform

double metricValue(const std::string& text, const std::string& sample) {
  size_t at = text.find("\n" + sample + " ");
  if (at == std::string::npos) return -1;
  return std::strtod(text.c_str() + at + sample.size() + 2, nullptr);
}

// The converter's ChunkSource as the platform's own (Platform::chunkSource),
// over its public lookupChunkAndHold.
class PlatformSource final : public image::ChunkSource {
 public:
  PlatformSource(Platform* p, Store* s) : p_(p), s_(s) {}
  ~PlatformSource() override { p_->releaseChunkHolds(held_); }
  Result<std::optional<Location>> find(const std::string& sha, uint64_t length) override {
    ++lookups;
    ASSIGN_OR_RETURN(auto loc, p_->lookupChunkAndHold(sha, int64_t(length)));
    if (!loc) return std::optional<Location>();
    held_.push_back(loc->data);
    ASSIGN_OR_RETURN(BlobRecord b, s_->getBlob(loc->data));
    return std::optional{Location{loc->data, uint64_t(b.size), loc->block}};
  }
  int lookups = 0;

 private:
  Platform* p_;
  Store* s_;
  std::vector<std::string> held_;
};

// A cluster (of no nodes) on `store`, for a platform in `dir`.
Result<std::unique_ptr<Cluster>> startTestCluster(const std::string& dir, Store* store) {
  ClusterOptions co;
  co.dataDir = dir;
  co.store = store;
  co.replicaId = "r-test";
  return Cluster::start(co);
}

// A platform on `store` and `cluster` with its blob store under `dir`,
// once it has loaded the chunk keys.
Result<std::unique_ptr<Platform>> startTestPlatform(const std::string& dir, Store* store,
                                                    Cluster* cluster, metrics::Registry* registry) {
  PlatformOptions po;
  po.dataDir = dir;
  po.token = "t";
  po.replicaId = "r-test";
  po.registry = registry;
  ASSIGN_OR_RETURN(auto p, Platform::start(po, store, cluster));
  for (int i = 0; i < 500 && metricValue(registry->render(), "dsec_chunk_keys_loaded") != 1; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return p;
}

class ChunkKeysPlatformTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = "/tmp/dsec-chunk-keys-platform-" + randomHex(4);
    ASSERT_TRUE(makeDirs(dir_).isOk());
    auto store = SqliteStore::open(dir_ + "/state.db");
    ASSERT_TRUE(store.isOk()) << store.status().toString();
    store_ = std::move(*store);
    auto c = startTestCluster(dir_, store_.get());
    ASSERT_TRUE(c.isOk()) << c.status().toString();
    cluster_ = std::move(*c);
    // A tar of many small files, each a chunk of its own.
    std::string tar;
    for (int i = 0; i < kFiles; ++i) {
      std::string body = "file " + std::to_string(i) + " " + randomHex(8) + "\n";
      image::appendTarHeader(tar, "f" + std::to_string(i), '0', 0644, 0, 0, body.size(), 1700000000,
                             "");
      tar += body;
      tar.append((512 - body.size() % 512) % 512, '\0');
    }
    tar.append(1024, '\0');
    ASSERT_TRUE(writeFileAtomic(dir_ + "/layer.tar", tar, 0600).isOk());
  }
  void TearDown() override {
    stopPlatform();
    cluster_.reset();
    store_.reset();
    (void)removeTree(dir_);
  }
  void startPlatform() {
    auto p = startTestPlatform(dir_, store_.get(), cluster_.get(), &registry_);
    ASSERT_TRUE(p.isOk()) << p.status().toString();
    platform_ = std::move(*p);
    ASSERT_EQ(metric("dsec_chunk_keys_loaded"), 1);
  }
  void stopPlatform() {
    if (platform_) platform_->shutdown();
    platform_.reset();
  }
  double metric(const std::string& sample) { return metricValue(registry_.render(), sample); }
  Result<image::ConvertedLayer> convert(const std::string& work, int* lookups) {
    PlatformSource src(platform_.get(), store_.get());
    image::TarLayerOptions o;
    o.shared = &src;
    auto c = image::convertTarFile(dir_ + "/layer.tar", std::nullopt, dir_ + "/" + work, o);
    *lookups = src.lookups;
    return c;
  }

  static constexpr int kFiles = 2000;
  std::string dir_;
  metrics::Registry registry_;
  std::unique_ptr<Store> store_;
  std::unique_ptr<Cluster> cluster_;
  std::unique_ptr<Platform> platform_;
};

TEST_F(ChunkKeysPlatformTest, AConversionOfNewFilesAsksTheStoreNothing) {
  ASSERT_NO_FATAL_FAILURE(startPlatform());
  int lookups = 0;
  auto c = convert("work1", &lookups);
  ASSERT_TRUE(c.isOk()) << c.status().toString();
  // Every file was looked up, and the set answered every lookup: not one
  // findChunk reached the store.
  EXPECT_EQ(lookups, kFiles);
  EXPECT_EQ(c->stored.size(), size_t(kFiles));
  EXPECT_EQ(metric("dsec_chunk_lookups_total{answer=\"absent\"}"), kFiles);
  EXPECT_EQ(metric("dsec_chunk_lookups_total{answer=\"store\"}"), 0);

  // The chunks recorded behind this platform's back (as another replica on
  // the store would): its set does not know them, so converting the same
  // files again stores them again, still with no query. A lost chance only.
  const std::string data = c->layer.dataDigest;
  ASSERT_TRUE(store_->putBlob(data, int64_t(c->layer.dataSize)).isOk());
  ASSERT_TRUE(store_->setBlobKind(data, "data").isOk());
  std::vector<ChunkLoc> rows;
  for (auto& s : c->stored) rows.push_back({s.sha, s.length, data, s.block});
  ASSERT_TRUE(store_->putChunks(data, rows).isOk());
  auto again = convert("work2", &lookups);
  ASSERT_TRUE(again.isOk()) << again.status().toString();
  EXPECT_TRUE(again->extraData.empty());
  EXPECT_EQ(again->stored.size(), size_t(kFiles));
  EXPECT_EQ(metric("dsec_chunk_lookups_total{answer=\"store\"}"), 0);

  // Started again, the platform loads them: each lookup goes to the store
  // and finds its chunk in the first layer's blob.
  stopPlatform();
  ASSERT_NO_FATAL_FAILURE(startPlatform());
  EXPECT_EQ(metric("dsec_chunk_keys"), kFiles);
  auto third = convert("work3", &lookups);
  ASSERT_TRUE(third.isOk()) << third.status().toString();
  EXPECT_EQ(lookups, kFiles);
  EXPECT_EQ(third->extraData, std::vector<std::string>{data});
  EXPECT_TRUE(third->stored.empty());
  EXPECT_EQ(metric("dsec_chunk_lookups_total{answer=\"absent\"}"), 0);
  EXPECT_EQ(metric("dsec_chunk_lookups_total{answer=\"store\"}"), kFiles);
}

// ---------------------------------------------------------------- chunk-granular gc

std::string slurpOrEmpty(const std::string& path) {
  auto r = readFile(path);
  return r.isOk() ? *r : std::string();
}

// A platform over either store, and a data blob D of 8 chunks in its blob
// store whose own layer is gone (no layer has it as its data), with a chunk
// row per chunk.
class GcPlatformTest : public ::testing::TestWithParam<StoreKind> {
 protected:
  static constexpr int64_t kChunk = 128 << 10, kChunks = 8;
  void SetUp() override {
    DSEC_MAKE_TEST_STORE_ENV(env_, GetParam());
    auto opened = env_->open();
    ASSERT_TRUE(opened.isOk()) << opened.status().toString();
    store_ = std::move(*opened);
    dir_ = env_->dir;
    auto c = startTestCluster(dir_, store_.get());
    ASSERT_TRUE(c.isOk()) << c.status().toString();
    cluster_ = std::move(*c);
    for (int i = 0; i < kChunks; ++i) bytes_ += std::string(size_t(kChunk), char('a' + i));
    bytes_[5] = 'x';
    d_ = "sha256:" + sha256Hex(bytes_);
    path_ = Platform::blobPath(dir_, d_);
    ASSERT_TRUE(makeDirs(dir_ + "/blobs/sha256").isOk());
    ASSERT_TRUE(writeFileAtomic(path_, bytes_, 0600).isOk());
    auto idx = image::ChunkIndex::build(path_, kChunk);
    ASSERT_TRUE(idx.isOk());
    std::string idxBytes = idx->serialize();
    ASSERT_TRUE(writeFileAtomic(path_ + ".chunks", idxBytes, 0600).isOk());
    ASSERT_TRUE(store_->putBlob(d_, int64_t(bytes_.size())).isOk());
    ASSERT_TRUE(store_->setBlobKind(d_, "data").isOk());
    ASSERT_TRUE(store_->setBlobChunks(d_, "sha256:" + sha256Hex(idxBytes)).isOk());
    std::vector<ChunkLoc> rows;
    for (int i = 0; i < kChunks; ++i) rows.push_back({shaOfChunk(i), kChunk, d_, uint32_t(i * 32)});
    ASSERT_TRUE(store_->putChunks(d_, rows).isOk());
    auto p = startTestPlatform(dir_, store_.get(), cluster_.get(), &registry_);
    ASSERT_TRUE(p.isOk()) << p.status().toString();
    platform_ = std::move(*p);
  }
  void TearDown() override {
    if (platform_) platform_->shutdown();
    platform_.reset();
    cluster_.reset();
    store_.reset();
    env_.reset();
  }
  std::string shaOfChunk(int i) const { return sha256Hex(bytes_.substr(size_t(i * kChunk), kChunk)); }
  // A layer with D as an extra blob, reading `reads` of it, in image `name`.
  void addLayer(const std::string& name, const std::string& reads) {
    std::string meta = "sha256:" + sha256Hex(name + "-meta"), own = "sha256:" + sha256Hex(name);
    for (auto& b : {meta, own}) ASSERT_TRUE(store_->putBlob(b, 4096).isOk());
    ASSERT_TRUE(store_->setBlobKind(own, "data").isOk());
    ASSERT_TRUE(store_->setBlobExtraData(meta, {d_}).isOk());
    ASSERT_TRUE(store_->setBlobExtraReads(meta, reads).isOk());
    ASSERT_TRUE(store_->setBlobData(meta, own).isOk());
    ASSERT_TRUE(store_->putImage(ImageRecord{name, "v1", {meta}, 8192, 1}).isOk());
  }

  // D's bytes (and a metadata image) made again, as a conversion leaves them
  // in its work directory.
  image::BuiltLayer builtAgain() {
    image::BuiltLayer l;
    l.path = dir_ + "/again.meta";
    l.dataPath = dir_ + "/again.data";
    l.digest = "sha256:" + sha256Hex("meta");
    l.dataDigest = d_;
    EXPECT_TRUE(writeFileAtomic(l.dataPath, bytes_, 0600).isOk());
    EXPECT_TRUE(writeFileAtomic(l.path, "meta", 0600).isOk());
    return l;
  }

  std::unique_ptr<TestStoreEnv> env_;
  std::string dir_, bytes_, d_, path_;
  metrics::Registry registry_;
  std::unique_ptr<Store> store_;
  std::unique_ptr<Cluster> cluster_;
  std::unique_ptr<Platform> platform_;
};
DSEC_INSTANTIATE_FOR_BOTH_STORES(GcPlatformTest);

// Layer B reads chunk 0 of D. A converter that found chunk 3 holds D, so the
// first collection punches nothing (its rows for unread chunks are gone,
// though); the converter's layer C reads chunk 3. Then chunks 1, 2 and 4-7
// go: holes, recorded as reclaimed, their rows gone; chunks 0 and 3 read as
// they were. D made whole again (moveLayerIntoStore) is recorded whole.
TEST_P(GcPlatformTest, PunchesTheChunksNoLayerReadsButNotWhileAConverterHoldsTheBlob) {
  ASSERT_NO_FATAL_FAILURE(addLayer("b", "0+32"));
  auto held = platform_->lookupChunkAndHold(shaOfChunk(3), kChunk);
  ASSERT_TRUE(held.isOk() && *held) << held.status().toString();
  EXPECT_EQ((*held)->data, d_);
  auto gc = platform_->collectGarbage(0);
  ASSERT_TRUE(gc.isOk()) << gc.status().toString();
  EXPECT_TRUE(gc->reclaimed.empty());
  EXPECT_EQ(slurpOrEmpty(path_), bytes_);
  EXPECT_EQ(store_->getBlob(d_)->reclaimed, "");
  EXPECT_FALSE(store_->findChunk(shaOfChunk(5), kChunk)->has_value());  // no new finds
  ASSERT_NO_FATAL_FAILURE(addLayer("c", "96+32"));
  platform_->releaseChunkHolds({d_});

  gc = platform_->collectGarbage(0);
  ASSERT_TRUE(gc.isOk()) << gc.status().toString();
  EXPECT_TRUE(gc->removed.empty());
  ASSERT_EQ(gc->reclaimed.size(), 1u);
  EXPECT_EQ(gc->reclaimed[0].first, d_);
  EXPECT_GE(gc->reclaimed[0].second, 6 * kChunk - 8192);
  auto rec = store_->getBlob(d_);
  ASSERT_TRUE(rec.isOk());
  EXPECT_EQ(rec->reclaimed, "32+64,128+128");
  EXPECT_EQ(rec->storedBytes(), 2 * kChunk);
  std::string now = slurpOrEmpty(path_);
  ASSERT_EQ(now.size(), bytes_.size());
  for (int i = 0; i < kChunks; ++i) {
    std::string chunk = now.substr(size_t(i * kChunk), kChunk);
    if (i == 0 || i == 3) {
      EXPECT_EQ(chunk, bytes_.substr(size_t(i * kChunk), kChunk)) << i;
    } else {
      EXPECT_EQ(chunk, std::string(size_t(kChunk), '\0')) << i;
    }
  }
  EXPECT_TRUE(store_->findChunk(shaOfChunk(0), kChunk)->has_value());
  for (int i : {1, 2, 4, 7}) EXPECT_FALSE(store_->findChunk(shaOfChunk(i), kChunk)->has_value()) << i;
  // Nothing more to take.
  gc = platform_->collectGarbage(0);
  ASSERT_TRUE(gc.isOk());
  EXPECT_TRUE(gc->reclaimed.empty());

  // The same bytes stored again by a conversion: whole, and recorded so.
  image::BuiltLayer l = builtAgain();
  ASSERT_FALSE(testing::Test::HasFailure());
  {
    auto hold = platform_->moveLayerIntoStore(l);
    ASSERT_TRUE(hold.isOk()) << hold.status().toString();
    EXPECT_EQ(slurpOrEmpty(path_), bytes_);
    EXPECT_EQ(store_->getBlob(d_)->reclaimed, "");
    // Held until the layer is recorded: no collection touches it meanwhile
    // (B and C alone would leave only chunks 0 and 3).
    gc = platform_->collectGarbage(0);
    ASSERT_TRUE(gc.isOk());
    EXPECT_TRUE(gc->reclaimed.empty());
    EXPECT_EQ(slurpOrEmpty(path_), bytes_);
  }
}

// Replicas on one store: another replica's converter holding D (its lease)
// keeps this collector's hands off; another replica's collector at work on
// D (its lease) makes a hold here wait until it is done. A store of one
// platform takes no leases.
TEST_P(GcPlatformTest, ReplicasOnOneStoreSeeEachOthersHoldsAndCollections) {
  ASSERT_NO_FATAL_FAILURE(addLayer("b", "0+32"));
  if (!store_->shared()) {
    // A store of one platform: no other replicas, no leases taken.
    auto gc = platform_->collectGarbage(0);
    ASSERT_TRUE(gc.isOk()) << gc.status().toString();
    EXPECT_EQ(gc->reclaimed.size(), 1u);
    auto leases = store_->listLeases();
    ASSERT_TRUE(leases.isOk());
    for (auto& x : *leases) {
      EXPECT_FALSE(startsWith(x.name, "blob-collect:") || startsWith(x.name, "chunk-hold:")) << x.name;
    }
    return;
  }
  auto lease = store_->acquireLease("chunk-hold:" + d_ + "/r-other", "r-other", 600);
  ASSERT_TRUE(lease.isOk() && *lease);
  auto gc = platform_->collectGarbage(0);
  ASSERT_TRUE(gc.isOk()) << gc.status().toString();
  EXPECT_TRUE(gc->reclaimed.empty());
  EXPECT_EQ(slurpOrEmpty(path_), bytes_);
  ASSERT_TRUE(store_->releaseLease("chunk-hold:" + d_ + "/r-other", "r-other").isOk());

  // The chunk rows gone, a hold comes from moving a conversion's blob in.
  lease = store_->acquireLease("blob-collect:" + d_, "r-other", 600);
  ASSERT_TRUE(lease.isOk() && *lease);
  image::BuiltLayer l = builtAgain();
  ASSERT_FALSE(testing::Test::HasFailure());
  std::atomic<bool> moved{false};
  std::thread t([&] {
    auto hold = platform_->moveLayerIntoStore(l);
    EXPECT_TRUE(hold.isOk()) << hold.status().toString();
    moved = true;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  EXPECT_FALSE(moved.load());  // waits for the other collector
  // Not under gcMu_ while it waits: a collection here goes ahead (and leaves
  // D to the other replica's collector). Were it under gcMu_, this would
  // wait for a lease released only below.
  auto during = platform_->collectGarbage(0);
  ASSERT_TRUE(during.isOk()) << during.status().toString();
  EXPECT_TRUE(during->reclaimed.empty());
  EXPECT_FALSE(moved.load());
  ASSERT_TRUE(store_->releaseLease("blob-collect:" + d_, "r-other").isOk());
  t.join();
  EXPECT_TRUE(moved.load());
  EXPECT_EQ(slurpOrEmpty(path_), bytes_);

  // Its own collector takes the lease while it works, and gives it up.
  gc = platform_->collectGarbage(0);
  ASSERT_TRUE(gc.isOk()) << gc.status().toString();
  EXPECT_EQ(gc->reclaimed.size(), 1u);
  auto leases = store_->listLeases();
  ASSERT_TRUE(leases.isOk());
  for (auto& x : *leases) EXPECT_FALSE(x.live && startsWith(x.name, "blob-collect:")) << x.name;
}

// An image about to be stored holds its layers (holdLayers): a collection
// (of this replica or, on a shared store, another) keeps them meanwhile.
TEST_P(GcPlatformTest, LayersAnImageIsAboutToNameAreKept) {
  const std::string l = "sha256:" + sha256Hex("lonely layer");
  ASSERT_TRUE(store_->putBlob(l, 4096).isOk());
  {
    auto holds = platform_->holdLayers({l, l});
    ASSERT_TRUE(holds.isOk()) << holds.status().toString();
    EXPECT_EQ(holds->size(), 1u);
    auto gc = platform_->collectGarbage(0);
    ASSERT_TRUE(gc.isOk()) << gc.status().toString();
    EXPECT_EQ(std::count(gc->removed.begin(), gc->removed.end(), l), 0);
    EXPECT_TRUE(store_->getBlob(l).isOk());
  }
  auto gc = platform_->collectGarbage(0);
  ASSERT_TRUE(gc.isOk()) << gc.status().toString();
  EXPECT_EQ(std::count(gc->removed.begin(), gc->removed.end(), l), 1);
}

}  // namespace
}  // namespace dsec::platform
