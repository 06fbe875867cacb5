#include "image/blob_store.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <thread>

#include "common/http_server.h"
#include "common/sha256.h"
#include "common/util.h"
#include "image/chunk_index.h"

namespace dsec::image {
namespace {

std::string pattern(size_t n) {
  std::string s(n, '\0');
  for (size_t i = 0; i < n; ++i) s[i] = char((i * 7 + i / 251) & 0xff);
  return s;
}

TEST(ChunkIndexTest, BuildsParsesAndVerifies) {
  std::string dir = "/tmp/dsec-chunks-test-" + randomHex(4);
  ASSERT_TRUE(makeDirs(dir).isOk());
  std::string data = pattern(2500);
  ASSERT_TRUE(writeFileAtomic(dir + "/blob", data).isOk());
  auto idx = ChunkIndex::build(dir + "/blob", 1000);
  ASSERT_TRUE(idx.isOk()) << idx.status().toString();
  EXPECT_EQ(idx->chunkCount(), 3);
  EXPECT_EQ(idx->chunkLength(2), 500);
  EXPECT_TRUE(idx->verify(0, std::string_view(data).substr(0, 1000)));
  EXPECT_TRUE(idx->verify(2, std::string_view(data).substr(2000)));
  EXPECT_FALSE(idx->verify(1, std::string_view(data).substr(0, 1000)));  // wrong chunk
  EXPECT_FALSE(idx->verify(2, std::string_view(data).substr(2000, 499)));  // short
  std::string flipped = data.substr(1000, 1000);
  flipped[17] ^= 1;
  EXPECT_FALSE(idx->verify(1, flipped));

  auto back = ChunkIndex::parse(idx->serialize());
  ASSERT_TRUE(back.isOk()) << back.status().toString();
  EXPECT_EQ(back->digests, idx->digests);
  EXPECT_EQ(back->dataSize, 2500);
  EXPECT_EQ(ChunkIndex::parse("junk").status().code(), Code::kDataLoss);
  std::string cut = idx->serialize();
  cut.pop_back();
  EXPECT_EQ(ChunkIndex::parse(cut).status().code(), Code::kDataLoss);

  auto empty = ChunkIndex::build("/dev/null", 1000);
  ASSERT_TRUE(empty.isOk());
  EXPECT_EQ(empty->chunkCount(), 0);
  ASSERT_TRUE(removeTree(dir).isOk());
}

TEST(BlobStoreTest, RejectsBadUris) {
  for (const char* u : {"", "ftp://x/y", "file://relative", "file:///nonexistent-dir-xyz", "http://"}) {
    auto s = BlobStore::open(u);
    EXPECT_EQ(s.status().code(), Code::kInvalidArgument) << u;
    EXPECT_EQ(s.status().field(), "blob_store") << u;
  }
}

TEST(BlobStoreTest, FileStoreReadsRangesAndVerifies) {
  std::string dir = "/tmp/dsec-store-test-" + randomHex(4);
  ASSERT_TRUE(makeDirs(dir + "/sha256").isOk());
  std::string data = pattern(100000);
  std::string hex = sha256Hex(data);
  ASSERT_TRUE(writeFileAtomic(dir + "/sha256/" + hex, data).isOk());
  auto s = BlobStore::open("file://" + dir + "/");
  ASSERT_TRUE(s.isOk()) << s.status().toString();
  EXPECT_EQ((*s)->localPath(blobName("sha256:" + hex)), dir + "/sha256/" + hex);
  EXPECT_EQ(*(*s)->size(blobName(hex)), 100000);
  std::string buf(300, '\0');
  ASSERT_TRUE((*s)->readAt(blobName(hex), 5000, 300, buf.data()).isOk());
  EXPECT_EQ(buf, data.substr(5000, 300));
  EXPECT_EQ((*s)->readAt(blobName(hex), 99900, 300, buf.data()).code(), Code::kInvalidArgument);
  EXPECT_EQ((*s)->readAt("sha256/nope", 0, 1, buf.data()).code(), Code::kNotFound);
  ASSERT_TRUE((*s)->fetchVerified(blobName(hex), hex, dir + "/copy").isOk());
  EXPECT_EQ(*readFile(dir + "/copy"), data);
  EXPECT_EQ((*s)->fetchVerified(blobName(hex), sha256Hex("other"), dir + "/bad").code(),
            Code::kDataLoss);
  EXPECT_NE(access((dir + "/bad").c_str(), F_OK), 0);
  ASSERT_TRUE(removeTree(dir).isOk());
}

// A web server serving one object with Range support, failing the first
// `failFirst` requests with 503, optionally ignoring Range or corrupting bytes.
class RangeServer {
 public:
  RangeServer(std::string data, int failFirst, bool ignoreRange = false, bool corrupt = false)
      : data_(std::move(data)), fail_(failFirst), server_(http::ServerOptions{.port = 0}) {
    EXPECT_TRUE(server_.listen().isOk());
    thread_ = std::thread([this, ignoreRange, corrupt] {
      server_.serve([this, ignoreRange, corrupt](http::Request& req, http::Response& res) {
        ++requests;
        if (fail_-- > 0) {
          (void)res.send(503, "text/plain", "busy");
          return;
        }
        if (req.path != "/blobs/sha256/obj") {
          (void)res.send(404, "text/plain", "no");
          return;
        }
        std::string body = data_;
        if (corrupt) body[body.size() / 2] ^= 1;
        std::string range = req.header("range");
        if (range.empty() || ignoreRange) {
          (void)res.send(200, "application/octet-stream", req.method == "HEAD" ? "" : body);
          return;
        }
        long long a = 0, b = 0;
        sscanf(range.c_str(), "bytes=%lld-%lld", &a, &b);
        if (a >= (long long)body.size()) {
          (void)res.send(416, "text/plain", "");
          return;
        }
        b = std::min<long long>(b, body.size() - 1);
        res.setHeader("Content-Range", "bytes " + std::to_string(a) + "-" + std::to_string(b) +
                                           "/" + std::to_string(body.size()));
        (void)res.send(206, "application/octet-stream", body.substr(a, b - a + 1));
      });
    });
  }
  ~RangeServer() {
    server_.stop();
    thread_.join();
  }
  std::string uri() { return "http://127.0.0.1:" + std::to_string(server_.port()) + "/blobs/"; }
  std::atomic<int> requests{0};

 private:
  std::string data_;
  std::atomic<int> fail_;
  http::Server server_;
  std::thread thread_;
};

BlobStoreOptions fast() { return BlobStoreOptions{.attempts = 4, .backoffS = 0.001}; }

TEST(BlobStoreTest, HttpStoreRetriesAndReadsRanges) {
  std::string data = pattern(300000);
  RangeServer srv(data, 2);
  auto s = BlobStore::open(srv.uri(), fast());
  ASSERT_TRUE(s.isOk());
  std::string buf(4096, '\0');
  ASSERT_TRUE((*s)->readAt("sha256/obj", 123456, 4096, buf.data()).isOk());
  EXPECT_EQ(buf, data.substr(123456, 4096));
  EXPECT_EQ(srv.requests.load(), 3);  // two 503s, then the read
  EXPECT_EQ(*(*s)->size("sha256/obj"), 300000);
  EXPECT_EQ((*s)->readAt("sha256/missing", 0, 10, buf.data()).code(), Code::kNotFound);
  EXPECT_EQ((*s)->readAt("sha256/obj", 400000, 10, buf.data()).code(), Code::kInvalidArgument);
  std::string dir = "/tmp/dsec-http-store-" + randomHex(4);
  ASSERT_TRUE(makeDirs(dir).isOk());
  ASSERT_TRUE((*s)->fetchVerified("sha256/obj", sha256Hex(data), dir + "/obj").isOk());
  EXPECT_EQ(*readFile(dir + "/obj"), data);
  ASSERT_TRUE(removeTree(dir).isOk());
}

TEST(BlobStoreTest, HttpStoreGivesUpAfterRetries) {
  RangeServer srv(pattern(1000), 100);
  auto s = BlobStore::open(srv.uri(), fast());
  std::string buf(10, '\0');
  Status st = (*s)->readAt("sha256/obj", 0, 10, buf.data());
  EXPECT_EQ(st.code(), Code::kUnavailable) << st.toString();
  EXPECT_EQ(srv.requests.load(), 4);
}

TEST(BlobStoreTest, HttpStoreRefusesServersIgnoringRangeAndCorruptBlobs) {
  std::string data = pattern(5000);
  {
    RangeServer srv(data, 0, /*ignoreRange=*/true);
    auto s = BlobStore::open(srv.uri(), fast());
    std::string buf(10, '\0');
    EXPECT_EQ((*s)->readAt("sha256/obj", 100, 10, buf.data()).code(), Code::kFailedPrecondition);
  }
  {
    RangeServer srv(data, 0, false, /*corrupt=*/true);
    auto s = BlobStore::open(srv.uri(), fast());
    std::string dir = "/tmp/dsec-http-store-" + randomHex(4);
    ASSERT_TRUE(makeDirs(dir).isOk());
    EXPECT_EQ((*s)->fetchVerified("sha256/obj", sha256Hex(data), dir + "/obj").code(),
              Code::kDataLoss);
    EXPECT_NE(access((dir + "/obj").c_str(), F_OK), 0);
    ASSERT_TRUE(removeTree(dir).isOk());
  }
}

TEST(BlobStoreTest, HttpStoreUnreachableIsUnavailable) {
  auto s = BlobStore::open("http://127.0.0.1:1/", fast());
  std::string buf(10, '\0');
  EXPECT_EQ((*s)->readAt("sha256/obj", 0, 10, buf.data()).code(), Code::kUnavailable);
}

}  // namespace
}  // namespace dsec::image
