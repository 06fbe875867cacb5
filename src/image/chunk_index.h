// The chunk index of a layer's data blob: the sha256 of every fixed-size chunk,
// so a node that reads the blob piecemeal (range reads, on-demand loaders) can
// verify each chunk on its own. The index is itself content-addressed: it lies
// in the blob store as sha256/<hex of the index>, and the platform records that
// digest with the data blob, so a node trusts nothing it fetched unverified.
//
// Serialized form (binary): the line "dsec-chunks 1 <chunk size> <data size>\n"
// followed by 32 raw digest bytes per chunk.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "common/status.h"

namespace dsec::image {

struct ChunkIndex {
  int64_t chunkSize = 0;
  int64_t dataSize = 0;
  std::vector<std::array<uint8_t, 32>> digests;

  int64_t chunkCount() const { return int64_t(digests.size()); }
  // Bytes in chunk i (the last one may be short).
  int64_t chunkLength(int64_t i) const;
  // The 4 KiB blocks (kFsBlockSize) chunk i spans: first, count.
  std::pair<uint64_t, uint64_t> blocksOf(int64_t i) const;
  // True when `bytes` is exactly chunk i.
  bool verify(int64_t i, std::string_view bytes) const;

  std::string serialize() const;
  // kDataLoss for anything malformed (wrong header, count not matching sizes).
  static Result<ChunkIndex> parse(std::string_view bytes);
  // Reads the file at `path` and hashes it chunk by chunk.
  static Result<ChunkIndex> build(const std::string& path, int64_t chunkSize);
};

}  // namespace dsec::image
