// The parts of `dsec image build` (platform/api_build.cc) that need no
// sandbox, store or network, so they are tested alone (build_context_test):
//
//  * FileSet: files with their bytes in one spool file: a build context read
//    from its tar, a local archive that ADD unpacks, files read out of a
//    stage's sandbox. Nothing is ever extracted onto the host's file system.
//  * selectCopySources: which files a COPY/ADD takes and the path each gets
//    below the destination (Docker's rules: Go filepath.Match wildcards, a
//    directory source copies its contents, symlinks named as sources are
//    followed within the set).
//  * tarOf: a tar stream of entries whose bytes come from spool files, for
//    convertTarLayer (layer_converter.h), so a COPY layer is made without
//    extraction.
//  * stepCacheKey: the build step cache's key.
//  * packContextDir: a directory as a context tar, .dockerignore applied (the
//    CLI's `dsec image build`).
//
// Thread safety: a FileSet is not thread-safe; the functions are reentrant.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common/fd.h"
#include "common/status.h"
#include "image/dockerfile.h"
#include "image/dockerignore.h"
#include "image/tar_stream.h"

namespace dsec::image {

// One entry of a FileSet.
struct BuildFile {
  std::string path;   // relative, clean, '/'-separated; never "" or "."
  uint32_t mode = 0;  // st_mode: S_IFREG, S_IFDIR or S_IFLNK, and the permission bits
  uint32_t uid = 0;
  uint32_t gid = 0;
  int64_t mtime = 0;
  uint64_t size = 0;    // regular files
  std::string link;     // symlinks: the target as stored
  uint64_t offset = 0;  // regular files: where the bytes start in the set's spool
  std::string sha256;   // regular files: hex SHA-256 of the bytes
};

struct FileSetLimits {
  int64_t maxEntries = 1'000'000;
  uint64_t maxBytes = uint64_t(64) << 30;  // file bytes, summed
};

// Files and the spool that holds their bytes, one after another. The spool is
// an unlinked file in the directory given at creation (O_TMPFILE): it goes
// when the set does. Moveable, not copyable.
class FileSet {
 public:
  // Errors: sysError for the spool.
  static Result<FileSet> create(const std::string& spoolDir, FileSetLimits limits = {});
  FileSet() = default;

  // Adds (or replaces) a directory or symlink; `f.path` must be clean and
  // relative (kInvalidArgument otherwise). Parents are not required.
  Status add(BuildFile f);
  // Adds (or replaces) a regular file whose f.size bytes `in` supplies:
  // spooled, hashed. Errors: in's; kDataLoss when it ends early;
  // kResourceExhausted past the limits; sysError writing the spool.
  Status addFile(BuildFile f, ByteSource& in);
  // The same for bytes pushed: `produce` is called once with a sink and
  // hands it the file's bytes in order; f.size is set from them. An error
  // from the sink (limits, spool) or from produce is returned.
  using Sink = std::function<Status(std::string_view)>;
  Status addFileFrom(BuildFile f, const std::function<Status(const Sink&)>& produce);
  // Adds a regular file with the bytes of another set's entry (a hard link
  // within one set: the same bytes, not spooled again when `from` is this).
  Status addCopy(BuildFile f, const FileSet& from, const BuildFile& src);
  void remove(const std::string& path) { files_.erase(path); }

  const BuildFile* find(std::string_view path) const;
  const std::map<std::string, BuildFile, std::less<>>& files() const { return files_; }
  int fd() const { return fd_ ? fd_->get() : -1; }
  // The bytes of a regular file of this set; kResourceExhausted over `max`.
  Result<std::string> read(const BuildFile& f, size_t max) const;
  // A source of a regular file's bytes (valid while the set lives).
  std::unique_ptr<ByteSource> open(const BuildFile& f) const;

 private:
  Status checkPath(const std::string& path) const;
  std::shared_ptr<UniqueFd> fd_;
  uint64_t end_ = 0;
  FileSetLimits limits_;
  std::map<std::string, BuildFile, std::less<>> files_;
};

// Reads a tar archive (plain, gzip, bzip2, xz or zstd; an empty stream is an
// empty archive when allowEmpty) into a new set spooling in `spoolDir`.
// Names lose a leading "./" or "/" and are cleaned; directories, regular
// files, symlinks and hard links (made copies of their target's bytes) are
// kept; devices, FIFOs and sockets are skipped. `resetOwners`: every entry
// 0:0 (a build context: COPY ignores the context's owners).
// Errors: kInvalidArgument (field `field`) for data that is not such an
// archive, a ".." in a name, a hard link to a missing file; kDataLoss for a
// truncated or corrupt archive; the limits' kResourceExhausted; in's errors.
// *notArchive (if given) is set true, with the error, when `in` is not an
// archive at all (ADD then copies the file as it is).
Result<FileSet> readTarArchive(ByteSource& in, const std::string& spoolDir,
                               const std::string& field, bool resetOwners, bool allowEmpty,
                               bool* notArchive = nullptr, FileSetLimits limits = {});

// Applies the context's .dockerignore (if the set has one): removes what it
// excludes. Errors: DockerIgnore::parse's (field "dockerignore").
Status applyDockerIgnore(FileSet& set);

// What COPY/ADD takes from a set.
struct CopyItem {
  const BuildFile* file = nullptr;  // in the set selectCopySources was given
  std::string rel;                  // where it goes below the destination directory
  bool named = false;  // a source named it (or a wildcard matched it), not one inside a directory
};
struct CopySelection {
  std::vector<CopyItem> items;  // sorted by rel, one per rel (the last source wins)
  // One source, a file or symlink (not a directory, not several wildcard
  // matches): it becomes the destination itself unless the destination is a
  // directory (ends in '/', or is one in the image).
  bool singleFile = false;
};
// Selects the files `sources` (as written: relative to the set's root, a
// leading '/' ignored; Go filepath.Match wildcards matched at their depth)
// name: a directory gives its contents (not itself), a file or symlink gives
// itself under its base name; a symlink named as a source (not one inside a
// directory) is followed within the set. `excludes` (COPY --exclude) are
// patterns matched against each path in the set. `what` names the
// instruction in messages ("COPY").
// Errors (kInvalidArgument, field "dockerfile", without the line): a source
// that is missing or matches nothing, a symlink source leading outside the
// set or in a loop, a bad pattern.
Result<CopySelection> selectCopySources(const FileSet& set, const std::vector<std::string>& sources,
                                        const std::vector<std::string>& excludes,
                                        std::string_view what);

// Where `dest` (COPY's last argument, WORKDIR-relative unless absolute) is
// in the image: absolute and clean. `workdir` "" is "/". *isDir (if given):
// whether it names a directory by its form (ends in '/', "." or "..").
std::string resolveDest(std::string_view dest, std::string_view workdir, bool* isDir = nullptr);

// COPY/ADD --chown: "user[:group]", each a name or a numeric id; a user
// without a group takes the user's id as its gid (Docker's rule). Names are
// looked up in the image's /etc/passwd and /etc/group texts (nullopt: the
// image has none). Errors: kInvalidArgument (field "dockerfile", without the
// line) for an empty part, an unknown name, an id over 4294967294.
struct Owner {
  uint32_t uid = 0;
  uint32_t gid = 0;
};
Result<Owner> resolveChown(std::string_view spec, const std::optional<std::string>& passwd,
                           const std::optional<std::string>& group);
// Whether COPY's --chown value needs the image's /etc/passwd or /etc/group.
bool chownNeedsNames(std::string_view spec);

// Whether `head` (a file's first bytes, up to 512) looks like an archive ADD
// unpacks: gzip, bzip2, xz or zstd data, or a tar.
bool looksLikeArchive(std::string_view head);

// One entry of a layer tar (tarOf).
struct LayerEntry {
  std::string path;   // absolute in the image ("/app/x"), clean; "/" itself is not allowed
  uint32_t mode = 0;  // st_mode: type and permissions
  uint32_t uid = 0;
  uint32_t gid = 0;
  int64_t mtime = 0;
  uint64_t size = 0;
  std::string link;  // symlink target
  int fd = -1;       // regular files: the bytes are fd[offset, offset + size)
  uint64_t offset = 0;
};
// A tar (ustar, with PAX records for long names, large sizes and ids) of
// `entries` in the order given, ending with the two zero blocks. The fds
// must stay open while it is read. Errors from read(): sysError of pread,
// kDataLoss when a file's bytes end early.
std::unique_ptr<ByteSource> tarOf(std::vector<LayerEntry> entries);

// One tar header (and its PAX extended header when needed) appended to `out`.
// `type`: '0' file, '5' directory, '2' symlink.
void appendTarHeader(std::string& out, const std::string& name, char type, uint32_t perm,
                     uint32_t uid, uint32_t gid, uint64_t size, int64_t mtime,
                     const std::string& link);

// The step cache's key (docs/images.md, "Building from a Dockerfile"): a
// SHA-256 over everything a step's result depends on. `parent`: the key of
// the state before the step (for the first step, the base image's layer
// digests); `files`: what a COPY/ADD reads (each rel, mode, owner, size and
// content digest or link target), so that editing one file busts exactly
// the steps that copy it.
struct StepKeyInput {
  std::string parent;
  std::string owner;               // the tenant: caches are never shared across tenants
  std::string instruction;         // instructionText()
  std::vector<std::string> env;    // RUN: the environment, "K=V"
  std::vector<std::string> shell;  // RUN shell form: the shell
  std::string user;
  std::string workdir;
  bool network = false;
  std::vector<CopyItem> files;
  std::string source;  // COPY --from: the source stack's identity (layer digests)
};
std::string stepCacheKey(const StepKeyInput& in);  // "sha256:<hex>"

// The instruction as the cache sees it: keyword, substituted arguments,
// flags, --exclude patterns and form, canonically (JSON).
std::string instructionText(const Instruction& i);

// Writes `dir` as a build context tar to `outFd` (PAX, entries in byte order,
// owners 0:0, mtimes kept), leaving out what its .dockerignore excludes
// (directories an exception may re-enter are walked). Sockets, devices and
// FIFOs are skipped. Returns the SHA-256 ("sha256:<hex>") and size of what
// was written. Errors: sysError naming the path; DockerIgnore::parse's.
struct PackedContext {
  std::string digest;
  uint64_t size = 0;
  int64_t files = 0;
};
Result<PackedContext> packContextDir(const std::string& dir, int outFd);

}  // namespace dsec::image
