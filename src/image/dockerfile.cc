// Dockerfile parsing after BuildKit's frontend; see dockerfile.h for the
// contract. The code is organised as BuildKit's is, so each piece can be
// checked against its counterpart:
//   shell lexer .............. frontend/dockerfile/shell/lex.go
//   lines, directives ........ frontend/dockerfile/parser/{parser,directives}.go
//   flags, words, JSON ....... parser/{split_command,line_parsers}.go
//   instruction checks ....... instructions/{parse,bflag}.go
//   stages, ARG scoping ...... dockerfile2llb/convert.go (dispatchArg, buildMetaArgs)
#include "image/dockerfile.h"

#include <arpa/inet.h>

#include <algorithm>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <set>

#include "common/util.h"

namespace dsec::image {
namespace {

constexpr int kEof = -1;
constexpr const char* kDefaultPath = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

// Go's unicode.IsSpace, for ASCII.
bool isSpace(int c) {
  return c == ' ' || c == '\t' || c == '\n' || c == '\v' || c == '\f' || c == '\r';
}
// The parser's reWhitespace: [\t\v\f\r ].
bool isReWhitespace(char c) { return c == ' ' || c == '\t' || c == '\v' || c == '\f' || c == '\r'; }
bool isDigit(int c) { return c >= '0' && c <= '9'; }
bool isAlpha(int c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z'); }

std::string_view trimLeft(std::string_view s) {
  size_t i = 0;
  while (i < s.size() && isSpace(static_cast<unsigned char>(s[i]))) ++i;
  return s.substr(i);
}
std::string_view trimRight(std::string_view s) {
  size_t n = s.size();
  while (n > 0 && isSpace(static_cast<unsigned char>(s[n - 1]))) --n;
  return s.substr(0, n);
}
std::string_view trimSpace(std::string_view s) { return trimRight(trimLeft(s)); }

std::string toUpper(std::string_view s) {
  std::string out(s);
  for (char& c : out) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  return out;
}

// Go's %q, close enough for messages.
std::string quote(std::string_view s) {
  std::string out = "\"";
  for (unsigned char c : s) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\t':
        out += "\\t";
        break;
      case '\r':
        out += "\\r";
        break;
      default:
        if (c < 0x20 || c == 0x7f) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\x%02x", c);
          out += buf;
        } else {
          out.push_back(static_cast<char>(c));
        }
    }
  }
  return out + "\"";
}

// Splits on runs of [\t\v\f\r ] (parseStringsWhitespaceDelimited; its input
// is trimmed, so there are no empty fields).
std::vector<std::string> splitWhitespace(std::string_view s) {
  std::vector<std::string> out;
  size_t i = 0;
  while (i < s.size()) {
    while (i < s.size() && isReWhitespace(s[i])) ++i;
    size_t start = i;
    while (i < s.size() && !isReWhitespace(s[i])) ++i;
    if (i > start) out.emplace_back(s.substr(start, i - start));
  }
  return out;
}

const std::string* lookupEnv(const EnvList& env, std::string_view name) {
  for (auto it = env.rbegin(); it != env.rend(); ++it) {
    if (it->first == name) return &it->second;
  }
  return nullptr;
}

void setEnv(EnvList& env, const std::string& key, const std::string& value) {
  for (auto& kv : env) {
    if (kv.first == key) {
      kv.second = value;
      return;
    }
  }
  env.emplace_back(key, value);
}

Status dfError(int line, std::string_view msg) {
  return invalidArg("dockerfile", "Dockerfile:" + std::to_string(line) + ": " + std::string(msg));
}

// ---------------------------------------------------------------------------
// Shell patterns for ${V#p} ${V%p} ${V/p/r}: '*' and '?' over code points,
// neither matching a newline (they become Go regexp ".*" and ".").

struct Utf8 {
  std::vector<uint32_t> cps;
  std::vector<size_t> offsets;  // byte offset of each code point, plus the end
};

Utf8 decodeUtf8(std::string_view s) {
  Utf8 u;
  size_t i = 0;
  while (i < s.size()) {
    u.offsets.push_back(i);
    unsigned char c = static_cast<unsigned char>(s[i]);
    int len = c < 0x80 ? 1 : (c >> 5) == 0x6 ? 2 : (c >> 4) == 0xe ? 3 : (c >> 3) == 0x1e ? 4 : 0;
    uint32_t cp = 0;
    bool ok = len > 0 && i + len <= s.size();
    if (ok) {
      cp = len == 1 ? c : len == 2 ? (c & 0x1f) : len == 3 ? (c & 0x0f) : (c & 0x07);
      for (int k = 1; k < len; ++k) {
        unsigned char cc = static_cast<unsigned char>(s[i + k]);
        if ((cc & 0xc0) != 0x80) {
          ok = false;
          break;
        }
        cp = (cp << 6) | (cc & 0x3f);
      }
    }
    if (!ok) {
      cp = 0xDC00 + c;  // an invalid byte stands for itself
      len = 1;
    }
    u.cps.push_back(cp);
    i += len;
  }
  u.offsets.push_back(s.size());
  return u;
}

struct PatTok {
  enum Type { kLit, kStar, kAny } type;
  uint32_t cp = 0;
};

Result<std::vector<PatTok>> compileShellPattern(std::string_view pattern) {
  Utf8 u = decodeUtf8(pattern);
  std::vector<PatTok> toks;
  for (size_t i = 0; i < u.cps.size(); ++i) {
    uint32_t c = u.cps[i];
    if (c == '*') {
      toks.push_back({PatTok::kStar});
    } else if (c == '?') {
      toks.push_back({PatTok::kAny});
    } else if (c == '\\') {
      // "\}" and "\/" are how } and / are written inside ${}: drop the escape.
      if (i + 1 < u.cps.size() && (u.cps[i + 1] == '}' || u.cps[i + 1] == '/')) continue;
      if (i + 1 >= u.cps.size()) return Status(Code::kInvalidArgument, "invalid escape '\\'");
      uint32_t n = u.cps[++i];
      if (n != '*' && n != '?' && n != '\\') {
        std::string esc(pattern.substr(u.offsets[i], u.offsets[i + 1] - u.offsets[i]));
        return Status(Code::kInvalidArgument, "invalid escape '\\" + esc + "'");
      }
      toks.push_back({PatTok::kLit, n});
    } else {
      toks.push_back({PatTok::kLit, c});
    }
  }
  return toks;
}

// The positions where a match of `toks` starting at `from` can end.
std::vector<bool> matchEnds(const std::vector<PatTok>& toks, const std::vector<uint32_t>& s,
                            size_t from) {
  size_t n = s.size();
  std::vector<bool> cur(n + 1, false), nxt(n + 1, false);
  cur[from] = true;
  for (const PatTok& t : toks) {
    std::fill(nxt.begin(), nxt.end(), false);
    for (size_t p = from; p <= n; ++p) {
      if (t.type == PatTok::kStar) {  // linear: reachable from an earlier start, no newline between
        nxt[p] = cur[p] || (p > from && nxt[p - 1] && s[p - 1] != '\n');
        continue;
      }
      if (!cur[p] || p == n) continue;
      if (t.type == PatTok::kLit ? s[p] == t.cp : s[p] != '\n') nxt[p + 1] = true;
    }
    std::swap(cur, nxt);
  }
  return cur;
}

// ${V#p} (greedy: ##): drops the shortest (longest) prefix matching p.
Result<std::string> trimPrefixPattern(std::string_view pattern, const std::string& value,
                                      bool greedy) {
  auto toks = compileShellPattern(pattern);
  if (!toks.isOk()) {
    return Status(Code::kInvalidArgument, "invalid pattern (" + std::string(pattern) +
                                              ") in substitution: " + toks.status().message());
  }
  Utf8 u = decodeUtf8(value);
  std::vector<bool> ends = matchEnds(*toks, u.cps, 0);
  size_t n = u.cps.size();
  for (size_t k = 0; k <= n; ++k) {
    size_t e = greedy ? n - k : k;
    if (ends[e]) return value.substr(u.offsets[e]);
  }
  return value;
}

// ${V%p} (greedy: %%): drops the shortest (longest) suffix matching p.
Result<std::string> trimSuffixPattern(std::string_view pattern, const std::string& value,
                                      bool greedy) {
  auto toks = compileShellPattern(pattern);
  if (!toks.isOk()) {
    return Status(Code::kInvalidArgument, "invalid pattern (" + std::string(pattern) +
                                              ") in substitution: " + toks.status().message());
  }
  Utf8 u = decodeUtf8(value);
  size_t n = u.cps.size();
  for (size_t k = 0; k <= n; ++k) {
    size_t start = greedy ? k : n - k;
    if (matchEnds(*toks, u.cps, start)[n]) return value.substr(0, u.offsets[start]);
  }
  return value;
}

// ${V/p/r} and ${V//p/r}: leftmost, longest matches, as Go's regexp with a
// greedy ".*" finds them; empty matches next to a previous match are skipped
// as in Regexp.ReplaceAllString.
Result<std::string> replacePattern(std::string_view pattern, const std::string& value,
                                   const std::string& replacement, bool all) {
  auto toks = compileShellPattern(pattern);
  if (!toks.isOk()) {
    return Status(Code::kInvalidArgument, "invalid pattern (" + std::string(pattern) +
                                              ") in substitution: " + toks.status().message());
  }
  Utf8 u = decodeUtf8(value);
  size_t n = u.cps.size();
  auto findFrom = [&](size_t from, size_t* mStart, size_t* mEnd) {
    for (size_t s = from; s <= n; ++s) {
      std::vector<bool> ends = matchEnds(*toks, u.cps, s);
      for (size_t e = n + 1; e-- > s;) {
        if (ends[e]) {
          *mStart = s;
          *mEnd = e;
          return true;
        }
      }
    }
    return false;
  };
  std::string out;
  size_t lastEnd = 0;
  size_t search = 0;
  while (search <= n) {
    size_t a, b;
    if (!findFrom(search, &a, &b)) break;
    out += value.substr(u.offsets[lastEnd], u.offsets[a] - u.offsets[lastEnd]);
    if (b > lastEnd || a == 0) out += replacement;
    lastEnd = b;
    if (!all) break;
    search = b > search ? b : search + 1;
  }
  out += value.substr(u.offsets[lastEnd]);
  return out;
}

// ---------------------------------------------------------------------------
// The shell lexer (shell/lex.go). One instance per word.

bool isSpecialParam(int c) {
  switch (c) {
    case '@':
    case '*':
    case '#':
    case '?':
    case '-':
    case '$':
    case '!':
    case '0':
      return true;
    default:
      return false;
  }
}

class ShellWord {
 public:
  ShellWord(std::string_view src, const EnvList& env, const ShellLexOptions& opts)
      : src_(src), env_(env), opts_(opts), rawEscapes_(opts.rawEscapes) {}

  Status run(std::string* word, std::vector<std::string>* words) {
    return processStopOn(kEof, opts_.rawEscapes, word, words);
  }

 private:
  // The words of ProcessWords: unquoted whitespace separates them.
  struct Words {
    std::string buf;
    std::vector<std::string> words;
    bool inWord = false;
    void addChar(char ch) {
      if (isSpace(static_cast<unsigned char>(ch)) && inWord) {
        if (!buf.empty()) {
          words.push_back(buf);
          buf.clear();
          inWord = false;
        }
      } else if (!isSpace(static_cast<unsigned char>(ch))) {
        addRawChar(ch);
      }
    }
    void addRawChar(char ch) {
      buf.push_back(ch);
      inWord = true;
    }
    void addString(std::string_view s) {
      for (char c : s) addChar(c);
    }
    void addRawString(std::string_view s) {
      buf += s;
      inWord = true;
    }
    std::vector<std::string> take() {
      if (!buf.empty()) {
        words.push_back(buf);
        buf.clear();
        inWord = false;
      }
      return std::move(words);
    }
  };

  int peek() const { return pos_ < src_.size() ? static_cast<unsigned char>(src_[pos_]) : kEof; }
  int next() { return pos_ < src_.size() ? static_cast<unsigned char>(src_[pos_++]) : kEof; }
  static Status err(std::string msg) { return Status(Code::kInvalidArgument, std::move(msg)); }

  Status processStopOn(int stop, bool rawEscapes, std::string* word,
                       std::vector<std::string>* words) {
    bool saved = rawEscapes_;
    rawEscapes_ = rawEscapes;
    Status st = stopOn(stop, word, words);
    rawEscapes_ = saved;
    return st;
  }

  Status stopOn(int stop, std::string* word, std::vector<std::string>* wordsOut) {
    std::string result;
    Words words;
    const int esc = static_cast<unsigned char>(opts_.escape);
    while (peek() != kEof) {
      int ch = peek();
      if (stop != kEof && ch == stop) {
        next();
        *word = std::move(result);
        if (wordsOut) *wordsOut = words.take();
        return Status::ok();
      }
      if (ch == '$' || ch == '<' || ch == '\'' || ch == '"') {
        std::string tmp;
        Status st = ch == '$'    ? processDollar(&tmp)
                    : ch == '<'  ? processPossibleHeredoc(&tmp)
                    : ch == '\'' ? processSingleQuote(&tmp)
                                 : processDoubleQuote(&tmp);
        if (!st.isOk()) return st;
        result += tmp;
        if (ch == '$') {
          words.addString(tmp);
        } else {
          words.addRawString(tmp);
        }
        continue;
      }
      ch = next();
      if (ch == esc) {
        if (rawEscapes_) {
          words.addRawChar(static_cast<char>(ch));
          result.push_back(static_cast<char>(ch));
        }
        ch = next();  // the escape token escapes anything, except the end
        if (ch == kEof) break;
        words.addRawChar(static_cast<char>(ch));
      } else {
        words.addChar(static_cast<char>(ch));
      }
      result.push_back(static_cast<char>(ch));
    }
    if (stop != kEof) {
      return err(std::string("unexpected end of statement while looking for matching ") +
                 static_cast<char>(stop));
    }
    *word = std::move(result);
    if (wordsOut) *wordsOut = words.take();
    return Status::ok();
  }

  Status processSingleQuote(std::string* out) {
    int ch = next();
    if (opts_.rawQuotes) out->push_back(static_cast<char>(ch));
    for (;;) {
      ch = next();
      if (ch == kEof)
        return err("unexpected end of statement while looking for matching single-quote");
      if (ch == '\'') {
        if (opts_.rawQuotes) out->push_back(static_cast<char>(ch));
        return Status::ok();
      }
      out->push_back(static_cast<char>(ch));
    }
  }

  Status processDoubleQuote(std::string* out) {
    const int esc = static_cast<unsigned char>(opts_.escape);
    int ch = next();
    if (opts_.rawQuotes) out->push_back(static_cast<char>(ch));
    for (;;) {
      int p = peek();
      if (p == kEof)
        return err("unexpected end of statement while looking for matching double-quote");
      if (p == '"') {
        ch = next();
        if (opts_.rawQuotes) out->push_back(static_cast<char>(ch));
        return Status::ok();
      }
      if (p == '$') {
        std::string value;
        RETURN_IF_ERROR(processDollar(&value));
        *out += value;
        continue;
      }
      ch = next();
      if (ch == esc) {
        if (rawEscapes_) out->push_back(static_cast<char>(ch));
        int q = peek();
        if (q == kEof) continue;  // the unterminated quote is reported next round
        if (q == '"' || q == '$' || q == esc) ch = next();  // only these are escaped
      }
      out->push_back(static_cast<char>(ch));
    }
  }

  std::string processName() {
    std::string name;
    while (peek() != kEof) {
      int ch = peek();
      if (name.empty() && isDigit(ch)) {
        while (peek() != kEof && isDigit(peek())) name.push_back(static_cast<char>(next()));
        return name;
      }
      if (name.empty() && isSpecialParam(ch)) {
        next();
        return std::string(1, static_cast<char>(ch));
      }
      // Non-ASCII bytes count as letters (Go: unicode.IsLetter).
      if (!isAlpha(ch) && !isDigit(ch) && ch != '_' && ch < 0x80) break;
      name.push_back(static_cast<char>(next()));
    }
    return name;
  }

  const std::string* getEnv(const std::string& name) const { return lookupEnv(env_, name); }

  Status processDollar(std::string* out) {
    next();  // '$'
    if (peek() != '{') {
      std::string name = processName();
      if (name.empty()) {
        *out = "$";
        return Status::ok();
      }
      const std::string* v = getEnv(name);
      if (!v && opts_.skipUnsetEnv) {
        *out = "$" + name;
      } else {
        *out = v ? *v : "";
      }
      return Status::ok();
    }
    next();  // '{'
    int p = peek();
    if (p == kEof) return err("syntax error: missing '}'");
    if (p == '{' || p == '}' || p == ':') return err("syntax error: bad substitution");
    std::string name = processName();
    int ch = next();
    if (ch == kEof) return err("syntax error: missing '}'");
    std::string chs(1, static_cast<char>(ch));
    if (ch == '}') {
      const std::string* v = getEnv(name);
      if (!v && opts_.skipUnsetEnv) {
        *out = "${" + name + "}";
      } else {
        *out = v ? *v : "";
      }
      return Status::ok();
    }
    bool nullIsUnset = false;
    if (ch == ':') {
      nullIsUnset = true;
      ch = next();
      if (ch != kEof) chs.push_back(static_cast<char>(ch));
    }
    if (nullIsUnset || ch == '+' || ch == '-' || ch == '?' || ch == '#' || ch == '%') {
      bool rawEsc = ch == '#' || ch == '%';
      if (nullIsUnset && rawEsc) return err("unsupported modifier (" + chs + ") in substitution");
      std::string word;
      Status st = processStopOn('}', rawEsc, &word, nullptr);
      if (!st.isOk()) {
        if (peek() == kEof) return err("syntax error: missing '}'");
        return st;
      }
      const std::string* v = getEnv(name);
      if (!v && opts_.skipUnsetEnv) {
        *out = "${" + name + chs + word + "}";
        return Status::ok();
      }
      std::string value = v ? *v : "";
      bool set = v != nullptr;
      switch (ch) {
        case '-':
          *out = (!set || (nullIsUnset && value.empty())) ? word : value;
          return Status::ok();
        case '+':
          *out = (!set || (nullIsUnset && value.empty())) ? "" : word;
          return Status::ok();
        case '?':
          if (!set) return err(name + ": " + (word.empty() ? "is not allowed to be unset" : word));
          if (nullIsUnset && value.empty()) {
            return err(name + ": " + (word.empty() ? "is not allowed to be empty" : word));
          }
          *out = value;
          return Status::ok();
        case '%':
        case '#': {
          bool greedy = !word.empty() && word[0] == static_cast<char>(ch);
          if (greedy) word.erase(0, 1);
          auto r = ch == '%' ? trimSuffixPattern(word, value, greedy)
                             : trimPrefixPattern(word, value, greedy);
          if (!r.isOk()) return std::move(r).takeStatus();
          *out = std::move(*r);
          return Status::ok();
        }
        default:
          return err("unsupported modifier (" + chs + ") in substitution");
      }
    }
    if (ch == '/') {
      bool all = peek() == '/';
      if (all) next();
      std::string pattern, replacement;
      Status st = processStopOn('/', true, &pattern, nullptr);
      if (!st.isOk()) {
        if (peek() == kEof) return err("syntax error: missing '/' in ${}");
        return st;
      }
      st = processStopOn('}', true, &replacement, nullptr);
      if (!st.isOk()) {
        if (peek() == kEof) return err("syntax error: missing '}'");
        return st;
      }
      const std::string* v = getEnv(name);
      if (!v && opts_.skipUnsetEnv) {
        *out = "${" + name + "/" + pattern + "/" + replacement + "}";
        return Status::ok();
      }
      auto r = replacePattern(pattern, v ? *v : "", replacement, all);
      if (!r.isOk()) return std::move(r).takeStatus();
      *out = std::move(*r);
      return Status::ok();
    }
    return err("unsupported modifier (" + chs + ") in substitution");
  }

  Status processPossibleHeredoc(std::string* out) {
    next();
    if (peek() != '<') {
      *out = "<";
      return Status::ok();
    }
    next();
    *out = "<<";
    while (peek() == '\t' || peek() == '\r' || peek() == ' ')
      out->push_back(static_cast<char>(next()));
    return Status::ok();
  }

  std::string_view src_;
  size_t pos_ = 0;
  const EnvList& env_;
  ShellLexOptions opts_;
  bool rawEscapes_;
};

Status lexError(std::string_view word, const Status& st) {
  return invalidArg("dockerfile", "failed to process " + quote(word) + ": " + st.message());
}

}  // namespace

Result<std::string> shellExpandWord(std::string_view word, const EnvList& env,
                                    const ShellLexOptions& opts) {
  ShellWord sw(word, env, opts);
  std::string out;
  Status st = sw.run(&out, nullptr);
  if (!st.isOk()) return lexError(word, st);
  return out;
}

Result<std::vector<std::string>> shellExpandWords(std::string_view word, const EnvList& env,
                                                  const ShellLexOptions& opts) {
  ShellWord sw(word, env, opts);
  std::string out;
  std::vector<std::string> words;
  Status st = sw.run(&out, &words);
  if (!st.isOk()) return lexError(word, st);
  return words;
}

namespace {

// ---------------------------------------------------------------------------
// Physical lines to logical lines (parser.go Parse): directives, comments,
// continuation with the escape token.

struct LogicalLine {
  std::string text;
  int start = 0;  // 1-based
  int end = 0;
};

struct Directives {
  char escape = '\\';
  bool done = false;
  std::set<std::string> seen;

  // DirectiveParser.ParseLine: true if `line` is a directive. Directives end
  // at the first line that is not one.
  Result<bool> parseLine(std::string_view line) {
    if (done) return false;
    if (line.empty() || line[0] != '#') {
      done = true;
      return false;
    }
    std::string_view rest = trimLeft(line.substr(1));
    // ^([a-zA-Z][a-zA-Z0-9]*)\s*=\s*(.+?)\s*$
    auto isReSpace = [](char c) {
      return c == ' ' || c == '\t' || c == '\n' || c == '\f' || c == '\r';
    };
    size_t i = 0;
    if (rest.empty() || !isAlpha(static_cast<unsigned char>(rest[0]))) {
      done = true;
      return false;
    }
    while (i < rest.size() && (isAlpha(static_cast<unsigned char>(rest[i])) ||
                               isDigit(static_cast<unsigned char>(rest[i])))) {
      ++i;
    }
    std::string key = asciiLower(rest.substr(0, i));
    while (i < rest.size() && isReSpace(rest[i])) ++i;
    if (i >= rest.size() || rest[i] != '=') {
      done = true;
      return false;
    }
    ++i;
    std::string_view tail = rest.substr(i);
    if (tail.empty()) {
      done = true;
      return false;
    }
    size_t b = 0;
    while (b < tail.size() && isReSpace(tail[b])) ++b;
    size_t e = tail.size();
    while (e > b && isReSpace(tail[e - 1])) --e;
    // (.+?) needs one character: an all-space value keeps its last space.
    std::string value = b < e ? std::string(tail.substr(b, e - b)) : std::string(1, tail.back());
    if (key != "syntax" && key != "escape" && key != "check") {
      done = true;
      return false;
    }
    if (!seen.insert(key).second) {
      return Status(Code::kInvalidArgument, "only one " + key + " parser directive can be used");
    }
    if (key == "escape") {
      if (value != "`" && value != "\\") {
        return Status(Code::kInvalidArgument,
                      "invalid escape token '" + value + "' does not match ` or \\");
      }
      escape = value[0];
    }
    return true;
  }
};

std::string_view trimNewline(std::string_view s) {
  while (!s.empty() && (s.back() == '\r' || s.back() == '\n')) s.remove_suffix(1);
  return s;
}

bool isCommentLine(std::string_view raw) {
  std::string_view t = trimLeft(raw);
  return !t.empty() && t[0] == '#';
}

// trimContinuationCharacter: the escape token as the last non-blank, not
// itself escaped, joins the next line.
bool trimContinuation(std::string* line, char escape) {
  size_t n = line->size();
  while (n > 0 && ((*line)[n - 1] == ' ' || (*line)[n - 1] == '\t')) --n;
  if (n == 0 || (*line)[n - 1] != escape) return true;
  if (n >= 2 && (*line)[n - 2] == escape) return true;
  line->resize(n - 1);
  return false;
}

Result<std::vector<LogicalLine>> logicalLines(std::string_view text, Directives* d,
                                              int* physicalLines) {
  std::vector<std::string_view> raw;
  size_t pos = 0;
  while (pos < text.size()) {
    size_t nl = text.find('\n', pos);
    size_t end = nl == std::string_view::npos ? text.size() : nl + 1;
    raw.push_back(text.substr(pos, end - pos));
    pos = end;
  }
  if (!raw.empty() && raw[0].substr(0, 3) == "\xEF\xBB\xBF") raw[0].remove_prefix(3);
  *physicalLines = static_cast<int>(raw.size());

  auto process = [&](size_t idx, bool stripLeft, std::string* out) -> Status {
    std::string_view tok = trimNewline(raw[idx]);
    if (stripLeft) tok = trimLeft(tok);
    auto directive = d->parseLine(tok);
    if (!directive.isOk()) return dfError(static_cast<int>(idx) + 1, directive.status().message());
    *out = isCommentLine(tok) ? std::string() : std::string(tok);
    return Status::ok();
  };

  std::vector<LogicalLine> out;
  size_t i = 0;
  while (i < raw.size()) {
    std::string line;
    RETURN_IF_ERROR(process(i, true, &line));
    int start = static_cast<int>(++i);
    bool eol = trimContinuation(&line, d->escape);
    if (eol && line.empty()) continue;
    std::string buf = line;
    while (!eol && i < raw.size()) {
      RETURN_IF_ERROR(process(i, false, &line));
      std::string_view rawLine = raw[i];
      ++i;
      if (isCommentLine(rawLine)) continue;  // comments inside a continuation are dropped
      if (trimLeft(trimNewline(line)).empty()) continue;  // so are empty lines
      eol = trimContinuation(&line, d->escape);
      buf += line;
    }
    out.push_back({std::move(buf), start, static_cast<int>(i)});
  }
  return out;
}

// ---------------------------------------------------------------------------
// One logical line to an instruction (split_command.go, line_parsers.go,
// instructions/parse.go).

struct Split {
  std::string cmd;
  std::vector<std::string> flags;
  std::string args;
};

// extractBuilderFlags: leading --words, quotes and the escape token honoured.
std::string extractFlags(std::string_view line, char escape, std::vector<std::string>* words) {
  enum { kInSpaces, kInWord, kInQuote } phase = kInSpaces;
  std::string sb;
  char quoteCh = 0;
  bool blankOK = false;
  for (size_t pos = 0; pos <= line.size(); ++pos) {
    char ch = pos < line.size() ? line[pos] : 0;
    if (phase == kInSpaces) {
      if (pos == line.size()) break;
      if (isSpace(static_cast<unsigned char>(ch))) continue;
      if (ch != '-' || pos + 1 == line.size() || line[pos + 1] != '-') {
        return std::string(line.substr(pos));
      }
      phase = kInWord;
    }
    if ((phase == kInWord || phase == kInQuote) && pos == line.size()) {
      if (sb != "--" && (blankOK || !sb.empty())) words->push_back(sb);
      break;
    }
    if (phase == kInWord) {
      if (isSpace(static_cast<unsigned char>(ch))) {
        phase = kInSpaces;
        if (sb == "--") return std::string(line.substr(pos));
        if (blankOK || !sb.empty()) words->push_back(sb);
        sb.clear();
        blankOK = false;
        continue;
      }
      if (ch == '\'' || ch == '"') {
        quoteCh = ch;
        blankOK = true;
        phase = kInQuote;
        continue;
      }
      if (ch == escape) {
        if (pos + 1 == line.size()) continue;
        ch = line[++pos];
      }
      sb.push_back(ch);
      continue;
    }
    // kInQuote
    if (ch == quoteCh) {
      phase = kInWord;
      continue;
    }
    if (ch == escape) {
      if (pos + 1 == line.size()) {
        phase = kInWord;
        continue;
      }
      ch = line[++pos];
    }
    sb.push_back(ch);
  }
  return "";
}

Split splitCommand(std::string_view line, char escape) {
  Split sp;
  std::string_view t = trimSpace(line);
  size_t i = 0;
  while (i < t.size() && !isReWhitespace(t[i])) ++i;
  sp.cmd = std::string(t.substr(0, i));
  if (i < t.size()) {
    while (i < t.size() && isReWhitespace(t[i])) ++i;
    std::string rest = extractFlags(t.substr(i), escape, &sp.flags);
    sp.args = std::string(trimSpace(rest));
  }
  return sp;
}

// parseWords: words with quotes and escapes kept (they are processed when
// the value is expanded).
std::vector<std::string> parseWords(std::string_view rest, char escape) {
  enum { kInSpaces, kInWord, kInQuote } phase = kInSpaces;
  std::vector<std::string> words;
  std::string sb;
  char quoteCh = 0;
  bool blankOK = false;
  for (size_t pos = 0; pos <= rest.size(); ++pos) {
    char ch = pos < rest.size() ? rest[pos] : 0;
    if (phase == kInSpaces) {
      if (pos == rest.size()) break;
      if (isSpace(static_cast<unsigned char>(ch))) continue;
      phase = kInWord;
    }
    if ((phase == kInWord || phase == kInQuote) && pos == rest.size()) {
      if (blankOK || !sb.empty()) words.push_back(sb);
      break;
    }
    if (phase == kInWord) {
      if (isSpace(static_cast<unsigned char>(ch))) {
        phase = kInSpaces;
        if (blankOK || !sb.empty()) words.push_back(sb);
        sb.clear();
        blankOK = false;
        continue;
      }
      if (ch == '\'' || ch == '"') {
        quoteCh = ch;
        blankOK = true;
        phase = kInQuote;
      }
      if (ch == escape) {
        if (pos + 1 == rest.size()) continue;  // a trailing escape is dropped
        sb.push_back(ch);
        ch = rest[++pos];
      }
      sb.push_back(ch);
      continue;
    }
    // kInQuote
    if (ch == quoteCh) phase = kInWord;
    if (ch == escape && quoteCh != '\'') {
      if (pos + 1 == rest.size()) {
        phase = kInWord;
        continue;
      }
      sb.push_back(ch);
      ch = rest[++pos];
    }
    sb.push_back(ch);
  }
  return words;
}

enum class JsonParse { kNotJson, kOk, kNotStrings };

// parseJSON: a JSON array of strings, or not JSON at all (then the caller
// falls back to the shell form); an array holding anything else is an error.
JsonParse parseJsonArray(std::string_view rest, std::vector<std::string>* out) {
  std::string_view s = trimLeft(rest);
  if (s.empty() || s[0] != '[') return JsonParse::kNotJson;
  nlohmann::json j = nlohmann::json::parse(s.begin(), s.end(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_array()) return JsonParse::kNotJson;
  std::vector<std::string> v;
  for (const auto& e : j) {
    if (!e.is_string()) return JsonParse::kNotStrings;
    v.push_back(e.get<std::string>());
  }
  *out = std::move(v);
  return JsonParse::kOk;
}

constexpr const char* kNotStringArray =
    "when using JSON array syntax, arrays must be comprised of strings only";

// A `<<WORD` that BuildKit would read as a heredoc (parser.go heredocsFromLine).
bool looksLikeHeredoc(std::string_view line) {
  if (line.find("<<") == std::string_view::npos) return false;
  ShellLexOptions raw{'\\', true, true, true};
  auto words = shellExpandWords(line, {}, raw);
  if (!words.isOk()) return false;
  for (const std::string& w : *words) {
    // ^(\d*)<<(-?)\s*([^<]*)$
    size_t i = 0;
    while (i < w.size() && isDigit(static_cast<unsigned char>(w[i]))) ++i;
    if (w.compare(i, 2, "<<") != 0) continue;
    i += 2;
    if (i < w.size() && w[i] == '-') ++i;
    while (i < w.size() &&
           (w[i] == ' ' || w[i] == '\t' || w[i] == '\n' || w[i] == '\f' || w[i] == '\r')) {
      ++i;
    }
    std::string rest = w.substr(i);
    if (rest.empty() || rest.find('<') != std::string::npos) continue;
    ShellLexOptions plain{'\\', false, false, true};
    auto name = shellExpandWords(rest, {}, plain);
    if (!name.isOk() || name->size() == 1) return true;
  }
  return false;
}

enum class FlagType { kBool, kString, kStrings, kUnsupported };
struct FlagSpec {
  const char* name;
  FlagType type;
};

// BFlags.Parse, plus flags BuildKit knows and dsec refuses.
Status parseFlags(const std::vector<std::string>& words, const std::vector<FlagSpec>& specs,
                  const std::string& keyword, Instruction* inst) {
  std::set<std::string> used;
  for (const std::string& a : words) {
    if (a == "--") return Status::ok();
    if (a.rfind("--", 0) != 0) {
      return Status(Code::kInvalidArgument, "arg should start with -- : " + a);
    }
    size_t eq = a.find('=');
    bool hasValue = eq != std::string::npos;
    std::string flagName = a.substr(0, eq);
    std::string value = hasValue ? a.substr(eq + 1) : "";
    std::string name = flagName.substr(2);
    const FlagSpec* spec = nullptr;
    for (const FlagSpec& s : specs) {
      if (name == s.name) spec = &s;
    }
    if (!spec) return Status(Code::kInvalidArgument, "unknown flag: " + flagName);
    if (spec->type == FlagType::kUnsupported) {
      return Status(Code::kInvalidArgument,
                    keyword + " " + flagName + " is not supported by dsec image build");
    }
    if (!used.insert(name).second && spec->type != FlagType::kStrings) {
      return Status(Code::kInvalidArgument, "duplicate flag specified: " + flagName);
    }
    switch (spec->type) {
      case FlagType::kBool: {
        if (hasValue && value.empty()) {
          return Status(Code::kInvalidArgument, "missing a value on flag: " + flagName);
        }
        std::string v = asciiLower(value);
        if (v == "true" || v.empty()) {
          inst->flags[name] = "true";
        } else if (v == "false") {
          inst->flags[name] = "false";
        } else {
          return Status(Code::kInvalidArgument,
                        "expecting boolean value for flag " + flagName + ", not: " + value);
        }
        break;
      }
      case FlagType::kString:
        if (!hasValue)
          return Status(Code::kInvalidArgument, "missing a value on flag: " + flagName);
        inst->flags[name] = value;
        break;
      case FlagType::kStrings:
        if (!hasValue)
          return Status(Code::kInvalidArgument, "missing a value on flag: " + flagName);
        inst->excludes.push_back(value);
        break;
      case FlagType::kUnsupported:
        break;
    }
  }
  return Status::ok();
}

// Go's time.ParseDuration, in nanoseconds.
Result<int64_t> parseGoDuration(const std::string& s) {
  auto bad = [&] { return Status(Code::kInvalidArgument, "time: invalid duration " + quote(s)); };
  size_t i = 0;
  bool neg = false;
  if (i < s.size() && (s[i] == '-' || s[i] == '+')) neg = s[i++] == '-';
  if (s.substr(i) == "0") return int64_t{0};
  if (i == s.size()) return bad();
  long double total = 0;
  while (i < s.size()) {
    size_t startDigits = i;
    long double v = 0;
    while (i < s.size() && isDigit(static_cast<unsigned char>(s[i]))) v = v * 10 + (s[i++] - '0');
    bool pre = i > startDigits;
    bool post = false;
    if (i < s.size() && s[i] == '.') {
      ++i;
      long double scale = 0.1L;
      while (i < s.size() && isDigit(static_cast<unsigned char>(s[i]))) {
        v += (s[i++] - '0') * scale;
        scale /= 10;
        post = true;
      }
    }
    if (!pre && !post) return bad();
    size_t u = i;
    while (i < s.size() && s[i] != '.' && !isDigit(static_cast<unsigned char>(s[i]))) ++i;
    std::string unit = s.substr(u, i - u);
    long double mult;
    if (unit == "ns") {
      mult = 1;
    } else if (unit == "us" || unit == "\xC2\xB5s" || unit == "\xCE\xBCs") {
      mult = 1e3L;
    } else if (unit == "ms") {
      mult = 1e6L;
    } else if (unit == "s") {
      mult = 1e9L;
    } else if (unit == "m") {
      mult = 60e9L;
    } else if (unit == "h") {
      mult = 3600e9L;
    } else if (unit.empty()) {
      return Status(Code::kInvalidArgument, "time: missing unit in duration " + quote(s));
    } else {
      return Status(Code::kInvalidArgument,
                    "time: unknown unit " + quote(unit) + " in duration " + quote(s));
    }
    total += v * mult;
    if (total > 9.2233720368547758e18L) return bad();
  }
  int64_t ns = static_cast<int64_t>(total);
  return neg ? -ns : ns;
}

bool parseInt(std::string_view s, int64_t* out) {
  size_t i = 0;
  bool neg = false;
  if (i < s.size() && (s[i] == '+' || s[i] == '-')) neg = s[i++] == '-';
  if (i == s.size()) return false;
  int64_t v = 0;
  for (; i < s.size(); ++i) {
    if (!isDigit(static_cast<unsigned char>(s[i]))) return false;
    if (v > 1'000'000'000'000LL) return false;
    v = v * 10 + (s[i] - '0');
  }
  *out = neg ? -v : v;
  return true;
}

const std::vector<std::string> kDefaultShell = {"/bin/sh", "-c"};

bool isKnownInstruction(const std::string& lower) {
  static const std::set<std::string> kNames = {
      "add",    "arg",   "cmd",         "copy",  "entrypoint", "env",
      "expose", "from",  "healthcheck", "label", "maintainer", "onbuild",
      "run",    "shell", "stopsignal",  "user",  "volume",     "workdir"};
  return kNames.count(lower) > 0;
}

// Parses one instruction other than FROM. Errors are plain messages; the
// caller adds the line.
Result<Instruction> parseInstruction(const Split& sp, const std::string& original, int line,
                                     char escape) {
  const std::string lower = asciiLower(sp.cmd);
  Instruction inst;
  inst.line = line;
  inst.keyword = toUpper(sp.cmd);
  inst.original = std::string(trimSpace(original));
  const std::string& kw = inst.keyword;
  const std::string& rest = sp.args;
  auto fail = [](std::string msg) { return Status(Code::kInvalidArgument, std::move(msg)); };

  // The argument shapes (line_parsers.go).
  auto maybeJson = [&](bool toList) -> Status {
    std::vector<std::string> arr;
    switch (parseJsonArray(rest, &arr)) {
      case JsonParse::kOk:
        inst.args = std::move(arr);
        inst.jsonForm = true;
        return Status::ok();
      case JsonParse::kNotStrings:
        return fail(kNotStringArray);
      case JsonParse::kNotJson:
        break;
    }
    if (toList) {
      inst.args = splitWhitespace(rest);
    } else if (!rest.empty()) {
      inst.args = {rest};
    }
    return Status::ok();
  };
  auto exactlyOne = [&]() -> Status {
    if (!rest.empty()) inst.args = {rest};
    if (inst.args.size() != 1) return fail(kw + " requires exactly one argument");
    return Status::ok();
  };
  auto noFlags = [&]() { return parseFlags(sp.flags, {}, kw, &inst); };
  auto heredocCheck = [&]() -> Status {
    if (!inst.jsonForm && looksLikeHeredoc(original)) {
      return fail("heredocs (" + kw + " <<EOF) are not supported by dsec image build");
    }
    return Status::ok();
  };

  if (lower == "run" || lower == "cmd" || lower == "entrypoint") {
    inst.kind = lower == "run"   ? Instruction::Kind::kRun
                : lower == "cmd" ? Instruction::Kind::kCmd
                                 : Instruction::Kind::kEntrypoint;
    if (lower == "run") {
      RETURN_IF_ERROR(parseFlags(sp.flags,
                                 {{"network", FlagType::kString},
                                  {"mount", FlagType::kUnsupported},
                                  {"security", FlagType::kUnsupported},
                                  {"device", FlagType::kUnsupported}},
                                 kw, &inst));
      auto net = inst.flags.find("network");
      if (net != inst.flags.end() && net->second != "default" && net->second != "none" &&
          net->second != "host") {
        return fail("invalid network mode " + quote(net->second));
      }
    } else {
      RETURN_IF_ERROR(noFlags());
    }
    RETURN_IF_ERROR(maybeJson(false));
    if (inst.args.empty() && (lower == "run" || !inst.jsonForm)) {
      return fail(kw + " requires at least one argument");
    }
    if (lower == "run") RETURN_IF_ERROR(heredocCheck());
    return inst;
  }
  if (lower == "shell") {
    inst.kind = Instruction::Kind::kShell;
    RETURN_IF_ERROR(noFlags());
    RETURN_IF_ERROR(maybeJson(false));
    if (inst.args.empty()) return fail("SHELL requires at least one argument");
    if (!inst.jsonForm) return fail("SHELL requires the arguments to be in JSON form");
    return inst;
  }
  if (lower == "copy" || lower == "add") {
    bool copy = lower == "copy";
    inst.kind = copy ? Instruction::Kind::kCopy : Instruction::Kind::kAdd;
    std::vector<FlagSpec> specs = {{"chown", FlagType::kString},
                                   {"chmod", FlagType::kString},
                                   {"link", FlagType::kBool},
                                   {"exclude", FlagType::kStrings}};
    if (copy) {
      specs.push_back({"from", FlagType::kString});
      specs.push_back({"parents", FlagType::kUnsupported});
    } else {
      specs.push_back({"keep-git-dir", FlagType::kBool});
      specs.push_back({"checksum", FlagType::kString});
      specs.push_back({"unpack", FlagType::kBool});
    }
    RETURN_IF_ERROR(maybeJson(true));
    if (inst.args.size() < 2) {
      return fail(kw +
                  " requires at least two arguments, but only one was provided. "
                  "Destination could not be determined");
    }
    RETURN_IF_ERROR(parseFlags(sp.flags, specs, kw, &inst));
    RETURN_IF_ERROR(heredocCheck());
    auto from = inst.flags.find("from");
    if (from != inst.flags.end()) {
      if (from->second.empty()) return fail("COPY --from requires a stage name, index or image");
      ShellLexOptions o{escape, false, false, false};
      auto expanded = shellExpandWord(from->second, {}, o);
      if (!expanded.isOk()) return fail(expanded.status().message());
      if (*expanded != from->second) {
        return fail(
            "variable expansion is not supported for --from, define a new stage with "
            "FROM using ARG from global scope as a workaround");
      }
    }
    return inst;
  }
  if (lower == "env" || lower == "label") {
    inst.kind = lower == "env" ? Instruction::Kind::kEnv : Instruction::Kind::kLabel;
    RETURN_IF_ERROR(noFlags());
    std::vector<std::string> words = parseWords(rest, escape);
    if (words.empty()) return fail(kw + " requires at least one argument");
    if (words[0].find('=') == std::string::npos) {
      // Legacy `ENV name value with spaces`.
      size_t i = 0;
      while (i < rest.size() && !isReWhitespace(rest[i])) ++i;
      if (i == rest.size()) return fail(kw + " must have two arguments");
      size_t j = i;
      while (j < rest.size() && isReWhitespace(rest[j])) ++j;
      inst.kv.emplace_back(rest.substr(0, i), rest.substr(j));
    } else {
      for (const std::string& w : words) {
        size_t eq = w.find('=');
        if (eq == std::string::npos) {
          return fail("Syntax error - can't find = in " + quote(w) +
                      ". Must be of the form: name=value");
        }
        inst.kv.emplace_back(w.substr(0, eq), w.substr(eq + 1));
      }
    }
    for (const auto& kv : inst.kv) {
      if (kv.first.empty()) return fail(kw + " names can not be blank");
    }
    return inst;
  }
  if (lower == "maintainer") {
    inst.kind = Instruction::Kind::kLabel;
    RETURN_IF_ERROR(exactlyOne());
    RETURN_IF_ERROR(noFlags());
    inst.kv = {{"maintainer", inst.args[0]}};
    inst.args.clear();
    return inst;
  }
  if (lower == "arg") {
    inst.kind = Instruction::Kind::kArg;
    RETURN_IF_ERROR(noFlags());
    inst.args = parseWords(rest, escape);  // raw "name[=default]" until substitution
    if (inst.args.empty()) return fail("ARG requires at least one argument");
    for (const std::string& w : inst.args) {
      if (w.empty() || w[0] == '=') return fail("ARG names can not be blank");
    }
    return inst;
  }
  if (lower == "workdir" || lower == "user" || lower == "stopsignal") {
    inst.kind = lower == "workdir" ? Instruction::Kind::kWorkdir
                : lower == "user"  ? Instruction::Kind::kUser
                                   : Instruction::Kind::kStopsignal;
    RETURN_IF_ERROR(exactlyOne());
    RETURN_IF_ERROR(noFlags());
    return inst;
  }
  if (lower == "expose") {
    inst.kind = Instruction::Kind::kExpose;
    inst.args = splitWhitespace(rest);
    if (inst.args.empty()) return fail("EXPOSE requires at least one argument");
    RETURN_IF_ERROR(noFlags());
    return inst;
  }
  if (lower == "volume") {
    inst.kind = Instruction::Kind::kVolume;
    RETURN_IF_ERROR(maybeJson(true));
    if (inst.args.empty()) return fail("VOLUME requires at least one argument");
    RETURN_IF_ERROR(noFlags());
    for (std::string& v : inst.args) {
      v = std::string(trimSpace(v));
      if (v.empty()) return fail("VOLUME specified can not be an empty string");
    }
    return inst;
  }
  if (lower == "healthcheck") {
    inst.kind = Instruction::Kind::kHealthcheck;
    size_t sep = 0;
    while (sep < rest.size() && !isSpace(static_cast<unsigned char>(rest[sep]))) ++sep;
    if (sep == 0) return fail("HEALTHCHECK requires at least one argument");
    std::string typ = toUpper(rest.substr(0, sep));
    std::string cmd(trimLeft(std::string_view(rest).substr(sep)));
    HealthConfig hc;
    if (typ == "NONE") {
      if (!cmd.empty()) return fail("HEALTHCHECK NONE takes no arguments");
      if (!sp.flags.empty()) return fail("HEALTHCHECK NONE takes no flags");
      hc.test = {"NONE"};
    } else {
      RETURN_IF_ERROR(parseFlags(sp.flags,
                                 {{"interval", FlagType::kString},
                                  {"timeout", FlagType::kString},
                                  {"start-period", FlagType::kString},
                                  {"start-interval", FlagType::kString},
                                  {"retries", FlagType::kString}},
                                 kw, &inst));
      if (typ != "CMD") return fail("Unknown type " + quote(typ) + " in HEALTHCHECK (try CMD)");
      std::vector<std::string> arr;
      switch (parseJsonArray(cmd, &arr)) {
        case JsonParse::kOk:
          inst.jsonForm = true;
          break;
        case JsonParse::kNotStrings:
          return fail(kNotStringArray);
        case JsonParse::kNotJson:
          if (!cmd.empty()) arr = {cmd};
          break;
      }
      if (arr.empty()) return fail("Missing command after HEALTHCHECK CMD");
      hc.test = {inst.jsonForm ? "CMD" : "CMD-SHELL"};
      hc.test.insert(hc.test.end(), arr.begin(), arr.end());
      struct {
        const char* flag;
        int64_t* out;
      } durations[] = {{"interval", &hc.intervalNs},
                       {"timeout", &hc.timeoutNs},
                       {"start-period", &hc.startPeriodNs},
                       {"start-interval", &hc.startIntervalNs}};
      for (const auto& d : durations) {
        auto it = inst.flags.find(d.flag);
        if (it == inst.flags.end() || it->second.empty()) continue;
        auto ns = parseGoDuration(it->second);
        if (!ns.isOk()) return std::move(ns).takeStatus();
        if (*ns != 0 && *ns < 1'000'000) {
          return fail(std::string("Interval ") + quote(d.flag) + " cannot be less than 1ms");
        }
        *d.out = *ns;
      }
      auto r = inst.flags.find("retries");
      if (r != inst.flags.end() && !r->second.empty()) {
        int64_t n;
        if (!parseInt(r->second, &n) || n > INT32_MAX || n < INT32_MIN) {
          return fail("strconv.ParseInt: parsing " + quote(r->second) + ": invalid syntax");
        }
        if (n < 0) return fail("--retries cannot be negative (" + std::to_string(n) + ")");
        hc.retries = static_cast<int>(n);
      }
    }
    inst.args = hc.test;
    inst.health = std::move(hc);
    return inst;
  }
  if (lower == "onbuild") {
    inst.kind = Instruction::Kind::kOnbuild;
    if (rest.empty()) return fail("ONBUILD requires at least one argument");
    RETURN_IF_ERROR(noFlags());
    Split sub = splitCommand(rest, escape);
    std::string trigger = toUpper(sub.cmd);
    if (trigger == "ONBUILD") return fail("Chaining ONBUILD via `ONBUILD ONBUILD` isn't allowed");
    if (trigger == "MAINTAINER" || trigger == "FROM") {
      return fail(trigger + " isn't allowed as an ONBUILD trigger");
    }
    if (!isKnownInstruction(asciiLower(sub.cmd))) return fail("unknown instruction: " + sub.cmd);
    // Check the trigger now: it runs in another build, where errors are late.
    auto checked = parseInstruction(sub, rest, line, escape);
    if (!checked.isOk()) return std::move(checked).takeStatus();
    // (?i)^\s*ONBUILD\s*
    std::string_view expr = trimLeft(original);
    expr.remove_prefix(std::min<size_t>(7, expr.size()));
    inst.args = {std::string(trimLeft(expr))};
    return inst;
  }
  return fail("unknown instruction: " + sp.cmd);
}

// ---------------------------------------------------------------------------
// Values checked when an instruction is dispatched.

bool isValidStageName(const std::string& name) {
  if (name.empty() || name[0] < 'a' || name[0] > 'z') return false;
  for (char c : name) {
    if (!((c >= 'a' && c <= 'z') || isDigit(static_cast<unsigned char>(c)) || c == '-' ||
          c == '_' || c == '.')) {
      return false;
    }
  }
  return true;
}

Status checkChmod(const std::string& v) {
  if (v.empty()) return Status::ok();
  bool digits = std::all_of(v.begin(), v.end(), [](char c) { return isDigit(c); });
  bool octal = std::all_of(v.begin(), v.end(), [](char c) { return c >= '0' && c <= '7'; });
  if (digits || octal) {
    uint64_t m = 0;
    bool ok = octal;
    for (char c : v) {
      if (!ok) break;
      m = m * 8 + static_cast<uint64_t>(c - '0');
      if (m > 07777) ok = false;
    }
    if (ok) return Status::ok();
    return Status(
        Code::kInvalidArgument,
        "invalid chmod parameter: '" + v + "'. it should be octal string and between 0 and 07777");
  }
  return Status(
      Code::kInvalidArgument,
      "symbolic --chmod=" + v + " is not supported by dsec image build; use an octal mode");
}

// moby/sys/signal ParseSignal (Linux table).
Status checkSignal(const std::string& raw) {
  int64_t n;
  if (parseInt(raw, &n)) {
    if (n == 0) return Status(Code::kInvalidArgument, "Invalid signal: " + raw);
    return Status::ok();
  }
  std::string s = toUpper(raw);
  if (s.rfind("SIG", 0) == 0) s = s.substr(3);
  static const std::set<std::string> kNames = [] {
    std::set<std::string> names = {
        "ABRT", "ALRM",   "BUS",  "CHLD",   "CLD",   "CONT", "FPE",  "HUP",   "ILL",
        "INT",  "IO",     "IOT",  "KILL",   "PIPE",  "POLL", "PROF", "PWR",   "QUIT",
        "SEGV", "STKFLT", "STOP", "SYS",    "TERM",  "TRAP", "TSTP", "TTIN",  "TTOU",
        "URG",  "USR1",   "USR2", "VTALRM", "WINCH", "XCPU", "XFSZ", "RTMIN", "RTMAX"};
    for (int i = 1; i <= 15; ++i) names.insert("RTMIN+" + std::to_string(i));
    for (int i = 1; i <= 14; ++i) names.insert("RTMAX-" + std::to_string(i));
    return names;
  }();
  if (!kNames.count(s)) return Status(Code::kInvalidArgument, "Invalid signal: " + raw);
  return Status::ok();
}

bool parsePortNumber(std::string_view s, int* out) {
  int64_t v;
  if (s.empty() || !parseInt(s, &v) || v < 0 || v > 65535) return false;
  *out = static_cast<int>(v);
  return true;
}

bool parsePortRange(std::string_view s, int* start, int* end) {
  if (s.empty()) return false;
  size_t dash = s.find('-');
  std::string_view a = s.substr(0, dash);
  if (!parsePortNumber(a, start)) return false;
  if (dash == std::string_view::npos || a == s.substr(dash + 1)) {
    *end = *start;
    return true;
  }
  if (!parsePortNumber(s.substr(dash + 1), end)) return false;
  return *end >= *start;
}

// convert_expose.go parsePort: "[ip:][hostPort:]port[-end][/proto]" to
// "port/proto" entries.
Status normalizePort(const std::string& raw, std::vector<std::string>* out) {
  std::vector<std::string> parts;
  size_t pos = 0;
  for (;;) {
    size_t c = raw.find(':', pos);
    parts.push_back(raw.substr(pos, c == std::string::npos ? std::string::npos : c - pos));
    if (c == std::string::npos) break;
    pos = c + 1;
  }
  std::string ip, hostPort, containerPort = parts.back();
  if (parts.size() >= 2) hostPort = parts[parts.size() - 2];
  for (size_t i = 0; i + 2 < parts.size(); ++i) ip += (i ? ":" : "") + parts[i];
  size_t slash = containerPort.find('/');
  std::string rawProto = slash == std::string::npos ? "" : containerPort.substr(slash + 1);
  std::string proto = asciiLower(rawProto);
  containerPort = containerPort.substr(0, slash);
  if (containerPort.empty()) {
    return Status(Code::kInvalidArgument, "invalid port: " + quote(raw) + ": no port specified");
  }
  if (proto.empty()) proto = "tcp";
  if (proto != "tcp" && proto != "udp" && proto != "sctp") {
    return Status(Code::kInvalidArgument,
                  "invalid port: " + quote(raw) + ": invalid proto: " + rawProto);
  }
  if (!ip.empty()) {
    std::string addr = ip;
    if (addr.front() == '[' && addr.back() == ']') addr = addr.substr(1, addr.size() - 2);
    unsigned char buf[16];
    if (inet_pton(AF_INET, addr.c_str(), buf) != 1 && inet_pton(AF_INET6, addr.c_str(), buf) != 1) {
      return Status(Code::kInvalidArgument, "invalid IP address: " + ip);
    }
  }
  int start, end;
  if (!parsePortRange(containerPort, &start, &end)) {
    return Status(Code::kInvalidArgument, "invalid containerPort: " + containerPort);
  }
  if (!hostPort.empty()) {
    int hs, he;
    if (!parsePortRange(hostPort, &hs, &he)) {
      return Status(Code::kInvalidArgument, "invalid hostPort: " + hostPort);
    }
    if (end - start != he - hs && end != start) {
      return Status(Code::kInvalidArgument,
                    "invalid ranges specified for container and host Ports: " + containerPort +
                        " and " + hostPort);
    }
  }
  for (int p = start; p <= end; ++p) out->push_back(std::to_string(p) + "/" + proto);
  return Status::ok();
}

struct Platform {
  std::string os, arch, variant;
  std::string format() const { return os + "/" + arch + (variant.empty() ? "" : "/" + variant); }
};

Platform parsePlatformOpt(const std::string& s) {
  Platform p;
  if (s.empty()) {
    p.os = "linux";
#if defined(__x86_64__)
    p.arch = "amd64";
#elif defined(__aarch64__)
    p.arch = "arm64";
#elif defined(__riscv) && __riscv_xlen == 64
    p.arch = "riscv64";
#elif defined(__powerpc64__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    p.arch = "ppc64le";
#elif defined(__s390x__)
    p.arch = "s390x";
#elif defined(__arm__)
    p.arch = "arm";
    p.variant = "v7";
#elif defined(__i386__)
    p.arch = "386";
#else
    p.arch = "unknown";
#endif
    return p;
  }
  size_t a = s.find('/');
  p.os = s.substr(0, a);
  if (a != std::string::npos) {
    size_t b = s.find('/', a + 1);
    p.arch = s.substr(a + 1, b == std::string::npos ? std::string::npos : b - a - 1);
    if (b != std::string::npos) p.variant = s.substr(b + 1);
  }
  return p;
}

const char* const kProxyArgs[] = {"http_proxy", "https_proxy", "ftp_proxy", "no_proxy",
                                  "all_proxy"};
bool isProxyArg(const std::string& key) {
  std::string l = asciiLower(key);
  for (const char* p : kProxyArgs) {
    if (l == p) return true;
  }
  return false;
}

// ARGs that never reach the environment (convert.go nonEnvArgs).
bool isNonEnvArg(const std::string& key) {
  return key == "BUILDKIT_SBOM_SCAN_CONTEXT" || key == "BUILDKIT_SBOM_SCAN_STAGE";
}

std::string stageLabel(const Stage& s) {
  return s.name.empty() ? "stage-" + std::to_string(s.index) : s.name;
}

int findStage(const std::vector<Stage>& stages, std::string_view name) {
  std::string l = asciiLower(name);
  for (const Stage& s : stages) {
    if (!s.name.empty() && s.name == l) return s.index;
  }
  return -1;
}

// Resolves COPY --from against the stages: an integer is an index (it must
// exist), a stage name (any case) is that stage, anything else an image.
Status resolveFrom(const std::vector<Stage>& stages, Instruction* inst) {
  auto it = inst->flags.find("from");
  if (inst->kind != Instruction::Kind::kCopy || it == inst->flags.end()) return Status::ok();
  int64_t idx;
  if (parseInt(it->second, &idx)) {
    if (idx < 0 || idx >= static_cast<int64_t>(stages.size())) {
      return dfError(inst->line, "invalid stage index " + std::to_string(idx));
    }
    inst->fromStage = static_cast<int>(idx);
  } else {
    inst->fromStage = findStage(stages, it->second);
  }
  return Status::ok();
}

void computeDeps(Stage* s) {
  std::set<int> deps;
  if (s->baseStage >= 0) deps.insert(s->baseStage);
  for (const Instruction& i : s->instructions) {
    if (i.fromStage >= 0) deps.insert(i.fromStage);
  }
  s->deps.assign(deps.begin(), deps.end());
}

Result<std::vector<int>> closure(const std::vector<Stage>& stages, int target) {
  std::vector<bool> need(stages.size(), false);
  std::vector<int> todo = {target};
  while (!todo.empty()) {
    int s = todo.back();
    todo.pop_back();
    if (need[s]) continue;
    need[s] = true;
    const Stage& st = stages[s];
    for (const Instruction& i : st.instructions) {
      if (i.fromStage < 0) continue;
      if (i.fromStage >= s) {
        return dfError(i.line, "cannot copy from stage " + quote(i.flags.at("from")) +
                                   ", it needs to be defined before current stage " +
                                   quote(stageLabel(st)));
      }
      todo.push_back(i.fromStage);
    }
    if (st.baseStage >= 0) todo.push_back(st.baseStage);
  }
  std::vector<int> out;
  for (size_t i = 0; i < need.size(); ++i) {
    if (need[i]) out.push_back(static_cast<int>(i));
  }
  return out;
}

Result<int> findTarget(const std::vector<Stage>& stages, std::string_view target) {
  if (target.empty()) return static_cast<int>(stages.size()) - 1;
  int t = findStage(stages, target);
  if (t < 0) {
    return invalidArg("target", "target stage " + quote(target) + " could not be found");
  }
  return t;
}

// Parses ONBUILD trigger texts as instructions of the stage that runs them
// (BuildKit parses each with default directives).
Result<std::vector<Instruction>> parseTriggers(
    const std::vector<std::pair<std::string, int>>& triggers) {
  std::vector<Instruction> out;
  for (const auto& [text, line] : triggers) {
    Split sp = splitCommand(text, '\\');
    std::string lower = asciiLower(sp.cmd);
    if (lower == "from" || lower == "maintainer" || lower == "onbuild") {
      return dfError(line, toUpper(sp.cmd) + " isn't allowed as an ONBUILD trigger");
    }
    auto inst = parseInstruction(sp, text, line, '\\');
    if (!inst.isOk()) return dfError(line, inst.status().message());
    inst->onbuildTrigger = true;
    out.push_back(std::move(*inst));
  }
  return out;
}

// The variables a needed stage's instructions are expanded with.
struct StageState {
  EnvList env;       // ENV and ARG values, over the base image's env
  EnvList imageEnv;  // ENV values only, over the base image's env
  std::vector<std::string> shell = kDefaultShell;
};

class Substituter {
 public:
  Substituter(const ParseOptions& opts, const EnvList& globals, char escape,
              const EnvList& proxyEnv)
      : opts_(opts), globals_(globals), proxyEnv_(proxyEnv) {
    lex_.escape = escape;
  }

  std::set<std::string> declared;  // every ARG name met

  Status run(Instruction* inst, StageState* st) {
    auto expand = [&](const std::string& w) -> Result<std::string> {
      auto r = shellExpandWord(w, st->env, lex_);
      if (!r.isOk()) return dfError(inst->line, r.status().message());
      return r;
    };
    using K = Instruction::Kind;
    switch (inst->kind) {
      case K::kEnv:
      case K::kLabel: {
        if (inst->keyword == "MAINTAINER") break;  // never expanded
        EnvList out;
        for (const auto& [k, v] : inst->kv) {  // all against the env before the instruction
          ASSIGN_OR_RETURN(std::string ek, expand(k));
          ASSIGN_OR_RETURN(std::string ev, expand(v));
          out.emplace_back(std::move(ek), std::move(ev));
        }
        inst->kv = std::move(out);
        if (inst->kind == K::kEnv) {
          for (const auto& [k, v] : inst->kv) {
            setEnv(st->env, k, v);
            setEnv(st->imageEnv, k, v);
          }
        }
        break;
      }
      case K::kArg: {
        std::vector<std::string> names;
        EnvList kv;
        for (const std::string& word : inst->args) {  // one by one: later ones see earlier
          size_t eq = word.find('=');
          std::string key = word.substr(0, eq);
          declared.insert(key);
          std::optional<std::string> value;
          auto given = opts_.buildArgs.find(key);
          if (given != opts_.buildArgs.end()) {
            value = given->second;
          } else if (eq != std::string::npos) {
            ASSIGN_OR_RETURN(value, expand(word.substr(eq + 1)));
          } else if (const std::string* g = lookupEnv(globals_, key)) {
            value = *g;
          }
          names.push_back(key);
          if (value) {
            if (!isNonEnvArg(key)) setEnv(st->env, key, *value);
            kv.emplace_back(key, *value);
          }
        }
        inst->args = std::move(names);
        inst->kv = std::move(kv);
        break;
      }
      case K::kWorkdir:
      case K::kUser:
      case K::kStopsignal:
      case K::kVolume: {
        for (std::string& a : inst->args) {
          ASSIGN_OR_RETURN(a, expand(a));
          if (inst->kind == K::kVolume && a.empty()) {
            return dfError(inst->line, "VOLUME specified can not be an empty string");
          }
        }
        if (inst->kind == K::kStopsignal) {
          Status s = checkSignal(inst->args[0]);
          if (!s.isOk()) return dfError(inst->line, s.message());
        }
        break;
      }
      case K::kExpose: {
        std::vector<std::string> ports;
        for (const std::string& raw : inst->args) {
          auto words = shellExpandWords(raw, st->env, lex_);
          if (!words.isOk()) return dfError(inst->line, words.status().message());
          for (const std::string& w : *words) {
            Status s = normalizePort(w, &ports);
            if (!s.isOk()) return dfError(inst->line, s.message());
          }
        }
        inst->args = std::move(ports);
        break;
      }
      case K::kCopy:
      case K::kAdd: {
        for (const char* f : {"chown", "chmod", "checksum"}) {
          auto it = inst->flags.find(f);
          if (it != inst->flags.end()) {
            ASSIGN_OR_RETURN(it->second, expand(it->second));
          }
        }
        auto chmod = inst->flags.find("chmod");
        if (chmod != inst->flags.end()) {
          Status s = checkChmod(chmod->second);
          if (!s.isOk()) return dfError(inst->line, s.message());
        }
        for (std::string& a : inst->args) {
          ASSIGN_OR_RETURN(a, expand(a));
        }
        break;
      }
      case K::kRun:
        inst->env = st->env;
        for (const auto& [k, v] : proxyEnv_) {
          for (const std::string& name : {toUpper(k), asciiLower(k)}) {
            if (!lookupEnv(inst->env, name)) inst->env.emplace_back(name, v);
          }
        }
        if (!inst->jsonForm) inst->shell = st->shell;
        break;
      case K::kCmd:
      case K::kEntrypoint:
        if (!inst->jsonForm) inst->shell = st->shell;
        break;
      case K::kShell:
        st->shell = inst->args;
        break;
      case K::kHealthcheck:
      case K::kOnbuild:
        break;
    }
    return Status::ok();
  }

 private:
  const ParseOptions& opts_;
  const EnvList& globals_;
  const EnvList& proxyEnv_;
  ShellLexOptions lex_;
};

// The public form of an ARG in a stage that is not substituted.
void rawArgForm(Instruction* inst) {
  std::vector<std::string> names;
  EnvList kv;
  for (const std::string& w : inst->args) {
    size_t eq = w.find('=');
    names.push_back(w.substr(0, eq));
    if (eq != std::string::npos) kv.emplace_back(w.substr(0, eq), w.substr(eq + 1));
  }
  inst->args = std::move(names);
  inst->kv = std::move(kv);
}

}  // namespace

Result<Dockerfile> parseDockerfile(std::string_view text, const ParseOptions& opts) {
  Directives directives;
  int physical = 0;
  ASSIGN_OR_RETURN(std::vector<LogicalLine> lines, logicalLines(text, &directives, &physical));
  const char esc = directives.escape;
  if (lines.empty()) return dfError(std::max(physical, 1), "file with no instructions");

  std::vector<Split> splits;
  splits.reserve(lines.size());
  for (const LogicalLine& l : lines) splits.push_back(splitCommand(l.text, esc));

  // The automatic platform ARGs (dockerfile2llb defaultArgs), then global ARGs.
  Platform tp = parsePlatformOpt(opts.targetPlatform);
  Platform bp = parsePlatformOpt(opts.buildPlatform);
  std::string targetStage = opts.target;
  if (targetStage.empty()) {
    for (const Split& sp : splits) {
      if (asciiLower(sp.cmd) != "from") continue;
      auto a = splitWhitespace(sp.args);
      targetStage = a.size() == 3 ? asciiLower(a[2]) : "";
    }
  }
  EnvList globals = {{"BUILDPLATFORM", bp.format()},
                     {"BUILDOS", bp.os},
                     {"BUILDOSVERSION", ""},
                     {"BUILDARCH", bp.arch},
                     {"BUILDVARIANT", bp.variant},
                     {"TARGETPLATFORM", tp.format()},
                     {"TARGETOS", tp.os},
                     {"TARGETOSVERSION", ""},
                     {"TARGETARCH", tp.arch},
                     {"TARGETVARIANT", tp.variant},
                     {"TARGETSTAGE", targetStage.empty() ? "default" : targetStage}};
  std::set<std::string> builtin;
  for (auto& [k, v] : globals) {
    builtin.insert(k);
    auto o = opts.buildArgs.find(k);
    if (o != opts.buildArgs.end()) v = o->second;
  }
  ShellLexOptions lex;
  lex.escape = esc;

  Dockerfile df;
  df.escape = esc;
  std::set<std::string> declared;
  for (size_t li = 0; li < lines.size(); ++li) {
    const LogicalLine& ll = lines[li];
    const Split& sp = splits[li];
    const std::string lower = asciiLower(sp.cmd);
    if (lower == "from") {
      Stage st;
      st.index = static_cast<int>(df.stages.size());
      st.line = ll.start;
      Instruction scratch;
      Status fs = parseFlags(sp.flags, {{"platform", FlagType::kString}}, "FROM", &scratch);
      std::vector<std::string> args = splitWhitespace(sp.args);
      if (args.size() == 3 && asciiLower(args[1]) == "as") {
        st.name = asciiLower(args[2]);
        if (!isValidStageName(st.name)) {
          return dfError(ll.start, "invalid name for build stage: " + quote(args[2]) +
                                       ", name can't start with a number or contain symbols");
        }
      } else if (args.size() != 1) {
        return dfError(ll.start, "FROM requires either one or three arguments");
      }
      if (!fs.isOk()) return dfError(ll.start, fs.message());
      if (!st.name.empty()) {
        if (st.name == "scratch" || st.name == "context") {
          return dfError(ll.start, "stage name " + quote(st.name) + " is reserved");
        }
        int prev = findStage(df.stages, st.name);
        if (prev >= 0) {
          return dfError(ll.start, "duplicate stage name " + quote(st.name) +
                                       " (first defined on line " +
                                       std::to_string(df.stages[prev].line) + ")");
        }
      }
      auto base = shellExpandWord(args[0], globals, lex);
      if (!base.isOk()) return dfError(ll.start, base.status().message());
      if (base->empty()) {
        return dfError(ll.start, "base name (" + args[0] + ") should not be blank");
      }
      st.base = *base;
      // Only earlier stages count, so `FROM node AS node` is the image.
      for (const Stage& prev : df.stages) {
        if (!prev.name.empty() && prev.name == st.base) st.baseStage = prev.index;
      }
      auto platform = scratch.flags.find("platform");
      if (platform != scratch.flags.end()) {
        auto p = shellExpandWord(platform->second, globals, lex);
        if (!p.isOk()) return dfError(ll.start, p.status().message());
        if (p->empty()) {
          return dfError(ll.start, "empty platform value from expression " + platform->second);
        }
        st.platform = *p;
      }
      df.stages.push_back(std::move(st));
      continue;
    }
    if (!isKnownInstruction(lower)) return dfError(ll.start, "unknown instruction: " + sp.cmd);
    auto parsed = parseInstruction(sp, ll.text, ll.start, esc);
    if (!parsed.isOk()) return dfError(ll.start, parsed.status().message());
    Instruction inst = std::move(*parsed);
    if (df.stages.empty()) {
      if (inst.kind != Instruction::Kind::kArg) {
        return dfError(ll.start, "no build stage in current context: " + inst.keyword +
                                     " must come after a FROM");
      }
      // A global ARG: build arg, else its default expanded with the ARGs so far.
      for (const std::string& word : inst.args) {
        size_t eq = word.find('=');
        std::string key = word.substr(0, eq);
        declared.insert(key);
        std::optional<std::string> value;
        auto given = opts.buildArgs.find(key);
        if (given != opts.buildArgs.end()) {
          value = given->second;
        } else if (eq != std::string::npos) {
          auto v = shellExpandWord(word.substr(eq + 1), globals, lex);
          if (!v.isOk()) return dfError(ll.start, v.status().message());
          value = *v;
        }
        if (value) setEnv(globals, key, *value);
        df.globalArgs.emplace_back(key, value);
      }
      continue;
    }
    df.stages.back().instructions.push_back(std::move(inst));
  }
  if (df.stages.empty())
    return dfError(lines.back().start, "dockerfile contains no stages to build");

  // A parent stage's ONBUILD triggers run first in a `FROM <stage>` child.
  for (Stage& st : df.stages) {
    if (st.baseStage < 0) continue;
    std::vector<std::pair<std::string, int>> triggers;
    for (const Instruction& i : df.stages[st.baseStage].instructions) {
      if (i.kind == Instruction::Kind::kOnbuild) triggers.emplace_back(i.args[0], i.line);
    }
    if (triggers.empty()) continue;
    ASSIGN_OR_RETURN(std::vector<Instruction> injected, parseTriggers(triggers));
    st.instructions.insert(st.instructions.begin(), std::make_move_iterator(injected.begin()),
                           std::make_move_iterator(injected.end()));
  }
  for (Stage& st : df.stages) {
    for (Instruction& i : st.instructions) RETURN_IF_ERROR(resolveFrom(df.stages, &i));
    computeDeps(&st);
  }

  ASSIGN_OR_RETURN(df.target, findTarget(df.stages, opts.target));

  // Base image configs of the needed stages; their ONBUILD triggers may add
  // stages (BuildKit's resolveStages loop).
  std::vector<std::optional<BaseImageConfig>> baseConfigs(df.stages.size());
  for (;;) {
    ASSIGN_OR_RETURN(df.needed, closure(df.stages, df.target));
    if (!opts.resolveBase) break;
    bool changed = false;
    for (int s : df.needed) {
      Stage& st = df.stages[s];
      if (st.baseStage >= 0 || st.base == "scratch" || baseConfigs[s]) continue;
      ASSIGN_OR_RETURN(BaseImageConfig cfg, opts.resolveBase(st.base, st.platform));
      if (!cfg.onbuild.empty()) {
        std::vector<std::pair<std::string, int>> triggers;
        for (const std::string& t : cfg.onbuild) triggers.emplace_back(t, st.line);
        ASSIGN_OR_RETURN(std::vector<Instruction> injected, parseTriggers(triggers));
        for (Instruction& i : injected) RETURN_IF_ERROR(resolveFrom(df.stages, &i));
        st.instructions.insert(st.instructions.begin(), std::make_move_iterator(injected.begin()),
                               std::make_move_iterator(injected.end()));
        computeDeps(&st);
        changed = true;
      }
      baseConfigs[s] = std::move(cfg);
    }
    if (!changed) break;
  }

  for (const auto& [k, v] : opts.buildArgs) {
    if (isProxyArg(k)) df.proxyEnv.emplace_back(k, v);
  }
  Substituter sub(opts, globals, esc, df.proxyEnv);
  std::vector<std::optional<StageState>> finals(df.stages.size());
  std::vector<bool> isNeeded(df.stages.size(), false);
  for (int s : df.needed) isNeeded[s] = true;
  for (Stage& st : df.stages) {
    if (!isNeeded[st.index]) {
      for (Instruction& i : st.instructions) {
        if (i.kind == Instruction::Kind::kArg) rawArgForm(&i);
      }
      continue;
    }
    StageState state;
    if (st.baseStage >= 0) {
      state = *finals[st.baseStage];
    } else if (const auto& cfg = baseConfigs[st.index]) {
      state.env = cfg->env;
      if (!cfg->shell.empty()) state.shell = cfg->shell;
    }
    if (!lookupEnv(state.env, "PATH")) {
      state.env.insert(state.env.begin(),
                       std::make_pair(std::string("PATH"), std::string(kDefaultPath)));
    }
    if (st.baseStage < 0) state.imageEnv = state.env;
    for (Instruction& i : st.instructions) RETURN_IF_ERROR(sub.run(&i, &state));
    st.substituted = true;
    st.imageEnv = state.imageEnv;
    finals[st.index] = std::move(state);
  }

  declared.insert(sub.declared.begin(), sub.declared.end());
  for (const auto& [k, v] : opts.buildArgs) {
    if (!declared.count(k) && !builtin.count(k) && !isProxyArg(k)) df.unusedBuildArgs.push_back(k);
  }
  return df;
}

Result<Dockerfile> parseDockerfile(std::string_view text,
                                   const std::map<std::string, std::string>& buildArgs) {
  ParseOptions opts;
  opts.buildArgs = buildArgs;
  return parseDockerfile(text, opts);
}

Result<std::vector<int>> stagesFor(const Dockerfile& df, std::string_view target) {
  ASSIGN_OR_RETURN(int t, findTarget(df.stages, target));
  return closure(df.stages, t);
}

}  // namespace dsec::image
