#include "edge/image/fuse_loader.h"

#include <gtest/gtest.h>

#include "edge/image/loader_control.h"

namespace dsec::edge {
namespace {

constexpr int64_t kMiB = 1 << 20;

TEST(ChunkSpanTest, ReadWithinOneChunk) {
  ChunkSpan s = chunkSpan(kMiB, 10 * kMiB, 4096, 4096);
  EXPECT_EQ(s.first, 0);
  EXPECT_EQ(s.last, 0);
  EXPECT_FALSE(s.empty());
}

TEST(ChunkSpanTest, ReadAcrossAChunkBoundary) {
  ChunkSpan s = chunkSpan(kMiB, 10 * kMiB, kMiB - 1, 2);
  EXPECT_EQ(s.first, 0);
  EXPECT_EQ(s.last, 1);
}

TEST(ChunkSpanTest, ReadEndingExactlyAtABoundaryStaysInItsChunk) {
  ChunkSpan s = chunkSpan(kMiB, 10 * kMiB, kMiB, kMiB);
  EXPECT_EQ(s.first, 1);
  EXPECT_EQ(s.last, 1);
}

TEST(ChunkSpanTest, ReadPastTheEndIsClampedToTheShortLastChunk) {
  // 2.5 MiB blob: chunks 0, 1 and a half chunk 2.
  ChunkSpan s = chunkSpan(kMiB, 2 * kMiB + kMiB / 2, 2 * kMiB + 10, 4 * kMiB);
  EXPECT_EQ(s.first, 2);
  EXPECT_EQ(s.last, 2);
}

TEST(ChunkSpanTest, EmptyReads) {
  EXPECT_TRUE(chunkSpan(kMiB, 3 * kMiB, 3 * kMiB, 4096).empty());  // at the end
  EXPECT_TRUE(chunkSpan(kMiB, 3 * kMiB, 5 * kMiB, 4096).empty());  // past it
  EXPECT_TRUE(chunkSpan(kMiB, 3 * kMiB, 0, 0).empty());            // zero bytes
  EXPECT_TRUE(chunkSpan(kMiB, 3 * kMiB, -1, 10).empty());          // negative offset
  EXPECT_TRUE(chunkSpan(0, 3 * kMiB, 0, 10).empty());              // no chunk size
  EXPECT_TRUE(chunkSpan(kMiB, 0, 0, 10).empty());                  // empty blob
}

TEST(ChunkSpanTest, WholeBlob) {
  ChunkSpan s = chunkSpan(kMiB, 6 * kMiB, 0, 6 * kMiB);
  EXPECT_EQ(s.first, 0);
  EXPECT_EQ(s.last, 5);
}

const char* kMountinfo =
    "22 1 0:21 / /proc rw,nosuid - proc proc rw\n"
    "95 30 0:52 / /data/edge/cache/fuse rw,nosuid,nodev - fuse.dsec dsec-loader "
    "ro,user_id=0,group_id=0,default_permissions,allow_other\n"
    "96 30 0:53 / /data/edge/cache/fuse2 rw - fuse.dsec dsec-loader ro\n"
    "97 95 0:54 / /data/edge/cache/fuse rw,nosuid,nodev - fuse.dsec dsec-loader ro\n"
    "98 30 8:1 / /data/edge/cache/other rw - ext4 /dev/sda1 rw\n";

TEST(FuseConnectionOfTest, TopmostFuseMountAtThePoint) {
  EXPECT_EQ(fuseConnectionOf(kMountinfo, "/data/edge/cache/fuse"), "54");
  EXPECT_EQ(fuseConnectionOf(kMountinfo, "/data/edge/cache/fuse2"), "53");
}

TEST(FuseConnectionOfTest, NoneForOtherFileSystemsOrPaths) {
  EXPECT_EQ(fuseConnectionOf(kMountinfo, "/data/edge/cache/other"), "");
  EXPECT_EQ(fuseConnectionOf(kMountinfo, "/data/edge/cache"), "");
  EXPECT_EQ(fuseConnectionOf("", "/x"), "");
}

}  // namespace
}  // namespace dsec::edge
