// Tests for the Dockerfile parser and the .dockerignore matcher. Many tables
// come from the projects whose semantics these follow, so a difference shows
// up as a failing row: moby/buildkit frontend/dockerfile/shell (envVarTest,
// wordsTest, lex_test.go), parser/testfiles, moby/patternmatcher
// (patternmatcher_test.go, ignorefile_test.go) and Go's path and
// path/filepath tests.
#include "image/dockerfile.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "image/dockerignore.h"

namespace dsec::image {
namespace {

using Kind = Instruction::Kind;
using Strings = std::vector<std::string>;

std::string trim(std::string s) {
  size_t b = s.find_first_not_of(" \t\r\n");
  if (b == std::string::npos) return "";
  size_t e = s.find_last_not_of(" \t\r\n");
  return s.substr(b, e - b + 1);
}

std::vector<std::string> splitOn(const std::string& s, char sep) {
  std::vector<std::string> out;
  size_t start = 0;
  for (;;) {
    size_t p = s.find(sep, start);
    out.push_back(s.substr(start, p == std::string::npos ? std::string::npos : p - start));
    if (p == std::string::npos) return out;
    start = p + 1;
  }
}

Dockerfile parseOk(std::string_view text, const ParseOptions& opts = {}) {
  auto r = parseDockerfile(text, opts);
  EXPECT_TRUE(r.isOk()) << r.status().toString() << "\n--- in:\n" << text;
  return r.isOk() ? *r : Dockerfile{};
}

// The message of a failed parse ("" if it succeeded), checking code and field.
std::string parseErr(std::string_view text, const ParseOptions& opts = {}) {
  auto r = parseDockerfile(text, opts);
  if (r.isOk()) return "";
  EXPECT_EQ(r.status().code(), Code::kInvalidArgument);
  EXPECT_EQ(r.status().field(), "dockerfile");
  return r.status().message();
}

// The instructions of the only (or last) stage.
const std::vector<Instruction>& insts(const Dockerfile& df) {
  static const std::vector<Instruction> kNone;
  return df.stages.empty() ? kNone : df.stages.back().instructions;
}

std::string lookupForTest(const EnvList& env, const std::string& key) {
  for (auto it = env.rbegin(); it != env.rend(); ++it) {
    if (it->first == key) return it->second;
  }
  return "<unset>";
}

ParseOptions withArgs(std::map<std::string, std::string> args) {
  ParseOptions o;
  o.buildArgs = std::move(args);
  return o;
}

// ===========================================================================
// Shell lexer

// buildkit frontend/dockerfile/shell/envVarTest, verbatim: platform|input|want
// ("error" for an error). Run with PWD=/home SHELL=bash KOREAN=한국어 NULL=.
const char* const kEnvVarTest = R"TABLE(A|hello                    |     hello
A|he'll'o                  |     hello
A|he'llo                   |     error
A|he\'llo                  |     he'llo
A|he\\'llo                 |     error
A|abc\tdef                 |     abctdef
A|"abc\tdef"               |     abc\tdef
A|"abc\\tdef"              |     abc\tdef
A|'abc\tdef'               |     abc\tdef
A|hello\                   |     hello
A|hello\\                  |     hello\
A|"hello                   |     error
A|"hello\"                 |     error
A|"hel'lo"                 |     hel'lo
A|'hello                   |     error
A|'hello\'                 |     hello\
A|'hello\there'            |     hello\there
A|'hello\\there'           |     hello\\there
A|"''"                     |     ''
A|$.                       |     $.
A|he$1x                    |     hex
A|he$.x                    |     he$.x
# Next one is different on Windows as $pwd==$PWD
U|he$pwd.                  |     he.
W|he$pwd.                  |     he/home.
A|he$PWD                   |     he/home
A|he\$PWD                  |     he$PWD
A|he\\$PWD                 |     he\/home
A|"he\$PWD"                |     he$PWD
A|"he\\$PWD"               |     he\/home
A|\${}                     |     ${}
A|\${}aaa                  |     ${}aaa
A|he\${}                   |     he${}
A|he\${}xx                 |     he${}xx
A|${}                      |     error
A|${}aaa                   |     error
A|he${}                    |     error
A|he${}xx                  |     error
A|he${hi}                  |     he
A|he${hi}xx                |     hexx
A|he${PWD}                 |     he/home
A|he${.}                   |     error
A|he${XXX:-000}xx          |     he000xx
A|he${PWD:-000}xx          |     he/homexx
A|he${XXX:-$PWD}xx         |     he/homexx
A|he${XXX:-${PWD:-yyy}}xx  |     he/homexx
A|he${XXX:-${YYY:-yyy}}xx  |     heyyyxx
A|he${XXX:YYY}             |     error
A|he${XXX?}                |     error
A|he${XXX:?}               |     error
A|he${PWD?}                |     he/home
A|he${PWD:?}               |     he/home
A|he${NULL?}               |     he
A|he${NULL:?}              |     error
A|he${XXX:+${PWD}}xx       |     hexx
A|he${PWD:+${XXX}}xx       |     hexx
A|he${PWD:+${SHELL}}xx     |     hebashxx
A|he${XXX:+000}xx          |     hexx
A|he${PWD:+000}xx          |     he000xx
A|'he${XX}'                |     he${XX}
A|"he${PWD}"               |     he/home
A|"he'$PWD'"               |     he'/home'
A|"$PWD"                   |     /home
A|'$PWD'                   |     $PWD
A|'\$PWD'                  |     \$PWD
A|'"hello"'                |     "hello"
A|he\$PWD                  |     he$PWD
A|"he\$PWD"                |     he$PWD
A|'he\$PWD'                |     he\$PWD
A|he${PWD                  |     error
A|he${PWD:=000}xx          |     error
A|he${PWD:+${PWD}:}xx      |     he/home:xx
A|he${XXX:-\$PWD:}xx       |     he$PWD:xx
A|he${XXX:-\${PWD}z}xx     |     he${PWDz}xx
A|안녕하세요                 |     안녕하세요
A|안'녕'하세요               |     안녕하세요
A|안'녕하세요                |     error
A|안녕\'하세요               |     안녕'하세요
A|안\\'녕하세요              |     error
A|안녕\t하세요               |     안녕t하세요
A|"안녕\t하세요"             |     안녕\t하세요
A|'안녕\t하세요              |     error
A|안녕하세요\                |     안녕하세요
A|안녕하세요\\               |     안녕하세요\
A|"안녕하세요                |     error
A|"안녕하세요\"              |     error
A|"안녕'하세요"              |     안녕'하세요
A|'안녕하세요                |     error
A|'안녕하세요\'              |     안녕하세요\
A|안녕$1x                    |     안녕x
A|안녕$.x                    |     안녕$.x
# Next one is different on Windows as $pwd==$PWD
U|안녕$pwd.                  |     안녕.
W|안녕$pwd.                  |     안녕/home.
A|안녕$PWD                   |     안녕/home
A|안녕\$PWD                  |     안녕$PWD
A|안녕\\$PWD                 |     안녕\/home
A|안녕\${}                   |     안녕${}
A|안녕\${}xx                 |     안녕${}xx
A|안녕${}                    |     error
A|안녕${}xx                  |     error
A|안녕${hi}                  |     안녕
A|안녕${hi}xx                |     안녕xx
A|안녕${PWD}                 |     안녕/home
A|안녕${.}                   |     error
A|안녕${XXX:-000}xx          |     안녕000xx
A|안녕${PWD:-000}xx          |     안녕/homexx
A|안녕${XXX:-$PWD}xx         |     안녕/homexx
A|안녕${XXX:-${PWD:-yyy}}xx  |     안녕/homexx
A|안녕${XXX:-${YYY:-yyy}}xx  |     안녕yyyxx
A|안녕${XXX:YYY}             |     error
A|안녕${XXX:+${PWD}}xx       |     안녕xx
A|안녕${PWD:+${XXX}}xx       |     안녕xx
A|안녕${PWD:+${SHELL}}xx     |     안녕bashxx
A|안녕${XXX:+000}xx          |     안녕xx
A|안녕${PWD:+000}xx          |     안녕000xx
A|'안녕${XX}'                |     안녕${XX}
A|"안녕${PWD}"               |     안녕/home
A|"안녕'$PWD'"               |     안녕'/home'
A|'"안녕"'                   |     "안녕"
A|안녕\$PWD                  |     안녕$PWD
A|"안녕\$PWD"                |     안녕$PWD
A|'안녕\$PWD'                |     안녕\$PWD
A|안녕${PWD                  |     error
A|안녕${PWD:=000}xx          |     error
A|안녕${PWD:+${PWD}:}xx      |     안녕/home:xx
A|안녕${XXX:-\$PWD:}xx       |     안녕$PWD:xx
A|안녕${XXX:-\${PWD}z}xx     |     안녕${PWDz}xx
A|$KOREAN                    |     한국어
A|안녕$KOREAN                |     안녕한국어
A|${{aaa}                   |     error
A|${aaa}}                   |     }
A|${aaa                     |     error
A|${{aaa:-bbb}              |     error
A|${aaa:-bbb}}              |     bbb}
A|${aaa:-bbb                |     error
A|${aaa:-bbb}               |     bbb
A|${aaa:-${bbb:-ccc}}       |     ccc
A|${aaa:-bbb ${foo}         |     error
A|${aaa:-bbb {foo}          |     bbb {foo
A|${:}                      |     error
A|${:-bbb}                  |     error
A|${:+bbb}                  |     error

# Positional parameters won't be set:
# http://pubs.opengroup.org/onlinepubs/009695399/utilities/xcu_chap02.html#tag_02_05_01
A|$1                        |
A|${1}                      |
A|${1:+bbb}                 |
A|${1:-bbb}                 |     bbb
A|$2                        |
A|${2}                      |
A|${2:+bbb}                 |
A|${2:-bbb}                 |     bbb
A|$3                        |
A|${3}                      |
A|${3:+bbb}                 |
A|${3:-bbb}                 |     bbb
A|$4                        |
A|${4}                      |
A|${4:+bbb}                 |
A|${4:-bbb}                 |     bbb
A|$5                        |
A|${5}                      |
A|${5:+bbb}                 |
A|${5:-bbb}                 |     bbb
A|$6                        |
A|${6}                      |
A|${6:+bbb}                 |
A|${6:-bbb}                 |     bbb
A|$7                        |
A|${7}                      |
A|${7:+bbb}                 |
A|${7:-bbb}                 |     bbb
A|$8                        |
A|${8}                      |
A|${8:+bbb}                 |
A|${8:-bbb}                 |     bbb
A|$9                        |
A|${9}                      |
A|${9:+bbb}                 |
A|${9:-bbb}                 |     bbb
A|$999                      |
A|${999}                    |
A|${999:+bbb}               |
A|${999:-bbb}               |     bbb
A|$999aaa                   |     aaa
A|${999}aaa                 |     aaa
A|${999:+bbb}aaa            |     aaa
A|${999:-bbb}aaa            |     bbbaaa
A|$001                      |
A|${001}                    |
A|${001:+bbb}               |
A|${001:-bbb}               |     bbb
A|$001aaa                   |     aaa
A|${001}aaa                 |     aaa
A|${001:+bbb}aaa            |     aaa
A|${001:-bbb}aaa            |     bbbaaa

# Special parameters won't be set in the Dockerfile:
# http://pubs.opengroup.org/onlinepubs/009695399/utilities/xcu_chap02.html#tag_02_05_02
A|$@                        |
A|${@}                      |
A|${@:+bbb}                 |
A|${@:-bbb}                 |     bbb
A|$@@@                      |     @@
A|$@aaa                     |     aaa
A|${@}aaa                   |     aaa
A|${@:+bbb}aaa              |     aaa
A|${@:-bbb}aaa              |     bbbaaa
A|$*                        |
A|${*}                      |
A|${*:+bbb}                 |
A|${*:-bbb}                 |     bbb
A|$#                        |
A|${#}                      |
A|${#:+bbb}                 |
A|${#:-bbb}                 |     bbb
A|$?                        |
A|${?}                      |
A|${?:+bbb}                 |
A|${?:-bbb}                 |     bbb
A|$-                        |
A|${-}                      |
A|${-:+bbb}                 |
A|${-:-bbb}                 |     bbb
A|$$                        |
A|${$}                      |
A|${$:+bbb}                 |
A|${$:-bbb}                 |     bbb
A|$!                        |
A|${!}                      |
A|${!:+bbb}                 |
A|${!:-bbb}                 |     bbb
A|$0                        |
A|${0}                      |
A|${0:+bbb}                 |
A|${0:-bbb}                 |     bbb
)TABLE";

TEST(ShellLexTest, BuildkitEnvVarTable) {
  EnvList env = {{"PWD", "/home"}, {"SHELL", "bash"}, {"KOREAN", "한국어"}, {"NULL", ""}};
  int rows = 0;
  for (const std::string& line : splitOn(kEnvVarTest, '\n')) {
    if (line.empty() || line[0] == '#' || trim(line).empty()) continue;
    auto f = splitOn(trim(line), '|');
    ASSERT_EQ(f.size(), 3u) << line;
    std::string platform = trim(f[0]), input = trim(f[1]), want = trim(f[2]);
    if (platform == "W") continue;
    ++rows;
    auto got = shellExpandWord(input, env);
    if (want == "error") {
      EXPECT_FALSE(got.isOk()) << input << " gave " << (got.isOk() ? *got : "");
    } else {
      ASSERT_TRUE(got.isOk()) << input << ": " << got.status().message();
      EXPECT_EQ(*got, want) << input;
    }
  }
  EXPECT_GT(rows, 200);
}

// buildkit frontend/dockerfile/shell/wordsTest, verbatim: "ENV k=v" lines add
// to the env; "input | want,words" (or "error").
const char* const kWordsTest = R"TABLE(hello | hello
hello${hi}bye | hellobye
ENV hi=hi
hello${hi}bye | hellohibye
ENV space=abc  def
hello${space}bye | helloabc,defbye
hello"${space}"bye | helloabc  defbye
hello "${space}"bye | hello,abc  defbye
ENV leading=  ab c
hello${leading}def | hello,ab,cdef
hello"${leading}" def | hello  ab c,def
hello"${leading}" | hello  ab c
hello${leading} | hello,ab,c
# next line MUST have 3 trailing spaces, don't erase them!
ENV trailing=ab c   
hello${trailing} | helloab,c
hello${trailing}d | helloab,c,d
hello"${trailing}"d | helloab c   d
# next line MUST have 3 trailing spaces, don't erase them!
hel"lo${trailing}" | helloab c   
hello" there  " | hello there  
hello there     | hello,there
hello\ there | hello there
hello" there | error
hello\" there | hello",there
hello"\\there" | hello\there
hello"\there" | hello\there
hello'\\there' | hello\\there
hello'\there' | hello\there
hello'$there' | hello$there
)TABLE";

TEST(ShellLexTest, BuildkitWordsTable) {
  EnvList env;
  int rows = 0;
  for (const std::string& line : splitOn(kWordsTest, '\n')) {
    if (line.empty() || line[0] == '#') continue;
    if (line.rfind("ENV ", 0) == 0) {
      std::string kv = line.substr(3);
      kv = kv.substr(kv.find_first_not_of(' '));
      size_t eq = kv.find('=');
      env.emplace_back(kv.substr(0, eq), kv.substr(eq + 1));
      continue;
    }
    auto f = splitOn(line, '|');
    ASSERT_EQ(f.size(), 2u) << line;
    std::string input = trim(f[0]);
    std::string wantRaw = f[1].substr(f[1].find_first_not_of(' '));
    Strings want = splitOn(wantRaw, ',');
    ++rows;
    auto got = shellExpandWords(input, env);
    Strings words = got.isOk() ? *got : Strings{"error"};
    EXPECT_EQ(words, want) << input;
  }
  EXPECT_GT(rows, 20);
}

// lex_test.go TestProcessWithMatches and TestShellParserMandatoryEnvVars.
TEST(ShellLexTest, BuildkitModifierTable) {
  struct Case {
    std::string input;
    EnvList env;
    std::string want;  // "<error>" for an error
  };
  const std::string kErr = "<error>";
  EnvList fooBar = {{"FOO", "xxx"}, {"BAR", ""}};
  std::vector<Case> cases = {
      {"x", {{"DUMMY", "dummy"}}, "x"},
      {"x ${UNUSED}", {{"DUMMY", "dummy"}}, "x "},
      {"x ${FOO}", {{"FOO", "y"}}, "x y"},
      {"${FOO-aaa} ${BAR-bbb} ${BAZ-ccc}", fooBar, "xxx  ccc"},
      {"${FOO:-aaa} ${BAR:-bbb} ${BAZ:-ccc}", fooBar, "xxx bbb ccc"},
      {"${FOO:-}", fooBar, "xxx"},
      {"${FOO:-}", {}, ""},
      {"${FOO+aaa} ${BAR+bbb} ${BAZ+ccc}", fooBar, "aaa bbb "},
      {"${FOO:+aaa} ${BAR:+bbb} ${BAZ:+ccc}", fooBar, "aaa  "},
      {"${FOO?aaa}", fooBar, "xxx"},
      {"${BAR?bbb}", fooBar, ""},
      {"${BAZ?ccc}", fooBar, kErr},
      {"${FOO:?aaa}", fooBar, "xxx"},
      {"${BAR:?bbb}", fooBar, kErr},
      {"${BAZ:?ccc}", fooBar, kErr},
      {"${BAZ:?}", fooBar, kErr},
      {"${FOO=aaa}", fooBar, kErr},
      {"${FOO=:aaa}", fooBar, kErr},
      {"${FOO=}", {}, kErr},
      {"${FOO#()[]{\\}^$.\\*\\?|\\\\}", {{"FOO", "()[]{}^$.*?|\\x"}}, "x"},
      {"${FOO%%\\**}", {{"FOO", "xx**"}}, "xx"},
      {"${FOO#*x*y}", {{"FOO", "xxyy"}}, "y"},
      {"${FOO#*}", {{"FOO", "xxyy"}}, "xxyy"},
      {"${FOO#$BAR}", {{"FOO", "xxyy"}, {"BAR", "x"}}, "xyy"},
      {"${FOO#$BAR}", {{"FOO", "xxyy"}, {"BAR", ""}}, "xxyy"},
      {"${FOO#}", {{"FOO", "xxyy"}}, "xxyy"},
      {"${FOO##*x}", {{"FOO", "xxyy"}}, "yy"},
      {"${FOO##}", {{"FOO", "xxyy"}}, "xxyy"},
      {"${FOO#?\\?}", {{"FOO", "???y"}}, "?y"},
      {"${ABC:-.}${FOO%x}${ABC:-.}", {{"FOO", "xxyy"}}, ".xxyy."},
      {"${FOO%%\\**\\*}", {{"FOO", "a***yy*"}}, "a"},
      {"${FOO%}", {{"FOO", "xxyy"}}, "xxyy"},
      {"${FOO%%$BAR}", {{"FOO", "xxyy"}, {"BAR", ""}}, "xxyy"},
      {"${FOO:#}", {}, kErr},
      {"${FOO:##}", {}, kErr},
      {"${FOO:%}", {}, kErr},
      {"${FOO:%%}", {}, kErr},
      {"${FOO/$NEEDLE/.} - ${FOO//$NEEDLE/.}",
       {{"FOO", "/foo*/*/*.txt"}, {"NEEDLE", "\\*/"}},
       "/foo.*/*.txt - /foo..*.txt"},
      {"${FOO/$NEEDLE/} - ${FOO//$NEEDLE/}",
       {{"FOO", "/tmp/tmp/bar.txt"}, {"NEEDLE", "/tmp"}},
       "/tmp/bar.txt - /bar.txt"},
      {"${FOO/$NEEDLE/$REPLACEMENT} - ${FOO//$NEEDLE/$REPLACEMENT}",
       {{"FOO", "/a/foo/b/c.txt"}, {"NEEDLE", "/?/"}, {"REPLACEMENT", "/"}},
       "/foo/b/c.txt - /foo/c.txt"},
      {"${FOO/$NEEDLE/$REPLACEMENT}",
       {{"FOO", "http://google.de"}, {"NEEDLE", "http://"}, {"REPLACEMENT", "https://"}},
       "https://google.de"},
      {"${FOO//\\//\\/}", {{"FOO", "/tmp/foo.txt"}}, "\\/tmp\\/foo.txt"},
      {"${FOO/$BAR/ww}", {{"FOO", "xxyy"}, {"BAR", ""}}, "wwxxyy"},
      {"${FOO//ww}", {{"FOO", "xxyy"}}, kErr},
      {"${FOO//}", {{"FOO", "xxyy"}}, kErr},
      {"${FOO///}", {{"FOO", "xxyy"}}, "xxyy"},
      {"${FOO///}", {}, ""},
      // TestProcessWithMatchesPlatform
      {"something-${VERSION}.${TARGETOS}-${TARGETARCH}${TARGETVARIANT:+-${TARGETVARIANT}}.tar.gz",
       {{"VERSION", "v1.2.3"},
        {"TARGETOS", "linux"},
        {"TARGETARCH", "arm"},
        {"TARGETVARIANT", "v7"}},
       "something-v1.2.3.linux-arm-v7.tar.gz"},
      {"something-${VERSION}.${TARGETOS}-${TARGETARCH}${TARGETVARIANT:+-${TARGETVARIANT}}.tar.gz",
       {{"VERSION", "v1.2.3"},
        {"TARGETOS", "linux"},
        {"TARGETARCH", "arm64"},
        {"TARGETVARIANT", ""}},
       "something-v1.2.3.linux-arm64.tar.gz"},
      {"something-${VERSION}.${TARGETOS}-${TARGETARCH}${TARGETVARIANT:+-${TARGETVARIANT}}.tar.gz",
       {{"VERSION", "v1.2.3"}, {"TARGETOS", "linux"}, {"TARGETARCH", "arm64"}},
       "something-v1.2.3.linux-arm64.tar.gz"},
      // TestShellParserMandatoryEnvVars
      {"${VAR:?message here$ARG}", {{"VAR", "plain"}, {"ARG", "x"}}, "plain"},
      {"${VAR:?message here$ARG}", {{"VAR", ""}, {"ARG", "x"}}, kErr},
      {"${VAR:?message here$ARG}", {{"ARG", "x"}}, kErr},
      {"${VAR?message here$ARG}", {{"VAR", "plain"}, {"ARG", "x"}}, "plain"},
      {"${VAR?message here$ARG}", {{"VAR", ""}, {"ARG", "x"}}, ""},
      {"${VAR?message here$ARG}", {{"ARG", "x"}}, kErr},
      // More: the last definition of a name wins; nesting; greedy forms.
      {"$A", {{"A", "1"}, {"A", "2"}}, "2"},
      {"${A:-${B:-${C:-deep}}}", {}, "deep"},
      {"${P%.*}", {{"P", "archive.tar.gz"}}, "archive.tar"},
      {"${P%%.*}", {{"P", "archive.tar.gz"}}, "archive"},
      {"${P#*/}", {{"P", "usr/local/bin"}}, "local/bin"},
      {"${P##*/}", {{"P", "usr/local/bin"}}, "bin"},
      {"${P/local/share}", {{"P", "usr/local/local"}}, "usr/share/local"},
      {"${P//local/share}", {{"P", "usr/local/local"}}, "usr/share/share"},
      {"${P//?/x}", {{"P", "abc"}}, "xxx"},
      {"${P#안}", {{"P", "안녕"}}, "녕"},
      {"${P%?}", {{"P", "안녕"}}, "안"},
      {"${P#\\x}", {{"P", "x"}}, kErr},
      {"$", {}, "$"},
      {"a$", {}, "a$"},
      {"${}", {}, kErr},
      {"${V", {{"V", "1"}}, kErr},
      {"${V:", {{"V", "1"}}, kErr},
  };
  for (const Case& c : cases) {
    auto got = shellExpandWord(c.input, c.env);
    if (c.want == kErr) {
      EXPECT_FALSE(got.isOk()) << c.input << " gave " << (got.isOk() ? *got : "");
    } else {
      ASSERT_TRUE(got.isOk()) << c.input << ": " << got.status().message();
      EXPECT_EQ(*got, c.want) << c.input;
    }
  }
}

TEST(ShellLexTest, ErrorMessagesNameTheWordAndTheReason) {
  EnvList env = {{"E", ""}};
  auto r = shellExpandWord("${V:?must be set}", env);
  ASSERT_FALSE(r.isOk());
  EXPECT_EQ(r.status().message(), "failed to process \"${V:?must be set}\": V: must be set");
  EXPECT_EQ(shellExpandWord("${V?}", env).status().message(),
            "failed to process \"${V?}\": V: is not allowed to be unset");
  EXPECT_EQ(shellExpandWord("${E:?}", env).status().message(),
            "failed to process \"${E:?}\": E: is not allowed to be empty");
  EXPECT_EQ(shellExpandWord("'abc", env).status().message(),
            "failed to process \"'abc\": unexpected end of statement while looking for matching "
            "single-quote");
  EXPECT_EQ(shellExpandWord("\"abc", env).status().message(),
            "failed to process \"\\\"abc\": unexpected end of statement while looking for "
            "matching double-quote");
  EXPECT_EQ(shellExpandWord("${X:=1}", env).status().message(),
            "failed to process \"${X:=1}\": unsupported modifier (:=) in substitution");
  EXPECT_EQ(shellExpandWord("${}", env).status().message(),
            "failed to process \"${}\": syntax error: bad substitution");
  EXPECT_EQ(shellExpandWord("${X", env).status().message(),
            "failed to process \"${X\": syntax error: missing '}'");
}

TEST(ShellLexTest, BacktickEscapeToken) {
  ShellLexOptions o;
  o.escape = '`';
  EnvList env = {{"HOME", "/root"}};
  struct {
    const char* in;
    const char* want;
  } cases[] = {
      {"c:\\Users\\$HOME", "c:\\Users\\/root"},  // backslash is just a character
      {"`$HOME", "$HOME"},
      {"a` b", "a b"},
      {"\"x`\"y\"", "x\"y"},
      {"\"x\\\"", "x\\"},
      {"'`'", "`"},
      {"``", "`"},
  };
  for (const auto& c : cases) {
    auto r = shellExpandWord(c.in, env, o);
    ASSERT_TRUE(r.isOk()) << c.in << ": " << r.status().message();
    EXPECT_EQ(*r, c.want) << c.in;
  }
}

TEST(ShellLexTest, RawAndSkipUnsetModes) {
  ShellLexOptions o;
  o.rawQuotes = true;
  o.skipUnsetEnv = true;
  EnvList env = {{"SET", "v"}};
  EXPECT_EQ(*shellExpandWord("'a b' \"$SET\" $UNSET ${UNSET:-d} ${UNSET}", env, o),
            "'a b' \"v\" $UNSET ${UNSET:-d} ${UNSET}");
  o.rawEscapes = true;
  EXPECT_EQ(*shellExpandWord("a\\ b", env, o), "a\\ b");
  EXPECT_EQ(*shellExpandWords("x <<EOF y << EOF2", env, o),
            (Strings{"x", "<<EOF", "y", "<< EOF2"}));
}

// ===========================================================================
// Lines, directives, continuation (buildkit parser/testfiles and parser_test.go)

TEST(DockerfileLinesTest, ContinueIndent) {
  // parser/testfiles/continueIndent
  Dockerfile df = parseOk(
      "FROM ubuntu:14.04\n"
      "\n"
      "RUN echo hello\\\n"
      "  world\\\n"
      "  goodnight  \\\n"
      "  moon\\\n"
      "  light\\\n"
      "ning\n"
      "RUN echo hello  \\\n"
      "  world\n"
      "RUN echo hello  \\\n"
      "world\n"
      "RUN echo hello \\\n"
      "goodbye\\\n"
      "frog\n"
      "RUN echo hello  \\  \n"
      "world\n"
      "RUN echo hi \\\n"
      " \\\n"
      " world \\\n"
      "\\\n"
      " good\\\n"
      "\\\n"
      "night\n"
      "RUN echo goodbye\\\n"
      "frog\n"
      "RUN echo good\\\n"
      "bye\\\n"
      "frog\n"
      "\n"
      "RUN echo hello \\\n"
      "# this is a comment\n"
      "\n"
      "# this is a comment with a blank line surrounding it\n"
      "\n"
      "this is some more useful stuff\n");
  Strings want = {"echo hello  world  goodnight    moon  lightning",
                  "echo hello    world",
                  "echo hello  world",
                  "echo hello goodbyefrog",
                  "echo hello  world",
                  "echo hi   world  goodnight",
                  "echo goodbyefrog",
                  "echo goodbyefrog",
                  "echo hello this is some more useful stuff"};
  ASSERT_EQ(insts(df).size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_EQ(insts(df)[i].kind, Kind::kRun);
    EXPECT_EQ(insts(df)[i].args, Strings{want[i]}) << i;
    EXPECT_FALSE(insts(df)[i].jsonForm);
  }
  EXPECT_EQ(insts(df)[0].line, 3);
  EXPECT_EQ(insts(df)[8].line, 31);
}

TEST(DockerfileLinesTest, LineNumbersAreTheFirstLineOfEachInstruction) {
  // parser/testfile-line: children at lines 5, 11 and 17.
  Dockerfile df = parseOk(
      "# ESCAPE=\\\n"
      "\n\n\n"
      "FROM brimstone/ubuntu:14.04\n"
      "\n\n"
      "# TORUN -v /var/run/docker.sock:/var/run/docker.sock\n"
      "\n\n"
      "ENV GOPATH \\\n"
      "/go\n"
      "\n\n\n"
      "# Install the packages we need, clean up after them and us\n"
      "RUN apt-get update \\\n"
      "\t&& dpkg -l | awk '/^ii/ {print $2}' > /tmp/dpkg.clean \\\n"
      "\n\n"
      "    && apt-get --no-install-recommends install -y git golang ca-certificates \\\n"
      "    && apt-get clean \\\n"
      "    && rm -rf /var/lib/apt/lists \\\n"
      "\n"
      "\t&& go get -v github.com/brimstone/consuldock \\\n"
      "    && mv $GOPATH/bin/consuldock /usr/local/bin/consuldock \\\n"
      "\n"
      "\t&& dpkg -l | awk '/^ii/ {print $2}' > /tmp/dpkg.dirty \\\n"
      "\t&& apt-get remove --purge -y $(diff /tmp/dpkg.clean /tmp/dpkg.dirty | awk '/^>/ {print "
      "$2}') \\\n"
      "\t&& rm /tmp/dpkg.* \\\n"
      "\t&& rm -rf $GOPATH\n"
      "\n\n\n\n");
  ASSERT_EQ(df.stages.size(), 1u);
  EXPECT_EQ(df.stages[0].line, 5);
  ASSERT_EQ(insts(df).size(), 2u);
  EXPECT_EQ(insts(df)[0].line, 11);
  EXPECT_EQ(insts(df)[0].kv, (EnvList{{"GOPATH", "/go"}}));
  EXPECT_EQ(insts(df)[1].line, 17);
  EXPECT_NE(insts(df)[1].args[0].find("$GOPATH/bin/consuldock"), std::string::npos)
      << "RUN is left for the shell";
}

TEST(DockerfileLinesTest, CommentsAndEmptyLinesInsideAContinuationAreSkipped) {
  // parser_test.go TestParseWarnsOnEmptyContinutationLine
  Dockerfile df = parseOk(
      "\n"
      "FROM alpine:3.6\n"
      "\n"
      "RUN valid \\\n"
      "    continuation\n"
      "\n"
      "RUN something \\\n"
      "\n"
      "    following \\\n"
      "\n"
      "    more\n"
      "\n"
      "RUN another \\\n"
      "\n"
      "    thing\n"
      "\n"
      "RUN non-indented \\\n"
      "# this is a comment\n"
      "   after-comment\n"
      "\n"
      "RUN indented \\\n"
      "    # this is an indented comment\n"
      "    comment\n"
      "\t");
  Strings want = {"valid     continuation", "something     following     more", "another     thing",
                  "non-indented    after-comment", "indented     comment"};
  ASSERT_EQ(insts(df).size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) EXPECT_EQ(insts(df)[i].args, Strings{want[i]});
  EXPECT_EQ(insts(df)[3].line, 17);
  EXPECT_EQ(insts(df)[4].line, 21);
}

TEST(DockerfileLinesTest, TrailingBackslash) {
  // parser/testfiles/trailing-backslash, after substitution.
  Dockerfile df = parseOk(
      "# https://github.com/docker/for-win/issues/5254\n"
      "\n"
      "FROM hello-world\n"
      "\n"
      "ENV A path\n"
      "ENV B another\\\\path\n"
      "ENV C trailing\\\\backslash\\\\\n"
      "ENV D This should not be appended to C\n"
      "ENV E hello\\\n"
      "\\\n"
      "world\n"
      "ENV F hello\\\n"
      " \\\n"
      "world\n"
      "ENV G hello \\\n"
      "\\\n"
      "world\n");
  std::vector<EnvList> want = {{{"A", "path"}},
                               {{"B", "another\\path"}},
                               {{"C", "trailing\\backslash\\"}},
                               {{"D", "This should not be appended to C"}},
                               {{"E", "helloworld"}},
                               {{"F", "hello world"}},
                               {{"G", "hello world"}}};
  ASSERT_EQ(insts(df).size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) EXPECT_EQ(insts(df)[i].kv, want[i]) << i;
}

TEST(DockerfileLinesTest, ContinuationAtEndOfFile) {
  Dockerfile df = parseOk("FROM alpine:3.5\n\nRUN something \\");
  EXPECT_EQ(insts(df).at(0).args, Strings{"something"});
  df = parseOk("FROM a\nENV name=value \\\n    name1=value1 \\\n");
  EXPECT_EQ(insts(df).at(0).kv, (EnvList{{"name", "value"}, {"name1", "value1"}}));
}

TEST(DockerfileLinesTest, AnEscapedEscapeIsNotAContinuation) {
  Dockerfile df = parseOk("FROM a\nRUN echo a\\\\\nRUN echo b\n");
  ASSERT_EQ(insts(df).size(), 2u);
  EXPECT_EQ(insts(df)[0].args, Strings{"echo a\\\\"});
  EXPECT_EQ(insts(df)[1].args, Strings{"echo b"});
}

TEST(DockerfileLinesTest, CrlfBomAndIndentation) {
  Dockerfile df = parseOk(
      "\xEF\xBB\xBF"
      "FROM a\r\n  RUN echo hi \\\r\n  there\r\n\tENV X=1\r\n");
  ASSERT_EQ(insts(df).size(), 2u);
  EXPECT_EQ(insts(df)[0].args, Strings{"echo hi   there"});
  EXPECT_EQ(insts(df)[1].kv, (EnvList{{"X", "1"}}));
  EXPECT_EQ(insts(df)[1].line, 4);
}

TEST(DockerfileLinesTest, InstructionNamesAreCaseInsensitive) {
  Dockerfile df = parseOk(
      "from alpine As Build\nrun echo 1\nFrom scratch\nCoPy --from=BUILD a b\nworkDIR /x\n");
  ASSERT_EQ(df.stages.size(), 2u);
  EXPECT_EQ(df.stages[0].name, "build");
  EXPECT_EQ(df.stages[0].instructions.at(0).kind, Kind::kRun);
  EXPECT_EQ(df.stages[0].instructions.at(0).keyword, "RUN");
  ASSERT_EQ(insts(df).size(), 2u);
  EXPECT_EQ(insts(df)[0].kind, Kind::kCopy);
  EXPECT_EQ(insts(df)[0].fromStage, 0);
  EXPECT_EQ(insts(df)[1].kind, Kind::kWorkdir);
  EXPECT_EQ(insts(df)[1].original, "workDIR /x");
  EXPECT_EQ(parseErr("FROM a\nCOPY --FROM=x a b\n"), "Dockerfile:2: unknown flag: --FROM")
      << "flags are case-sensitive";
}

TEST(DockerfileDirectivesTest, BacktickEscape) {
  // parser/testfiles/escape, escape-nonewline, escape-with-syntax
  for (const char* text :
       {"#escape = `\n\nFROM image\nLABEL maintainer foo@bar.com\nENV GOPATH `\n\\go",
        "# escape = `\n# There is no white space line after the directives.\n"
        "FROM image\nLABEL maintainer foo@bar.com\nENV GOPATH `\n\\go\n"}) {
    Dockerfile df = parseOk(text);
    EXPECT_EQ(df.escape, '`');
    ASSERT_EQ(insts(df).size(), 2u);
    EXPECT_EQ(insts(df)[0].kv, (EnvList{{"maintainer", "foo@bar.com"}}));
    EXPECT_EQ(insts(df)[1].kv, (EnvList{{"GOPATH", "\\go"}}));
  }
  Dockerfile df = parseOk("# syntax = docker/dockerfile\n# escape = `\n\nFROM `\n    image\n");
  EXPECT_EQ(df.stages.at(0).base, "image");
}

TEST(DockerfileDirectivesTest, BacktickEscapeForWindowsPaths) {
  Dockerfile df = parseOk(
      "# escape=`\n"
      "FROM mcr.microsoft.com/windows/servercore\n"
      "RUN dir c:\\ `\n"
      "    && echo hi\n"
      "WORKDIR c:\\Users\\$USERNAME\n"
      "ENV A=`$notvar B=\"x`\"y\" C=c:\\temp\\\n"
      "COPY c:\\src\\ c:\\dst\\\n");
  ASSERT_EQ(insts(df).size(), 4u);
  EXPECT_EQ(insts(df)[0].args, Strings{"dir c:\\     && echo hi"});
  EXPECT_EQ(insts(df)[1].args, Strings{"c:\\Users\\"});
  EXPECT_EQ(insts(df)[2].kv, (EnvList{{"A", "$notvar"}, {"B", "x\"y"}, {"C", "c:\\temp\\"}}));
  EXPECT_EQ(insts(df)[3].args, (Strings{"c:\\src\\", "c:\\dst\\"}));
}

TEST(DockerfileDirectivesTest, OnlyLeadingCommentsAreDirectives) {
  // parser/testfiles/escape-after-comment: the directive is ignored.
  Dockerfile df = parseOk(
      "# Comment here. Should not be looking for the following parser directive.\n"
      "# Hence the following line will be ignored, and the subsequent backslash\n"
      "# continuation will be the default.\n"
      "# escape = `\n"
      "\n"
      "FROM image\n"
      "LABEL maintainer foo@bar.com\n"
      "ENV GOPATH \\\n"
      "\\go");
  EXPECT_EQ(df.escape, '\\');
  EXPECT_EQ(insts(df).at(1).kv, (EnvList{{"GOPATH", "go"}}));
  // After a blank line, or after an instruction, nothing is a directive.
  EXPECT_EQ(parseOk("\n# escape=`\nFROM a\nRUN x `\n").escape, '\\');
  df = parseOk("FROM a\n# escape=`\nRUN x `\nRUN y\n");
  EXPECT_EQ(df.escape, '\\');
  EXPECT_EQ(insts(df).size(), 2u);
  // Leading whitespace, any case, explicit backslash.
  EXPECT_EQ(parseOk("   #   ESCAPE  =  `  \nFROM a\n").escape, '`');
  df = parseOk("# escape=\\\nFROM a\nRUN a \\\n b\n");
  EXPECT_EQ(df.escape, '\\');
  EXPECT_EQ(insts(df).at(0).args, Strings{"a  b"});
}

TEST(DockerfileDirectivesTest, SyntaxAndCheckAreAcceptedAndIgnored) {
  Dockerfile df = parseOk(
      "# syntax=docker/dockerfile:1.7\n"
      "# check=skip=JSONArgsRecommended;error=true\n"
      "# escape=`\n"
      "FROM a\n"
      "RUN x `\n"
      "  y\n");
  EXPECT_EQ(df.escape, '`');
  EXPECT_EQ(insts(df).at(0).args, Strings{"x   y"});
  // An unknown key ends the directives; it is just a comment.
  df = parseOk("# foo=bar\n# escape=`\nFROM a\n");
  EXPECT_EQ(df.escape, '\\');
}

// ===========================================================================
// Instruction forms

TEST(DockerfileFormsTest, JsonAndShellForms) {
  // parser/testfiles/json and the jeztah-invalid-json-* files.
  Dockerfile df = parseOk(
      "FROM a\n"
      "CMD []\n"
      "CMD [\"\"]\n"
      "CMD [\"a\"]\n"
      "CMD [\"a\",\"b\"]\n"
      "CMD [ \"a\", \"b\" ]\n"
      "CMD [\t\"a\",\t\"b\"\t]\n"
      "CMD\t[\t\"a\",\t\"b\"\t]\t\n"
      "CMD [\"abc 123\", \"♥\", \"☃\", \"\\\" \\\\ \\/ \\b \\f \\n \\r \\t \\u0000\"]\n"
      "CMD '[\"echo\", \"Well, JSON in a string is JSON too?\"]'\n"
      "CMD ['echo','single quotes are invalid JSON']\n"
      "CMD [\"echo\", \"Please, close the brackets when you're done\"\n"
      "CMD [\"echo\", \"look ma, no quote!]\n"
      "CMD \"[\\\"echo\\\", \\\"Phew, I just managed to escaped those double quotes\\\"]\"\n"
      "CMD [\"a\"] trailing\n");
  struct Want {
    bool json;
    Strings args;
  };
  std::vector<Want> want = {
      {true, {}},
      {true, {""}},
      {true, {"a"}},
      {true, {"a", "b"}},
      {true, {"a", "b"}},
      {true, {"a", "b"}},
      {true, {"a", "b"}},
      {true, {"abc 123", "♥", "☃", std::string("\" \\ / \b \f \n \r \t \0", 17)}},
      {false, {"'[\"echo\", \"Well, JSON in a string is JSON too?\"]'"}},
      {false, {"['echo','single quotes are invalid JSON']"}},
      {false, {"[\"echo\", \"Please, close the brackets when you're done\""}},
      {false, {"[\"echo\", \"look ma, no quote!]"}},
      {false, {"\"[\\\"echo\\\", \\\"Phew, I just managed to escaped those double quotes\\\"]\""}},
      {false, {"[\"a\"] trailing"}},
  };
  ASSERT_EQ(insts(df).size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_EQ(insts(df)[i].kind, Kind::kCmd);
    EXPECT_EQ(insts(df)[i].jsonForm, want[i].json) << i;
    EXPECT_EQ(insts(df)[i].args, want[i].args) << i;
    EXPECT_EQ(insts(df)[i].shell, want[i].json ? Strings{} : (Strings{"/bin/sh", "-c"})) << i;
  }
}

TEST(DockerfileFormsTest, RunCmdEntrypointShell) {
  Dockerfile df = parseOk(
      "FROM a\n"
      "RUN [\"ls\", \"-la\"]\n"
      "RUN [\"echo\", \"'1234'\"]\n"
      "RUN echo \"1234\"\n"
      "RUN echo '1234' && \\\n"
      "    echo \"456\" && \\\n"
      "    echo 789\n"
      "RUN    sh -c 'echo root:testpass \\\n"
      "        > /tmp/passwd'\n"
      "ENTRYPOINT [ \"/usr/bin/redis-server\" ]\n"
      "ENTRYPOINT []\n"
      "ENTRYPOINT exec top -b\n"
      "SHELL [\"/bin/bash\", \"-eo\", \"pipefail\", \"-c\"]\n"
      "RUN echo $HOME | cat\n"
      "CMD echo 'test' | wc -\n");
  const auto& in = insts(df);
  ASSERT_EQ(in.size(), 11u);
  EXPECT_EQ(in[0].args, (Strings{"ls", "-la"}));
  EXPECT_TRUE(in[0].jsonForm);
  EXPECT_TRUE(in[0].shell.empty());
  EXPECT_EQ(in[1].args, (Strings{"echo", "'1234'"}));
  EXPECT_EQ(in[2].args, Strings{"echo \"1234\""});
  EXPECT_EQ(in[2].shell, (Strings{"/bin/sh", "-c"}));
  EXPECT_EQ(in[3].args, Strings{"echo '1234' &&     echo \"456\" &&     echo 789"});
  EXPECT_EQ(in[4].args, Strings{"sh -c 'echo root:testpass         > /tmp/passwd'"});
  EXPECT_EQ(in[5].kind, Kind::kEntrypoint);
  EXPECT_EQ(in[5].args, Strings{"/usr/bin/redis-server"});
  EXPECT_TRUE(in[6].jsonForm);
  EXPECT_TRUE(in[6].args.empty());
  EXPECT_EQ(in[7].args, Strings{"exec top -b"});
  EXPECT_EQ(in[7].shell, (Strings{"/bin/sh", "-c"}));
  EXPECT_EQ(in[8].kind, Kind::kShell);
  EXPECT_EQ(in[8].args, (Strings{"/bin/bash", "-eo", "pipefail", "-c"}));
  EXPECT_EQ(in[9].args, Strings{"echo $HOME | cat"}) << "RUN is never substituted";
  EXPECT_EQ(in[9].shell, (Strings{"/bin/bash", "-eo", "pipefail", "-c"}));
  EXPECT_EQ(in[10].shell, (Strings{"/bin/bash", "-eo", "pipefail", "-c"}));
}

TEST(DockerfileFormsTest, ShellCarriesIntoChildStages) {
  Dockerfile df = parseOk(
      "FROM a AS base\n"
      "SHELL [\"/bin/bash\", \"-c\"]\n"
      "FROM base\n"
      "RUN echo\n"
      "FROM a\n"
      "COPY --from=1 / /\n"
      "RUN echo\n");
  EXPECT_EQ(df.stages[1].instructions[0].shell, (Strings{"/bin/bash", "-c"}));
  EXPECT_EQ(df.stages[2].instructions[1].shell, (Strings{"/bin/sh", "-c"}));
}

TEST(DockerfileFormsTest, CopyAndAdd) {
  // parser/testfiles/ADD-COPY-with-JSON
  Dockerfile df = parseOk(
      "FROM\tubuntu:14.04\n"
      "LABEL\tmaintainer\tSeongyeol Lim <seongyeol37@gmail.com>\n"
      "\n"
      "COPY\t.\t/go/src/github.com/docker/docker\n"
      "ADD\t\t.\t/\n"
      "ADD\t\tnull /\n"
      "COPY\tnullfile /tmp\n"
      "ADD\t\t[ \"vimrc\", \"/tmp\" ]\n"
      "COPY\t[ \"bashrc\", \"/tmp\" ]\n"
      "COPY\t[ \"test file\", \"/tmp\" ]\n"
      "ADD\t\t[ \"test file\", \"/tmp/test file\" ]\n"
      "COPY a b c /many/\n");
  const auto& in = insts(df);
  ASSERT_EQ(in.size(), 10u);
  EXPECT_EQ(in[0].kv, (EnvList{{"maintainer", "Seongyeol Lim <seongyeol37@gmail.com>"}}));
  EXPECT_EQ(in[1].args, (Strings{".", "/go/src/github.com/docker/docker"}));
  EXPECT_EQ(in[2].kind, Kind::kAdd);
  EXPECT_EQ(in[2].args, (Strings{".", "/"}));
  EXPECT_EQ(in[3].args, (Strings{"null", "/"}));
  EXPECT_EQ(in[4].args, (Strings{"nullfile", "/tmp"}));
  EXPECT_EQ(in[5].args, (Strings{"vimrc", "/tmp"}));
  EXPECT_TRUE(in[5].jsonForm);
  EXPECT_EQ(in[6].args, (Strings{"bashrc", "/tmp"}));
  EXPECT_EQ(in[7].args, (Strings{"test file", "/tmp"}));
  EXPECT_EQ(in[8].args, (Strings{"test file", "/tmp/test file"}));
  EXPECT_EQ(in[9].args, (Strings{"a", "b", "c", "/many/"}));
  EXPECT_FALSE(in[9].jsonForm);
}

TEST(DockerfileFormsTest, CopyAndAddFlags) {
  Dockerfile df = parseOk(
      "FROM a\n"
      "ARG USER=app\n"
      "ENV GROUP=staff MODE=0640\n"
      "COPY --chown=$USER:${GROUP} --chmod=$MODE --link src/ /dst/\n"
      "COPY --link=false --chmod=755 -- a b\n"
      "COPY --exclude=*.md --exclude=docs . /src\n"
      "ADD --checksum=sha256:abc --keep-git-dir --unpack=false https://x/y.tgz /y\n"
      "COPY [\"$GROUP dir/\", \"/dst dir/\"]\n"
      "COPY --chmod= a b\n");
  const auto& in = insts(df);
  ASSERT_EQ(in.size(), 8u);
  EXPECT_EQ(in[2].flags, (std::map<std::string, std::string>{
                             {"chown", "app:staff"}, {"chmod", "0640"}, {"link", "true"}}));
  EXPECT_EQ(in[2].args, (Strings{"src/", "/dst/"}));
  EXPECT_EQ(in[3].flags, (std::map<std::string, std::string>{{"link", "false"}, {"chmod", "755"}}));
  EXPECT_EQ(in[3].args, (Strings{"a", "b"}));
  EXPECT_EQ(in[4].excludes, (Strings{"*.md", "docs"}));
  EXPECT_TRUE(in[4].flags.empty());
  EXPECT_EQ(in[5].flags,
            (std::map<std::string, std::string>{
                {"checksum", "sha256:abc"}, {"keep-git-dir", "true"}, {"unpack", "false"}}));
  EXPECT_EQ(in[6].args, (Strings{"staff dir/", "/dst dir/"})) << "JSON args are substituted too";
  EXPECT_TRUE(in[6].jsonForm);
  EXPECT_EQ(in[7].flags.at("chmod"), "");
}

TEST(DockerfileFormsTest, ChmodValues) {
  for (const char* ok : {"755", "0644", "4755", "07777", "0", "600"}) {
    std::string text = std::string("FROM a\nCOPY --chmod=") + ok + " a b\n";
    EXPECT_EQ(parseErr(text), "") << ok;
  }
  EXPECT_EQ(parseErr("FROM a\nCOPY --chmod=17777 a b\n"),
            "Dockerfile:2: invalid chmod parameter: '17777'. it should be octal string and "
            "between 0 and 07777");
  EXPECT_EQ(parseErr("FROM a\nCOPY --chmod=888 a b\n"),
            "Dockerfile:2: invalid chmod parameter: '888'. it should be octal string and between "
            "0 and 07777");
  EXPECT_EQ(parseErr("FROM a\nADD --chmod=u+x a b\n"),
            "Dockerfile:2: symbolic --chmod=u+x is not supported by dsec image build; use an "
            "octal mode");
  EXPECT_EQ(parseErr("FROM a\nARG M=999\nCOPY --chmod=$M a b\n"),
            "Dockerfile:3: invalid chmod parameter: '999'. it should be octal string and between "
            "0 and 07777");
}

TEST(DockerfileFormsTest, EnvForms) {
  // parser/testfiles/env, after substitution: one row per line.
  struct Case {
    std::string line;
    EnvList want;  // empty: an error
  };
  std::vector<Case> cases = {
      {"ENV name value", {{"name", "value"}}},
      {"ENV name=value", {{"name", "value"}}},
      {"ENV name=value name2=value2", {{"name", "value"}, {"name2", "value2"}}},
      {"ENV name=\"value value1\"", {{"name", "value value1"}}},
      {"ENV name=value\\ value2", {{"name", "value value2"}}},
      {"ENV name=\"value'quote space'value2\"", {{"name", "value'quote space'value2"}}},
      {"ENV name='value\"double quote\"value2'", {{"name", "value\"double quote\"value2"}}},
      {"ENV name=value\\ value2 name2=value2\\ value3",
       {{"name", "value value2"}, {"name2", "value2 value3"}}},
      {"ENV name=\"a\\\"b\"", {{"name", "a\"b"}}},
      {"ENV name=\"a\\'b\"", {{"name", "a\\'b"}}},
      {"ENV name='a\\'b'", {}},
      {"ENV name='a\\'b''", {{"name", "a\\b"}}},
      {"ENV name='a\\\"b'", {{"name", "a\\\"b"}}},
      {"ENV name=\"''\"", {{"name", "''"}}},
      {"ENV name=value \\\n    name1=value1 \\\n    name2=\"value2a \\\n           value2b\" \\\n"
       "    name3=\"value3a\\n\\\"value3b\\\"\" \\\n\tname4=\"value4a\\\\nvalue4b\" \\\n",
       {{"name", "value"},
        {"name1", "value1"},
        {"name2", "value2a            value2b"},
        {"name3", "value3a\\n\"value3b\""},
        {"name4", "value4a\\nvalue4b"}}},
      // Legacy form: everything after the name, spaces kept, quotes processed.
      {"ENV SCUBA 1 DUBA 3", {{"SCUBA", "1 DUBA 3"}}},
      {"ENV SCUBA \"1 DUBA 3\"", {{"SCUBA", "1 DUBA 3"}}},
      {"ENV a b=c", {{"a", "b=c"}}},
      {"ENV  spaced   \t value  with   spaces  ", {{"spaced", "value  with   spaces"}}},
      {"ENV empty=", {{"empty", ""}}},
      {"ENV empty=\"\" x=1", {{"empty", ""}, {"x", "1"}}},
      {"ENV eq=a=b", {{"eq", "a=b"}}},
      {"ENV \"quoted\"=key", {{"quoted", "key"}}},
  };
  for (const Case& c : cases) {
    std::string text = "FROM a\n" + c.line + "\n";
    if (c.want.empty()) {
      EXPECT_NE(parseErr(text), "") << c.line;
      continue;
    }
    Dockerfile df = parseOk(text);
    ASSERT_EQ(insts(df).size(), 1u) << c.line;
    EXPECT_EQ(insts(df)[0].kind, Kind::kEnv);
    EXPECT_EQ(insts(df)[0].kv, c.want) << c.line;
  }
}

TEST(DockerfileFormsTest, LabelsAndMaintainer) {
  Dockerfile df = parseOk(
      "FROM a\n"
      "ENV V=1.2\n"
      "LABEL a=b \"c d\"=\"e f\" g=\"h\\\"i\" version=$V\n"
      "LABEL maintainer James Turnbull \"james@example.com\"\n"
      "LABEL maintainer docker <docker@docker.io>\n"
      "MAINTAINER Jane Doe <jane@example.com> $V\n");
  const auto& in = insts(df);
  ASSERT_EQ(in.size(), 5u);
  EXPECT_EQ(in[1].kv, (EnvList{{"a", "b"}, {"c d", "e f"}, {"g", "h\"i"}, {"version", "1.2"}}));
  EXPECT_EQ(in[2].kv, (EnvList{{"maintainer", "James Turnbull james@example.com"}}));
  EXPECT_EQ(in[3].kv, (EnvList{{"maintainer", "docker <docker@docker.io>"}}));
  EXPECT_EQ(in[4].kind, Kind::kLabel);
  EXPECT_EQ(in[4].keyword, "MAINTAINER");
  EXPECT_EQ(in[4].kv, (EnvList{{"maintainer", "Jane Doe <jane@example.com> $V"}}))
      << "MAINTAINER is not expanded";
}

TEST(DockerfileFormsTest, WorkdirUserStopsignalVolume) {
  Dockerfile df = parseOk(
      "FROM busybox\n"
      "ENV D=/data U=app\n"
      "WORKDIR /test\n"
      "WORKDIR $D/sub dir\n"
      "USER docker:root\n"
      "USER ${U:-nobody}:${G:-nogroup}\n"
      "VOLUME [\"/test\"]\n"
      "VOLUME [\"/test\", \"$D\"]\n"
      "VOLUME /opt/nagios/var /opt/nagios/etc $D\n"
      "STOPSIGNAL SIGTERM\n"
      "STOPSIGNAL 9\n"
      "STOPSIGNAL sigrtmin+3\n"
      "STOPSIGNAL ${SIG:-SIGQUIT}\n");
  const auto& in = insts(df);
  ASSERT_EQ(in.size(), 12u);
  EXPECT_EQ(in[1].args, Strings{"/test"});
  EXPECT_EQ(in[2].args, Strings{"/data/sub dir"});
  EXPECT_EQ(in[3].args, Strings{"docker:root"});
  EXPECT_EQ(in[4].args, Strings{"app:nogroup"});
  EXPECT_EQ(in[5].args, Strings{"/test"});
  EXPECT_TRUE(in[5].jsonForm);
  EXPECT_EQ(in[6].args, (Strings{"/test", "/data"}));
  EXPECT_EQ(in[7].args, (Strings{"/opt/nagios/var", "/opt/nagios/etc", "/data"}));
  EXPECT_EQ(in[8].args, Strings{"SIGTERM"});
  EXPECT_EQ(in[9].args, Strings{"9"});
  EXPECT_EQ(in[10].args, Strings{"sigrtmin+3"});
  EXPECT_EQ(in[11].args, Strings{"SIGQUIT"});
}

TEST(DockerfileFormsTest, StopSignals) {
  for (const char* ok :
       {"SIGKILL", "KILL", "kill", "SIGUSR1", "RTMIN", "SIGRTMAX-14", "15", "-1"}) {
    EXPECT_EQ(parseErr(std::string("FROM a\nSTOPSIGNAL ") + ok + "\n"), "") << ok;
  }
  for (const char* bad : {"SIGFOO", "0", "RTMIN+16", "SIG"}) {
    EXPECT_EQ(parseErr(std::string("FROM a\nSTOPSIGNAL ") + bad + "\n"),
              std::string("Dockerfile:2: Invalid signal: ") + bad);
  }
}

TEST(DockerfileFormsTest, ExposeIsNormalized) {
  Dockerfile df = parseOk(
      "FROM a\n"
      "ENV PORT=9000 PORTS=\"1 2\"\n"
      "EXPOSE 80 443/tcp 53/UDP 8000-8002 ${PORT}/sctp\n"
      "EXPOSE $PORTS\n"
      "EXPOSE 127.0.0.1:8080:80 [::1]:5000:5000/udp 3000-3001:3000-3001\n"
      "EXPOSE 9000 5000 6000\n");
  const auto& in = insts(df);
  ASSERT_EQ(in.size(), 5u);
  EXPECT_EQ(in[1].args, (Strings{"80/tcp", "443/tcp", "53/udp", "8000/tcp", "8001/tcp", "8002/tcp",
                                 "9000/sctp"}));
  EXPECT_EQ(in[2].args, (Strings{"1/tcp", "2/tcp"}));
  EXPECT_EQ(in[3].args, (Strings{"80/tcp", "5000/udp", "3000/tcp", "3001/tcp"}));
  EXPECT_EQ(in[4].args, (Strings{"9000/tcp", "5000/tcp", "6000/tcp"}));
  struct {
    const char* port;
    const char* msg;
  } bad[] = {
      {"80/xyz", "invalid port: \"80/xyz\": invalid proto: xyz"},
      {"/tcp", "invalid port: \"/tcp\": no port specified"},
      {"70000", "invalid containerPort: 70000"},
      {"abc", "invalid containerPort: abc"},
      {"90-80", "invalid containerPort: 90-80"},
      {"1.2.3:80:80", "invalid IP address: 1.2.3"},
      {"x:80", "invalid hostPort: x"},
      {"1-3:1-2", "invalid ranges specified for container and host Ports: 1-2 and 1-3"},
  };
  for (const auto& b : bad) {
    EXPECT_EQ(parseErr(std::string("FROM a\nEXPOSE ") + b.port + "\n"),
              std::string("Dockerfile:2: ") + b.msg);
  }
}

TEST(DockerfileFormsTest, Healthcheck) {
  // parser/testfiles/health
  Dockerfile df = parseOk(
      "FROM debian\n"
      "ADD check.sh main.sh /app/\n"
      "CMD /app/main.sh\n"
      "HEALTHCHECK --interval=5s --timeout=3s --retries=3 \\\n"
      "  CMD /app/check.sh --quiet\n"
      "HEALTHCHECK   CMD   a b\n"
      "HEALTHCHECK --timeout=3s CMD [\"foo\"]\n"
      "HEALTHCHECK --start-period=0s --start-interval=0s --interval=5s --timeout=0s --retries=0 "
      "CMD [\"foo\"]\n"
      "HEALTHCHECK --start-period=1m30s --start-interval=500ms --interval=1.5h cmd x $Y\n"
      "HEALTHCHECK NONE\n"
      "healthcheck none\n");
  const auto& in = insts(df);
  ASSERT_EQ(in.size(), 9u);
  HealthConfig h1;
  h1.test = {"CMD-SHELL", "/app/check.sh --quiet"};
  h1.intervalNs = 5'000'000'000;
  h1.timeoutNs = 3'000'000'000;
  h1.retries = 3;
  EXPECT_EQ(in[2].kind, Kind::kHealthcheck);
  EXPECT_EQ(in[2].health, h1);
  EXPECT_EQ(in[2].args, h1.test);
  EXPECT_EQ(in[3].health->test, (Strings{"CMD-SHELL", "a b"}));
  HealthConfig h3;
  h3.test = {"CMD", "foo"};
  h3.timeoutNs = 3'000'000'000;
  EXPECT_EQ(in[4].health, h3);
  EXPECT_TRUE(in[4].jsonForm);
  HealthConfig h4;
  h4.test = {"CMD", "foo"};
  h4.intervalNs = 5'000'000'000;
  EXPECT_EQ(in[5].health, h4);
  HealthConfig h5;
  h5.test = {"CMD-SHELL", "x $Y"};
  h5.startPeriodNs = 90'000'000'000;
  h5.startIntervalNs = 500'000'000;
  h5.intervalNs = 5'400'000'000'000;
  EXPECT_EQ(in[6].health, h5);
  EXPECT_EQ(in[7].health->test, Strings{"NONE"});
  EXPECT_EQ(in[8].health->test, Strings{"NONE"});

  struct {
    const char* line;
    const char* msg;
  } bad[] = {
      {"HEALTHCHECK", "HEALTHCHECK requires at least one argument"},
      {"HEALTHCHECK CMD", "Missing command after HEALTHCHECK CMD"},
      {"HEALTHCHECK CMD []", "Missing command after HEALTHCHECK CMD"},
      {"HEALTHCHECK CONNECT TCP 7000", "Unknown type \"CONNECT\" in HEALTHCHECK (try CMD)"},
      {"HEALTHCHECK NONE x", "HEALTHCHECK NONE takes no arguments"},
      {"HEALTHCHECK --interval=5s NONE", "HEALTHCHECK NONE takes no flags"},
      {"HEALTHCHECK --interval=10us CMD x", "Interval \"interval\" cannot be less than 1ms"},
      {"HEALTHCHECK --timeout=-1s CMD x", "Interval \"timeout\" cannot be less than 1ms"},
      {"HEALTHCHECK --interval=5 CMD x", "time: missing unit in duration \"5\""},
      {"HEALTHCHECK --interval=5x CMD x", "time: unknown unit \"x\" in duration \"5x\""},
      {"HEALTHCHECK --retries=-1 CMD x", "--retries cannot be negative (-1)"},
      {"HEALTHCHECK --retries=a CMD x", "strconv.ParseInt: parsing \"a\": invalid syntax"},
      {"HEALTHCHECK --foo=1 CMD x", "unknown flag: --foo"},
      {"HEALTHCHECK CMD [\"a\", 1]",
       "when using JSON array syntax, arrays must be comprised of strings only"},
  };
  for (const auto& b : bad) {
    EXPECT_EQ(parseErr(std::string("FROM a\n") + b.line + "\n"),
              std::string("Dockerfile:2: ") + b.msg)
        << b.line;
  }
}

TEST(DockerfileFormsTest, RunFlags) {
  Dockerfile df = parseOk(
      "FROM a\nRUN --network=none make\nRUN --network=host [\"x\"]\nRUN --network=default y\n");
  EXPECT_EQ(insts(df)[0].flags.at("network"), "none");
  EXPECT_EQ(insts(df)[0].args, Strings{"make"});
  EXPECT_EQ(insts(df)[1].flags.at("network"), "host");
  EXPECT_TRUE(insts(df)[1].jsonForm);
  EXPECT_EQ(insts(df)[2].flags.at("network"), "default");
  EXPECT_EQ(parseErr("FROM a\nRUN --network=bridge x\n"),
            "Dockerfile:2: invalid network mode \"bridge\"");
  EXPECT_EQ(parseErr("FROM a\nRUN --mount=type=cache,target=/root/.cache go build\n"),
            "Dockerfile:2: RUN --mount is not supported by dsec image build");
  EXPECT_EQ(parseErr("FROM a\nRUN --security=insecure x\n"),
            "Dockerfile:2: RUN --security is not supported by dsec image build");
  EXPECT_EQ(parseErr("FROM a\nRUN --device=nvidia.com/gpu x\n"),
            "Dockerfile:2: RUN --device is not supported by dsec image build");
  EXPECT_EQ(parseErr("FROM a\nRUN --privileged x\n"), "Dockerfile:2: unknown flag: --privileged");
}

TEST(DockerfileFormsTest, FlagSyntax) {
  // extractBuilderFlags: quotes and the escape token in flag words, `--` ends them.
  Dockerfile df = parseOk(
      "FROM a\n"
      "COPY --chown=\"a b\" x y\n"
      "COPY --chown='c'd x y\n"
      "COPY --chown=e\\ f x y\n"
      "COPY -- --not-a-flag y\n"
      "COPY --chown=\"\" x y\n");
  EXPECT_EQ(insts(df)[0].flags.at("chown"), "a b");
  EXPECT_EQ(insts(df)[1].flags.at("chown"), "cd");
  EXPECT_EQ(insts(df)[2].flags.at("chown"), "e f");
  EXPECT_EQ(insts(df)[3].args, (Strings{"--not-a-flag", "y"}));
  EXPECT_TRUE(insts(df)[3].flags.empty());
  EXPECT_EQ(insts(df)[4].flags.at("chown"), "");
}

TEST(DockerfileFormsTest, Heredocs) {
  for (const char* line : {"RUN <<EOF", "RUN <<-EOF", "RUN cat <<EOF > /x", "RUN 3<<EOF x",
                           "RUN << EOF", "RUN <<\"EOF\"", "COPY <<EOF /x",
                           // BuildKit reads a spaced shift as a heredoc too.
                           "RUN echo $((1 << 2))"}) {
    std::string text = std::string("FROM a\n") + line + "\nhello\nEOF\n";
    std::string err = parseErr(text);
    EXPECT_NE(err.find("Dockerfile:2: heredocs ("), std::string::npos) << line << ": " << err;
    EXPECT_NE(err.find("are not supported"), std::string::npos) << line;
  }
  // Not heredocs: shifts, JSON form, other instructions.
  Dockerfile df = parseOk(
      "FROM a\n"
      "RUN echo $((1<<2))\n"
      "RUN [\"sh\", \"-c\", \"cat <<EOF\"]\n"
      "LABEL x=\"<<EOF\"\n"
      "RUN a<<b\n");
  EXPECT_EQ(insts(df).size(), 4u);
}

TEST(DockerfileFormsTest, OnbuildIsRecordedAndRunsInChildStages) {
  // parser/testfiles/lk4d4-the-edge-case-generator (ONBUILD part)
  Dockerfile df = parseOk(
      "FROM busybox:buildroot-2014.02 AS parent\n"
      "ONBUILD RUN [\"echo\", \"test\"]\n"
      "ONBUILD RUN echo test\n"
      "onbuild   COPY . /\n"
      "ONBUILD ENV X=$Y\n"
      "FROM parent AS child\n"
      "ENV Y=1\n"
      "FROM child\n"
      "RUN own\n");
  const auto& p = df.stages[0].instructions;
  ASSERT_EQ(p.size(), 4u);
  EXPECT_EQ(p[0].kind, Kind::kOnbuild);
  EXPECT_EQ(p[0].args, Strings{"RUN [\"echo\", \"test\"]"});
  EXPECT_EQ(p[1].args, Strings{"RUN echo test"});
  EXPECT_EQ(p[2].args, Strings{"COPY . /"});
  EXPECT_EQ(p[3].args, Strings{"ENV X=$Y"}) << "ONBUILD is not expanded";
  const auto& c = df.stages[1].instructions;
  ASSERT_EQ(c.size(), 5u);
  EXPECT_TRUE(c[0].onbuildTrigger);
  EXPECT_EQ(c[0].kind, Kind::kRun);
  EXPECT_TRUE(c[0].jsonForm);
  EXPECT_EQ(c[0].args, (Strings{"echo", "test"}));
  EXPECT_EQ(c[0].line, 2);
  EXPECT_EQ(c[1].args, Strings{"echo test"});
  EXPECT_EQ(c[2].kind, Kind::kCopy);
  EXPECT_EQ(c[2].line, 4);
  EXPECT_EQ(c[3].kv, (EnvList{{"X", ""}})) << "expanded in the child, before its own ENV";
  EXPECT_FALSE(c[4].onbuildTrigger);
  // Triggers run once: the grandchild gets none from `child` (it has no ONBUILD).
  ASSERT_EQ(df.stages[2].instructions.size(), 1u);

  EXPECT_EQ(parseErr("FROM a\nONBUILD ONBUILD RUN x\n"),
            "Dockerfile:2: Chaining ONBUILD via `ONBUILD ONBUILD` isn't allowed");
  EXPECT_EQ(parseErr("FROM a\nONBUILD FROM b\n"),
            "Dockerfile:2: FROM isn't allowed as an ONBUILD trigger");
  EXPECT_EQ(parseErr("FROM a\nONBUILD maintainer me\n"),
            "Dockerfile:2: MAINTAINER isn't allowed as an ONBUILD trigger");
  EXPECT_EQ(parseErr("FROM a\nONBUILD RUNN x\n"), "Dockerfile:2: unknown instruction: RUNN");
  EXPECT_EQ(parseErr("FROM a\nONBUILD\n"), "Dockerfile:2: ONBUILD requires at least one argument");
  EXPECT_EQ(parseErr("FROM a\nONBUILD COPY x\n"),
            "Dockerfile:2: COPY requires at least two arguments, but only one was provided. "
            "Destination could not be determined");
  EXPECT_EQ(parseErr("FROM a\nONBUILD RUN <<EOF\nx\nEOF\n"),
            "Dockerfile:2: heredocs (RUN <<EOF) are not supported by dsec image build");
}

// ===========================================================================
// Variables: ENV, ARG scoping, build args

TEST(DockerfileVarsTest, SubstitutionFormsInEveryExpandedInstruction) {
  Dockerfile df = parseOk(
      "FROM a\n"
      "ENV SET=v EMPTY=\n"
      "WORKDIR /$SET/${SET}/${SET:-d}/${UNSET:-d}/${EMPTY:-d}/${EMPTY-d}/${SET:+alt}/"
      "${UNSET:+alt}/${EMPTY+alt}/${UNSET+alt}/\\$SET/'$SET'/\"$SET\"\n"
      "USER ${SET#v}x${SET%v}\n"
      "LABEL \"k$SET\"=\"v${SET}\"\n"
      "COPY $SET/${UNSET} /${SET:?}/\n"
      "STOPSIGNAL ${SIG:-TERM}\n"
      "VOLUME $SET\n"
      "EXPOSE ${P:-80}\n"
      "ENV X=$SET\n"
      "ARG Y=$SET\n");
  const auto& in = insts(df);
  ASSERT_EQ(in.size(), 10u);
  EXPECT_EQ(in[1].args, Strings{"/v/v/v/d/d//alt//alt//$SET/$SET/v"});
  EXPECT_EQ(in[2].args, Strings{"x"});
  EXPECT_EQ(in[3].kv, (EnvList{{"kv", "vv"}}));
  EXPECT_EQ(in[4].args, (Strings{"v/", "/v/"}));
  EXPECT_EQ(in[5].args, Strings{"TERM"});
  EXPECT_EQ(in[6].args, Strings{"v"});
  EXPECT_EQ(in[7].args, Strings{"80/tcp"});
  EXPECT_EQ(in[8].kv, (EnvList{{"X", "v"}}));
  EXPECT_EQ(in[9].kv, (EnvList{{"Y", "v"}}));

  EXPECT_EQ(parseErr("FROM a\nWORKDIR ${V:?}\n"),
            "Dockerfile:2: failed to process \"${V:?}\": V: is not allowed to be unset");
  EXPECT_EQ(parseErr("FROM a\nENV E=\nUSER ${E:?need a user}\n"),
            "Dockerfile:3: failed to process \"${E:?need a user}\": E: need a user");
  EXPECT_EQ(parseErr("FROM a\nLABEL x=\"${V:?no label}\"\n"),
            "Dockerfile:2: failed to process \"\\\"${V:?no label}\\\"\": V: no label");
  // Words split before expansion, as in BuildKit: an unquoted message with
  // spaces breaks the key=value form.
  EXPECT_EQ(parseErr("FROM a\nLABEL x=${V:?no label}\n"),
            "Dockerfile:2: Syntax error - can't find = in \"label}\". Must be of the form: "
            "name=value");
  EXPECT_EQ(parseErr("FROM a\nCOPY ${SRC:?} /\n"),
            "Dockerfile:2: failed to process \"${SRC:?}\": SRC: is not allowed to be unset");
}

TEST(DockerfileVarsTest, RunCmdEntrypointAreLeftForTheShell) {
  Dockerfile df = parseOk(
      "FROM a\nENV X=1\nRUN echo $X ${Y:?}\nCMD [\"echo\", \"$X\"]\nENTRYPOINT echo ${X}\n"
      "HEALTHCHECK CMD test $X\nONBUILD RUN $X\nSHELL [\"$X\"]\n");
  const auto& in = insts(df);
  EXPECT_EQ(in[1].args, Strings{"echo $X ${Y:?}"});
  EXPECT_EQ(in[2].args, (Strings{"echo", "$X"}));
  EXPECT_EQ(in[3].args, Strings{"echo ${X}"});
  EXPECT_EQ(in[4].health->test, (Strings{"CMD-SHELL", "test $X"}));
  EXPECT_EQ(in[5].args, Strings{"RUN $X"});
  EXPECT_EQ(in[6].args, Strings{"$X"});
}

TEST(DockerfileVarsTest, EnvUsesTheValuesBeforeTheInstructionArgSeesEarlierOnes) {
  Dockerfile df = parseOk(
      "FROM a\n"
      "ENV A=1\n"
      "ENV A=2 B=$A\n"
      "ENV C=$A\n"
      "ARG D=x E=${D}y\n"
      "ARG F=$E$A\n");
  const auto& in = insts(df);
  EXPECT_EQ(in[1].kv, (EnvList{{"A", "2"}, {"B", "1"}}));
  EXPECT_EQ(in[2].kv, (EnvList{{"C", "2"}}));
  EXPECT_EQ(in[3].kv, (EnvList{{"D", "x"}, {"E", "xy"}}));
  EXPECT_EQ(in[4].kv, (EnvList{{"F", "xy2"}}));
}

TEST(DockerfileVarsTest, RunGetsTheWholeEnvironment) {
  ParseOptions o = withArgs({{"HTTP_PROXY", "http://proxy:3128"}, {"no_proxy", "localhost"}});
  Dockerfile df = parseOk(
      "FROM scratch\n"
      "RUN first\n"
      "ENV PATH=/opt/bin:$PATH GOPATH=/go\n"
      "ARG V=1\n"
      "ARG W\n"
      "ENV V=2\n"
      "RUN second\n",
      o);
  const auto& in = insts(df);
  const std::string defPath = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";
  EXPECT_EQ(in[0].env, (EnvList{{"PATH", defPath},
                                {"HTTP_PROXY", "http://proxy:3128"},
                                {"http_proxy", "http://proxy:3128"},
                                {"NO_PROXY", "localhost"},
                                {"no_proxy", "localhost"}}));
  EXPECT_EQ(in[5].env, (EnvList{{"PATH", "/opt/bin:" + defPath},
                                {"GOPATH", "/go"},
                                {"V", "2"},
                                {"HTTP_PROXY", "http://proxy:3128"},
                                {"http_proxy", "http://proxy:3128"},
                                {"NO_PROXY", "localhost"},
                                {"no_proxy", "localhost"}}));
  EXPECT_EQ(df.proxyEnv, (EnvList{{"HTTP_PROXY", "http://proxy:3128"}, {"no_proxy", "localhost"}}));
  EXPECT_TRUE(df.unusedBuildArgs.empty()) << "proxy args are predefined";
  EXPECT_EQ(in[3].args, Strings{"W"});
  EXPECT_TRUE(in[3].kv.empty());
  EXPECT_TRUE(in[1].env.empty()) << "only RUN carries env";
  EXPECT_EQ(df.stages[0].imageEnv,
            (EnvList{{"PATH", "/opt/bin:" + defPath}, {"GOPATH", "/go"}, {"V", "2"}}))
      << "ARG values stay out of the image";
  df = parseOk("FROM a AS p\nARG A=1\nENV E=2\nFROM p\nENV F=$A$E\n");
  EXPECT_EQ(df.stages[1].imageEnv, (EnvList{{"PATH", defPath}, {"E", "2"}, {"F", "12"}}));
}

TEST(DockerfileVarsTest, ProxyArgsAreNotSubstitutedUnlessDeclared) {
  ParseOptions o = withArgs({{"HTTPS_PROXY", "http://p"}});
  Dockerfile df =
      parseOk("FROM a\nWORKDIR /$HTTPS_PROXY\nARG HTTPS_PROXY\nWORKDIR /$HTTPS_PROXY\n", o);
  EXPECT_EQ(insts(df)[0].args, Strings{"/"});
  EXPECT_EQ(insts(df)[2].args, Strings{"/http://p"});
}

TEST(DockerfileVarsTest, GlobalArgsAreForFromAndMustBeRedeclaredInStages) {
  const char* text =
      "ARG BASE=alpine\n"
      "ARG VERSION=3.19\n"
      "ARG TAG=${BASE}-${VERSION}\n"
      "ARG UNSET\n"
      "FROM ${BASE}:${VERSION} AS build\n"
      "WORKDIR /before/$VERSION/$BASE\n"
      "RUN echo $VERSION\n"
      "ARG VERSION\n"
      "WORKDIR /src/$VERSION\n"
      "ARG UNSET\n"
      "WORKDIR /x${UNSET}y\n"
      "ARG TAG=own-default\n"
      "ENV V2=${VERSION}-x TAG=$TAG\n"
      "FROM $TAG AS other\n"
      "WORKDIR /$VERSION\n"
      "FROM build\n"
      "WORKDIR /$V2/$VERSION\n";
  Dockerfile df = parseOk(text);
  ASSERT_EQ(df.stages.size(), 3u);
  EXPECT_EQ(df.stages[0].base, "alpine:3.19");
  EXPECT_EQ(df.stages[1].base, "alpine-3.19");
  EXPECT_EQ(df.stages[2].baseStage, 0);
  using Global = std::vector<std::pair<std::string, std::optional<std::string>>>;
  EXPECT_EQ(df.globalArgs, (Global{{"BASE", "alpine"},
                                   {"VERSION", "3.19"},
                                   {"TAG", "alpine-3.19"},
                                   {"UNSET", std::nullopt}}));
  const auto& b = df.stages[0].instructions;
  EXPECT_EQ(b[0].args, Strings{"/before//"}) << "a global ARG is not visible until redeclared";
  EXPECT_EQ(lookupForTest(b[1].env, "VERSION"), "<unset>");
  EXPECT_EQ(b[2].args, Strings{"VERSION"});
  EXPECT_EQ(b[2].kv, (EnvList{{"VERSION", "3.19"}})) << "redeclared: takes the global value";
  EXPECT_EQ(b[3].args, Strings{"/src/3.19"});
  EXPECT_TRUE(b[4].kv.empty());
  EXPECT_EQ(b[5].args, Strings{"/xy"});
  EXPECT_EQ(b[6].kv, (EnvList{{"TAG", "own-default"}})) << "a default beats the global value";
  EXPECT_EQ(b[7].kv, (EnvList{{"V2", "3.19-x"}, {"TAG", "own-default"}}));
  // A child stage inherits everything, ARG values included.
  EXPECT_EQ(df.stages[2].instructions[0].args, Strings{"/3.19-x/3.19"});
  // `other` is not needed for the default target (the last stage).
  EXPECT_EQ(df.needed, (std::vector<int>{0, 2}));
  EXPECT_TRUE(df.stages[0].substituted);
  EXPECT_FALSE(df.stages[1].substituted);
  EXPECT_EQ(df.stages[1].instructions[0].args, Strings{"/$VERSION"});
  ParseOptions other;
  other.target = "other";
  df = parseOk(text, other);
  EXPECT_EQ(df.needed, (std::vector<int>{1}));
  EXPECT_EQ(df.stages[1].instructions[0].args, Strings{"/"});

  // Build args override global and stage defaults, but only for declared names.
  ParseOptions o =
      withArgs({{"VERSION", "3.20"}, {"TAG", "cli"}, {"SECRET", "s"}, {"BASE", "debian"}});
  o.target = "1";  // no stage is named "1"
  auto bad = parseDockerfile(text, o);
  EXPECT_EQ(bad.status().field(), "target");
  EXPECT_EQ(bad.status().message(), "target stage \"1\" could not be found");
  o.target = "build";
  df = parseOk(std::string(text) + "WORKDIR /$SECRET\n", o);
  EXPECT_EQ(df.stages[0].base, "debian:3.20");
  EXPECT_EQ(df.stages[1].base, "cli");
  EXPECT_EQ(df.stages[0].instructions[3].args, Strings{"/src/3.20"});
  EXPECT_EQ(df.stages[0].instructions[6].kv, (EnvList{{"TAG", "cli"}}));
  EXPECT_EQ(df.unusedBuildArgs, Strings{"SECRET"});
  EXPECT_EQ(df.needed, (std::vector<int>{0}));
  EXPECT_EQ(df.target, 0);
}

TEST(DockerfileVarsTest, AutomaticPlatformArgs) {
  ParseOptions o;
  o.targetPlatform = "linux/arm/v7";
  o.buildPlatform = "linux/amd64";
  Dockerfile df = parseOk(
      "FROM --platform=$BUILDPLATFORM golang AS build\n"
      "WORKDIR /$TARGETARCH\n"
      "ARG TARGETARCH TARGETVARIANT TARGETPLATFORM BUILDOS TARGETSTAGE\n"
      "WORKDIR /$TARGETARCH/$TARGETVARIANT\n"
      "FROM --platform=${TARGETPLATFORM} alpine AS final\n",
      o);
  EXPECT_EQ(df.stages[0].platform, "linux/amd64");
  EXPECT_EQ(df.stages[1].platform, "linux/arm/v7");
  o.target = "build";
  df = parseOk(
      "FROM --platform=$BUILDPLATFORM golang AS build\n"
      "WORKDIR /$TARGETARCH\n"
      "ARG TARGETARCH TARGETVARIANT TARGETPLATFORM BUILDOS TARGETSTAGE\n"
      "WORKDIR /$TARGETARCH/$TARGETVARIANT\n",
      o);
  const auto& in = insts(df);
  EXPECT_EQ(in[0].args, Strings{"/"});
  EXPECT_EQ(in[1].kv, (EnvList{{"TARGETARCH", "arm"},
                               {"TARGETVARIANT", "v7"},
                               {"TARGETPLATFORM", "linux/arm/v7"},
                               {"BUILDOS", "linux"},
                               {"TARGETSTAGE", "build"}}));
  EXPECT_EQ(in[2].args, Strings{"/arm/v7"});
  // A build arg can override an automatic one.
  o = withArgs({{"TARGETARCH", "riscv64"}});
  df = parseOk("FROM a\nARG TARGETARCH\n", o);
  EXPECT_EQ(insts(df)[0].kv, (EnvList{{"TARGETARCH", "riscv64"}}));
  EXPECT_TRUE(df.unusedBuildArgs.empty());
  // The default platform is this machine's.
  df = parseOk("FROM a\nARG TARGETOS TARGETPLATFORM\n");
  EXPECT_EQ(insts(df)[0].kv.at(0), (std::pair<std::string, std::string>{"TARGETOS", "linux"}));
  EXPECT_EQ(insts(df)[0].kv.at(1).second.rfind("linux/", 0), 0u);
}

TEST(DockerfileVarsTest, MetaArgsSeeEarlierMetaArgsAndBuildArgs) {
  Dockerfile df = parseOk("ARG A=x\nARG B=${A}y C=$B\nFROM $C$A\n");
  EXPECT_EQ(df.stages[0].base, "xyx");
  df = parseOk("ARG A=x\nARG B=${A}y C=$B\nFROM $C$A\n", withArgs({{"A", "q"}}));
  EXPECT_EQ(df.stages[0].base, "qyq");
  df = parseOk("ARG B=${A}y\nARG A=x\nFROM $B\n");
  EXPECT_EQ(df.stages[0].base, "y") << "A is not declared yet";
  EXPECT_EQ(parseErr("ARG A=${B:?nope}\nFROM x\n"),
            "Dockerfile:1: failed to process \"${B:?nope}\": B: nope");
}

// ===========================================================================
// Stages

TEST(DockerfileStagesTest, DependencyClosureForTargets) {
  const char* text =
      "FROM alpine AS base\n"                             // 0
      "FROM base AS deps\n"                               // 1 <- 0
      "FROM golang AS tools\n"                            // 2
      "FROM deps AS build\n"                              // 3 <- 1
      "COPY --from=tools /t /t\n"                         //   <- 2
      "FROM scratch AS test\n"                            // 4
      "COPY --from=2 /x /x\n"                             //   <- 2
      "FROM alpine AS final\n"                            // 5
      "COPY --from=BUILD /app /app\n"                     //   <- 3
      "COPY --from=nginx:latest /etc/nginx /etc/nginx\n"  //   an image
      "FROM final\n";                                     // 6 <- 5
  Dockerfile df = parseOk(text);
  ASSERT_EQ(df.stages.size(), 7u);
  EXPECT_EQ(df.stages[0].baseStage, -1);
  EXPECT_EQ(df.stages[1].baseStage, 0);
  EXPECT_EQ(df.stages[3].baseStage, 1);
  EXPECT_EQ(df.stages[4].base, "scratch");
  EXPECT_EQ(df.stages[6].baseStage, 5);
  EXPECT_EQ(df.stages[6].name, "");
  EXPECT_EQ(df.stages[3].deps, (std::vector<int>{1, 2}));
  EXPECT_EQ(df.stages[5].deps, (std::vector<int>{3}));
  EXPECT_EQ(df.stages[3].instructions[0].fromStage, 2);
  EXPECT_EQ(df.stages[4].instructions[0].fromStage, 2);
  EXPECT_EQ(df.stages[5].instructions[0].fromStage, 3);
  EXPECT_EQ(df.stages[5].instructions[1].fromStage, -1);
  EXPECT_EQ(df.stages[5].instructions[1].flags.at("from"), "nginx:latest");
  EXPECT_EQ(df.target, 6);
  EXPECT_EQ(df.needed, (std::vector<int>{0, 1, 2, 3, 5, 6}));
  EXPECT_FALSE(df.stages[4].substituted);

  struct {
    const char* target;
    std::vector<int> want;
  } cases[] = {
      {"", {0, 1, 2, 3, 5, 6}},
      {"final", {0, 1, 2, 3, 5}},
      {"test", {2, 4}},
      {"build", {0, 1, 2, 3}},
      {"BASE", {0}},
      {"tools", {2}},
      {"deps", {0, 1}},
  };
  for (const auto& c : cases) {
    auto got = stagesFor(df, c.target);
    ASSERT_TRUE(got.isOk()) << c.target;
    EXPECT_EQ(*got, c.want) << c.target;
    ParseOptions o;
    o.target = c.target;
    Dockerfile d2 = parseOk(text, o);
    EXPECT_EQ(d2.needed, c.want) << c.target;
    for (const Stage& s : d2.stages) {
      bool needed = std::find(c.want.begin(), c.want.end(), s.index) != c.want.end();
      EXPECT_EQ(s.substituted, needed) << c.target << " stage " << s.index;
    }
  }
  auto missing = stagesFor(df, "nope");
  EXPECT_EQ(missing.status().code(), Code::kInvalidArgument);
  EXPECT_EQ(missing.status().field(), "target");
}

TEST(DockerfileStagesTest, FromNamesOnlyEarlierStages) {
  // `FROM node AS node` is the image; a later `FROM node` is the stage.
  Dockerfile df = parseOk("FROM node AS node\nFROM node\n");
  EXPECT_EQ(df.stages[0].baseStage, -1);
  EXPECT_EQ(df.stages[1].baseStage, 0);
  // A name defined later is an image reference, as in BuildKit.
  df = parseOk("FROM later\nFROM alpine AS later\n", ParseOptions{{}, "later", "", "", nullptr});
  EXPECT_EQ(df.stages[0].baseStage, -1);
  // A stage name reached through a variable is still the stage.
  df = parseOk("ARG B=builder\nFROM alpine AS builder\nFROM $B\n");
  EXPECT_EQ(df.stages[1].baseStage, 0);
  // Stage names are matched as written (lower case) by FROM.
  df = parseOk("FROM alpine AS builder\nFROM Builder\n");
  EXPECT_EQ(df.stages[1].baseStage, -1);
}

TEST(DockerfileStagesTest, CopyFromChecks) {
  EXPECT_EQ(parseErr("FROM a\nCOPY --from=5 a b\n"), "Dockerfile:2: invalid stage index 5");
  EXPECT_EQ(parseErr("FROM a\nCOPY --from=-1 a b\n"), "Dockerfile:2: invalid stage index -1");
  EXPECT_EQ(parseErr("FROM a\nCOPY x y\nFROM b\nCOPY --from=1 p q\n"),
            "Dockerfile:4: cannot copy from stage \"1\", it needs to be defined before current "
            "stage \"stage-1\"");
  // A forward reference only matters when the stage is built.
  const char* forward = "FROM a AS first\nCOPY --from=later x y\nFROM b AS later\n";
  EXPECT_EQ(parseErr(forward), "");
  ParseOptions o;
  o.target = "first";
  EXPECT_EQ(parseErr(forward, o),
            "Dockerfile:2: cannot copy from stage \"later\", it needs to be defined before "
            "current stage \"first\"");
  EXPECT_EQ(parseErr("FROM a\nARG S=x\nCOPY --from=$S a b\n"),
            "Dockerfile:3: variable expansion is not supported for --from, define a new stage "
            "with FROM using ARG from global scope as a workaround");
  EXPECT_EQ(parseErr("FROM a\nCOPY --from= a b\n"),
            "Dockerfile:2: COPY --from requires a stage name, index or image");
  EXPECT_EQ(parseErr("FROM a\nADD --from=x a b\n"), "Dockerfile:2: unknown flag: --from");
}

TEST(DockerfileStagesTest, StageNames) {
  EXPECT_EQ(parseOk("FROM a AS my-stage_1.x\n").stages[0].name, "my-stage_1.x");
  EXPECT_EQ(parseOk("FROM a as UPPER\n").stages[0].name, "upper");
  EXPECT_EQ(parseErr("FROM a AS 1x\n"),
            "Dockerfile:1: invalid name for build stage: \"1x\", name can't start with a number or "
            "contain symbols");
  EXPECT_EQ(parseErr("FROM a AS b$c\n"),
            "Dockerfile:1: invalid name for build stage: \"b$c\", name can't start with a number "
            "or contain symbols");
  EXPECT_EQ(parseErr("FROM a AS x\nRUN y\nFROM b AS X\n"),
            "Dockerfile:3: duplicate stage name \"x\" (first defined on line 1)");
  EXPECT_EQ(parseErr("FROM a AS scratch\n"), "Dockerfile:1: stage name \"scratch\" is reserved");
  EXPECT_EQ(parseErr("FROM a AS context\n"), "Dockerfile:1: stage name \"context\" is reserved");
  EXPECT_EQ(parseErr("FROM a b\n"), "Dockerfile:1: FROM requires either one or three arguments");
  EXPECT_EQ(parseErr("FROM a AS\n"), "Dockerfile:1: FROM requires either one or three arguments");
  EXPECT_EQ(parseErr("FROM\n"), "Dockerfile:1: FROM requires either one or three arguments");
  EXPECT_EQ(parseErr("FROM a AS b c\n"),
            "Dockerfile:1: FROM requires either one or three arguments");
  EXPECT_EQ(parseErr("FROM --platform a\n"), "Dockerfile:1: missing a value on flag: --platform");
  EXPECT_EQ(parseErr("FROM --pull a\n"), "Dockerfile:1: unknown flag: --pull");
  EXPECT_EQ(parseErr("FROM $EMPTY\n"), "Dockerfile:1: base name ($EMPTY) should not be blank");
  EXPECT_EQ(parseErr("FROM --platform=$NOPE a\n"),
            "Dockerfile:1: empty platform value from expression $NOPE");
  EXPECT_EQ(parseOk("FROM --platform=linux/arm64 a\n").stages[0].platform, "linux/arm64");
}

TEST(DockerfileStagesTest, ResolverSuppliesTheBaseImageConfig) {
  int calls = 0;
  std::vector<std::string> refs;
  ParseOptions o;
  o.resolveBase = [&](const std::string& ref,
                      const std::string& platform) -> Result<BaseImageConfig> {
    ++calls;
    refs.push_back(ref + "@" + platform);
    BaseImageConfig c;
    if (ref == "golang:1.22") {
      c.env = {{"PATH", "/usr/local/go/bin:/usr/bin"}, {"GOPATH", "/go"}};
      c.onbuild = {"ENV FROM_TRIGGER=$GOPATH", "COPY --from=assets /a /a"};
    } else if (ref == "mcr/pwsh") {
      c.shell = {"pwsh", "-Command"};
    } else if (ref == "broken") {
      return Status(Code::kUnavailable, "registry down");
    }
    return c;
  };
  Dockerfile df = parseOk(
      "FROM alpine AS assets\n"
      "FROM scratch AS unused\n"
      "FROM debian AS unused2\n"
      "FROM --platform=linux/amd64 golang:1.22 AS build\n"
      "WORKDIR $GOPATH/src\n"
      "RUN go build\n"
      "FROM build\n"
      "FROM mcr/pwsh\n"
      "COPY --from=build a b\n"
      "COPY --from=1 c d\n"
      "RUN Get-Item\n",
      o);
  EXPECT_EQ(calls, 3) << "alpine (via the trigger), golang and mcr/pwsh; not scratch, debian "
                         "or stages";
  EXPECT_EQ(refs, (Strings{"golang:1.22@linux/amd64", "mcr/pwsh@", "alpine@"}));
  const auto& b = df.stages[3].instructions;
  ASSERT_EQ(b.size(), 4u);
  EXPECT_TRUE(b[0].onbuildTrigger);
  EXPECT_EQ(b[0].kv, (EnvList{{"FROM_TRIGGER", "/go"}}));
  EXPECT_EQ(b[0].line, 4);
  EXPECT_EQ(b[1].fromStage, 0);
  EXPECT_EQ(b[2].args, Strings{"/go/src"});
  EXPECT_EQ(b[3].env, (EnvList{{"PATH", "/usr/local/go/bin:/usr/bin"},
                               {"GOPATH", "/go"},
                               {"FROM_TRIGGER", "/go"}}));
  EXPECT_EQ(df.stages[3].imageEnv, b[3].env);
  EXPECT_EQ(df.needed, (std::vector<int>{0, 1, 3, 5}))
      << "the trigger's COPY --from made `assets` needed";
  EXPECT_EQ(df.stages[5].instructions[2].shell, (Strings{"pwsh", "-Command"}));
  EXPECT_EQ(df.stages[4].instructions.size(), 0u) << "image triggers do not pass to child stages";

  auto r = parseDockerfile("FROM broken\n", o);
  EXPECT_EQ(r.status().code(), Code::kUnavailable);
  EXPECT_EQ(r.status().message(), "registry down");
}

// ===========================================================================
// Errors: every one is "Dockerfile:<line>: ...", field "dockerfile".

TEST(DockerfileErrorsTest, Table) {
  struct {
    std::string text;
    std::string want;
  } cases[] = {
      {"", "Dockerfile:1: file with no instructions"},
      {"\n\n", "Dockerfile:2: file with no instructions"},
      {"# Hello\n# These are just comments\n\n", "Dockerfile:3: file with no instructions"},
      {"ARG X=1\n", "Dockerfile:1: dockerfile contains no stages to build"},
      {"FROM a\nRUNN x\n", "Dockerfile:2: unknown instruction: RUNN"},
      {"FROM a\n\n# c\nRUN echo \\\n  ok \\\n  && done\nFOO bar\n",
       "Dockerfile:7: unknown instruction: FOO"},
      {"FROM a\nRUN a \\\n  b\nCOPY \\\n x\n",
       "Dockerfile:4: COPY requires at least two arguments, but only one was provided. "
       "Destination could not be determined"},
      {"RUN x\nFROM a\n",
       "Dockerfile:1: no build stage in current context: RUN must come after a FROM"},
      {"LABEL a=b\nFROM a\n",
       "Dockerfile:1: no build stage in current context: LABEL must come after a FROM"},
      {"RUNN x\nFROM a\n", "Dockerfile:1: unknown instruction: RUNN"},
      {"FROM a\nWORKDIR\n", "Dockerfile:2: WORKDIR requires exactly one argument"},
      {"FROM a\nUSER\n", "Dockerfile:2: USER requires exactly one argument"},
      {"FROM a\nSTOPSIGNAL\n", "Dockerfile:2: STOPSIGNAL requires exactly one argument"},
      {"FROM a\nMAINTAINER\n", "Dockerfile:2: MAINTAINER requires exactly one argument"},
      {"FROM a\nRUN\n", "Dockerfile:2: RUN requires at least one argument"},
      {"FROM a\nRUN []\n", "Dockerfile:2: RUN requires at least one argument"},
      {"FROM a\nCMD\n", "Dockerfile:2: CMD requires at least one argument"},
      {"FROM a\nENTRYPOINT\n", "Dockerfile:2: ENTRYPOINT requires at least one argument"},
      {"FROM a\nARG\n", "Dockerfile:2: ARG requires at least one argument"},
      {"FROM a\nARG =x\n", "Dockerfile:2: ARG names can not be blank"},
      {"FROM a\nENV\n", "Dockerfile:2: ENV requires at least one argument"},
      {"FROM a\nLABEL\n", "Dockerfile:2: LABEL requires at least one argument"},
      {"FROM a\nEXPOSE\n", "Dockerfile:2: EXPOSE requires at least one argument"},
      {"FROM a\nVOLUME\n", "Dockerfile:2: VOLUME requires at least one argument"},
      {"FROM a\nSHELL\n", "Dockerfile:2: SHELL requires at least one argument"},
      {"FROM a\nSHELL /bin/bash -c\n",
       "Dockerfile:2: SHELL requires the arguments to be in JSON form"},
      {"FROM busybox\n\nENV PATH\n", "Dockerfile:3: ENV must have two arguments"},
      {"FROM a\nLABEL onlykey\n", "Dockerfile:2: LABEL must have two arguments"},
      {"FROM a\nENV a=b c\n",
       "Dockerfile:2: Syntax error - can't find = in \"c\". Must be of the form: name=value"},
      {"FROM a\nLABEL =x\n", "Dockerfile:2: LABEL names can not be blank"},
      {"FROM a\nENV =x\n", "Dockerfile:2: ENV names can not be blank"},
      {"FROM a\nCOPY onlyone\n",
       "Dockerfile:2: COPY requires at least two arguments, but only one was provided. "
       "Destination could not be determined"},
      {"FROM a\nADD [\"onlyone\"]\n",
       "Dockerfile:2: ADD requires at least two arguments, but only one was provided. "
       "Destination could not be determined"},
      {"FROM a\nCOPY\n",
       "Dockerfile:2: COPY requires at least two arguments, but only one was provided. "
       "Destination could not be determined"},
      {"CMD [ \"echo\", [ \"nested json\" ] ]\n",
       "Dockerfile:1: when using JSON array syntax, arrays must be comprised of strings only"},
      {"FROM a\nRUN [\"a\", 1]\n",
       "Dockerfile:2: when using JSON array syntax, arrays must be comprised of strings only"},
      {"FROM a\nCOPY [\"a\", null]\n",
       "Dockerfile:2: when using JSON array syntax, arrays must be comprised of strings only"},
      {"FROM a\nVOLUME [\"\"]\n", "Dockerfile:2: VOLUME specified can not be an empty string"},
      {"FROM a\nENV D=\nVOLUME $D\n", "Dockerfile:3: VOLUME specified can not be an empty string"},
      {"FROM a\nCOPY --foo=bar a b\n", "Dockerfile:2: unknown flag: --foo"},
      {"FROM a\nENV --x=1 A=b\n", "Dockerfile:2: unknown flag: --x"},
      {"FROM a\nWORKDIR --x /a\n", "Dockerfile:2: unknown flag: --x"},
      {"FROM a\nCOPY --from a b\n", "Dockerfile:2: missing a value on flag: --from"},
      {"FROM a\nCOPY --link= a b\n", "Dockerfile:2: missing a value on flag: --link"},
      {"FROM a\nCOPY --link=maybe a b\n",
       "Dockerfile:2: expecting boolean value for flag --link, not: maybe"},
      {"FROM a\nCOPY --chown=a --chown=b x y\n", "Dockerfile:2: duplicate flag specified: --chown"},
      {"FROM a\nCOPY --parents a b\n",
       "Dockerfile:2: COPY --parents is not supported by dsec image build"},
      {"FROM a\nCOPY --from=5 a b\n", "Dockerfile:2: invalid stage index 5"},
      {"FROM a AS x\nFROM b AS x\n",
       "Dockerfile:2: duplicate stage name \"x\" (first defined on line 1)"},
      {"FROM a\nCOPY --chmod=888 a b\n",
       "Dockerfile:2: invalid chmod parameter: '888'. it should be octal string and between 0 "
       "and 07777"},
      {"FROM a\nENV X=${Y:?must-be-set}\n",
       "Dockerfile:2: failed to process \"${Y:?must-be-set}\": Y: must-be-set"},
      {"FROM a\nENV X ${Y:?must be set}\n",
       "Dockerfile:2: failed to process \"${Y:?must be set}\": Y: must be set"},
      {"FROM a\nWORKDIR ${X\n",
       "Dockerfile:2: failed to process \"${X\": syntax error: missing '}'"},
      {"FROM a\nUSER 'abc\n",
       "Dockerfile:2: failed to process \"'abc\": unexpected end of statement while looking for "
       "matching single-quote"},
      {"FROM ubuntu:14.04\nADD \\conf\\\\\" /.znc\n",
       "Dockerfile:2: failed to process \"\\\\conf\\\\\\\\\\\"\": unexpected end of statement "
       "while looking for matching double-quote"},
      {"FROM a\nRUN <<EOF\necho hi\nEOF\n",
       "Dockerfile:2: heredocs (RUN <<EOF) are not supported by dsec image build"},
      {"FROM a\nRUN --mount=type=secret,id=x cat /run/secrets/x\n",
       "Dockerfile:2: RUN --mount is not supported by dsec image build"},
      {"# escape=x\nFROM a\n", "Dockerfile:1: invalid escape token 'x' does not match ` or \\"},
      {"# escape=`\n# escape=\\\nFROM a\n",
       "Dockerfile:2: only one escape parser directive can be used"},
      {"# syntax=a\n# SYNTAX=b\nFROM a\n",
       "Dockerfile:2: only one syntax parser directive can be used"},
      {"FROM a\nEXPOSE 80/xyz\n", "Dockerfile:2: invalid port: \"80/xyz\": invalid proto: xyz"},
      {"FROM a\nSTOPSIGNAL SIGFOO\n", "Dockerfile:2: Invalid signal: SIGFOO"},
  };
  for (const auto& c : cases) {
    EXPECT_EQ(parseErr(c.text), c.want) << "--- in:\n" << c.text;
  }
}

TEST(DockerfileErrorsTest, NegativeTestfiles) {
  // parser/testfiles-negative
  EXPECT_EQ(parseErr(""), "Dockerfile:1: file with no instructions");
  EXPECT_EQ(parseErr("FROM busybox\n\nENV PATH\n"), "Dockerfile:3: ENV must have two arguments");
  EXPECT_EQ(parseErr("# Hello\n# These are just comments\n"),
            "Dockerfile:2: file with no instructions");
  EXPECT_NE(parseErr("CMD [ \"echo\", [ \"nested json\" ] ]"), "");
}

TEST(DockerfileErrorsTest, SubstitutionErrorsOnlyInNeededStages) {
  const char* text = "FROM a AS broken\nWORKDIR ${NOPE:?}\nFROM b AS fine\nRUN ok\n";
  EXPECT_EQ(parseErr(text), "");
  ParseOptions o;
  o.target = "broken";
  EXPECT_EQ(parseErr(text, o),
            "Dockerfile:2: failed to process \"${NOPE:?}\": NOPE: is not allowed to be unset");
  // Syntax errors count everywhere.
  EXPECT_EQ(parseErr("FROM a AS x\nRUNN\nFROM b\n"), "Dockerfile:2: unknown instruction: RUNN");
}

TEST(DockerfileErrorsTest, UnneededStagesKeepTheirTextAndArgForm) {
  ParseOptions o;
  o.target = "first";
  Dockerfile df = parseOk("FROM a AS first\nFROM b\nARG X=$Y Z\nWORKDIR $X\nEXPOSE $P\n", o);
  const auto& in = df.stages[1].instructions;
  EXPECT_FALSE(df.stages[1].substituted);
  EXPECT_EQ(in[0].args, (Strings{"X", "Z"}));
  EXPECT_EQ(in[0].kv, (EnvList{{"X", "$Y"}}));
  EXPECT_EQ(in[1].args, Strings{"$X"});
  EXPECT_EQ(in[2].args, Strings{"$P"});
}

TEST(DockerfileErrorsTest, TheBuildArgsOverloadMatchesOptions) {
  auto r = parseDockerfile("FROM a\nARG V\nWORKDIR /$V\n",
                           std::map<std::string, std::string>{{"V", "x"}});
  ASSERT_TRUE(r.isOk());
  EXPECT_EQ(r->stages[0].instructions[1].args, Strings{"/x"});
}

TEST(DockerfileRealWorldTest, LinesOfAKitchenSinkFile) {
  // parser/testfiles/lk4d4-the-edge-case-generator, the non-ONBUILD part.
  Dockerfile df = parseOk(
      "FROM busybox:buildroot-2014.02\n"
      "\n"
      "LABEL maintainer docker <docker@docker.io>\n"
      "\n"
      "\n"
      "# RUN Commands \\\n"
      "# linebreak in comment \\\n"
      "RUN [\"ls\", \"-la\"]\n"
      "RUN mkdir -p /test /test2 /test3/test\n"
      "\n"
      "# ENV \\\n"
      "ENV SCUBA 1 DUBA 3\n"
      "ENV SCUBA \"1 DUBA 3\"\n"
      "\n"
      "# CMD \\\n"
      "CMD [\"echo\", \"test\"]\n"
      "CMD echo \"test\"\n"
      "\n"
      "#EXPOSE\\\n"
      "EXPOSE 3000\n"
      "EXPOSE 9000 5000 6000\n"
      "\n"
      "USER docker\n"
      "USER docker:root\n"
      "\n"
      "VOLUME [\"/test\"]\n"
      "VOLUME [\"/test\", \"/test2\"]\n"
      "VOLUME /test3\n"
      "\n"
      "WORKDIR /test\n"
      "\n"
      "ADD . /\n"
      "COPY . copy\n");
  std::vector<std::pair<Kind, int>> want = {
      {Kind::kLabel, 3},   {Kind::kRun, 8},     {Kind::kRun, 9},      {Kind::kEnv, 12},
      {Kind::kEnv, 13},    {Kind::kCmd, 16},    {Kind::kCmd, 17},     {Kind::kExpose, 20},
      {Kind::kExpose, 21}, {Kind::kUser, 23},   {Kind::kUser, 24},    {Kind::kVolume, 26},
      {Kind::kVolume, 27}, {Kind::kVolume, 28}, {Kind::kWorkdir, 30}, {Kind::kAdd, 32},
      {Kind::kCopy, 33}};
  ASSERT_EQ(insts(df).size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_EQ(insts(df)[i].kind, want[i].first) << i;
    EXPECT_EQ(insts(df)[i].line, want[i].second) << i;
  }
  EXPECT_EQ(insts(df)[3].kv, (EnvList{{"SCUBA", "1 DUBA 3"}}));
  EXPECT_EQ(insts(df)[4].kv, (EnvList{{"SCUBA", "1 DUBA 3"}}));
}

// ===========================================================================
// .dockerignore

DockerIgnore ignoreOf(const std::vector<std::string>& patterns) {
  auto r = DockerIgnore::fromPatterns(patterns);
  EXPECT_TRUE(r.isOk()) << r.status().toString();
  return r.isOk() ? *r : DockerIgnore{};
}

// What a parents-first walk gets (patternmatcher's MatchesUsingParentResults
// test): each parent directory's MatchInfo feeds the next level.
bool walkExcluded(const DockerIgnore& di, const std::string& path) {
  std::string parent =
      cleanPath(path.substr(0, path.rfind('/') == std::string::npos ? 0 : path.rfind('/') + 1));
  DockerIgnore::MatchInfo info;
  if (parent != ".") {
    std::string prefix;
    for (const std::string& part : splitOn(parent, '/')) {
      prefix += (prefix.empty() ? "" : "/") + part;
      DockerIgnore::MatchInfo next;
      di.excludedUsingParent(prefix, info, &next);
      info = std::move(next);
    }
  }
  return di.excludedUsingParent(path, info, nullptr);
}

TEST(DockerIgnoreTest, PatternmatcherMatchesTable) {
  // patternmatcher_test.go TestMatches
  struct {
    const char* pattern;
    const char* text;
    bool pass;
  } tests[] = {
      {"**", "file", true},
      {"**", "file/", true},
      {"**/", "file", true},
      {"**/", "file/", true},
      {"**", "/", true},
      {"**/", "/", true},
      {"**", "dir/file", true},
      {"**/", "dir/file", true},
      {"**", "dir/file/", true},
      {"**/", "dir/file/", true},
      {"**/**", "dir/file", true},
      {"**/**", "dir/file/", true},
      {"dir/**", "dir/file", true},
      {"dir/**", "dir/file/", true},
      {"dir/**", "dir/dir2/file", true},
      {"dir/**", "dir/dir2/file/", true},
      {"**/dir", "dir", true},
      {"**/dir", "dir/file", true},
      {"**/dir2/*", "dir/dir2/file", true},
      {"**/dir2/*", "dir/dir2/file/", true},
      {"**/dir2/**", "dir/dir2/dir3/file", true},
      {"**/dir2/**", "dir/dir2/dir3/file/", true},
      {"**file", "file", true},
      {"**file", "dir/file", true},
      {"**/file", "dir/file", true},
      {"**file", "dir/dir/file", true},
      {"**/file", "dir/dir/file", true},
      {"**/file*", "dir/dir/file", true},
      {"**/file*", "dir/dir/file.txt", true},
      {"**/file*txt", "dir/dir/file.txt", true},
      {"**/file*.txt", "dir/dir/file.txt", true},
      {"**/file*.txt*", "dir/dir/file.txt", true},
      {"**/**/*.txt", "dir/dir/file.txt", true},
      {"**/**/*.txt2", "dir/dir/file.txt", false},
      {"**/*.txt", "file.txt", true},
      {"**/**/*.txt", "file.txt", true},
      {"a**/*.txt", "a/file.txt", true},
      {"a**/*.txt", "a/dir/file.txt", true},
      {"a**/*.txt", "a/dir/dir/file.txt", true},
      {"a/*.txt", "a/dir/file.txt", false},
      {"a/*.txt", "a/file.txt", true},
      {"a/*.txt**", "a/file.txt", true},
      {"a[b-d]e", "ae", false},
      {"a[b-d]e", "ace", true},
      {"a[b-d]e", "aae", false},
      {"a[^b-d]e", "aze", true},
      {".*", ".foo", true},
      {".*", "foo", false},
      {"abc.def", "abcdef", false},
      {"abc.def", "abc.def", true},
      {"abc.def", "abcZdef", false},
      {"abc?def", "abcZdef", true},
      {"abc?def", "abcdef", false},
      {"a\\\\", "a\\", true},
      {"**/foo/bar", "foo/bar", true},
      {"**/foo/bar", "dir/foo/bar", true},
      {"**/foo/bar", "dir/dir2/foo/bar", true},
      {"abc/**", "abc", false},
      {"abc/**", "abc/def", true},
      {"abc/**", "abc/def/ghi", true},
      {"**/.foo", ".foo", true},
      {"**/.foo", "bar.foo", false},
      {"a(b)c/def", "a(b)c/def", true},
      {"a(b)c/def", "a(b)c/xyz", false},
      {"a.|)$(}+{bc", "a.|)$(}+{bc", true},
      {"dist/proxy.py-2.4.0rc3.dev36+g08acad9-py3-none-any.whl",
       "dist/proxy.py-2.4.0rc3.dev36+g08acad9-py3-none-any.whl", true},
      {"dist/*.whl", "dist/proxy.py-2.4.0rc3.dev36+g08acad9-py3-none-any.whl", true},
      {"a\\*b", "a*b", true},
  };
  int rows = 0;
  for (const auto& t : tests) {
    DockerIgnore di = ignoreOf({t.pattern});
    EXPECT_EQ(di.excluded(t.text), t.pass)
        << "MatchesOrParentMatches " << t.pattern << " " << t.text;
    EXPECT_EQ(walkExcluded(di, t.text), t.pass)
        << "MatchesUsingParentResults " << t.pattern << " " << t.text;
    EXPECT_EQ(di.excludedUsingParent(t.text, {}, nullptr), t.pass)
        << "MatchesUsingParentResultsNoContext " << t.pattern << " " << t.text;
    ++rows;
  }
  struct {
    Strings patterns;
    const char* text;
    bool pass;
  } multi[] = {
      {{"**", "!util/docker/web"}, "util/docker/web/foo", false},
      {{"**", "!util/docker/web", "util/docker/web/foo"}, "util/docker/web/foo", true},
      {{"**", "!dist/proxy.py-2.4.0rc3.dev36+g08acad9-py3-none-any.whl"},
       "dist/proxy.py-2.4.0rc3.dev36+g08acad9-py3-none-any.whl",
       false},
      {{"**", "!dist/*.whl"}, "dist/proxy.py-2.4.0rc3.dev36+g08acad9-py3-none-any.whl", false},
      // More: last match wins, exceptions inside excluded dirs.
      {{"*.go", "!fileutils.go"}, "fileutils.go", false},
      {{"!fileutils.go", "*.go"}, "fileutils.go", true},
      {{"docs", "!docs/README.md"}, "docs/README.md", false},
      {{"docs/", "!docs/README.md"}, "docs/README.md", false},
      {{"docs/*", "!docs/README.md"}, "docs/README.md", false},
      {{"docs/*", "!docs/README.md"}, "docs/other.md", true},
      {{"*", "!keep", "keep/secret"}, "keep/secret", true},
      {{"*", "!keep", "keep/secret"}, "keep/public", false},
      {{"*", "!keep", "keep/secret"}, "other", true},
      {{}, "any/path/there", false},
  };
  for (const auto& t : multi) {
    DockerIgnore di = ignoreOf(t.patterns);
    EXPECT_EQ(di.excluded(t.text), t.pass) << t.text;
    EXPECT_EQ(walkExcluded(di, t.text), t.pass) << t.text;
    EXPECT_EQ(di.excludedUsingParent(t.text, {}, nullptr), t.pass) << t.text;
    ++rows;
  }
  EXPECT_EQ(rows, 82);
}

TEST(DockerIgnoreTest, PatternmatcherGoMatchTable) {
  // patternmatcher_test.go TestMatch (Go's filepath.Match cases, with the
  // parent-directory rule on top): pattern, path, excluded, error.
  struct {
    const char* pattern;
    const char* s;
    bool match;
    bool err;
  } tests[] = {
      {"abc", "abc", true, false},
      {"*", "abc", true, false},
      {"*c", "abc", true, false},
      {"a*", "a", true, false},
      {"a*", "abc", true, false},
      {"a*", "ab/c", true, false},
      {"a*/b", "abc/b", true, false},
      {"a*/b", "a/c/b", false, false},
      {"a*b*c*d*e*/f", "axbxcxdxe/f", true, false},
      {"a*b*c*d*e*/f", "axbxcxdxexxx/f", true, false},
      {"a*b*c*d*e*/f", "axbxcxdxe/xxx/f", false, false},
      {"a*b*c*d*e*/f", "axbxcxdxexxx/fff", false, false},
      {"a*b?c*x", "abxbbxdbxebxczzx", true, false},
      {"a*b?c*x", "abxbbxdbxebxczzy", false, false},
      {"ab[c]", "abc", true, false},
      {"ab[b-d]", "abc", true, false},
      {"ab[e-g]", "abc", false, false},
      {"ab[^c]", "abc", false, false},
      {"ab[^b-d]", "abc", false, false},
      {"ab[^e-g]", "abc", true, false},
      {"a\\*b", "a*b", true, false},
      {"a\\*b", "ab", false, false},
      {"a?b", "a☺b", true, false},
      {"a[^a]b", "a☺b", true, false},
      {"a???b", "a☺b", false, false},
      {"a[^a][^a][^a]b", "a☺b", false, false},
      {"[a-ζ]*", "α", true, false},
      {"*[a-ζ]", "A", false, false},
      {"a?b", "a/b", false, false},
      {"a*b", "a/b", false, false},
      {"[\\]a]", "]", true, false},
      {"[\\-]", "-", true, false},
      {"[x\\-]", "x", true, false},
      {"[x\\-]", "-", true, false},
      {"[x\\-]", "z", false, false},
      {"[\\-x]", "x", true, false},
      {"[\\-x]", "-", true, false},
      {"[\\-x]", "a", false, false},
      {"[]a]", "]", false, true},
      {"[-]", "-", false, true},
      {"[x-]", "x", false, true},
      {"[x-]", "-", false, true},
      {"[x-]", "z", false, true},
      {"[-x]", "x", false, true},
      {"[-x]", "-", false, true},
      {"[-x]", "a", false, true},
      {"\\", "a", false, true},
      {"[a-b-c]", "a", false, true},
      {"[", "a", false, true},
      {"[^", "a", false, true},
      {"[^bc", "a", false, true},
      {"a[", "a", false, true},
      {"a[", "ab", false, true},
      {"*x", "xxx", true, false},
  };
  for (const auto& t : tests) {
    auto di = DockerIgnore::fromPatterns({t.pattern});
    if (t.err) {
      ASSERT_FALSE(di.isOk()) << t.pattern;
      EXPECT_EQ(di.status().field(), "dockerignore");
      EXPECT_EQ(di.status().message(),
                std::string("pattern 1: syntax error in pattern: ") + t.pattern);
      continue;
    }
    ASSERT_TRUE(di.isOk()) << t.pattern << ": " << di.status().message();
    EXPECT_EQ(di->excluded(cleanPath(t.s)), t.match) << t.pattern << " " << t.s;
  }
  // Matches(".", ...) is never true; no patterns match nothing.
  EXPECT_FALSE(ignoreOf({"*.go"}).excluded("."));
  EXPECT_FALSE(ignoreOf({"*"}).excluded("."));
  EXPECT_TRUE(ignoreOf({"*"}).excluded("fileutils.go"));
  EXPECT_TRUE(ignoreOf({"*.go"}).excluded("fileutils.go"));
  EXPECT_FALSE(DockerIgnore().excluded("anything"));
  EXPECT_TRUE(DockerIgnore().empty());
}

TEST(DockerIgnoreTest, GoFilepathMatch) {
  // Go's path/filepath match_test.go (Unix).
  struct {
    const char* pattern;
    const char* s;
    bool match;
    bool err;
  } tests[] = {
      {"abc", "abc", true, false},
      {"*", "abc", true, false},
      {"*c", "abc", true, false},
      {"a*", "a", true, false},
      {"a*", "abc", true, false},
      {"a*", "ab/c", false, false},
      {"a*/b", "abc/b", true, false},
      {"a*/b", "a/c/b", false, false},
      {"a*b*c*d*e*/f", "axbxcxdxe/f", true, false},
      {"a*b*c*d*e*/f", "axbxcxdxexxx/f", true, false},
      {"a*b*c*d*e*/f", "axbxcxdxe/xxx/f", false, false},
      {"a*b*c*d*e*/f", "axbxcxdxexxx/fff", false, false},
      {"a*b?c*x", "abxbbxdbxebxczzx", true, false},
      {"a*b?c*x", "abxbbxdbxebxczzy", false, false},
      {"ab[c]", "abc", true, false},
      {"ab[b-d]", "abc", true, false},
      {"ab[e-g]", "abc", false, false},
      {"ab[^c]", "abc", false, false},
      {"ab[^b-d]", "abc", false, false},
      {"ab[^e-g]", "abc", true, false},
      {"a\\*b", "a*b", true, false},
      {"a\\*b", "ab", false, false},
      {"a?b", "a☺b", true, false},
      {"a[^a]b", "a☺b", true, false},
      {"a???b", "a☺b", false, false},
      {"a[^a][^a][^a]b", "a☺b", false, false},
      {"[a-ζ]*", "α", true, false},
      {"*[a-ζ]", "A", false, false},
      {"a?b", "a/b", false, false},
      {"a*b", "a/b", false, false},
      {"[\\]a]", "]", true, false},
      {"[\\-]", "-", true, false},
      {"[x\\-]", "x", true, false},
      {"[x\\-]", "-", true, false},
      {"[x\\-]", "z", false, false},
      {"[\\-x]", "x", true, false},
      {"[\\-x]", "-", true, false},
      {"[\\-x]", "a", false, false},
      {"[]a]", "]", false, true},
      {"[-]", "-", false, true},
      {"[x-]", "x", false, true},
      {"[x-]", "-", false, true},
      {"[x-]", "z", false, true},
      {"[-x]", "x", false, true},
      {"[-x]", "-", false, true},
      {"[-x]", "a", false, true},
      {"\\", "a", false, true},
      {"[a-b-c]", "a", false, true},
      {"[", "a", false, true},
      {"[^", "a", false, true},
      {"[^bc", "a", false, true},
      {"a[", "a", false, true},
      {"a[", "ab", false, true},
      {"a[", "x", false, true},
      {"a/b[", "x", false, true},
      {"*x", "xxx", true, false},
  };
  for (const auto& t : tests) {
    auto r = goFilepathMatch(t.pattern, t.s);
    if (t.err) {
      EXPECT_FALSE(r.isOk()) << t.pattern << " " << t.s;
      continue;
    }
    ASSERT_TRUE(r.isOk()) << t.pattern << " " << t.s;
    EXPECT_EQ(*r, t.match) << t.pattern << " " << t.s;
  }
}

TEST(DockerIgnoreTest, CleanPath) {
  // Go's path.Clean tests.
  struct {
    const char* in;
    const char* want;
  } tests[] = {
      {"abc", "abc"},
      {"abc/def", "abc/def"},
      {"a/b/c", "a/b/c"},
      {".", "."},
      {"..", ".."},
      {"../..", "../.."},
      {"../../abc", "../../abc"},
      {"/abc", "/abc"},
      {"/", "/"},
      {"", "."},
      {"abc/", "abc"},
      {"abc/def/", "abc/def"},
      {"a/b/c/", "a/b/c"},
      {"./", "."},
      {"../", ".."},
      {"../../", "../.."},
      {"/abc/", "/abc"},
      {"abc//def//ghi", "abc/def/ghi"},
      {"//abc", "/abc"},
      {"///abc", "/abc"},
      {"//abc//", "/abc"},
      {"abc//", "abc"},
      {"abc/./def", "abc/def"},
      {"/./abc/def", "/abc/def"},
      {"abc/.", "abc"},
      {"abc/def/ghi/../jkl", "abc/def/jkl"},
      {"abc/def/../ghi/../jkl", "abc/jkl"},
      {"abc/def/..", "abc"},
      {"abc/def/../..", "."},
      {"/abc/def/../..", "/"},
      {"abc/def/../../..", ".."},
      {"/abc/def/../../..", "/"},
      {"abc/def/../../../ghi/jkl/../../../mno", "../../mno"},
      {"abc/./../def", "def"},
      {"abc//./../def", "def"},
      {"abc/../../././../def", "../../def"},
  };
  for (const auto& t : tests) EXPECT_EQ(cleanPath(t.in), t.want) << t.in;
}

TEST(DockerIgnoreTest, ReadsTheFileLikeIgnorefile) {
  // ignorefile_test.go TestReadAll (the "!" lines are tested below: they are
  // errors once the patterns are compiled).
  auto di = DockerIgnore::parse(
      "test1\n"
      "/test2\n"
      "/a/file/here\n"
      "\n"
      "lastfile\n"
      "# this is a comment\n"
      "! /inverted/abs/path\n");
  ASSERT_TRUE(di.isOk()) << di.status().toString();
  std::vector<std::pair<std::string, bool>> got;
  for (const auto& p : di->patterns()) got.emplace_back(p.text, p.exclusion);
  EXPECT_EQ(got, (std::vector<std::pair<std::string, bool>>{{"test1", false},
                                                            {"test2", false},
                                                            {"a/file/here", false},
                                                            {"lastfile", false},
                                                            {"inverted/abs/path", true}}));
  EXPECT_EQ(di->patterns()[4].line, 7);
  EXPECT_TRUE(di->hasExceptions());
  EXPECT_TRUE(DockerIgnore::parse("").isOk());
  EXPECT_TRUE(DockerIgnore::parse("")->empty());

  auto bang = DockerIgnore::parse("a\n\n! \n");
  ASSERT_FALSE(bang.isOk());
  EXPECT_EQ(bang.status().field(), "dockerignore");
  EXPECT_EQ(bang.status().message(), ".dockerignore:3: illegal exclusion pattern: \"!\"");
  auto bad = DockerIgnore::parse("# ok\nfoo[\n");
  ASSERT_FALSE(bad.isOk());
  EXPECT_EQ(bad.status().message(), ".dockerignore:2: syntax error in pattern: foo[");
  auto reversed = DockerIgnore::parse("[Local-Only]/\n");
  EXPECT_FALSE(reversed.isOk()) << "Go's regexp refuses the range l-O";
}

TEST(DockerIgnoreTest, FileDetails) {
  // BOM, CRLF, whitespace, comments only in column 1, cleaning.
  auto di = DockerIgnore::parse(
      "\xEF\xBB\xBF"
      "first\r\n"
      "  spaced/dir/  \r\n"
      "  # not a comment\n"
      "./dot/../cleaned\n"
      "!  ./spaced/dir/keep\n"
      "/\n"
      "\t\n");
  ASSERT_TRUE(di.isOk()) << di.status().toString();
  Strings texts;
  for (const auto& p : di->patterns()) texts.push_back((p.exclusion ? "!" : "") + p.text);
  EXPECT_EQ(texts, (Strings{"first", "spaced/dir", "# not a comment", "cleaned", "!spaced/dir/keep",
                            "/"}));
  EXPECT_TRUE(di->excluded("first"));
  EXPECT_TRUE(di->excluded("spaced/dir/x"));
  EXPECT_FALSE(di->excluded("spaced/dir/keep"));
  EXPECT_TRUE(di->excluded("# not a comment"));
  EXPECT_TRUE(di->excluded("cleaned/x"));
}

TEST(DockerIgnoreTest, ARealisticFile) {
  auto r = DockerIgnore::parse(
      "# build outputs\n"
      "node_modules\n"
      "*.log\n"
      "!important.log\n"
      "/build/\n"
      "**/.git\n"
      "docs/**\n"
      "!docs/README.md\n"
      "**/__pycache__\n"
      "*.py[co]\n"
      "Dockerfile*\n"
      ".dockerignore\n");
  ASSERT_TRUE(r.isOk()) << r.status().toString();
  const DockerIgnore& di = *r;
  struct {
    const char* path;
    bool excluded;
  } cases[] = {
      {"node_modules", true},
      {"node_modules/x/y.js", true},
      {"src/node_modules", false},
      {"a.log", true},
      {"dir/a.log", false},
      {"important.log", false},
      {"build", true},
      {"build/out/bin", true},
      {"src/build", false},
      {".git", true},
      {".git/HEAD", true},
      {"vendor/lib/.git/config", true},
      {"docs", false},
      {"docs/guide.md", true},
      {"docs/README.md", false},
      {"docs/sub/README.md", true},
      {"pkg/__pycache__/m.pyc", true},
      {"m.pyc", true},
      {"m.pyo", true},
      {"m.py", false},
      {"Dockerfile", true},
      {"Dockerfile.dev", true},
      {".dockerignore", true},
      {"src/main.go", false},
  };
  for (const auto& c : cases) {
    EXPECT_EQ(di.excluded(c.path), c.excluded) << c.path;
    EXPECT_EQ(walkExcluded(di, c.path), c.excluded) << c.path;
  }
  EXPECT_TRUE(di.hasExceptions());
  EXPECT_TRUE(di.mayContainExceptions("docs")) << "docs/README.md is an exception under it";
  EXPECT_FALSE(di.mayContainExceptions("node_modules"));
  EXPECT_FALSE(di.mayContainExceptions("build"));
  EXPECT_FALSE(di.mayContainExceptions("doc"));
}

TEST(DockerIgnoreTest, WhenAnExcludedDirectoryMustStillBeWalked) {
  // fsutil filterFS: skip an excluded dir unless an exception could match
  // inside it; any wildcard in an exception (before a trailing /* or /**)
  // means every excluded dir must be walked.
  EXPECT_FALSE(ignoreOf({"dir"}).mayContainExceptions("dir"));
  EXPECT_FALSE(ignoreOf({"dir", "!other/x"}).mayContainExceptions("dir"));
  EXPECT_TRUE(ignoreOf({"dir", "!dir/x"}).mayContainExceptions("dir"));
  EXPECT_TRUE(ignoreOf({"a", "!a/b/c"}).mayContainExceptions("a/b"));
  EXPECT_TRUE(ignoreOf({"a", "!a/b/**"}).mayContainExceptions("a/b"));
  EXPECT_TRUE(ignoreOf({"a", "!a/b/*"}).mayContainExceptions("a/b"));
  EXPECT_FALSE(ignoreOf({"a", "!a/b/*"}).mayContainExceptions("a/c"));
  EXPECT_FALSE(ignoreOf({"a", "!a/bc"}).mayContainExceptions("a/b"));
  EXPECT_TRUE(ignoreOf({"a", "!a"}).mayContainExceptions("a"));
  EXPECT_TRUE(ignoreOf({"dir", "!**/*.keep"}).mayContainExceptions("dir"));
  EXPECT_TRUE(ignoreOf({"dir", "!other/x?"}).mayContainExceptions("dir"));
  EXPECT_TRUE(ignoreOf({"dir", "!x[ab]"}).mayContainExceptions("dir"));
  // And the walk then finds the exception.
  DockerIgnore di = ignoreOf({"dir", "!**/*.keep"});
  EXPECT_TRUE(di.excluded("dir/a.txt"));
  EXPECT_FALSE(di.excluded("dir/sub/a.keep"));
  EXPECT_FALSE(walkExcluded(di, "dir/sub/a.keep"));
}

TEST(DockerIgnoreTest, WalkerMatchInfoIsPerPattern) {
  DockerIgnore di = ignoreOf({"a/*", "!a/keep", "a/keep/x"});
  DockerIgnore::MatchInfo top, a, keep;
  EXPECT_FALSE(di.excludedUsingParent("a", top, &a));
  EXPECT_EQ(a.parentMatched, (std::vector<bool>{false, false, false}));
  EXPECT_FALSE(di.excludedUsingParent("a/keep", a, &keep));
  EXPECT_EQ(keep.parentMatched, (std::vector<bool>{true, true, false}));
  EXPECT_TRUE(di.excludedUsingParent("a/keep/x", keep, nullptr));
  EXPECT_FALSE(di.excludedUsingParent("a/keep/y", keep, nullptr));
  EXPECT_TRUE(di.excludedUsingParent("a/other", a, nullptr));
}

}  // namespace
}  // namespace dsec::image
