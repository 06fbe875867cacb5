#include "image/layer_converter.h"

#include <unistd.h>

#include <algorithm>

#include "common/sha256.h"
#include "common/util.h"
#include "image/erofs_writer.h"

namespace dsec::image {

std::vector<BlockRanges> extraReadsOf(const FsTree& tree) {
  std::vector<BlockRanges> reads(tree.extraBlobs.size());
  for (const FsInode& n : tree.inodes) {
    for (size_t j = 0; j < n.chunkDevices.size() && j < n.chunks.size(); ++j) {
      uint8_t dev = n.chunkDevices[j];
      if (dev == 0 || dev > reads.size() || n.chunks[j] == kHoleChunk) continue;
      uint64_t length = std::min<uint64_t>(kChunkSize, n.size - j * uint64_t(kChunkSize));
      reads[dev - 1].add(n.chunks[j], (length + kFsBlockSize - 1) / kFsBlockSize);
    }
  }
  return reads;
}

Result<ConvertedLayer> convertTarLayer(ByteSource& in, std::optional<LayerCompression> c,
                                       const std::string& workDir, const TarLayerOptions& opts) {
  RETURN_IF_ERROR(makeDirs(workDir, 0700));
  ConvertedLayer out;
  BuiltLayer& l = out.layer;
  l.path = workDir + "/layer.erofs";
  l.dataPath = workDir + "/layer.data";
  ASSIGN_OR_RETURN(TarLayer tar, readTarLayer(in, c, l.dataPath, opts));
  // The data blob's digest in the image: the layer's digest names its bytes
  // too (setErofsDeviceTag).
  ErofsWriterOptions wopts;
  wopts.deviceTag = tar.dataDigest.substr(tar.dataDigest.find(':') + 1);
  auto info = writeErofs(tar.tree, l.path, wopts);
  if (!info.isOk()) {
    ::unlink(l.dataPath.c_str());
    return std::move(info).takeStatus();
  }
  ASSIGN_OR_RETURN(std::string metaHex, sha256File(l.path));
  l.digest = "sha256:" + metaHex;
  l.size = int64_t(info->size);
  l.dataDigest = tar.dataDigest;
  l.dataSize = int64_t(tar.tree.dataSize);
  l.owners = std::move(tar.owners);
  out.chunkIndex = tar.chunks.serialize();
  for (auto& x : tar.tree.extraBlobs) out.extraData.push_back(x.digest);
  out.extraReads = extraReadsOf(tar.tree);
  out.stored = std::move(tar.stored);
  out.sourceDigest = tar.digest;
  out.diffId = tar.diffId;
  out.compression = tar.compression;
  out.compressedSize = tar.compressedSize;
  out.uncompressedSize = tar.uncompressedSize;
  out.stats = tar.stats;
  return out;
}

Result<ConvertedLayer> convertTarFile(const std::string& path, std::optional<LayerCompression> c,
                                      const std::string& workDir, const TarLayerOptions& opts) {
  ASSIGN_OR_RETURN(auto src, openFileSource(path));
  return convertTarLayer(*src, c, workDir, opts);
}

}  // namespace dsec::image
