#include "image/blob_store.h"

#include <curl/curl.h>
#include <fcntl.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <strings.h>
#include <mutex>
#include <thread>
#include <vector>

#include "common/fd.h"
#include "common/log.h"
#include "common/sha256.h"
#include "common/util.h"

namespace dsec::image {

std::string blobName(const std::string& digest) {
  return "sha256/" + (startsWith(digest, "sha256:") ? digest.substr(7) : digest);
}

std::string chunkIndexName(const std::string& dataDigest) { return blobName(dataDigest) + ".chunks"; }

Status BlobStore::withRetries(const std::string& what, const std::function<Status()>& op) const {
  double backoff = opts_.backoffS;
  Status st;
  for (int attempt = 1;; ++attempt) {
    st = op();
    if (st.isOk()) return st;
    bool transient = st.code() == Code::kUnavailable || st.code() == Code::kDeadlineExceeded ||
                     st.code() == Code::kInternal;
    if (!transient || attempt >= opts_.attempts) break;
    // Full jitter: sleep a random time in [backoff/2, backoff].
    uint32_t r = 0;
    (void)::getrandom(&r, sizeof r, 0);
    double sleepS = backoff * (0.5 + 0.5 * (r / 4294967296.0));
    log::warn(what + ": " + st.message() + "; retry " + std::to_string(attempt) + " in " +
              std::to_string(int(sleepS * 1000)) + " ms");
    std::this_thread::sleep_for(std::chrono::duration<double>(sleepS));
    backoff = std::min(backoff * 2, 2.0);
  }
  return Status(st.code() == Code::kInternal ? Code::kUnavailable : st.code(),
                what + ": " + st.message(), st.sysErrno());
}

Status BlobStore::fetchVerified(const std::string& name, const std::string& expectHex,
                                const std::string& dest) {
  ASSIGN_OR_RETURN(int64_t total, size(name));
  std::string tmp = dest + ".part-" + randomHex(4);
  UniqueFd out(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644));
  if (!out) return sysError("create " + tmp);
  auto fail = [&tmp](Status st) {
    ::unlink(tmp.c_str());
    return st;
  };
  Sha256 h;
  std::string buf(size_t(std::min<int64_t>(std::max<int64_t>(total, 1), 4 << 20)), '\0');
  for (int64_t off = 0; off < total;) {
    size_t n = size_t(std::min<int64_t>(int64_t(buf.size()), total - off));
    if (Status st = readAt(name, off, n, buf.data()); !st.isOk()) return fail(st);
    h.update(buf.data(), n);
    if (::pwrite(out.get(), buf.data(), n, off) != ssize_t(n)) return fail(sysError("write " + tmp));
    off += int64_t(n);
  }
  std::string got = h.hexDigest();
  if (got != expectHex) {
    return fail(Status(Code::kDataLoss, uri_ + "/" + name + ": sha256 " + got +
                                            " does not match the expected " + expectHex));
  }
  if (::fsync(out.get()) != 0) return fail(sysError("fsync " + tmp));
  if (::rename(tmp.c_str(), dest.c_str()) != 0) return fail(sysError("rename " + dest));
  return Status::ok();
}

namespace {

// file://: pread from the shared directory. I/O errors (EIO from a network
// file system) are retried; ENOENT is final.
class FileStore final : public BlobStore {
 public:
  FileStore(std::string uri, std::string root, BlobStoreOptions o)
      : BlobStore(std::move(uri), o), root_(std::move(root)) {}
  const char* scheme() const override { return "file"; }
  std::string localPath(const std::string& name) const override { return root_ + "/" + name; }

  Result<int64_t> size(const std::string& name) override {
    struct stat st;
    if (::stat(localPath(name).c_str(), &st) != 0) return sysError("stat " + localPath(name));
    return int64_t(st.st_size);
  }

  Status readAt(const std::string& name, int64_t off, size_t len, char* buf) override {
    std::string path = localPath(name);
    return withRetries("read " + path, [&]() -> Status {
      UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
      if (!fd) return sysError("open " + path);
      size_t got = 0;
      while (got < len) {
        ssize_t r = ::pread(fd.get(), buf + got, len - got, off + int64_t(got));
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) return Status(Code::kInternal, std::string("read: ") + strerror(errno), errno);
        if (r == 0) {
          return invalidArg("range", "range " + std::to_string(off) + "+" + std::to_string(len) +
                                         " is past the end of " + path);
        }
        got += size_t(r);
      }
      return Status::ok();
    });
  }

 private:
  const std::string root_;
};

// http(s)://: libcurl with a pool of easy handles, so connections stay alive
// and reads from many threads run in parallel.
class HttpStore final : public BlobStore {
 public:
  HttpStore(std::string uri, BlobStoreOptions o) : BlobStore(std::move(uri), o) {
    base_ = uri_;
    while (!base_.empty() && base_.back() == '/') base_.pop_back();
  }
  ~HttpStore() override {
    for (CURL* c : idle_) curl_easy_cleanup(c);
  }
  const char* scheme() const override { return "http"; }
  std::string localPath(const std::string&) const override { return ""; }

  // A one-byte ranged GET rather than HEAD: presigned object-store URLs are
  // often valid for GET only. The total comes from Content-Range.
  Result<int64_t> size(const std::string& name) override {
    int64_t out = -1;
    Status st = withRetries("GET " + base_ + "/" + name, [&]() -> Status {
      Handle h(this);
      char byte;
      Sink sink{&byte, 1, 0, false};
      std::string total;
      curl_easy_setopt(h.c, CURLOPT_RANGE, "0-0");
      curl_easy_setopt(h.c, CURLOPT_HEADERFUNCTION, &contentRangeTotal);
      curl_easy_setopt(h.c, CURLOPT_HEADERDATA, &total);
      ASSIGN_OR_RETURN(long code, perform(h.c, name, &Sink::write, &sink));
      if (code == 416 && total == "0") {
        out = 0;
        return Status::ok();
      }
      RETURN_IF_ERROR(statusOf(code, name));
      curl_off_t len = -1;
      if (code == 206 && !total.empty() && total != "*") {
        len = strtoll(total.c_str(), nullptr, 10);
      } else if (code == 200) {
        curl_easy_getinfo(h.c, CURLINFO_CONTENT_LENGTH_DOWNLOAD_T, &len);
      }
      if (len < 0) return Status(Code::kUnavailable, "no object size in the response for " + name);
      out = int64_t(len);
      return Status::ok();
    });
    RETURN_IF_ERROR(st);
    return out;
  }

  Status readAt(const std::string& name, int64_t off, size_t len, char* buf) override {
    if (len == 0) return Status::ok();
    return withRetries("GET " + base_ + "/" + name, [&]() -> Status {
      Handle h(this);
      Sink sink{buf, len, 0, false};
      std::string range = std::to_string(off) + "-" + std::to_string(off + int64_t(len) - 1);
      curl_easy_setopt(h.c, CURLOPT_RANGE, range.c_str());
      ASSIGN_OR_RETURN(long code, perform(h.c, name, &Sink::write, &sink));
      if (code == 416) {
        return invalidArg("range", "range " + range + " is past the end of " + name);
      }
      RETURN_IF_ERROR(statusOf(code, name));
      // A server that ignores Range answers 200 with the whole object: only
      // acceptable when that is exactly the range asked for.
      if (code == 200 && off != 0) {
        return Status(Code::kFailedPrecondition, base_ + " does not honour Range requests");
      }
      if (sink.overflow && code == 206) return Status(Code::kUnavailable, "more bytes than asked");
      if (sink.got != len) {
        return Status(Code::kUnavailable, "short read: " + std::to_string(sink.got) + " of " +
                                              std::to_string(len) + " bytes");
      }
      return Status::ok();
    });
  }

 private:
  // Header callback: keeps the total of "Content-Range: bytes a-b/TOTAL".
  static size_t contentRangeTotal(char* p, size_t sz, size_t n, void* out) {
    std::string_view line(p, sz * n);
    constexpr std::string_view kName = "content-range:";
    if (line.size() > kName.size() && strncasecmp(line.data(), kName.data(), kName.size()) == 0) {
      size_t slash = line.rfind('/');
      if (slash != std::string_view::npos) {
        std::string_view t = line.substr(slash + 1);
        while (!t.empty() && (t.back() == '\r' || t.back() == '\n' || t.back() == ' ')) {
          t.remove_suffix(1);
        }
        *static_cast<std::string*>(out) = std::string(t);
      }
    }
    return sz * n;
  }
  struct Sink {
    char* buf;
    size_t len;
    size_t got;
    bool overflow;
    static size_t write(char* p, size_t sz, size_t n, void* self) {
      auto* s = static_cast<Sink*>(self);
      size_t bytes = sz * n;
      size_t take = std::min(bytes, s->len - s->got);
      memcpy(s->buf + s->got, p, take);
      s->got += take;
      if (take < bytes) s->overflow = true;
      return bytes;  // a server ignoring Range: drop the rest, judged above
    }
  };
  // An easy handle borrowed from the pool for one request.
  struct Handle {
    HttpStore* s;
    CURL* c;
    explicit Handle(HttpStore* store) : s(store), c(store->take()) {}
    ~Handle() { s->give(c); }
  };
  CURL* take() {
    {
      std::lock_guard lk(mu_);
      if (!idle_.empty()) {
        CURL* c = idle_.back();
        idle_.pop_back();
        curl_easy_reset(c);
        return c;
      }
    }
    return curl_easy_init();
  }
  void give(CURL* c) {
    if (!c) return;
    std::lock_guard lk(mu_);
    if (idle_.size() < 32) {
      idle_.push_back(c);
    } else {
      curl_easy_cleanup(c);
    }
  }
  Result<long> perform(CURL* c, const std::string& name, size_t (*fn)(char*, size_t, size_t, void*),
                       void* sink) {
    if (!c) return Status(Code::kResourceExhausted, "curl_easy_init failed");
    std::string url = base_ + "/" + name;
    char err[CURL_ERROR_SIZE] = {0};
    curl_easy_setopt(c, CURLOPT_URL, url.c_str());
    curl_easy_setopt(c, CURLOPT_ERRORBUFFER, err);
    curl_easy_setopt(c, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(c, CURLOPT_FOLLOWLOCATION, 1L);
    curl_easy_setopt(c, CURLOPT_MAXREDIRS, 5L);
    curl_easy_setopt(c, CURLOPT_PROTOCOLS_STR, "http,https");
    curl_easy_setopt(c, CURLOPT_TCP_NODELAY, 1L);
    curl_easy_setopt(c, CURLOPT_CONNECTTIMEOUT_MS, long(opts_.connectTimeoutS * 1000));
    if (!opts_.caFile.empty()) curl_easy_setopt(c, CURLOPT_CAINFO, opts_.caFile.c_str());
    curl_easy_setopt(c, CURLOPT_LOW_SPEED_LIMIT, 1024L);
    curl_easy_setopt(c, CURLOPT_LOW_SPEED_TIME, std::max(1L, long(opts_.stallTimeoutS)));
    if (fn) {
      curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, fn);
      curl_easy_setopt(c, CURLOPT_WRITEDATA, sink);
    }
    CURLcode rc = curl_easy_perform(c);
    if (rc != CURLE_OK) {
      Code code = rc == CURLE_OPERATION_TIMEDOUT ? Code::kDeadlineExceeded : Code::kUnavailable;
      return Status(code, std::string(err[0] ? err : curl_easy_strerror(rc)));
    }
    long status = 0;
    curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, &status);
    return status;
  }
  Status statusOf(long code, const std::string& name) const {
    if (code == 200 || code == 206) return Status::ok();
    std::string what = base_ + "/" + name + ": HTTP " + std::to_string(code);
    if (code == 404 || code == 410) return Status(Code::kNotFound, what);
    if (code == 401 || code == 403) return Status(Code::kPermissionDenied, what);
    if (code == 408 || code == 429 || code >= 500) return Status(Code::kUnavailable, what);
    return Status(Code::kFailedPrecondition, what);
  }

  std::string base_;
  std::mutex mu_;  // guards idle_
  std::vector<CURL*> idle_;
};

std::once_flag curlInit;

}  // namespace

Result<std::unique_ptr<BlobStore>> BlobStore::open(const std::string& uri, BlobStoreOptions opts) {
  if (startsWith(uri, "file://")) {
    std::string root = uri.substr(7);
    if (root.empty() || root[0] != '/') {
      return invalidArg("blob_store", "file:// store needs an absolute path: " + uri);
    }
    while (root.size() > 1 && root.back() == '/') root.pop_back();
    struct stat st;
    if (::stat(root.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
      return invalidArg("blob_store", "not a directory: " + root);
    }
    return std::unique_ptr<BlobStore>(new FileStore(uri, root, opts));
  }
  if (startsWith(uri, "http://") || startsWith(uri, "https://")) {
    size_t hostStart = uri.find("//") + 2;
    if (hostStart >= uri.size() || uri[hostStart] == '/') {
      return invalidArg("blob_store", "no host in " + uri);
    }
    if (!opts.caFile.empty() && ::access(opts.caFile.c_str(), R_OK) != 0) {
      return invalidArg("blob_store_ca", "cannot read " + opts.caFile);
    }
    std::call_once(curlInit, [] { curl_global_init(CURL_GLOBAL_DEFAULT); });
    return std::unique_ptr<BlobStore>(new HttpStore(uri, opts));
  }
  return invalidArg("blob_store", "blob store URI must be file:// or http(s)://, not " + uri);
}

}  // namespace dsec::image
