#include "image/build_context.h"

#include <archive.h>
#include <archive_entry.h>
#include <dirent.h>
#include <fcntl.h>
#include <locale.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <nlohmann/json.hpp>
#include <optional>

#include "common/sha256.h"
#include "common/util.h"
#include "image/libarchive_input.h"

namespace dsec::image {

namespace {

using json = nlohmann::json;

constexpr size_t kIoBuf = 1 << 20;

Status exhausted(std::string m) { return Status(Code::kResourceExhausted, std::move(m)); }

std::vector<std::string_view> components(std::string_view p) {
  std::vector<std::string_view> out;
  size_t i = 0;
  while (i <= p.size()) {
    size_t j = p.find('/', i);
    if (j == std::string_view::npos) j = p.size();
    std::string_view c = p.substr(i, j - i);
    if (!c.empty() && c != ".") out.push_back(c);
    i = j + 1;
  }
  return out;
}

std::string join(const std::vector<std::string_view>& parts, size_t n) {
  std::string out;
  for (size_t i = 0; i < n && i < parts.size(); ++i) {
    if (i) out += '/';
    out += parts[i];
  }
  return out;
}

bool isDir(const BuildFile& f) { return S_ISDIR(f.mode); }
bool isLink(const BuildFile& f) { return S_ISLNK(f.mode); }


// A regular file's bytes in a spool.
class SpoolSource final : public ByteSource {
 public:
  SpoolSource(int fd, uint64_t off, uint64_t size) : fd_(fd), off_(off), left_(size) {}
  Result<size_t> read(char* buf, size_t n) override {
    if (left_ == 0) return size_t(0);
    size_t want = size_t(std::min<uint64_t>(n, left_));
    ssize_t got;
    do {
      got = ::pread(fd_, buf, want, off_t(off_));
    } while (got < 0 && errno == EINTR);
    if (got < 0) return sysError("read the build spool");
    if (got == 0) return Status(Code::kDataLoss, "the build spool ends early");
    off_ += uint64_t(got);
    left_ -= uint64_t(got);
    return size_t(got);
  }

 private:
  int fd_;
  uint64_t off_;
  uint64_t left_;
};

Status writeAll(int fd, const char* p, size_t n, uint64_t off) {
  while (n > 0) {
    ssize_t w = ::pwrite(fd, p, n, off_t(off));
    if (w < 0 && errno == EINTR) continue;
    if (w < 0) return sysError("write the build spool");
    p += w;
    n -= size_t(w);
    off += uint64_t(w);
  }
  return Status::ok();
}

}  // namespace

// ---- FileSet ------------------------------------------------------------------

Result<FileSet> FileSet::create(const std::string& spoolDir, FileSetLimits limits) {
  int fd = ::open(spoolDir.c_str(), O_TMPFILE | O_RDWR | O_CLOEXEC, 0600);
  if (fd < 0 && (errno == EOPNOTSUPP || errno == EISDIR || errno == EINVAL)) {
    std::string tmpl = spoolDir + "/spool-XXXXXX";
    fd = ::mkostemp(tmpl.data(), O_CLOEXEC);
    if (fd >= 0) ::unlink(tmpl.c_str());
  }
  if (fd < 0) return sysError("create a spool in " + spoolDir);
  FileSet s;
  s.fd_ = std::make_shared<UniqueFd>(fd);
  s.limits_ = limits;
  return s;
}

Status FileSet::checkPath(const std::string& path) const {
  if (path.empty() || path == "." || path[0] == '/' || cleanPath(path) != path ||
      path.find('\0') != std::string::npos) {
    return invalidArg("path", "not a clean relative path: \"" + path + "\"");
  }
  for (auto c : components(path)) {
    if (c == "..") return invalidArg("path", "a \"..\" in \"" + path + "\"");
  }
  if (int64_t(files_.size()) >= limits_.maxEntries && !files_.count(path)) {
    return exhausted("more than " + std::to_string(limits_.maxEntries) + " files");
  }
  // A parent that is not a directory cannot hold it.
  for (size_t slash = path.find('/'); slash != std::string::npos;
       slash = path.find('/', slash + 1)) {
    auto it = files_.find(std::string_view(path).substr(0, slash));
    if (it != files_.end() && !isDir(it->second)) {
      return invalidArg("path",
                        "\"" + path + "\": its parent \"" + it->first + "\" is not a directory");
    }
  }
  return Status::ok();
}

Status FileSet::add(BuildFile f) {
  RETURN_IF_ERROR(checkPath(f.path));
  auto it = files_.find(f.path);
  if (it != files_.end() && isDir(it->second) && !isDir(f)) {
    // A non-directory replacing a directory takes its subtree with it.
    std::string prefix = f.path + "/";
    for (auto c = files_.lower_bound(prefix); c != files_.end() && startsWith(c->first, prefix);) {
      c = files_.erase(c);
    }
  }
  std::string key = f.path;
  files_[key] = std::move(f);
  return Status::ok();
}

Status FileSet::addFile(BuildFile f, ByteSource& in) {
  const uint64_t want = f.size;
  const std::string path = f.path;
  uint64_t got = 0;
  std::string buf(std::min<uint64_t>(kIoBuf, std::max<uint64_t>(want, 1)), '\0');
  auto produce = [&](const Sink& sink) -> Status {
    while (got < want) {
      ASSIGN_OR_RETURN(size_t n,
                       in.read(buf.data(), size_t(std::min<uint64_t>(buf.size(), want - got))));
      if (n == 0) {
        return Status(Code::kDataLoss, "\"" + path + "\" ends after " + std::to_string(got) +
                                           " of " + std::to_string(want) + " bytes");
      }
      got += n;
      RETURN_IF_ERROR(sink(std::string_view(buf.data(), n)));
    }
    return Status::ok();
  };
  return addFileFrom(std::move(f), produce);
}

Status FileSet::addFileFrom(BuildFile f, const std::function<Status(const Sink&)>& produce) {
  RETURN_IF_ERROR(checkPath(f.path));
  if (!fd_) return Status(Code::kFailedPrecondition, "the file set has no spool");
  Sha256 h;
  uint64_t start = end_, size = 0;
  Status st = produce([&](std::string_view d) -> Status {
    if (start + size + d.size() > limits_.maxBytes) {
      return exhausted("more than " + std::to_string(limits_.maxBytes) + " bytes of files");
    }
    RETURN_IF_ERROR(writeAll(fd_->get(), d.data(), d.size(), start + size));
    h.update(d.data(), d.size());
    size += d.size();
    return Status::ok();
  });
  RETURN_IF_ERROR(st);
  end_ = start + size;
  f.mode = S_IFREG | (f.mode & 07777);
  f.offset = start;
  f.size = size;
  f.sha256 = h.hexDigest();
  f.link.clear();
  return add(std::move(f));
}

Status FileSet::addCopy(BuildFile f, const FileSet& from, const BuildFile& src) {
  if (&from == this || (from.fd_ && from.fd_ == fd_)) {
    f.mode = S_IFREG | (f.mode & 07777);
    f.offset = src.offset;
    f.size = src.size;
    f.sha256 = src.sha256;
    f.link.clear();
    return add(std::move(f));
  }
  f.size = src.size;
  SpoolSource in(from.fd(), src.offset, src.size);
  return addFile(std::move(f), in);
}

const BuildFile* FileSet::find(std::string_view path) const {
  auto it = files_.find(path);
  return it == files_.end() ? nullptr : &it->second;
}

Result<std::string> FileSet::read(const BuildFile& f, size_t max) const {
  if (f.size > max) {
    return exhausted("\"" + f.path + "\" is larger than " + std::to_string(max) + " bytes");
  }
  std::string out(size_t(f.size), '\0');
  SpoolSource in(fd(), f.offset, f.size);
  size_t at = 0;
  while (at < out.size()) {
    ASSIGN_OR_RETURN(size_t n, in.read(out.data() + at, out.size() - at));
    at += n;
  }
  return out;
}

std::unique_ptr<ByteSource> FileSet::open(const BuildFile& f) const {
  return std::make_unique<SpoolSource>(fd(), f.offset, f.size);
}

// ---- archives -------------------------------------------------------------------

namespace {

// An entry's bytes, as libarchive hands them over (holes as zeros).
class EntrySource final : public ByteSource {
 public:
  EntrySource(struct archive* a, ArchiveInput& in, std::string path)
      : a_(a), in_(in), path_(std::move(path)) {}
  Result<size_t> read(char* buf, size_t n) override {
    la_ssize_t got = archive_read_data(a_, buf, n);
    if (got < 0) {
      if (!in_.err.isOk()) return in_.err;
      const char* msg = archive_error_string(a_);
      return Status(Code::kDataLoss, "entry \"" + path_ + "\": " + (msg ? msg : "unreadable"));
    }
    return size_t(got);
  }

 private:
  struct archive* a_;
  ArchiveInput& in_;
  std::string path_;
};

// An archive member's name made a set path ("" for the root), or an error
// for a ".." component.
Result<std::string> memberPath(std::string_view raw, const std::string& field) {
  auto parts = components(raw);
  for (auto c : parts) {
    if (c == "..") {
      return invalidArg(field, "archive entry \"" + std::string(raw) + "\" has a \"..\" component");
    }
  }
  return join(parts, parts.size());
}

}  // namespace

Result<FileSet> readTarArchive(ByteSource& in, const std::string& spoolDir,
                               const std::string& field, bool resetOwners, bool allowEmpty,
                               bool* notArchive, FileSetLimits limits) {
  if (notArchive) *notArchive = false;
  ASSIGN_OR_RETURN(FileSet set, FileSet::create(spoolDir, limits));
  ArchiveInput input;
  input.src = &in;
  input.buf.resize(kIoBuf);
  CLocaleScope cLocale;  // before the reader: libarchive settles its charset on first use
  std::unique_ptr<struct archive, int (*)(struct archive*)> a(archive_read_new(),
                                                              archive_read_free);
  if (!a) return exhausted("libarchive: cannot allocate a reader");
  archive_read_support_filter_none(a.get());
  archive_read_support_filter_gzip(a.get());
  archive_read_support_filter_bzip2(a.get());
  archive_read_support_filter_xz(a.get());
  archive_read_support_filter_zstd(a.get());
  archive_read_support_format_tar(a.get());
  if (allowEmpty) archive_read_support_format_empty(a.get());
  auto notTar = [&](const char* msg) -> Status {
    if (notArchive) *notArchive = true;
    return invalidArg(field, std::string("not a tar archive: ") + (msg ? msg : "?"));
  };
  if (archive_read_open(a.get(), &input, nullptr, archiveRead, nullptr) != ARCHIVE_OK) {
    if (!input.err.isOk()) return input.err;
    return notTar(archive_error_string(a.get()));
  }
  bool first = true;
  for (;;) {
    struct archive_entry* e = nullptr;
    int r = archive_read_next_header(a.get(), &e);
    if (r == ARCHIVE_EOF) break;
    if (r != ARCHIVE_OK && r != ARCHIVE_WARN) {
      if (!input.err.isOk()) return input.err;
      if (first) return notTar(archive_error_string(a.get()));
      const char* msg = archive_error_string(a.get());
      return Status(Code::kDataLoss, std::string("corrupt archive: ") + (msg ? msg : "?"));
    }
    first = false;
    const char* raw = archive_entry_pathname(e);
    if (!raw) return invalidArg(field, "an archive entry has no name");
    ASSIGN_OR_RETURN(std::string path, memberPath(raw, field));
    if (path.empty()) continue;  // the root: its attributes are not copied
    BuildFile f;
    f.path = path;
    f.mode = uint32_t(archive_entry_perm(e)) & 07777;
    f.uid = resetOwners ? 0 : uint32_t(std::clamp<la_int64_t>(archive_entry_uid(e), 0, 0xfffffffe));
    f.gid = resetOwners ? 0 : uint32_t(std::clamp<la_int64_t>(archive_entry_gid(e), 0, 0xfffffffe));
    f.mtime = archive_entry_mtime(e);
    Status st;
    if (const char* hl = archive_entry_hardlink(e)) {
      ASSIGN_OR_RETURN(std::string target, memberPath(hl, field));
      const BuildFile* t = set.find(target);
      if (!t || !S_ISREG(t->mode)) {
        return invalidArg(field, "archive entry \"" + path + "\" links to \"" + target +
                                     "\", which is not a file before it");
      }
      BuildFile copy = *t;
      copy.path = path;
      const BuildFile src = *t;
      st = set.addCopy(std::move(copy), set, src);
    } else {
      switch (archive_entry_filetype(e)) {
        case AE_IFDIR:
          f.mode |= S_IFDIR;
          st = set.add(std::move(f));
          break;
        case AE_IFLNK: {
          const char* t = archive_entry_symlink(e);
          if (!t || !*t) return invalidArg(field, "symlink \"" + path + "\" has no target");
          f.mode |= S_IFLNK;
          f.link = t;
          st = set.add(std::move(f));
          break;
        }
        case AE_IFREG: {
          f.mode |= S_IFREG;
          f.size = uint64_t(std::max<la_int64_t>(archive_entry_size(e), 0));
          EntrySource src(a.get(), input, path);
          st = set.addFile(std::move(f), src);
          break;
        }
        default:
          break;  // devices, FIFOs, sockets: not part of a build
      }
    }
    if (!st.isOk()) {
      if (st.code() == Code::kInvalidArgument) return invalidArg(field, st.message());
      return st;
    }
  }
  if (!input.err.isOk()) return input.err;
  return set;
}

Status applyDockerIgnore(FileSet& set) {
  const BuildFile* f = set.find(".dockerignore");
  if (!f || !S_ISREG(f->mode)) return Status::ok();
  ASSIGN_OR_RETURN(std::string text, set.read(*f, 1 << 20));
  ASSIGN_OR_RETURN(DockerIgnore ig, DockerIgnore::parse(text));
  if (ig.empty()) return Status::ok();
  std::vector<std::string> drop;
  for (auto& [path, file] : set.files()) {
    if (ig.excluded(path)) drop.push_back(path);
  }
  for (auto& p : drop) set.remove(p);
  return Status::ok();
}

// ---- COPY sources -----------------------------------------------------------------

namespace {

bool hasWildcard(std::string_view s) {
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '\\') {
      ++i;
      continue;
    }
    if (s[i] == '*' || s[i] == '?' || s[i] == '[') return true;
  }
  return false;
}

std::string baseName(std::string_view p) {
  size_t slash = p.rfind('/');
  return std::string(slash == std::string_view::npos ? p : p.substr(slash + 1));
}

// `path` (a set path, "" the root) with symlinks resolved within the set, as
// a root-scoped walk: ".." never leaves the root, an absolute target starts
// again from it. The last component is followed too when followLast. Returns
// the resolved path, or kNotFound for a missing component.
Result<std::string> resolveInSet(const FileSet& set, std::string_view path, bool followLast) {
  std::vector<std::string> todo;  // components left, in reverse
  for (auto c : components(path)) todo.insert(todo.begin(), std::string(c));
  std::vector<std::string> done;
  int hops = 0;
  while (!todo.empty()) {
    std::string c = todo.back();
    todo.pop_back();
    if (c == "..") {
      if (!done.empty()) done.pop_back();
      continue;
    }
    std::string cur;
    for (auto& d : done) cur += d + "/";
    cur += c;
    const BuildFile* f = set.find(cur);
    if (!f) return notFound(cur);
    if (isLink(*f) && (!todo.empty() || followLast)) {
      if (++hops > 40) {
        return invalidArg("dockerfile", "too many levels of symbolic links at \"" + cur + "\"");
      }
      if (!f->link.empty() && f->link[0] == '/') done.clear();
      auto parts = components(f->link);
      for (auto it = parts.rbegin(); it != parts.rend(); ++it) todo.emplace_back(*it);
      continue;
    }
    done.push_back(c);
  }
  std::string out;
  for (size_t i = 0; i < done.size(); ++i) out += (i ? "/" : "") + done[i];
  return out;
}

}  // namespace

Result<CopySelection> selectCopySources(const FileSet& set, const std::vector<std::string>& sources,
                                        const std::vector<std::string>& excludes,
                                        std::string_view what) {
  std::map<std::string, CopyItem> items;
  int matched = 0;
  bool anyDir = false;
  std::optional<DockerIgnore> ex;
  if (!excludes.empty()) {
    auto ig = DockerIgnore::fromPatterns(excludes);
    if (!ig.isOk()) {
      return invalidArg("dockerfile", std::string(what) + " --exclude: " + ig.status().message());
    }
    ex = std::move(ig).value();
  }
  auto take = [&](const std::string& name, const std::string& resolved) -> Status {
    ++matched;
    const BuildFile* f = resolved.empty() ? nullptr : set.find(resolved);
    if (resolved.empty() || (f && isDir(*f))) {  // a directory: its contents
      anyDir = true;
      std::string prefix = resolved.empty() ? "" : resolved + "/";
      for (auto it = set.files().lower_bound(prefix);
           it != set.files().end() && startsWith(it->first, prefix); ++it) {
        std::string rel = it->first.substr(prefix.size());
        if (ex && ex->excluded(rel)) continue;
        items[rel] = CopyItem{&it->second, rel, false};
      }
      return Status::ok();
    }
    if (!f) return notFound(name);
    std::string rel = baseName(name);
    if (ex && ex->excluded(rel)) return Status::ok();
    items[rel] = CopyItem{f, rel, true};
    return Status::ok();
  };
  for (const std::string& raw : sources) {
    std::string p = cleanPath(raw);
    while (!p.empty() && p[0] == '/') p.erase(0, 1);
    if (p == ".") p.clear();
    if (p == ".." || startsWith(p, "../")) {
      return invalidArg("dockerfile", std::string(what) + " failed: \"" + raw +
                                          "\" is outside the build context");
    }
    if (hasWildcard(p)) {
      size_t depth = components(p).size();
      std::vector<std::string> hits;
      for (auto& [path, f] : set.files()) {
        if (components(path).size() != depth) continue;
        auto m = goFilepathMatch(p, path);
        if (!m.isOk()) {
          return invalidArg("dockerfile", std::string(what) + " failed: bad pattern \"" + raw +
                                              "\": " + m.status().message());
        }
        if (*m) hits.push_back(path);
      }
      if (hits.empty()) {
        return invalidArg("dockerfile",
                          std::string(what) + " failed: no source files match \"" + raw + "\"");
      }
      for (auto& h : hits) {
        auto r = resolveInSet(set, h, true);
        if (!r.isOk()) {
          if (r.status().code() != Code::kNotFound) return r.status();
          return invalidArg("dockerfile", std::string(what) + " failed: \"" + h +
                                              "\" is a symlink to a file not in the source");
        }
        RETURN_IF_ERROR(take(h, *r));
      }
      if (hits.size() > 1) ++matched;  // several matches: the destination is a directory
      continue;
    }
    auto r = resolveInSet(set, p, true);
    if (!r.isOk()) {
      if (r.status().code() != Code::kNotFound) return r.status();
      return invalidArg("dockerfile", std::string(what) + " failed: \"" + raw + "\" not found");
    }
    Status st = take(p.empty() ? "." : p, *r);
    if (!st.isOk()) {
      return invalidArg("dockerfile", std::string(what) + " failed: \"" + raw + "\" not found");
    }
  }
  CopySelection out;
  out.singleFile = matched == 1 && !anyDir;
  for (auto& [rel, item] : items) out.items.push_back(item);
  return out;
}

namespace {

bool allDigits(std::string_view s) {
  return !s.empty() && s.size() <= 10 &&
         std::all_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; });
}

// The id of `name` in an /etc/passwd or /etc/group text (field 3), if any.
std::optional<uint64_t> lookupId(const std::string& text, std::string_view name) {
  for (auto& line : splitString(text, '\n')) {
    auto f = splitString(line, ':');
    if (f.size() >= 3 && f[0] == name && allDigits(f[2])) return std::stoull(f[2]);
  }
  return std::nullopt;
}

}  // namespace

bool chownNeedsNames(std::string_view spec) {
  size_t colon = spec.find(':');
  std::string_view user = spec.substr(0, colon);
  std::string_view group = colon == std::string_view::npos ? "" : spec.substr(colon + 1);
  return !allDigits(user) || (!group.empty() && !allDigits(group));
}

Result<Owner> resolveChown(std::string_view spec, const std::optional<std::string>& passwd,
                           const std::optional<std::string>& group) {
  size_t colon = spec.find(':');
  std::string_view u = spec.substr(0, colon);
  std::string_view g = colon == std::string_view::npos ? "" : spec.substr(colon + 1);
  if (u.empty() || (colon != std::string_view::npos && g.empty())) {
    return invalidArg("dockerfile", "--chown=" + std::string(spec) + ": want user[:group]");
  }
  auto id = [&](std::string_view name, const std::optional<std::string>& db,
                const char* file) -> Result<uint64_t> {
    uint64_t v;
    if (allDigits(name)) {
      v = std::stoull(std::string(name));
    } else if (!db) {
      return invalidArg("dockerfile", "--chown=" + std::string(spec) + ": the image has no " +
                                          file + " to look up \"" + std::string(name) + "\" in");
    } else if (auto found = lookupId(*db, name)) {
      v = *found;
    } else {
      return invalidArg("dockerfile", "--chown=" + std::string(spec) + ": no \"" +
                                          std::string(name) + "\" in the image's " + file);
    }
    if (v > 0xfffffffeULL) {
      return invalidArg("dockerfile", "--chown=" + std::string(spec) + ": id out of range");
    }
    return v;
  };
  ASSIGN_OR_RETURN(uint64_t uid, id(u, passwd, "/etc/passwd"));
  Owner o;
  o.uid = uint32_t(uid);
  o.gid = o.uid;
  if (!g.empty()) {
    ASSIGN_OR_RETURN(uint64_t gid, id(g, group, "/etc/group"));
    o.gid = uint32_t(gid);
  }
  return o;
}

bool looksLikeArchive(std::string_view h) {
  auto starts = [&](std::string_view m) { return h.substr(0, m.size()) == m; };
  if (starts("\x1f\x8b") || starts("BZh") ||
      starts(std::string_view("\xfd"
                              "7zXZ\0",
                              6)) ||
      starts("\x28\xb5\x2f\xfd")) {
    return true;
  }
  return h.size() >= 262 && h.substr(257, 5) == "ustar";
}

std::string resolveDest(std::string_view dest, std::string_view workdir, bool* isDir) {
  if (isDir) {
    *isDir = dest.empty() || dest.back() == '/' || dest == "." || dest == ".." ||
             dest.ends_with("/.") || dest.ends_with("/..");
  }
  std::string base = workdir.empty() ? "/" : std::string(workdir);
  std::string full =
      !dest.empty() && dest[0] == '/' ? std::string(dest) : base + "/" + std::string(dest);
  std::string out = cleanPath(full);
  if (out.empty() || out[0] != '/') out = "/" + out;
  return out;
}

// ---- tar --------------------------------------------------------------------------

namespace {

void octal(char* field, size_t width, uint64_t v) {
  // width-1 digits and a NUL.
  std::string s(width - 1, '0');
  for (size_t i = width - 1; i-- > 0 && v;) {
    s[i] = char('0' + (v & 7));
    v >>= 3;
  }
  memcpy(field, s.data(), width - 1);
  field[width - 1] = '\0';
}

void paxRecord(std::string& out, const std::string& key, const std::string& value) {
  size_t body = 1 + key.size() + 1 + value.size() + 1;  // " key=value\n"
  size_t len = body + 1;
  while (std::to_string(len).size() + body != len) len = std::to_string(len).size() + body;
  out += std::to_string(len) + " " + key + "=" + value + "\n";
}

void rawHeader(std::string& out, const std::string& name, char type, uint32_t perm, uint64_t uid,
               uint64_t gid, uint64_t size, uint64_t mtime, const std::string& link) {
  char h[512];
  memset(h, 0, sizeof h);
  memcpy(h, name.data(), std::min<size_t>(name.size(), 100));
  octal(h + 100, 8, perm & 07777);
  octal(h + 108, 8, uid);
  octal(h + 116, 8, gid);
  octal(h + 124, 12, size);
  octal(h + 136, 12, mtime);
  memset(h + 148, ' ', 8);
  h[156] = type;
  memcpy(h + 157, link.data(), std::min<size_t>(link.size(), 100));
  memcpy(h + 257, "ustar", 6);
  memcpy(h + 263, "00", 2);
  unsigned sum = 0;
  for (unsigned char c : h) sum += c;
  char ck[8];
  snprintf(ck, sizeof ck, "%06o", sum & 0777777);
  memcpy(h + 148, ck, 6);
  h[154] = '\0';
  h[155] = ' ';
  out.append(h, sizeof h);
}

void pad(std::string& out) {
  if (size_t r = out.size() % 512) out.append(512 - r, '\0');
}

}  // namespace

void appendTarHeader(std::string& out, const std::string& name, char type, uint32_t perm,
                     uint32_t uid, uint32_t gid, uint64_t size, int64_t mtime,
                     const std::string& link) {
  constexpr uint64_t kMaxSize = 077777777777ULL;
  constexpr uint64_t kMaxId = 07777777;
  std::string pax;
  if (name.size() > 100) paxRecord(pax, "path", name);
  if (link.size() > 100) paxRecord(pax, "linkpath", link);
  if (size > kMaxSize) paxRecord(pax, "size", std::to_string(size));
  if (uid > kMaxId) paxRecord(pax, "uid", std::to_string(uid));
  if (gid > kMaxId) paxRecord(pax, "gid", std::to_string(gid));
  if (mtime < 0 || uint64_t(mtime) > kMaxSize) paxRecord(pax, "mtime", std::to_string(mtime));
  if (!pax.empty()) {
    rawHeader(out, "PaxHeaders/" + baseName(name).substr(0, 80), 'x', 0644, 0, 0, pax.size(), 0,
              "");
    out += pax;
    pad(out);
  }
  rawHeader(out, name, type, perm, std::min<uint64_t>(uid, kMaxId), std::min<uint64_t>(gid, kMaxId),
            std::min(size, kMaxSize), mtime < 0 ? 0 : std::min<uint64_t>(uint64_t(mtime), kMaxSize),
            link);
}

namespace {

class TarSource final : public ByteSource {
 public:
  explicit TarSource(std::vector<LayerEntry> entries) : entries_(std::move(entries)) {}

  Result<size_t> read(char* buf, size_t n) override {
    for (;;) {
      if (pendingOff_ < pending_.size()) {
        size_t take = std::min(n, pending_.size() - pendingOff_);
        memcpy(buf, pending_.data() + pendingOff_, take);
        pendingOff_ += take;
        return take;
      }
      if (fileLeft_ > 0) {
        const LayerEntry& e = entries_[next_ - 1];
        size_t want = size_t(std::min<uint64_t>(n, fileLeft_));
        ssize_t got;
        do {
          got = ::pread(e.fd, buf, want, off_t(fileOff_));
        } while (got < 0 && errno == EINTR);
        if (got < 0) return sysError("read the bytes of " + e.path);
        if (got == 0) return Status(Code::kDataLoss, "the bytes of " + e.path + " end early");
        fileOff_ += uint64_t(got);
        fileLeft_ -= uint64_t(got);
        return size_t(got);
      }
      pending_.clear();
      pendingOff_ = 0;
      if (padLeft_ > 0) {
        pending_.assign(padLeft_, '\0');
        padLeft_ = 0;
        continue;
      }
      if (next_ < entries_.size()) {
        const LayerEntry& e = entries_[next_++];
        std::string name = e.path;
        while (!name.empty() && name[0] == '/') name.erase(0, 1);
        char type = S_ISDIR(e.mode) ? '5' : S_ISLNK(e.mode) ? '2' : '0';
        uint64_t size = type == '0' ? e.size : 0;
        appendTarHeader(pending_, type == '5' ? name + "/" : name, type, e.mode & 07777, e.uid,
                        e.gid, size, e.mtime, e.link);
        fileLeft_ = size;
        fileOff_ = e.offset;
        padLeft_ = size % 512 ? 512 - size % 512 : 0;
        continue;
      }
      if (!ended_) {
        ended_ = true;
        pending_.assign(1024, '\0');
        continue;
      }
      return size_t(0);
    }
  }

 private:
  std::vector<LayerEntry> entries_;
  size_t next_ = 0;
  std::string pending_;
  size_t pendingOff_ = 0;
  uint64_t fileLeft_ = 0;
  uint64_t fileOff_ = 0;
  uint64_t padLeft_ = 0;
  bool ended_ = false;
};

}  // namespace

std::unique_ptr<ByteSource> tarOf(std::vector<LayerEntry> entries) {
  return std::make_unique<TarSource>(std::move(entries));
}

// ---- the cache key -------------------------------------------------------------------

std::string stepCacheKey(const StepKeyInput& in) {
  json files = json::array();
  for (const CopyItem& it : in.files) {
    const BuildFile& f = *it.file;
    files.push_back({it.rel, f.mode, f.uid, f.gid, f.size,
                     S_ISREG(f.mode)   ? f.sha256
                     : S_ISLNK(f.mode) ? f.link
                                       : ""});
  }
  json doc = {"dsec-build-step/1", in.parent,  in.owner, in.instruction, in.env, in.shell, in.user,
              in.workdir,          in.network, files,    in.source};
  return "sha256:" + sha256Hex(doc.dump(-1, ' ', false, json::error_handler_t::replace));
}

std::string instructionText(const Instruction& i) {
  json flags = json::object();
  for (auto& [k, v] : i.flags) flags[k] = v;
  json doc = {{"k", i.keyword}, {"a", i.args}, {"f", flags}, {"x", i.excludes}, {"j", i.jsonForm}};
  return doc.dump(-1, ' ', false, json::error_handler_t::replace);
}

// ---- packing a context directory ----------------------------------------------------

namespace {

class ContextPacker {
 public:
  ContextPacker(int out, const DockerIgnore& ig) : out_(out), ig_(ig) {}

  Status walk(const std::string& abs, const std::string& rel, const DockerIgnore::MatchInfo& info) {
    DIR* d = ::opendir(abs.c_str());
    if (!d) return sysError("open directory " + abs);
    std::vector<std::string> names;
    while (struct dirent* e = ::readdir(d)) {
      std::string n = e->d_name;
      if (n != "." && n != "..") names.push_back(std::move(n));
    }
    ::closedir(d);
    std::sort(names.begin(), names.end());
    for (const std::string& n : names) {
      std::string childAbs = abs + "/" + n;
      std::string childRel = rel.empty() ? n : rel + "/" + n;
      struct stat st;
      if (::lstat(childAbs.c_str(), &st) != 0) return sysError("stat " + childAbs);
      DockerIgnore::MatchInfo self;
      bool excluded = ig_.excludedUsingParent(childRel, info, &self);
      if (S_ISDIR(st.st_mode)) {
        if (excluded && !ig_.mayContainExceptions(childRel)) continue;
        if (!excluded) RETURN_IF_ERROR(entry(childRel + "/", '5', st, 0, ""));
        RETURN_IF_ERROR(walk(childAbs, childRel, self));
        continue;
      }
      if (excluded) continue;
      if (S_ISLNK(st.st_mode)) {
        std::string target(size_t(std::max<off_t>(st.st_size, 0)) + 1, '\0');
        ssize_t n2 = ::readlink(childAbs.c_str(), target.data(), target.size());
        if (n2 < 0) return sysError("readlink " + childAbs);
        target.resize(size_t(n2));
        RETURN_IF_ERROR(entry(childRel, '2', st, 0, target));
      } else if (S_ISREG(st.st_mode)) {
        RETURN_IF_ERROR(file(childAbs, childRel, st));
      }
    }
    return Status::ok();
  }

  Status finish() {
    std::string end(1024, '\0');
    return emit(end);
  }
  PackedContext result() {
    PackedContext p;
    p.digest = "sha256:" + hash_.hexDigest();
    p.size = size_;
    p.files = files_;
    return p;
  }

 private:
  Status entry(const std::string& name, char type, const struct stat& st, uint64_t size,
               const std::string& link) {
    std::string h;
    appendTarHeader(h, name, type, st.st_mode & 07777, 0, 0, size, st.st_mtim.tv_sec, link);
    ++files_;
    return emit(h);
  }
  Status file(const std::string& abs, const std::string& rel, const struct stat& st) {
    UniqueFd fd(::open(abs.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW));
    if (!fd) return sysError("open " + abs);
    uint64_t size = uint64_t(st.st_size);
    RETURN_IF_ERROR(entry(rel, '0', st, size, ""));
    std::string buf(kIoBuf, '\0');
    uint64_t left = size;
    while (left > 0) {
      ssize_t n = ::read(fd.get(), buf.data(), size_t(std::min<uint64_t>(buf.size(), left)));
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) return sysError("read " + abs);
      if (n == 0) {  // shrank while read: the header's size still holds
        std::fill(buf.begin(), buf.end(), '\0');
        n = ssize_t(std::min<uint64_t>(buf.size(), left));
      }
      RETURN_IF_ERROR(emit(std::string_view(buf.data(), size_t(n))));
      left -= uint64_t(n);
    }
    if (size_t r = size % 512) RETURN_IF_ERROR(emit(std::string(512 - r, '\0')));
    return Status::ok();
  }
  Status emit(std::string_view d) {
    hash_.update(d.data(), d.size());
    size_ += d.size();
    while (!d.empty()) {
      ssize_t w = ::write(out_, d.data(), d.size());
      if (w < 0 && errno == EINTR) continue;
      if (w < 0) return sysError("write the context tar");
      d.remove_prefix(size_t(w));
    }
    return Status::ok();
  }

  int out_;
  const DockerIgnore& ig_;
  Sha256 hash_;
  uint64_t size_ = 0;
  int64_t files_ = 0;
};

}  // namespace

Result<PackedContext> packContextDir(const std::string& dir, int outFd) {
  struct stat st;
  if (::stat(dir.c_str(), &st) != 0) return sysError("stat " + dir);
  if (!S_ISDIR(st.st_mode)) return invalidArg("context", dir + " is not a directory");
  DockerIgnore ig;
  std::string ignorePath = dir + "/.dockerignore";
  if (::access(ignorePath.c_str(), F_OK) == 0) {
    ASSIGN_OR_RETURN(std::string text, readFile(ignorePath));
    ASSIGN_OR_RETURN(ig, DockerIgnore::parse(text));
  }
  ContextPacker p(outFd, ig);
  RETURN_IF_ERROR(p.walk(dir, "", {}));
  RETURN_IF_ERROR(p.finish());
  return p.result();
}

}  // namespace dsec::image
