#include "edge/image/fanotify_filler.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include "common/sha256.h"
#include "common/util.h"

namespace dsec::edge {
namespace {

class FanotifyFillerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = "/var/tmp/dsec-filler-test-" + randomHex(4);
    ASSERT_TRUE(makeDirs(dir_ + "/store/sha256").isOk());
    if (Status p = FanotifyFiller::probe(dir_); !p.isOk()) {
      GTEST_SKIP() << "fanotify pre-content events unavailable: " << p.toString();
    }
    data_.resize(3 * kChunk + 1234);
    for (size_t i = 0; i < data_.size(); ++i) data_[i] = char((i * 131 + i / 4096) & 0xff);
    hex_ = sha256Hex(data_);
    ASSERT_TRUE(writeFileAtomic(dir_ + "/store/sha256/" + hex_, data_).isOk());
    auto idx = image::ChunkIndex::build(dir_ + "/store/sha256/" + hex_, kChunk);
    ASSERT_TRUE(idx.isOk());
    index_ = std::make_shared<const image::ChunkIndex>(*idx);
    auto st = image::BlobStore::open("file://" + dir_ + "/store",
                                     image::BlobStoreOptions{.attempts = 1});
    ASSERT_TRUE(st.isOk());
    store_ = std::move(*st);
    sparse_ = dir_ + "/copy.data";
    UniqueFd fd(::open(sparse_.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600));
    ASSERT_EQ(::ftruncate(fd.get(), int64_t(data_.size())), 0);
  }
  void TearDown() override { (void)removeTree(dir_); }

  // Reads [off, off+n) of the sparse copy through a plain fd, as EROFS would.
  Result<std::string> readCopy(int64_t off, size_t n) {
    UniqueFd fd(::open(sparse_.c_str(), O_RDONLY | O_CLOEXEC));
    std::string out(n, '\0');
    ssize_t r = ::pread(fd.get(), out.data(), n, off);
    if (r < 0) return sysError("pread");
    out.resize(size_t(r));
    return out;
  }

  static constexpr int64_t kChunk = 64 * 1024;
  std::string dir_, hex_, sparse_, data_;
  std::shared_ptr<const image::ChunkIndex> index_;
  std::unique_ptr<image::BlobStore> store_;
};

TEST_F(FanotifyFillerTest, FillsOnlyTheChunksReadAndCountsHits) {
  auto f = FanotifyFiller::start(store_.get(), 2);
  ASSERT_TRUE(f.isOk()) << f.status().toString();
  ASSERT_TRUE((*f)->add(sparse_, "sha256:" + hex_, index_).isOk());
  auto got = readCopy(kChunk + 100, 5000);
  ASSERT_TRUE(got.isOk()) << got.status().toString();
  EXPECT_EQ(*got, data_.substr(kChunk + 100, 5000));
  LayerStats s = (*f)->stats(sparse_);
  EXPECT_EQ(s.chunks, 4);
  EXPECT_EQ(s.chunksFetched, 1);
  EXPECT_EQ(s.bytesFetched, kChunk);
  EXPECT_EQ(s.chunksCached, 1);
  got = readCopy(kChunk + 9000, 100);  // same chunk: a hit
  EXPECT_EQ(*got, data_.substr(kChunk + 9000, 100));
  EXPECT_EQ((*f)->stats(sparse_).cacheHits, 1);
  got = readCopy(0, data_.size());  // everything, the short tail chunk included
  EXPECT_EQ(*got, data_);
  s = (*f)->stats(sparse_);
  EXPECT_EQ(s.chunksCached, 4);
  EXPECT_EQ(s.bytesRead, int64_t(data_.size()));
  EXPECT_EQ((*f)->readOrder(sparse_), (std::vector<int64_t>{1, 0, 2, 3}));
}

TEST_F(FanotifyFillerTest, CorruptStoreFailsTheReadWithEio) {
  std::string bad = data_;
  bad[2 * kChunk + 7] ^= 1;
  ASSERT_TRUE(writeFileAtomic(dir_ + "/store/sha256/" + hex_, bad).isOk());
  auto f = FanotifyFiller::start(store_.get(), 1);
  ASSERT_TRUE(f.isOk());
  ASSERT_TRUE((*f)->add(sparse_, "sha256:" + hex_, index_).isOk());
  auto got = readCopy(2 * kChunk, 10);
  ASSERT_FALSE(got.isOk());
  EXPECT_EQ(got.status().sysErrno(), EIO) << got.status().toString();
  EXPECT_EQ(*readCopy(0, 10), data_.substr(0, 10));  // other chunks are fine
  EXPECT_EQ((*f)->stats(sparse_).chunksCached, 1);
}

TEST_F(FanotifyFillerTest, ACopyFilledEarlierIsServedWithoutFetching) {
  {
    auto f = FanotifyFiller::start(store_.get(), 1);
    ASSERT_TRUE((*f)->add(sparse_, "sha256:" + hex_, index_).isOk());
    ASSERT_TRUE(readCopy(0, 10).isOk());
  }
  // A new filler (an edge restart) finds chunk 0 on disk.
  auto f = FanotifyFiller::start(store_.get(), 1);
  ASSERT_TRUE((*f)->add(sparse_, "sha256:" + hex_, index_).isOk());
  EXPECT_EQ((*f)->stats(sparse_).chunksCached, 1);
  EXPECT_EQ(*readCopy(5, 10), data_.substr(5, 10));
  EXPECT_EQ((*f)->stats(sparse_).chunksFetched, 0);
}

TEST_F(FanotifyFillerTest, RejectsACopyOfTheWrongSize) {
  ASSERT_EQ(::truncate(sparse_.c_str(), 100), 0);
  auto f = FanotifyFiller::start(store_.get(), 1);
  EXPECT_EQ((*f)->add(sparse_, "sha256:" + hex_, index_).code(), Code::kFailedPrecondition);
}

}  // namespace
}  // namespace dsec::edge
