#include "image/tar_stream.h"

#include <archive.h>
#include <archive_entry.h>
#include <fcntl.h>
#include <isa-l/igzip_lib.h>
#include <locale.h>
#include <openssl/evp.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>
#include <zstd.h>
#include <zstd_errors.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <deque>
#include <limits>
#include <map>
#include <new>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "common/sha256.h"
#include "image/libarchive_input.h"

namespace dsec::image {

namespace {

using Digest = std::array<uint8_t, 32>;

constexpr size_t kCompressedBufBytes = 256 << 10;
constexpr size_t kTarBufBytes = 1 << 20;
constexpr size_t kWriteBufBytes = 1 << 20;
constexpr size_t kMaxNameComponent = 255;  // EROFS_NAME_LEN, NAME_MAX
constexpr std::string_view kWhiteoutPrefix = ".wh.";
constexpr std::string_view kOpaqueMarker = ".wh..wh..opq";
constexpr uint32_t kNoInode = std::numeric_limits<uint32_t>::max();

// Whether an xattr name is one EROFS can store (and Linux can set): a known
// namespace prefix and a non-empty rest.
bool erofsCanHold(std::string_view n) {
  for (std::string_view p : {"user.", "trusted.", "security."}) {
    if (n.size() > p.size() && n.substr(0, p.size()) == p) return true;
  }
  return n == "system.posix_acl_access" || n == "system.posix_acl_default";
}

// kChunkSize zeros: padding, and the all-zero test by memcmp.
const char kZeros[kChunkSize] = {};

Status dataLoss(std::string msg) { return Status(Code::kDataLoss, std::move(msg)); }
Status exhausted(std::string msg) { return Status(Code::kResourceExhausted, std::move(msg)); }
Status badLayer(std::string msg) { return invalidArg("layer", std::move(msg)); }

std::string hexOf(const Digest& d) {
  static const char* kHex = "0123456789abcdef";
  std::string out;
  out.reserve(64);
  for (uint8_t b : d) {
    out.push_back(kHex[b >> 4]);
    out.push_back(kHex[b & 15]);
  }
  return out;
}

// SHA-256 with raw output and a reusable context (common/sha256.h gives hex
// and is single-use).
class RawSha256 {
 public:
  RawSha256() : ctx_(EVP_MD_CTX_new()) { reset(); }
  ~RawSha256() { EVP_MD_CTX_free(ctx_); }
  RawSha256(const RawSha256&) = delete;
  RawSha256& operator=(const RawSha256&) = delete;
  void reset() { EVP_DigestInit_ex(ctx_, EVP_sha256(), nullptr); }
  void update(const void* p, size_t n) { EVP_DigestUpdate(ctx_, p, n); }
  // The digest; the context starts over.
  Digest finish() {
    Digest d{};
    unsigned len = 0;
    EVP_DigestFinal_ex(ctx_, d.data(), &len);
    reset();
    return d;
  }

 private:
  EVP_MD_CTX* ctx_;
};

Digest sha256Of(const char* p, size_t n) {
  Digest d{};
  unsigned len = 0;
  EVP_Digest(p, n, d.data(), &len, EVP_sha256(), nullptr);
  return d;
}

struct DigestHash {
  size_t operator()(const Digest& d) const {
    size_t h;
    std::memcpy(&h, d.data(), sizeof h);
    return h;
  }
};

// ---- decompression ----------------------------------------------------------

// gzip is inflated with ISA-L's igzip rather than zlib: about twice zlib's
// speed, and inflate was half of a pull's conversion time. Its state is one
// 85 KiB block (87,368 bytes in 2.30: the 32 KiB window twice over, the
// Huffman tables, a header buffer), allocated once per stream. What it leaves
// to us:
//   - isal_inflate can parse the member header itself, but into a header
//     struct on its stack, set up afresh on each call: a header split across
//     two reads (FEXTRA, FNAME and FCOMMENT make it any length; detection
//     alone splits it after 6 bytes) restarts its running FHCRC sum, so 2.30
//     refuses a valid header, and resumes with uninitialised flags. So the
//     header is read with isal_read_gzip_header and a struct that lives as
//     long as the member; isal_inflate starts at the deflate data (it skips
//     the header once wrapper_flag is set).
//   - "More input" and "member done" are in block_state, not the return value
//     (isal_inflate turns ISAL_END_INPUT into ISAL_DECOMP_OK).
// With crc_flag ISAL_GZIP it checks the trailer (CRC-32 and ISIZE, failing
// with ISAL_INCORRECT_CHECKSUM) and, at ISAL_BLOCK_FINISH, leaves next_in just
// past it, so the next member starts there after isal_inflate_reset (which
// keeps crc_flag). It does not look at the reserved header flags; zlib
// refused them, and so do we.
class DecodingSource final : public ByteSource {
 public:
  explicit DecodingSource(std::unique_ptr<ByteSource> in)
      : in_(std::move(in)), inBuf_(kCompressedBufBytes) {}
  ~DecodingSource() override {
    if (zd_) ZSTD_freeDCtx(zd_);
  }

  // Decides the compression (reading the first bytes if `c` is unset) and
  // sets up the decoder.
  Result<LayerCompression> start(std::optional<LayerCompression> c) {
    if (!c) {
      while (inLen_ < 6 && !inEof_) {
        ASSIGN_OR_RETURN(size_t got, in_->read(inBuf_.data() + inLen_, 6 - inLen_));
        if (got == 0) inEof_ = true;
        inLen_ += got;
      }
      auto b = [&](size_t i) { return i < inLen_ ? uint8_t(inBuf_[i]) : 0x100; };
      if (b(0) == 0x1f && b(1) == 0x8b) {
        c = LayerCompression::kGzip;
      } else if ((b(0) == 0x28 && b(1) == 0xb5 && b(2) == 0x2f && b(3) == 0xfd) ||
                 ((b(0) & 0xf0) == 0x50 && b(1) == 0x2a && b(2) == 0x4d && b(3) == 0x18)) {
        c = LayerCompression::kZstd;  // a frame, or a skippable frame
      } else if (b(0) == 0xfd && b(1) == '7' && b(2) == 'z' && b(3) == 'X' && b(4) == 'Z') {
        return badLayer("the layer is xz-compressed: only gzip, zstd and plain tar are supported");
      } else if (b(0) == 'B' && b(1) == 'Z' && b(2) == 'h') {
        return badLayer(
            "the layer is bzip2-compressed: only gzip, zstd and plain tar are supported");
      } else {
        c = LayerCompression::kNone;
      }
    }
    c_ = *c;
    if (c_ == LayerCompression::kGzip) {
      gz_.reset(new (std::nothrow) inflate_state);
      if (!gz_) return exhausted("gzip: cannot allocate an inflate state");
      isal_inflate_init(gz_.get());
      gz_->crc_flag = ISAL_GZIP;  // the gzip wrapper only (a bare zlib stream is refused)
      isal_gzip_header_init(&gzHeader_);
    } else if (c_ == LayerCompression::kZstd) {
      zd_ = ZSTD_createDCtx();
      if (!zd_) return exhausted("zstd: cannot allocate a decompression context");
      size_t r = ZSTD_DCtx_setParameter(zd_, ZSTD_d_windowLogMax, 27);
      if (ZSTD_isError(r)) return internalError(std::string("zstd: ") + ZSTD_getErrorName(r));
    }
    return c_;
  }

  Result<size_t> read(char* buf, size_t n) override {
    if (n == 0) return size_t(0);
    switch (c_) {
      case LayerCompression::kGzip:
        return readGzip(buf, n);
      case LayerCompression::kZstd:
        return readZstd(buf, n);
      case LayerCompression::kNone:
        break;
    }
    if (inPos_ < inLen_) {  // bytes read ahead to detect the compression
      size_t take = std::min(n, inLen_ - inPos_);
      std::memcpy(buf, inBuf_.data() + inPos_, take);
      inPos_ += take;
      return take;
    }
    if (inEof_) return size_t(0);
    ASSIGN_OR_RETURN(size_t got, in_->read(buf, n));
    if (got == 0) inEof_ = true;
    return got;
  }

 private:
  // Refills the (fully consumed) input buffer; at the end sets inEof_.
  Status fill() {
    ASSIGN_OR_RETURN(size_t got, in_->read(inBuf_.data(), inBuf_.size()));
    inPos_ = 0;
    inLen_ = got;
    if (got == 0) inEof_ = true;
    return Status::ok();
  }

  Result<size_t> readGzip(char* buf, size_t n) {
    if (done_) return size_t(0);
    n = std::min<size_t>(n, 1 << 30);
    inflate_state& st = *gz_;
    for (;;) {
      if (inPos_ == inLen_ && !inEof_) RETURN_IF_ERROR(fill());
      if (memberDone_) {
        if (inPos_ == inLen_) {  // and inEof_: a clean end after a whole member
          done_ = true;
          return size_t(0);
        }
        // More input after a member: another member must follow.
        isal_inflate_reset(&st);
        gzHeader_ = {};
        isal_gzip_header_init(&gzHeader_);
        magicSeen_ = 0;
        memberDone_ = false;
        ++members_;
      }
      st.next_in = reinterpret_cast<uint8_t*>(inBuf_.data() + inPos_);
      st.avail_in = uint32_t(inLen_ - inPos_);
      st.next_out = reinterpret_cast<uint8_t*>(buf);
      st.avail_out = uint32_t(n);
      bool inHeader = st.wrapper_flag == 0;
      // The header reader looks at the magic only once it has all 10 fixed
      // bytes: look first, so that a few bytes of garbage after a member are
      // called that rather than a truncated member.
      for (size_t k = 0; inHeader && magicSeen_ + k < 2 && inPos_ + k < inLen_; ++k) {
        if (uint8_t(inBuf_[inPos_ + k]) != (magicSeen_ + k == 0 ? 0x1f : 0x8b)) {
          return gzipCorrupt("not a gzip member header");
        }
      }
      // ISAL_END_INPUT from the header reader: all of the input taken, the
      // header not complete yet. It sets wrapper_flag once the header is read.
      int r = inHeader ? isal_read_gzip_header(&st, &gzHeader_) : isal_inflate(&st);
      size_t used = (inLen_ - inPos_) - st.avail_in;
      inPos_ += used;
      consumed_ += int64_t(used);
      if (inHeader) magicSeen_ = std::min<size_t>(2, magicSeen_ + used);
      size_t produced = n - st.avail_out;
      if (r == ISAL_END_INPUT && inHeader) r = ISAL_DECOMP_OK;
      if (r == ISAL_DECOMP_OK && inHeader && st.wrapper_flag && (gzHeader_.flags & 0xe0)) {
        return gzipCorrupt("unknown header flags set");  // reserved bits, as zlib refuses
      }
      switch (r) {
        case ISAL_DECOMP_OK:
          break;
        case ISAL_INVALID_BLOCK:
          return gzipCorrupt("invalid deflate block");
        case ISAL_INVALID_SYMBOL:
          return gzipCorrupt("invalid deflate code");
        case ISAL_INVALID_LOOKBACK:
          return gzipCorrupt("invalid distance too far back");
        case ISAL_INVALID_WRAPPER:
          return gzipCorrupt("not a gzip member header");
        case ISAL_UNSUPPORTED_METHOD:
          return gzipCorrupt("unknown compression method");
        case ISAL_INCORRECT_CHECKSUM:
          return gzipCorrupt(inHeader ? "header crc mismatch"
                                      : "the trailer's CRC-32 or length does not match the data");
        default:
          return internalError("gzip: isa-l inflate returned " + std::to_string(r));
      }
      if (st.block_state == ISAL_BLOCK_FINISH) memberDone_ = true;
      if (produced > 0) return produced;
      if (used == 0 && !memberDone_ && !(inHeader && st.wrapper_flag)) {
        if (inEof_ && inPos_ == inLen_) {
          return dataLoss("truncated gzip stream: it ends inside member " +
                          std::to_string(members_ + 1) + " at byte " + std::to_string(consumed_));
        }
        // Input there, room for output, and nothing taken or given: never
        // seen; looping on it would spin.
        if (inPos_ < inLen_) {
          return internalError("gzip: isa-l inflate made no progress at compressed byte " +
                               std::to_string(consumed_));
        }
      }
    }
  }

  // kDataLoss for corrupt gzip data at about where the decoder stopped (less
  // the whole bytes it holds unread in its bit buffer).
  Status gzipCorrupt(const std::string& why) const {
    int64_t at = consumed_ - (gz_->read_in_length > 0 ? gz_->read_in_length / 8 : 0);
    return dataLoss("corrupt gzip stream at compressed byte " + std::to_string(at) +
                    (members_ > 0 ? " (after member " + std::to_string(members_) + ")" : "") +
                    ": " + why);
  }

  Result<size_t> readZstd(char* buf, size_t n) {
    if (done_) return size_t(0);
    for (;;) {
      if (inPos_ == inLen_ && !inEof_) RETURN_IF_ERROR(fill());
      if (inPos_ == inLen_ && inEof_ && !frameOpen_) {  // the end, between frames
        done_ = true;
        return size_t(0);
      }
      ZSTD_inBuffer zin{inBuf_.data(), inLen_, inPos_};
      ZSTD_outBuffer zout{buf, n, 0};
      size_t r = ZSTD_decompressStream(zd_, &zout, &zin);
      consumed_ += int64_t(zin.pos - inPos_);
      inPos_ = zin.pos;
      if (ZSTD_isError(r)) {
        if (ZSTD_getErrorCode(r) == ZSTD_error_frameParameter_windowTooLarge) {
          return badLayer("zstd frame at compressed byte " + std::to_string(consumed_) +
                          " needs a window over 128 MiB (windowLogMax 27)");
        }
        if (ZSTD_getErrorCode(r) == ZSTD_error_memory_allocation) {
          return exhausted("zstd: out of memory");
        }
        return dataLoss("corrupt zstd stream at compressed byte " + std::to_string(consumed_) +
                        ": " + ZSTD_getErrorName(r));
      }
      // 0: a frame is complete and flushed. (Called again with no input, the
      // context answers with the size of the next frame's header: not "open".)
      frameOpen_ = r != 0;
      if (zout.pos > 0) return zout.pos;
      if (inPos_ == inLen_ && inEof_) {
        return dataLoss("truncated zstd stream: it ends inside a frame at byte " +
                        std::to_string(consumed_));
      }
    }
  }

  std::unique_ptr<ByteSource> in_;
  LayerCompression c_ = LayerCompression::kNone;
  std::vector<char> inBuf_;
  size_t inPos_ = 0;
  size_t inLen_ = 0;
  bool inEof_ = false;
  bool done_ = false;
  int64_t consumed_ = 0;               // compressed bytes consumed, for messages
  std::unique_ptr<inflate_state> gz_;  // ~85 KiB: heap, once per stream
  isal_gzip_header gzHeader_{};        // the current member's, kept across reads
  size_t magicSeen_ = 0;               // of the member's 1f 8b, bytes checked
  bool memberDone_ = false;
  int64_t members_ = 0;  // gzip members finished before the current one
  ZSTD_DCtx* zd_ = nullptr;
  bool frameOpen_ = true;  // an empty stream is not a zstd stream
};

// ---- the data blob ----------------------------------------------------------

// The data blob being written: buffered appends, its sha256, and its
// ChunkIndex built slice by slice as bytes go out.
class BlobWriter {
 public:
  BlobWriter() : buf_(kWriteBufBytes) { index_.chunkSize = kChunkSize; }

  Status open(const std::string& path) {
    path_ = path;
    fd_.reset(::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
    if (!fd_) return sysError("create " + path);
    return Status::ok();
  }

  uint64_t size() const { return size_; }

  Status append(const char* p, size_t n) { return appendOrSkip(p, n, false); }

  // Appends bytes, or (`hole`) zeros left as a hole: hashed all the same,
  // never written, so padding costs no disk.
  Status appendOrSkip(const char* p, size_t n, bool hole) {
    whole_.update(p, n);
    while (n > 0) {
      size_t take = std::min<size_t>(n, size_t(kChunkSize) - sliceFill_);
      slice_.update(p, take);
      sliceFill_ += take;
      if (sliceFill_ == size_t(kChunkSize)) {
        index_.digests.push_back(slice_.finish());
        sliceFill_ = 0;
      }
      if (hole) {
        RETURN_IF_ERROR(flush());
        if (::lseek(fd_.get(), off_t(take), SEEK_CUR) < 0) return sysError("seek " + path_);
        size_ += take;
      } else {
        RETURN_IF_ERROR(put(p, take));
      }
      p += take;
      n -= take;
    }
    return Status::ok();
  }

  // Appends one whole slice whose digest the caller already has (a full file
  // chunk at a slice boundary): spares hashing it twice.
  Status appendSlice(const char* p, const Digest& d) {
    if (sliceFill_ != 0) return internalError("blob: a whole slice appended off a boundary");
    whole_.update(p, size_t(kChunkSize));
    index_.digests.push_back(d);
    return put(p, size_t(kChunkSize));
  }

  // Appends zeros up to the next multiple of `align` (a power of two), as a
  // hole: alignment takes no disk.
  Status padTo(uint64_t align) {
    uint64_t target = (size_ + align - 1) & ~(align - 1);
    while (size_ < target) {
      RETURN_IF_ERROR(
          appendOrSkip(kZeros, size_t(std::min<uint64_t>(target - size_, kChunkSize)), true));
    }
    return Status::ok();
  }

  // Pads to kFsBlockSize, writes out what is buffered and closes the file.
  Status finish() {
    RETURN_IF_ERROR(padTo(kFsBlockSize));
    RETURN_IF_ERROR(flush());
    // A trailing hole is not in the file until its length says so.
    if (::ftruncate(fd_.get(), off_t(size_)) != 0) return sysError("truncate " + path_);
    if (sliceFill_ > 0) {
      index_.digests.push_back(slice_.finish());
      sliceFill_ = 0;
    }
    index_.dataSize = int64_t(size_);
    if (::close(fd_.release()) != 0) return sysError("close " + path_);
    return Status::ok();
  }

  ChunkIndex takeIndex() { return std::move(index_); }
  std::string hexDigest() { return hexOf(whole_.finish()); }

 private:
  Status put(const char* p, size_t n) {
    size_ += n;
    if (len_ + n > buf_.size()) RETURN_IF_ERROR(flush());
    if (n >= buf_.size()) return writeAll(p, n);
    std::memcpy(buf_.data() + len_, p, n);
    len_ += n;
    return Status::ok();
  }
  Status flush() {
    Status st = writeAll(buf_.data(), len_);
    len_ = 0;
    return st;
  }
  Status writeAll(const char* p, size_t n) {
    while (n > 0) {
      ssize_t w = ::write(fd_.get(), p, n);
      if (w < 0) {
        if (errno == EINTR) continue;
        return sysError("write " + path_);
      }
      p += w;
      n -= size_t(w);
    }
    return Status::ok();
  }

  std::string path_;
  UniqueFd fd_;
  std::vector<char> buf_;
  size_t len_ = 0;
  uint64_t size_ = 0;
  RawSha256 whole_;
  RawSha256 slice_;
  size_t sliceFill_ = 0;
  ChunkIndex index_;
};

// ---- the converter ----------------------------------------------------------

using DirMap = std::map<std::string, uint32_t>;  // std::string orders bytes unsigned

class Converter {
 public:
  Converter(const TarLayerOptions& opts, BlobWriter& blob) : opts_(opts), blob_(blob) {
    chunk_.resize(kChunkSize);
    FsInode root;
    root.mode = S_IFDIR | 0755;
    inodes_.push_back(std::move(root));
    dirs_.push_back(std::make_unique<DirMap>());
  }

  Status run(struct archive* a, ArchiveInput& input);
  Status finalize(TarLayer& out);
  TarLayerStats& stats() { return stats_; }

 private:
  Status entry(struct archive* a, struct archive_entry* e, ArchiveInput& input);
  Result<std::vector<std::string_view>> split(std::string_view path, std::string_view what);
  Result<uint32_t> parentOf(const std::vector<std::string_view>& comps, const std::string& path);
  Result<uint32_t> lookup(const std::vector<std::string_view>& comps);
  Status setAttrs(FsInode& ino, struct archive_entry* e, const std::string& path);
  Status countEntry();
  Status countMetadata(size_t n);
  void warn(std::string w);
  uint32_t newInode(FsInode ino);

  Status readFile(struct archive* a, ArchiveInput& input, uint32_t ino, const std::string& path);
  Status fileZeros(uint64_t target);
  Status fileBytes(const char* p, size_t n);
  Status emitChunk(const char* p, size_t len);
  size_t curChunkLen() const {
    return size_t(std::min<uint64_t>(kChunkSize, fileSize_ - fileChunkStart()));
  }
  uint64_t fileChunkStart() const { return uint64_t(file_->chunks.size()) * kChunkSize; }
  // Appends the current file's next chunk: at `block` of the own blob (dev
  // 0) or of extra blob `dev`.
  void pushChunk(uint32_t block, uint8_t dev) {
    if (dev != 0 && file_->chunkDevices.empty()) file_->chunkDevices.assign(file_->chunks.size(), 0);
    if (dev != 0 || !file_->chunkDevices.empty()) file_->chunkDevices.push_back(dev);
    file_->chunks.push_back(block);
  }
  // A chunk of another layer's blob (opts_.shared), as {block, device}, or
  // nullopt to store it here.
  Result<std::optional<std::pair<uint32_t, uint8_t>>> findShared(const Digest& d, size_t len);

 public:
  std::vector<FsTree::ExtraBlob> takeExtraBlobs() { return std::move(extraBlobs_); }
  std::vector<StoredChunk> takeStored() { return std::move(storedList_); }

 private:

  const TarLayerOptions& opts_;
  BlobWriter& blob_;
  TarLayerStats stats_;
  std::vector<FsInode> inodes_;
  std::vector<std::unique_ptr<DirMap>> dirs_;  // by inode; null for non-directories
  int64_t nodes_ = 0;                          // counted against maxEntries
  int64_t metadataBytes_ = 0;                  // counted against maxMetadataBytes

  // The regular file being read.
  FsInode* file_ = nullptr;
  uint64_t fileSize_ = 0;
  uint64_t filePos_ = 0;
  size_t chunkFill_ = 0;  // bytes in chunk_ of the current chunk
  std::vector<char> chunk_;
  struct Where {
    uint32_t block;
    uint8_t dev;  // 0: this layer's blob; k: extraBlobs_[k - 1]
  };
  std::unordered_map<Digest, Where, DigestHash> stored_;  // chunk digest -> where it is
  std::vector<FsTree::ExtraBlob> extraBlobs_;
  std::vector<StoredChunk> storedList_;
};

Status Converter::countEntry() {
  if (++nodes_ > opts_.maxEntries) {
    return exhausted("the layer has more than " + std::to_string(opts_.maxEntries) +
                     " entries (implicit directories included)");
  }
  return Status::ok();
}

Status Converter::countMetadata(size_t n) {
  metadataBytes_ += int64_t(n);
  if (metadataBytes_ > opts_.maxMetadataBytes) {
    return exhausted("the layer's names, link targets and xattrs exceed " +
                     std::to_string(opts_.maxMetadataBytes) + " bytes");
  }
  return Status::ok();
}

uint32_t Converter::newInode(FsInode ino) {
  bool dir = S_ISDIR(ino.mode);
  inodes_.push_back(std::move(ino));
  dirs_.push_back(dir ? std::make_unique<DirMap>() : nullptr);
  return uint32_t(inodes_.size() - 1);
}

Result<std::vector<std::string_view>> Converter::split(std::string_view path,
                                                       std::string_view what) {
  if (path.size() > opts_.maxPathBytes) {
    return badLayer(std::string(what) + " is " + std::to_string(path.size()) +
                    " bytes long, over " + std::to_string(opts_.maxPathBytes) + ": \"" +
                    std::string(path.substr(0, 64)) + "...\"");
  }
  std::vector<std::string_view> comps;
  size_t i = 0;
  while (i <= path.size()) {
    size_t j = path.find('/', i);
    if (j == std::string_view::npos) j = path.size();
    std::string_view c = path.substr(i, j - i);
    if (c == "..") {
      return badLayer(std::string(what) + " \"" + std::string(path) + "\" has a \"..\" component");
    }
    if (c.size() > kMaxNameComponent) {
      return badLayer(std::string(what) + " \"" + std::string(path) +
                      "\" has a component over 255 bytes");
    }
    if (!c.empty() && c != ".") comps.push_back(c);
    i = j + 1;
  }
  return comps;
}

Result<uint32_t> Converter::parentOf(const std::vector<std::string_view>& comps,
                                     const std::string& path) {
  uint32_t dir = 0;
  for (size_t i = 0; i + 1 < comps.size(); ++i) {
    DirMap& m = *dirs_[dir];
    auto it = m.find(std::string(comps[i]));
    if (it == m.end()) {
      RETURN_IF_ERROR(countEntry());
      RETURN_IF_ERROR(countMetadata(comps[i].size()));
      FsInode ino;
      ino.mode = S_IFDIR | 0755;
      uint32_t idx = newInode(std::move(ino));
      dirs_[dir]->emplace(std::string(comps[i]), idx);
      ++stats_.implicitDirs;
      dir = idx;
      continue;
    }
    if (!dirs_[it->second]) {
      std::string prefix;
      for (size_t k = 0; k <= i; ++k) prefix += (k ? "/" : "") + std::string(comps[k]);
      return badLayer("entry \"" + path + "\": its parent \"" + prefix +
                      "\" is not a directory in the layer");
    }
    dir = it->second;
  }
  return dir;
}

Result<uint32_t> Converter::lookup(const std::vector<std::string_view>& comps) {
  uint32_t cur = 0;
  for (auto c : comps) {
    if (!dirs_[cur]) return kNoInode;
    auto it = dirs_[cur]->find(std::string(c));
    if (it == dirs_[cur]->end()) return kNoInode;
    cur = it->second;
  }
  return cur;
}

Status Converter::setAttrs(FsInode& ino, struct archive_entry* e, const std::string& path) {
  int64_t uid = archive_entry_uid(e), gid = archive_entry_gid(e);
  constexpr int64_t kMaxId = 0xfffffffe;  // (uid_t)-1 means "no change" to the kernel
  if (uid < 0 || uid > kMaxId || gid < 0 || gid > kMaxId) {
    return badLayer("entry \"" + path + "\": owner " + std::to_string(uid) + ":" +
                    std::to_string(gid) + " is out of range");
  }
  ino.uid = uint32_t(uid);
  ino.gid = uint32_t(gid);
  ino.mode = (ino.mode & S_IFMT) | (uint32_t(archive_entry_perm(e)) & 07777);
  if (archive_entry_mtime_is_set(e)) {
    ino.mtime = int64_t(archive_entry_mtime(e));
    long ns = archive_entry_mtime_nsec(e);
    ino.mtimeNsec = ns >= 0 && ns < 1000000000 ? uint32_t(ns) : 0;
  } else {
    ino.mtime = 0;
    ino.mtimeNsec = 0;
  }
  ino.xattrs.clear();
  size_t total = 0;
  archive_entry_xattr_reset(e);
  const char* name = nullptr;
  const void* value = nullptr;
  size_t size = 0;
  while (archive_entry_xattr_next(e, &name, &value, &size) == ARCHIVE_OK) {
    std::string n = name ? name : "";
    if (n.empty() || n.size() > opts_.maxXattrNameBytes) {
      return badLayer(
          "entry \"" + path + "\": xattr name \"" + n.substr(0, 64) + "\" is " +
          (n.empty() ? "empty" : "over " + std::to_string(opts_.maxXattrNameBytes) + " bytes"));
    }
    if (size > opts_.maxXattrValueBytes) {
      return badLayer("entry \"" + path + "\": xattr " + n + " has " + std::to_string(size) +
                      " bytes, over " + std::to_string(opts_.maxXattrValueBytes));
    }
    total += n.size() + size;
    if (total > opts_.maxXattrBytesPerEntry) {
      return badLayer("entry \"" + path + "\": its xattrs exceed " +
                      std::to_string(opts_.maxXattrBytesPerEntry) + " bytes");
    }
    if (!erofsCanHold(n)) {  // as tar -x, where the kernel refuses the namespace
      warn("entry \"" + path + "\": xattr \"" + n.substr(0, 64) +
           "\" dropped: EROFS has no such namespace");
      continue;
    }
    std::string v(static_cast<const char*>(value), size);
    auto same = std::find_if(ino.xattrs.begin(), ino.xattrs.end(),
                             [&](const auto& x) { return x.first == n; });
    if (same != ino.xattrs.end()) {
      same->second = std::move(v);  // the last of a name wins
    } else {
      ino.xattrs.emplace_back(std::move(n), std::move(v));
    }
  }
  return countMetadata(total);
}

void Converter::warn(std::string w) {
  if (stats_.warnings++ == 0) stats_.firstWarning = std::move(w);
}

Status Converter::run(struct archive* a, ArchiveInput& input) {
  std::unique_ptr<struct archive_entry, void (*)(struct archive_entry*)> e(archive_entry_new(),
                                                                           archive_entry_free);
  if (!e) return exhausted("libarchive: cannot allocate an entry");
  std::string last;  // the last entry's name, for messages
  for (;;) {
    int r = archive_read_next_header2(a, e.get());
    if (r == ARCHIVE_EOF) break;
    if (r != ARCHIVE_OK && r != ARCHIVE_WARN) {  // ARCHIVE_RETRY (a bad header), FAILED, FATAL
      if (!input.err.isOk()) return input.err;
      const char* msg = archive_error_string(a);
      std::string why = msg ? msg : "unreadable header";
      if (stats_.entries == 0) return badLayer("the layer is not a readable tar: " + why);
      return dataLoss("corrupt tar after entry " + std::to_string(stats_.entries) + " (\"" + last +
                      "\"): " + why);
    }
    if (r == ARCHIVE_WARN) {
      const char* msg = archive_error_string(a);
      std::string w = msg ? msg : "";
      if (w.find("can't be converted") == std::string::npos) warn(std::move(w));
    }
    ++stats_.entries;
    RETURN_IF_ERROR(countEntry());
    const char* p = archive_entry_pathname(e.get());
    last = p ? p : "";
    RETURN_IF_ERROR(entry(a, e.get(), input));
  }
  return Status::ok();
}

Status Converter::entry(struct archive* a, struct archive_entry* e, ArchiveInput& input) {
  const char* raw = archive_entry_pathname(e);
  if (!raw) return badLayer("entry " + std::to_string(stats_.entries) + " has no name");
  std::string path = raw;
  ASSIGN_OR_RETURN(auto comps, split(path, "entry name"));
  const char* hardlink = archive_entry_hardlink(e);
  mode_t type = archive_entry_filetype(e);

  if (comps.empty()) {  // "." or "/": the root's own attributes
    if (hardlink || type != AE_IFDIR) {
      return badLayer("entry \"" + path + "\" names the root but is not a directory");
    }
    return setAttrs(inodes_[0], e, path);
  }
  ASSIGN_OR_RETURN(uint32_t parent, parentOf(comps, path));
  std::string name(comps.back());
  auto existing = dirs_[parent]->find(name);
  bool replacing = existing != dirs_[parent]->end();

  if (hardlink) {
    ASSIGN_OR_RETURN(auto target, split(hardlink, "hard link target"));
    ASSIGN_OR_RETURN(uint32_t ino, lookup(target));
    if (ino == kNoInode) {
      return badLayer("entry \"" + path + "\" is a hard link to \"" + hardlink +
                      "\", which the layer does not have");
    }
    if (dirs_[ino]) {
      return badLayer("entry \"" + path + "\" is a hard link to directory \"" +
                      std::string(hardlink) + "\"");
    }
    ++stats_.hardLinks;
    if (replacing) {
      ++stats_.replaced;
      existing->second = ino;
    } else {
      RETURN_IF_ERROR(countMetadata(name.size()));
      dirs_[parent]->emplace(std::move(name), ino);
    }
    return Status::ok();  // any data is skipped by the next header read
  }

  FsInode ino;
  switch (type) {
    case AE_IFREG:
      ino.mode = S_IFREG;
      break;
    case AE_IFDIR:
      ino.mode = S_IFDIR;
      break;
    case AE_IFLNK:
      ino.mode = S_IFLNK;
      break;
    case AE_IFCHR:
      ino.mode = S_IFCHR;
      break;
    case AE_IFBLK:
      ino.mode = S_IFBLK;
      break;
    case AE_IFIFO:
      ino.mode = S_IFIFO;
      break;
    case AE_IFSOCK:
      ino.mode = S_IFSOCK;
      break;
    default:
      return badLayer("entry \"" + path + "\" has an unsupported type (" + std::to_string(type) +
                      ")");
  }
  RETURN_IF_ERROR(setAttrs(ino, e, path));
  if (type == AE_IFLNK) {
    const char* t = archive_entry_symlink(e);
    std::string target = t ? t : "";
    if (target.empty()) return badLayer("entry \"" + path + "\" is a symlink to nothing");
    if (target.size() >= opts_.maxPathBytes) {
      return badLayer("entry \"" + path + "\": its symlink target is " +
                      std::to_string(target.size()) + " bytes, over " +
                      std::to_string(opts_.maxPathBytes - 1));
    }
    RETURN_IF_ERROR(countMetadata(target.size()));
    ino.symlink = std::move(target);
  } else if (type == AE_IFCHR || type == AE_IFBLK) {
    auto major = archive_entry_rdevmajor(e), minor = archive_entry_rdevminor(e);
    if (major > 0xfff || minor > 0xfffff) {
      return badLayer("entry \"" + path + "\": device " + std::to_string(major) + ":" +
                      std::to_string(minor) + " is out of range");
    }
    ino.rdev = uint32_t(makedev(major, minor));
  } else if (type == AE_IFREG) {
    int64_t size = archive_entry_size(e);
    if (size < 0) return badLayer("entry \"" + path + "\" has a negative size");
    if (size > opts_.maxFileBytes - stats_.fileBytes) {
      return exhausted("the layer's files exceed " + std::to_string(opts_.maxFileBytes) +
                       " bytes (at \"" + path + "\")");
    }
    ino.size = uint64_t(size);
    stats_.fileBytes += size;
  }

  if (replacing) {
    ++stats_.replaced;
    uint32_t old = existing->second;
    if (dirs_[old] && type == AE_IFDIR) {  // keeps its children, takes the new attributes
      FsInode& d = inodes_[old];
      d.mode = ino.mode;
      d.uid = ino.uid;
      d.gid = ino.gid;
      d.mtime = ino.mtime;
      d.mtimeNsec = ino.mtimeNsec;
      d.xattrs = std::move(ino.xattrs);
      return Status::ok();
    }
  } else {
    RETURN_IF_ERROR(countMetadata(name.size()));
  }
  uint32_t idx = newInode(std::move(ino));
  if (replacing) {
    existing->second = idx;
  } else {
    dirs_[parent]->emplace(std::move(name), idx);
  }
  if (type == AE_IFREG) return readFile(a, input, idx, path);
  return Status::ok();
}

// ---- file data --------------------------------------------------------------

Status Converter::readFile(struct archive* a, ArchiveInput& input, uint32_t idx,
                           const std::string& path) {
  FsInode& ino = inodes_[idx];
  fileSize_ = ino.size;
  filePos_ = 0;
  chunkFill_ = 0;
  file_ = &ino;
  file_->chunks.reserve(size_t((fileSize_ + kChunkSize - 1) / kChunkSize));
  for (;;) {
    const void* buf = nullptr;
    size_t len = 0;
    la_int64_t off = 0;
    int r = archive_read_data_block(a, &buf, &len, &off);
    if (r == ARCHIVE_EOF) break;
    if (r != ARCHIVE_OK && r != ARCHIVE_WARN) {
      if (!input.err.isOk()) return input.err;
      const char* msg = archive_error_string(a);
      return dataLoss("entry \"" + path + "\": " + (msg ? msg : "unreadable data"));
    }
    if (off < 0 || uint64_t(off) < filePos_ || uint64_t(off) > fileSize_ ||
        len > fileSize_ - uint64_t(off)) {
      return dataLoss("entry \"" + path + "\": a data block at " + std::to_string(off) + "+" +
                      std::to_string(len) + " is out of order or past its size " +
                      std::to_string(fileSize_));
    }
    RETURN_IF_ERROR(fileZeros(uint64_t(off)));  // a sparse hole, if any
    RETURN_IF_ERROR(fileBytes(static_cast<const char*>(buf), len));
  }
  RETURN_IF_ERROR(fileZeros(fileSize_));  // a trailing hole
  file_ = nullptr;
  return Status::ok();
}

Status Converter::fileZeros(uint64_t target) {
  while (filePos_ < target) {
    size_t len = curChunkLen();
    if (chunkFill_ == 0 && target - filePos_ >= len) {  // a whole chunk of hole
      pushChunk(kHoleChunk, 0);
      ++stats_.holeChunks;
      filePos_ += len;
      continue;
    }
    size_t take = size_t(std::min<uint64_t>(len - chunkFill_, target - filePos_));
    std::memset(chunk_.data() + chunkFill_, 0, take);
    chunkFill_ += take;
    filePos_ += take;
    if (chunkFill_ == len) {
      RETURN_IF_ERROR(emitChunk(chunk_.data(), len));
      chunkFill_ = 0;
    }
  }
  return Status::ok();
}

Status Converter::fileBytes(const char* p, size_t n) {
  while (n > 0) {
    size_t len = curChunkLen();
    if (chunkFill_ == 0 && n >= len) {  // a whole chunk in the block: no copy
      RETURN_IF_ERROR(emitChunk(p, len));
      p += len;
      n -= len;
      filePos_ += len;
      continue;
    }
    size_t take = std::min(len - chunkFill_, n);
    std::memcpy(chunk_.data() + chunkFill_, p, take);
    chunkFill_ += take;
    filePos_ += take;
    p += take;
    n -= take;
    if (chunkFill_ == len) {
      RETURN_IF_ERROR(emitChunk(chunk_.data(), len));
      chunkFill_ = 0;
    }
  }
  return Status::ok();
}

Result<std::optional<std::pair<uint32_t, uint8_t>>> Converter::findShared(const Digest& d,
                                                                            size_t len) {
  ASSIGN_OR_RETURN(auto loc, opts_.shared->find(hexOf(d), len));
  if (!loc) return std::optional<std::pair<uint32_t, uint8_t>>();
  size_t k = 0;
  while (k < extraBlobs_.size() && extraBlobs_[k].digest != loc->data) ++k;
  if (k == extraBlobs_.size()) {
    // One more device to mount; past the limit, the chunk is stored here.
    if (extraBlobs_.size() >= kMaxExtraBlobs) return std::optional<std::pair<uint32_t, uint8_t>>();
    extraBlobs_.push_back({loc->data, loc->dataSize});
  }
  return std::optional{std::pair{loc->block, uint8_t(k + 1)}};
}

Status Converter::emitChunk(const char* p, size_t len) {
  if (std::memcmp(p, kZeros, len) == 0) {
    pushChunk(kHoleChunk, 0);
    ++stats_.holeChunks;
    return Status::ok();
  }
  bool full = len == size_t(kChunkSize);
  const bool hashed = opts_.dedup || opts_.shared || full;
  Digest d{};
  if (hashed) d = sha256Of(p, len);
  if (opts_.dedup) {
    auto it = stored_.find(d);
    if (it != stored_.end()) {
      pushChunk(it->second.block, it->second.dev);
      if (it->second.dev == 0) {
        ++stats_.chunksDeduplicated;
        stats_.bytesDeduplicated += int64_t(len);
      } else {
        ++stats_.chunksShared;
        stats_.bytesShared += int64_t(len);
      }
      return Status::ok();
    }
  }
  if (opts_.shared && len >= opts_.minSharedChunk) {
    ASSIGN_OR_RETURN(auto hit, findShared(d, len));
    if (hit) {
      if (opts_.dedup) stored_.emplace(d, Where{hit->first, hit->second});
      pushChunk(hit->first, hit->second);
      ++stats_.chunksShared;
      stats_.bytesShared += int64_t(len);
      return Status::ok();
    }
  }
  // A file of at least a chunk puts every chunk on a slice of the blob.
  RETURN_IF_ERROR(blob_.padTo(fileSize_ >= uint64_t(kChunkSize) ? kChunkSize : kFsBlockSize));
  uint64_t block = blob_.size() / kFsBlockSize;
  if (block >= kHoleChunk) return exhausted("the data blob would exceed 16 TiB");
  if (full) {
    RETURN_IF_ERROR(blob_.appendSlice(p, d));
  } else {
    RETURN_IF_ERROR(blob_.append(p, len));
  }
  if (opts_.dedup) stored_.emplace(d, Where{uint32_t(block), 0});
  if (opts_.dedup || opts_.shared) storedList_.push_back({hexOf(d), uint32_t(len), uint32_t(block)});
  pushChunk(uint32_t(block), 0);
  ++stats_.chunksWritten;
  return Status::ok();
}

// ---- finalisation -------------------------------------------------------------

Status Converter::finalize(TarLayer& out) {
  // Whiteouts, directory by directory (every directory reachable from the root).
  std::deque<std::pair<uint32_t, std::string>> queue = {{0, ""}};
  while (!queue.empty()) {
    auto [dir, dirPath] = std::move(queue.front());
    queue.pop_front();
    DirMap& m = *dirs_[dir];
    std::vector<std::pair<std::string, uint32_t>> markers;
    for (auto it = m.lower_bound(std::string(kWhiteoutPrefix));
         it != m.end() && it->first.compare(0, kWhiteoutPrefix.size(), kWhiteoutPrefix) == 0;) {
      markers.emplace_back(it->first, it->second);
      it = m.erase(it);
    }
    for (auto& [name, ino] : markers) {
      std::string where = dirPath.empty() ? name : dirPath + "/" + name;
      if (dirs_[ino]) return badLayer("whiteout marker \"" + where + "\" is a directory");
      if (name == kOpaqueMarker) {
        auto& xs = inodes_[dir].xattrs;
        auto same = std::find_if(xs.begin(), xs.end(),
                                 [](const auto& x) { return x.first == "trusted.overlay.opaque"; });
        if (same != xs.end()) {
          same->second = "y";
        } else {
          xs.emplace_back("trusted.overlay.opaque", "y");
        }
        ++stats_.opaqueDirs;
        continue;
      }
      std::string target = name.substr(kWhiteoutPrefix.size());
      if (target.empty()) return badLayer("empty whiteout \"" + where + "\"");
      if (m.count(target)) {  // a whiteout hides lower layers' files, not this one's
        ++stats_.whiteoutsDropped;
        continue;
      }
      FsInode dev;
      dev.mode = S_IFCHR;  // 0000, 0:0, rdev 0:0: overlayfs's whiteout
      dev.mtime = inodes_[ino].mtime;
      dev.mtimeNsec = inodes_[ino].mtimeNsec;
      m.emplace(std::move(target), newInode(std::move(dev)));
      ++stats_.whiteouts;
    }
    for (auto& [name, child] : m) {
      if (dirs_[child]) queue.emplace_back(child, dirPath.empty() ? name : dirPath + "/" + name);
    }
  }

  // Renumber breadth first from the root, moving names into `children`, and
  // judge owners in the same walk (scanOwners' order).
  OwnerReport& rep = out.owners;
  uint32_t width = opts_.ownerWidth;
  rep.width = width;
  auto note = [&](const FsInode& ino, const std::string& dirPath, const std::string& name) {
    if (width == 0) return;
    ++rep.entries;
    rep.maxUid = std::max(rep.maxUid, ino.uid);
    rep.maxGid = std::max(rep.maxGid, ino.gid);
    if (ino.uid < width && ino.gid < width) return;
    ++rep.outside;
    if (rep.examples.size() < kOwnerExamples) {
      std::string p = name.empty() ? "." : dirPath.empty() ? name : dirPath + "/" + name;
      rep.examples.push_back({p, ino.uid, ino.gid});
    }
  };
  std::vector<uint32_t> renum(inodes_.size(), kNoInode);
  std::vector<FsInode>& res = out.tree.inodes;
  res.clear();
  res.reserve(inodes_.size());
  renum[0] = 0;
  res.push_back(std::move(inodes_[0]));
  note(res[0], "", "");
  queue = {{0, ""}};
  while (!queue.empty()) {
    auto [dir, dirPath] = std::move(queue.front());
    queue.pop_front();
    DirMap& m = *dirs_[dir];
    std::vector<std::pair<std::string, uint32_t>> children;
    children.reserve(m.size());
    while (!m.empty()) {
      auto nh = m.extract(m.begin());
      uint32_t old = nh.mapped();
      if (renum[old] == kNoInode) {
        renum[old] = uint32_t(res.size());
        res.push_back(std::move(inodes_[old]));
      }
      const FsInode& ino = res[renum[old]];
      note(ino, dirPath, nh.key());
      if (dirs_[old])
        queue.emplace_back(old, dirPath.empty() ? nh.key() : dirPath + "/" + nh.key());
      children.emplace_back(std::move(nh.key()), renum[old]);
    }
    dirs_[dir].reset();
    res[renum[dir]].children = std::move(children);
  }
  inodes_.clear();
  inodes_.shrink_to_fit();
  dirs_.clear();
  stored_.clear();
  return Status::ok();
}

}  // namespace

// ---- sources ------------------------------------------------------------------

Result<size_t> FdSource::read(char* buf, size_t n) {
  for (;;) {
    ssize_t r = ::read(fd_.get(), buf, n);
    if (r >= 0) return size_t(r);
    if (errno != EINTR) return sysError("read " + name_);
  }
}

Result<std::unique_ptr<ByteSource>> openFileSource(const std::string& path) {
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd) return sysError("open " + path);
  return std::unique_ptr<ByteSource>(std::make_unique<FdSource>(std::move(fd), path));
}

Result<size_t> MemorySource::read(char* buf, size_t n) {
  size_t take = std::min(n, bytes_.size() - pos_);
  std::memcpy(buf, bytes_.data() + pos_, take);
  pos_ += take;
  return take;
}

struct HashingSource::Impl {
  Sha256 sha;
};

HashingSource::HashingSource(ByteSource& in, bool hash)
    : in_(in), impl_(std::make_unique<Impl>()), hash_(hash) {}
HashingSource::~HashingSource() = default;

Result<size_t> HashingSource::read(char* buf, size_t n) {
  ASSIGN_OR_RETURN(size_t got, in_.read(buf, n));
  if (hash_) impl_->sha.update(buf, got);
  bytes_ += int64_t(got);
  return got;
}

std::string HashingSource::digest() {
  return hash_ ? "sha256:" + impl_->sha.hexDigest() : std::string();
}

Result<std::unique_ptr<ByteSource>> decompressing(std::unique_ptr<ByteSource> in,
                                                  std::optional<LayerCompression> c,
                                                  LayerCompression* used) {
  auto src = std::make_unique<DecodingSource>(std::move(in));
  ASSIGN_OR_RETURN(LayerCompression got, src->start(c));
  if (used) *used = got;
  return std::unique_ptr<ByteSource>(std::move(src));
}

// ---- the whole layer ----------------------------------------------------------

namespace {

Result<TarLayer> convert(ByteSource& in, std::optional<LayerCompression> c,
                         const std::string& dataPath, const TarLayerOptions& opts, bool* created) {
  TarLayer out;
  BlobWriter blob;
  RETURN_IF_ERROR(blob.open(dataPath));
  *created = true;
  auto hashed = std::make_unique<HashingSource>(in, opts.hashInput);
  HashingSource* compressed = hashed.get();  // owned by `plain` below
  ASSIGN_OR_RETURN(auto plain, decompressing(std::move(hashed), c, &out.compression));
  HashingSource tar(*plain, opts.hashDiffId);
  Converter conv(opts, blob);

  ArchiveInput input;
  input.src = &tar;
  input.buf.resize(kTarBufBytes);
  CLocaleScope cLocale;  // before the reader: libarchive settles its charset on first use
  std::unique_ptr<struct archive, int (*)(struct archive*)> a(archive_read_new(),
                                                              archive_read_free);
  if (!a) return exhausted("libarchive: cannot allocate a reader");
  // Format parsing only: decompression is ours. The empty format makes a
  // zero-byte stream an empty layer, as Go's tar reader takes it.
  archive_read_support_filter_none(a.get());
  archive_read_support_format_tar(a.get());
  archive_read_support_format_empty(a.get());
  if (archive_read_open(a.get(), &input, nullptr, archiveRead, nullptr) != ARCHIVE_OK) {
    if (!input.err.isOk()) return input.err;
    const char* msg = archive_error_string(a.get());
    return badLayer(std::string("cannot read the layer as tar: ") + (msg ? msg : "?"));
  }
  RETURN_IF_ERROR(conv.run(a.get(), input));
  a.reset();
  // What follows the end-of-archive blocks (tar's blocking padding) is part of
  // the diff_id, and the compressed stream's trailer must still be checked.
  std::vector<char> rest(kCompressedBufBytes);
  for (;;) {
    ASSIGN_OR_RETURN(size_t got, tar.read(rest.data(), rest.size()));
    if (got == 0) break;
  }
  RETURN_IF_ERROR(conv.finalize(out));
  RETURN_IF_ERROR(blob.finish());
  out.tree.dataSize = blob.size();
  out.dataDigest = "sha256:" + blob.hexDigest();
  out.chunks = blob.takeIndex();
  out.tree.extraBlobs = conv.takeExtraBlobs();
  out.stored = conv.takeStored();
  out.stats = std::move(conv.stats());
  out.stats.dataBytes = int64_t(blob.size());
  out.digest = compressed->digest();
  out.compressedSize = compressed->bytes();
  out.diffId = tar.digest();
  out.uncompressedSize = tar.bytes();
  return out;
}

}  // namespace

Result<TarLayer> readTarLayer(ByteSource& in, std::optional<LayerCompression> c,
                              const std::string& dataPath, const TarLayerOptions& opts) {
  bool created = false;
  auto r = convert(in, c, dataPath, opts, &created);
  if (!r.isOk() && created) ::unlink(dataPath.c_str());
  return r;
}

}  // namespace dsec::image
