// .dockerignore: which build-context paths a build may see. Follows Docker:
// moby/patternmatcher/ignorefile (reading the file), moby/patternmatcher
// (matching) and tonistiigi/fsutil's filtered walk (when an excluded
// directory must still be entered).
//
// Patterns are Go filepath.Match globs over slash-separated relative paths
// (`*` and `?` stop at '/', `[a-z]`/`[^a-z]` classes, `\` escapes) plus `**`,
// which spans any number of directories. A path is excluded when the last
// pattern that matches it, or one of its parent directories, is not a `!`
// exception. Known differences from patternmatcher, all in patterns Docker
// users do not write: a class never becomes part of a regexp (so `[*]` is a
// literal star and `\d` is a literal d), and a reversed class range such as
// `[z-a]` is rejected when the file is parsed instead of on first match.
//
// Thread safety: immutable after construction; const methods may be called
// concurrently.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "common/status.h"

namespace dsec::image {

class DockerIgnore {
 public:
  struct Pattern {
    std::string text;        // cleaned, without the leading '!'
    bool exclusion = false;  // a `!` exception: re-includes what it matches
    int line = 0;            // 1-based line in the file; 0 when given as a list
  };

  // What a walker remembers about a directory, so its children are matched
  // against patterns that did not already match the directory
  // (patternmatcher MatchInfo). Default-constructed: nothing known.
  struct MatchInfo {
    std::vector<bool> parentMatched;
  };

  DockerIgnore() = default;  // excludes nothing

  // Reads a .dockerignore file (ignorefile.ReadAll then patternmatcher.New):
  // a UTF-8 BOM is dropped; lines starting with '#' are comments; each other
  // line is trimmed, blank ones skipped, a leading '!' marks an exception,
  // the rest is path.Clean'ed and one leading '/' dropped. Errors:
  // kInvalidArgument, field "dockerignore", message ".dockerignore:<line>:
  // ..." for a lone "!" or a malformed pattern (e.g. "[", "a\\" at the end).
  static Result<DockerIgnore> parse(std::string_view text);

  // patternmatcher.New over patterns already read (each trimmed and
  // cleaned, blank ones skipped). Same errors, with "pattern <n>: ..." in
  // place of the line.
  static Result<DockerIgnore> fromPatterns(const std::vector<std::string>& patterns);

  // True if `path` (relative, '/'-separated, as a walk of the context yields
  // it, e.g. "dir/file") is excluded (patternmatcher MatchesOrParentMatches).
  // "." is never excluded.
  bool excluded(std::string_view path) const;

  // The same answer for a walk that visits parents first: pass the
  // MatchInfo the parent directory produced (or {} at the top); `self` gets
  // this path's, to pass to its children if it is a directory
  // (MatchesUsingParentResults).
  bool excludedUsingParent(std::string_view path, const MatchInfo& parent, MatchInfo* self) const;

  // For an excluded directory `dir`: whether the walk must still enter it
  // because an exception may re-include something below it (fsutil's
  // filterFS). False when it can be skipped whole.
  bool mayContainExceptions(std::string_view dir) const;

  bool hasExceptions() const { return exclusions_; }
  bool empty() const { return patterns_.empty(); }
  const std::vector<Pattern>& patterns() const { return patterns_; }

  // Internal: one compiled pattern (public so the implementation's helpers
  // can name it).
  struct Compiled;

 private:
  static Result<DockerIgnore> build(const std::vector<std::pair<std::string, int>>& patterns,
                                    bool fromFile);
  bool matchOne(size_t i, std::string_view path) const;

  std::vector<Pattern> patterns_;
  std::vector<std::shared_ptr<const Compiled>> compiled_;
  bool exclusions_ = false;
  bool onlyPrefixExceptions_ = true;  // no exception has wildcards before a trailing glob
};

// Go's path.Clean.
std::string cleanPath(std::string_view path);

// Go's filepath.Match on Linux: whether `name` matches the glob `pattern`.
// Error: kInvalidArgument "syntax error in pattern" for a malformed pattern.
Result<bool> goFilepathMatch(std::string_view pattern, std::string_view name);

}  // namespace dsec::image
