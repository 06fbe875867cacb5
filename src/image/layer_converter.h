// A layer tar (gzip, zstd or plain) made a dsec layer as it streams: the tar
// side (tar_stream.h) builds the tree and writes the data blob, the EROFS
// writer (erofs_writer.h) writes the metadata image. No file of the layer is
// ever extracted, so conversion needs no root, no chown or mknod, and cannot
// be steered outside its work directory by a hostile archive.
//
// Memory: bounded by the tree (about 230 bytes per entry plus names, xattrs
// and 4 bytes per 128 KiB of file data) plus fixed buffers of ~2.5 MiB and the
// decompressor's state (85 KiB of ISA-L inflate state for gzip, at most 128 MiB
// for zstd). Disk:
// the data blob and the metadata image, nothing else.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "common/status.h"
#include "image/block_ranges.h"
#include "image/layer_builder.h"
#include "image/registry_client.h"
#include "image/tar_stream.h"

namespace dsec::image {

struct ConvertedLayer {
  BuiltLayer layer;        // layer.erofs and layer.data in the work directory
  std::string chunkIndex;  // the data blob's ChunkIndex, serialized
  // Other layers' data blobs its chunks point into (TarLayerOptions::shared),
  // in device order: the layer must be recorded with them (LayerDesc::extraData).
  std::vector<std::string> extraData;
  // For each of extraData, the blocks of it the final tree's files read
  // (garbage collection keeps those chunks of a blob whose own layer is gone).
  std::vector<BlockRanges> extraReads;
  std::vector<StoredChunk> stored;  // chunks stored in layer.data (TarLayer::stored)
  // The source extraData came from, kept as long as this (it holds those
  // blobs from garbage collection until the layer is recorded).
  std::shared_ptr<ChunkSource> sharedFrom;
  std::string sourceDigest;  // sha256 of the bytes read (the registry blob)
  std::string diffId;        // sha256 of the uncompressed tar
  LayerCompression compression = LayerCompression::kNone;
  int64_t compressedSize = 0;
  int64_t uncompressedSize = 0;
  TarLayerStats stats;
};

// For each of tree.extraBlobs, the 4 KiB blocks of it that the tree's files
// read (their chunks deduplicated into that blob).
std::vector<BlockRanges> extraReadsOf(const FsTree& tree);

// Converts the tar read from `in` (compressed as `c`, or detected) into
// `workDir` (created). Errors: readTarLayer's and writeErofs's; on error
// nothing is left in workDir of this call's files.
Result<ConvertedLayer> convertTarLayer(ByteSource& in, std::optional<LayerCompression> c,
                                       const std::string& workDir,
                                       const TarLayerOptions& opts = {});

// The same for a file (a downloaded registry blob, a layer of an OCI layout).
Result<ConvertedLayer> convertTarFile(const std::string& path, std::optional<LayerCompression> c,
                                      const std::string& workDir,
                                      const TarLayerOptions& opts = {});

}  // namespace dsec::image
