#include "image/chunk_index.h"

#include <fcntl.h>
#include <openssl/sha.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>

#include "common/fd.h"
#include "image/fs_tree.h"

namespace dsec::image {

namespace {
constexpr std::string_view kMagic = "dsec-chunks 1 ";

std::array<uint8_t, 32> digestOf(std::string_view bytes) {
  std::array<uint8_t, 32> d;
  SHA256(reinterpret_cast<const unsigned char*>(bytes.data()), bytes.size(), d.data());
  return d;
}
}  // namespace

int64_t ChunkIndex::chunkLength(int64_t i) const {
  if (i < 0 || i >= chunkCount()) return 0;
  return std::min(chunkSize, dataSize - i * chunkSize);
}

std::pair<uint64_t, uint64_t> ChunkIndex::blocksOf(int64_t i) const {
  const uint64_t off = uint64_t(i * chunkSize), end = off + uint64_t(chunkLength(i));
  const uint64_t first = off / kFsBlockSize;
  return {first, (end + kFsBlockSize - 1) / kFsBlockSize - first};
}

bool ChunkIndex::verify(int64_t i, std::string_view bytes) const {
  if (i < 0 || i >= chunkCount() || int64_t(bytes.size()) != chunkLength(i)) return false;
  return digestOf(bytes) == digests[size_t(i)];
}

std::string ChunkIndex::serialize() const {
  std::string out(kMagic);
  out += std::to_string(chunkSize) + " " + std::to_string(dataSize) + "\n";
  for (auto& d : digests) out.append(reinterpret_cast<const char*>(d.data()), d.size());
  return out;
}

Result<ChunkIndex> ChunkIndex::parse(std::string_view bytes) {
  auto bad = [](const std::string& why) { return Status(Code::kDataLoss, "chunk index: " + why); };
  if (bytes.substr(0, kMagic.size()) != kMagic) return bad("bad header");
  size_t nl = bytes.find('\n');
  if (nl == std::string_view::npos || nl > 64) return bad("bad header");
  std::string head(bytes.substr(kMagic.size(), nl - kMagic.size()));
  long long cs = 0, ds = -1;
  char extra = 0;
  if (sscanf(head.c_str(), "%lld %lld%c", &cs, &ds, &extra) != 2 || cs <= 0 || ds < 0) {
    return bad("bad sizes");
  }
  ChunkIndex idx;
  idx.chunkSize = cs;
  idx.dataSize = ds;
  std::string_view body = bytes.substr(nl + 1);
  int64_t n = (ds + cs - 1) / cs;
  if (int64_t(body.size()) != n * 32) return bad("digest count does not match the data size");
  idx.digests.resize(size_t(n));
  for (int64_t i = 0; i < n; ++i) memcpy(idx.digests[size_t(i)].data(), body.data() + i * 32, 32);
  return idx;
}

Result<ChunkIndex> ChunkIndex::build(const std::string& path, int64_t chunkSize) {
  if (chunkSize <= 0) return invalidArg("chunk_size", "must be positive");
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd) return sysError("open " + path);
  struct stat st;
  if (::fstat(fd.get(), &st) != 0) return sysError("stat " + path);
  ChunkIndex idx;
  idx.chunkSize = chunkSize;
  idx.dataSize = st.st_size;
  std::string buf(size_t(chunkSize), '\0');
  for (int64_t off = 0; off < idx.dataSize; off += chunkSize) {
    size_t want = size_t(std::min<int64_t>(chunkSize, idx.dataSize - off));
    size_t got = 0;
    while (got < want) {
      ssize_t r = ::pread(fd.get(), buf.data() + got, want - got, off + int64_t(got));
      if (r < 0 && errno == EINTR) continue;
      if (r < 0) return sysError("read " + path);
      if (r == 0) return Status(Code::kDataLoss, path + " shrank while indexed");
      got += size_t(r);
    }
    idx.digests.push_back(digestOf(std::string_view(buf.data(), want)));
  }
  return idx;
}

}  // namespace dsec::image
