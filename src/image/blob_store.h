// Where layer blobs live, chosen by URI, read piecemeal:
//   file:///path  a local directory, or any shared POSIX mount (3FS, CephFS, NFS)
//   http(s)://host[:port]/prefix  any web server or object store that honours
//                 Range requests (nginx, S3-compatible gateways)
// Both hold blobs as <root>/sha256/<hex> and chunk indexes as
// <root>/sha256/<hex of the data blob>.chunks (see chunk_index.h).
//
// Reads are retried with exponential backoff and jitter; a missing blob is
// kNotFound at once. Whole-blob fetches verify the sha256 (kDataLoss on a
// mismatch); callers of readAt() verify chunks against the chunk index.
// Thread-safe.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "common/status.h"

namespace dsec::image {

struct BlobStoreOptions {
  int attempts = 5;               // tries per read, the first included
  double backoffS = 0.05;         // before the 2nd try; doubles each time, capped at 2 s
  double connectTimeoutS = 5;     // http: TCP + TLS connect
  double stallTimeoutS = 15;      // http: a transfer moving < 1 KB/s this long is aborted
  std::string caFile;             // https: trust these CA certificates (PEM) instead of the system's
};

class BlobStore {
 public:
  // kInvalidArgument (field "blob_store") for an unknown scheme or a malformed URI.
  static Result<std::unique_ptr<BlobStore>> open(const std::string& uri,
                                                 BlobStoreOptions opts = {});
  virtual ~BlobStore() = default;

  const std::string& uri() const { return uri_; }
  const BlobStoreOptions& options() const { return opts_; }
  // "file" or "http".
  virtual const char* scheme() const = 0;
  // A file:// store: the path of `name` in place. Remote stores: "".
  virtual std::string localPath(const std::string& name) const = 0;
  // Size of the object `name` ("sha256/<hex>").
  virtual Result<int64_t> size(const std::string& name) = 0;
  // Exactly `len` bytes at `off` into buf. kInvalidArgument for a range past
  // the end; kUnavailable once the retries are spent.
  virtual Status readAt(const std::string& name, int64_t off, size_t len, char* buf) = 0;

  // Downloads the whole object, checks that its sha256 is `expectHex`
  // (kDataLoss otherwise), and renames it into place at `dest`.
  Status fetchVerified(const std::string& name, const std::string& expectHex,
                       const std::string& dest);

 protected:
  BlobStore(std::string uri, BlobStoreOptions opts) : uri_(std::move(uri)), opts_(opts) {}
  // Runs op until it succeeds, fails permanently, or attempts are spent.
  // Transient: kUnavailable, kDeadlineExceeded, kInternal (I/O errors).
  Status withRetries(const std::string& what, const std::function<Status()>& op) const;

  const std::string uri_;
  const BlobStoreOptions opts_;
};

// "sha256:<hex>" -> "sha256/<hex>"; the name of a blob in any store.
std::string blobName(const std::string& digest);
// The name of the chunk index of data blob `dataDigest`.
std::string chunkIndexName(const std::string& dataDigest);

}  // namespace dsec::image
