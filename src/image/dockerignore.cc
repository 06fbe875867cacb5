// .dockerignore matching after moby/patternmatcher; see dockerignore.h.
#include "image/dockerignore.h"

#include <algorithm>

namespace dsec::image {
namespace {

bool isSpace(unsigned char c) {
  return c == ' ' || c == '\t' || c == '\n' || c == '\v' || c == '\f' || c == '\r';
}

std::string_view trimSpace(std::string_view s) {
  while (!s.empty() && isSpace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && isSpace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  return s;
}

// Decodes one UTF-8 code point at s[i]; invalid bytes decode as U+FFFD
// with width 1, as Go's utf8.DecodeRuneInString.
uint32_t decodeAt(std::string_view s, size_t i, size_t* width) {
  unsigned char c = static_cast<unsigned char>(s[i]);
  int len = c < 0x80 ? 1 : (c >> 5) == 0x6 ? 2 : (c >> 4) == 0xe ? 3 : (c >> 3) == 0x1e ? 4 : 0;
  if (len == 1) {
    *width = 1;
    return c;
  }
  if (len == 0 || i + len > s.size()) {
    *width = 1;
    return 0xFFFD;
  }
  uint32_t cp = len == 2 ? (c & 0x1f) : len == 3 ? (c & 0x0f) : (c & 0x07);
  for (int k = 1; k < len; ++k) {
    unsigned char cc = static_cast<unsigned char>(s[i + k]);
    if ((cc & 0xc0) != 0x80) {
      *width = 1;
      return 0xFFFD;
    }
    cp = (cp << 6) | (cc & 0x3f);
  }
  *width = static_cast<size_t>(len);
  return cp;
}

std::vector<uint32_t> codePoints(std::string_view s) {
  std::vector<uint32_t> out;
  for (size_t i = 0; i < s.size();) {
    size_t w;
    out.push_back(decodeAt(s, i, &w));
    i += w;
  }
  return out;
}

Status badPattern() { return Status(Code::kInvalidArgument, "syntax error in pattern"); }

// ---- Go's path/filepath Match (match.go), Linux flavour.

void scanChunk(std::string_view* pattern, bool* star, std::string_view* chunk) {
  std::string_view p = *pattern;
  *star = false;
  while (!p.empty() && p[0] == '*') {
    p.remove_prefix(1);
    *star = true;
  }
  bool inrange = false;
  size_t i = 0;
  for (; i < p.size(); ++i) {
    char c = p[i];
    if (c == '\\') {
      if (i + 1 < p.size()) ++i;
    } else if (c == '[') {
      inrange = true;
    } else if (c == ']') {
      inrange = false;
    } else if (c == '*' && !inrange) {
      break;
    }
  }
  *chunk = p.substr(0, i);
  *pattern = p.substr(i);
}

// getEsc: one possibly escaped character of a class.
bool getEsc(std::string_view* chunk, uint32_t* r) {
  std::string_view c = *chunk;
  if (c.empty() || c[0] == '-' || c[0] == ']') return false;
  if (c[0] == '\\') {
    c.remove_prefix(1);
    if (c.empty()) return false;
  }
  size_t w;
  *r = decodeAt(c, 0, &w);
  if (*r == 0xFFFD && w == 1 && static_cast<unsigned char>(c[0]) >= 0x80) return false;
  c.remove_prefix(w);
  if (c.empty()) return false;
  *chunk = c;
  return true;
}

// matchChunk: false with *err set for a malformed chunk.
bool matchChunk(std::string_view chunk, std::string_view s, std::string_view* rest, bool* err) {
  *err = false;
  bool failed = false;
  while (!chunk.empty()) {
    if (!failed && s.empty()) failed = true;
    switch (chunk[0]) {
      case '[': {
        uint32_t r = 0;
        if (!failed) {
          size_t w;
          r = decodeAt(s, 0, &w);
          s.remove_prefix(w);
        }
        chunk.remove_prefix(1);
        bool negated = false;
        if (!chunk.empty() && chunk[0] == '^') {
          negated = true;
          chunk.remove_prefix(1);
        }
        bool match = false;
        int nrange = 0;
        for (;;) {
          if (!chunk.empty() && chunk[0] == ']' && nrange > 0) {
            chunk.remove_prefix(1);
            break;
          }
          uint32_t lo, hi;
          if (!getEsc(&chunk, &lo)) {
            *err = true;
            return false;
          }
          hi = lo;
          if (chunk[0] == '-') {
            chunk.remove_prefix(1);
            if (!getEsc(&chunk, &hi)) {
              *err = true;
              return false;
            }
          }
          if (lo <= r && r <= hi) match = true;
          ++nrange;
        }
        if (match == negated) failed = true;
        break;
      }
      case '?':
        if (!failed) {
          if (s[0] == '/') failed = true;
          size_t w;
          decodeAt(s, 0, &w);
          s.remove_prefix(w);
        }
        chunk.remove_prefix(1);
        break;
      case '\\':
        chunk.remove_prefix(1);
        if (chunk.empty()) {
          *err = true;
          return false;
        }
        [[fallthrough]];
      default:
        if (!failed) {
          if (chunk[0] != s[0]) failed = true;
          s.remove_prefix(1);
        }
        chunk.remove_prefix(1);
    }
  }
  if (failed) return false;
  *rest = s;
  return true;
}

// ---- patternmatcher's compiled forms.

enum class MatchType { kExact, kPrefix, kSuffix, kRegexp };

struct Tok {
  enum Type { kLit, kStar, kQuestion, kDirs, kAll, kClass } type;
  uint32_t cp = 0;
  bool negated = false;
  std::vector<std::pair<uint32_t, uint32_t>> ranges;
};

bool shouldEscape(uint32_t c) {
  return c == '.' || c == '+' || c == '(' || c == ')' || c == '|' || c == '{' || c == '}' ||
         c == '$';
}

}  // namespace

struct DockerIgnore::Compiled {
  MatchType type = MatchType::kExact;
  std::string text;
  std::vector<Tok> toks;

  // The regexp form, evaluated directly: the set of reachable positions
  // after each token; a match must end at the end of the path.
  bool matchTokens(const std::vector<uint32_t>& s) const {
    size_t n = s.size();
    std::vector<bool> cur(n + 1, false), nxt(n + 1, false);
    cur[0] = true;
    for (const Tok& t : toks) {
      std::fill(nxt.begin(), nxt.end(), false);
      bool any = false;
      // `open`: some start at or before p reaches p through the token's
      // repeated part; each case is one pass, so a match is linear per token.
      bool open = false;
      for (size_t p = 0; p <= n; ++p) {
        switch (t.type) {
          case Tok::kStar:  // [^/]*
            open = cur[p] || (open && s[p - 1] != '/');
            nxt[p] = open;
            break;
          case Tok::kAll:  // .*  ("." stops at newlines, as in Go)
            open = cur[p] || (open && s[p - 1] != '\n');
            nxt[p] = open;
            break;
          case Tok::kDirs:  // (.*/)?
            nxt[p] = cur[p] || (open && s[p - 1] == '/');
            open = cur[p] || (open && p > 0 && s[p - 1] != '\n');
            break;
          case Tok::kLit:
            if (cur[p] && p < n && s[p] == t.cp) nxt[p + 1] = true;
            break;
          case Tok::kQuestion:  // [^/]
            if (cur[p] && p < n && s[p] != '/') nxt[p + 1] = true;
            break;
          case Tok::kClass: {
            if (!cur[p] || p >= n) break;
            bool in = false;
            for (const auto& [lo, hi] : t.ranges) {
              if (lo <= s[p] && s[p] <= hi) in = true;
            }
            if (in != t.negated) nxt[p + 1] = true;
            break;
          }
        }
        any = any || nxt[p];
      }
      std::swap(cur, nxt);
      if (!any) return false;
    }
    return cur[n];
  }

  bool match(std::string_view path) const {
    switch (type) {
      case MatchType::kExact:
        return path == text;
      case MatchType::kPrefix:
        return path.substr(0, text.size() - 2) == std::string_view(text).substr(0, text.size() - 2);
      case MatchType::kSuffix: {
        std::string_view suffix = std::string_view(text).substr(2);
        if (path.size() >= suffix.size() && path.substr(path.size() - suffix.size()) == suffix) {
          return true;
        }
        return !suffix.empty() && suffix[0] == '/' && path == suffix.substr(1);
      }
      case MatchType::kRegexp:
        return matchTokens(codePoints(path));
    }
    return false;
  }
};

namespace {

// patternmatcher Pattern.compile, producing tokens instead of a regexp.
Result<DockerIgnore::Compiled> compilePattern(const std::string& pattern) {
  DockerIgnore::Compiled c;
  c.text = pattern;
  std::vector<uint32_t> cps = codePoints(pattern);
  size_t k = 0;
  for (size_t i = 0; k < cps.size(); ++i) {
    uint32_t ch = cps[k++];
    if (ch == '*') {
      if (k < cps.size() && cps[k] == '*') {
        ++k;
        if (k < cps.size() && cps[k] == '/') ++k;  // "**/" is "**"
        if (k == cps.size()) {
          if (c.type == MatchType::kExact) {
            c.type = MatchType::kPrefix;
          } else {
            c.toks.push_back({Tok::kAll});
            c.type = MatchType::kRegexp;
          }
        } else {
          c.toks.push_back({Tok::kDirs});
          c.type = MatchType::kRegexp;
        }
        if (i == 0) c.type = MatchType::kSuffix;
      } else {
        c.toks.push_back({Tok::kStar});
        c.type = MatchType::kRegexp;
      }
    } else if (ch == '?') {
      c.toks.push_back({Tok::kQuestion});
      c.type = MatchType::kRegexp;
    } else if (shouldEscape(ch)) {
      c.toks.push_back({Tok::kLit, ch});
    } else if (ch == '\\') {
      if (k < cps.size()) {
        c.toks.push_back({Tok::kLit, cps[k++]});
        c.type = MatchType::kRegexp;
      } else {
        c.toks.push_back({Tok::kLit, ch});
      }
    } else if (ch == '[') {
      Tok t{Tok::kClass};
      if (k < cps.size() && cps[k] == '^') {
        t.negated = true;
        ++k;
      }
      auto esc = [&](uint32_t* r) {
        if (k >= cps.size() || cps[k] == '-' || cps[k] == ']') return false;
        if (cps[k] == '\\' && ++k >= cps.size()) return false;
        *r = cps[k++];
        return k < cps.size();
      };
      for (;;) {
        if (k < cps.size() && cps[k] == ']' && !t.ranges.empty()) {
          ++k;
          break;
        }
        uint32_t lo, hi;
        if (!esc(&lo)) return badPattern();
        hi = lo;
        if (cps[k] == '-') {
          ++k;
          if (!esc(&hi)) return badPattern();
        }
        if (lo > hi) return badPattern();  // Go's regexp refuses [z-a]
        t.ranges.emplace_back(lo, hi);
      }
      c.toks.push_back(std::move(t));
      c.type = MatchType::kRegexp;
    } else if (ch == ']') {
      c.toks.push_back({Tok::kLit, ch});
      c.type = MatchType::kRegexp;
    } else {
      c.toks.push_back({Tok::kLit, ch});
    }
  }
  return c;
}

std::string_view dirOf(std::string_view path, std::string* storage) {
  size_t slash = path.rfind('/');
  *storage =
      cleanPath(slash == std::string_view::npos ? std::string_view() : path.substr(0, slash + 1));
  return *storage;
}

std::vector<std::string_view> splitSlash(std::string_view s) {
  std::vector<std::string_view> out;
  size_t start = 0;
  for (;;) {
    size_t p = s.find('/', start);
    out.push_back(
        s.substr(start, p == std::string_view::npos ? std::string_view::npos : p - start));
    if (p == std::string_view::npos) break;
    start = p + 1;
  }
  return out;
}

std::string_view withoutTrailingGlob(std::string_view p) {
  if (p.size() >= 3 && p.substr(p.size() - 3) == "/**") p.remove_suffix(3);
  if (p.size() >= 2 && p.substr(p.size() - 2) == "/*") p.remove_suffix(2);
  return p;
}

}  // namespace

std::string cleanPath(std::string_view path) {
  if (path.empty()) return ".";
  bool rooted = path[0] == '/';
  std::vector<std::string_view> parts;
  for (std::string_view e : splitSlash(path)) {
    if (e.empty() || e == ".") continue;
    if (e == "..") {
      if (!parts.empty() && parts.back() != "..") {
        parts.pop_back();
      } else if (!rooted) {
        parts.push_back(e);
      }
      continue;
    }
    parts.push_back(e);
  }
  std::string out = rooted ? "/" : "";
  for (size_t i = 0; i < parts.size(); ++i) {
    if (i) out += '/';
    out += parts[i];
  }
  if (out.empty()) return ".";
  return out;
}

Result<bool> goFilepathMatch(std::string_view pattern, std::string_view name) {
  while (!pattern.empty()) {
    bool star;
    std::string_view chunk;
    scanChunk(&pattern, &star, &chunk);
    if (star && chunk.empty()) return name.find('/') == std::string_view::npos;
    std::string_view t;
    bool err;
    bool ok = matchChunk(chunk, name, &t, &err);
    if (ok && (t.empty() || !pattern.empty())) {
      name = t;
      continue;
    }
    if (err) return badPattern();
    bool next = false;
    if (star) {
      for (size_t i = 0; i < name.size() && name[i] != '/'; ++i) {
        ok = matchChunk(chunk, name.substr(i + 1), &t, &err);
        if (ok) {
          if (pattern.empty() && !t.empty()) continue;
          name = t;
          next = true;
          break;
        }
        if (err) return badPattern();
      }
    }
    if (next) continue;
    // Check the rest of the pattern is well formed before saying no.
    while (!pattern.empty()) {
      scanChunk(&pattern, &star, &chunk);
      matchChunk(chunk, "", &t, &err);
      if (err) return badPattern();
    }
    return false;
  }
  return name.empty();
}

Result<DockerIgnore> DockerIgnore::parse(std::string_view text) {
  if (text.substr(0, 3) == "\xEF\xBB\xBF") text.remove_prefix(3);
  std::vector<std::pair<std::string, int>> patterns;
  int line = 0;
  size_t pos = 0;
  while (pos < text.size()) {
    size_t nl = text.find('\n', pos);
    std::string_view raw =
        text.substr(pos, nl == std::string_view::npos ? std::string_view::npos : nl - pos);
    pos = nl == std::string_view::npos ? text.size() : nl + 1;
    ++line;
    if (!raw.empty() && raw.back() == '\r') raw.remove_suffix(1);  // bufio.ScanLines
    if (!raw.empty() && raw[0] == '#') continue;                   // a comment only in column 1
    std::string_view p = trimSpace(raw);
    if (p.empty()) continue;
    bool invert = p[0] == '!';
    if (invert) p = trimSpace(p.substr(1));
    std::string pattern(p);
    if (!pattern.empty()) {
      pattern = cleanPath(pattern);
      if (pattern.size() > 1 && pattern[0] == '/') pattern.erase(0, 1);
    }
    if (invert) pattern = "!" + pattern;
    patterns.emplace_back(std::move(pattern), line);
  }
  return build(patterns, true);
}

Result<DockerIgnore> DockerIgnore::fromPatterns(const std::vector<std::string>& patterns) {
  std::vector<std::pair<std::string, int>> numbered;
  for (size_t i = 0; i < patterns.size(); ++i) {
    numbered.emplace_back(patterns[i], static_cast<int>(i) + 1);
  }
  return build(numbered, false);
}

Result<DockerIgnore> DockerIgnore::build(const std::vector<std::pair<std::string, int>>& patterns,
                                         bool fromFile) {
  DockerIgnore di;
  for (const auto& [raw, line] : patterns) {
    auto fail = [&, line = line](const std::string& msg) {
      std::string where =
          fromFile ? ".dockerignore:" + std::to_string(line) : "pattern " + std::to_string(line);
      return invalidArg("dockerignore", where + ": " + msg);
    };
    std::string_view t = trimSpace(raw);
    if (t.empty()) continue;
    std::string p = cleanPath(t);
    Pattern pat;
    pat.line = fromFile ? line : 0;
    if (p[0] == '!') {
      if (p.size() == 1) return fail("illegal exclusion pattern: \"!\"");
      pat.exclusion = true;
      p.erase(0, 1);
      di.exclusions_ = true;
    }
    auto syntax = goFilepathMatch(p, ".");
    if (!syntax.isOk()) return fail(syntax.status().message() + ": " + std::string(t));
    auto compiled = compilePattern(p);
    if (!compiled.isOk()) return fail(compiled.status().message() + ": " + std::string(t));
    pat.text = p;
    if (pat.exclusion &&
        withoutTrailingGlob(p).find_first_of("*[]?^\\") != std::string_view::npos) {
      di.onlyPrefixExceptions_ = false;
    }
    di.patterns_.push_back(std::move(pat));
    di.compiled_.push_back(std::make_shared<const Compiled>(std::move(*compiled)));
  }
  return di;
}

bool DockerIgnore::matchOne(size_t i, std::string_view path) const {
  return compiled_[i]->match(path);
}

bool DockerIgnore::excluded(std::string_view path) const {
  if (path == "." || path.empty()) return false;
  std::string parentStorage;
  std::string_view parent = dirOf(path, &parentStorage);
  std::vector<std::string_view> parentDirs = splitSlash(parent);
  bool matched = false;
  for (size_t i = 0; i < patterns_.size(); ++i) {
    // Only a pattern that could change the answer is tried: last match wins.
    if (patterns_[i].exclusion != matched) continue;
    bool match = matchOne(i, path);
    if (!match && parent != ".") {
      for (size_t k = 0; k < parentDirs.size() && !match; ++k) {
        size_t len = parentDirs[k].data() + parentDirs[k].size() - parent.data();
        match = matchOne(i, parent.substr(0, len));
      }
    }
    if (match) matched = !patterns_[i].exclusion;
  }
  return matched;
}

bool DockerIgnore::excludedUsingParent(std::string_view path, const MatchInfo& parent,
                                       MatchInfo* self) const {
  const std::vector<bool>& parentMatched = parent.parentMatched;
  bool known = parentMatched.size() == patterns_.size() && !patterns_.empty();
  MatchInfo info;
  info.parentMatched.assign(patterns_.size(), false);
  bool matched = false;
  for (size_t i = 0; i < patterns_.size(); ++i) {
    bool match = known && parentMatched[i];
    if (!match) {
      if (patterns_[i].exclusion != matched) continue;
      match = matchOne(i, path);
      if (!match && !known) {
        std::string parentStorage;
        std::string_view dir = dirOf(path, &parentStorage);
        if (dir != ".") {
          std::vector<std::string_view> dirs = splitSlash(dir);
          for (size_t k = 0; k < dirs.size() && !match; ++k) {
            size_t len = dirs[k].data() + dirs[k].size() - dir.data();
            match = matchOne(i, dir.substr(0, len));
          }
        }
      }
    }
    info.parentMatched[i] = match;
    if (match) matched = !patterns_[i].exclusion;
  }
  if (self) *self = std::move(info);
  return matched;
}

bool DockerIgnore::mayContainExceptions(std::string_view dir) const {
  if (!exclusions_) return false;
  if (!onlyPrefixExceptions_) return true;
  std::string dirSlash = std::string(dir) + "/";
  for (const Pattern& p : patterns_) {
    if (!p.exclusion) continue;
    std::string patSlash = std::string(withoutTrailingGlob(p.text)) + "/";
    if (patSlash.compare(0, dirSlash.size(), dirSlash) == 0) return true;
  }
  return false;
}

}  // namespace dsec::image
