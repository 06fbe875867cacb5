// A pure Dockerfile parser for `dsec image build`: text in, typed stages out.
// It follows Docker's BuildKit frontend (moby/buildkit frontend/dockerfile:
// parser/, instructions/parse.go, shell/lex.go, dockerfile2llb/convert.go) for
// the subset dsec builds, and rejects the rest with a clear error rather than
// building something different. No I/O: the only outside information comes
// through ParseOptions (build args, target, platforms and an optional callback
// that supplies a base image's config).
//
// What the executor gets (the contract):
//  * Stages in file order; `Dockerfile::needed` lists, in build order, the
//    stages the target depends on (FROM <stage>, COPY --from=<stage|index>,
//    also through ONBUILD triggers a stage inherits from a parent stage).
//  * In needed stages, every instruction whose arguments Docker expands is
//    fully substituted: FROM (base and --platform, global ARGs only), ENV, ARG,
//    LABEL, WORKDIR, USER, COPY/ADD (sources, dest, --chown, --chmod,
//    --checksum), EXPOSE, STOPSIGNAL, VOLUME. RUN, CMD, ENTRYPOINT, SHELL,
//    HEALTHCHECK, ONBUILD and MAINTAINER are left as written (the shell, or a
//    later build, expands them). Stages that are not needed are parsed and
//    checked for syntax but not substituted (`Stage::substituted` is false),
//    as BuildKit only dispatches reachable stages.
//  * RUN carries `env`: the whole environment the command runs with (the base
//    image's env, or PATH's default, then ENV and ARG values in order, then
//    proxy build args), so the executor needs no variable bookkeeping.
//  * Shell-form RUN/CMD/ENTRYPOINT carry `shell`: the SHELL in effect.
//
// Deliberate choices and known differences from BuildKit:
//  * Errors are all Status kInvalidArgument, field "dockerfile", message
//    "Dockerfile:<line>: <what>" (line of the instruction's first line).
//  * Duplicate stage names and the reserved names "scratch"/"context" are
//    errors (BuildKit only lints them).
//  * RUN --mount, --security, --device, heredocs (`RUN <<EOF`), symbolic
//    --chmod (u+x) and COPY --parents are rejected as unsupported.
//  * ONBUILD is recorded (kOnbuild; args[0] is the trigger text) and a parent
//    stage's triggers are injected at the start of a `FROM <stage>` child, as
//    BuildKit runs them there; triggers of an external base image are injected
//    only when the resolver reports them.
//  * MAINTAINER becomes kLabel with kv {"maintainer", value} and keyword
//    "MAINTAINER" (BuildKit sets the image's author field instead).
//  * COPY --from is never substituted: a value that would expand is an error,
//    exactly as BuildKit ("variable expansion is not supported for --from").
//  * Without a resolver a base image's env is taken as PATH's default only,
//    so `$VAR` set by the base image expands to "" at build time.
//  * The shell lexer works on bytes: whitespace is ASCII; any non-ASCII byte
//    counts as a letter in a $NAME (Go's unicode.IsLetter is close to that
//    for names followed by CJK or accented text); ${V#pat}/${V%pat}/
//    ${V/pat/rep} patterns match code points.
//
// Thread safety: the functions are pure and reentrant; the resolver is called
// on the caller's thread.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "common/status.h"

namespace dsec::image {

// Ordered name/value pairs; a later entry with the same name wins.
using EnvList = std::vector<std::pair<std::string, std::string>>;

// HEALTHCHECK, as it goes into the image config.
struct HealthConfig {
  // {"NONE"}, {"CMD", argv...} (JSON form) or {"CMD-SHELL", "command line"}.
  std::vector<std::string> test;
  int64_t intervalNs = 0;  // 0: not set (the runtime default applies)
  int64_t timeoutNs = 0;
  int64_t startPeriodNs = 0;
  int64_t startIntervalNs = 0;
  int retries = 0;
  bool operator==(const HealthConfig&) const = default;
};

struct Instruction {
  enum class Kind {
    kRun,
    kCopy,
    kAdd,
    kEnv,
    kArg,
    kWorkdir,
    kUser,
    kLabel,  // also MAINTAINER
    kEntrypoint,
    kCmd,
    kExpose,
    kVolume,
    kStopsignal,
    kHealthcheck,
    kShell,
    kOnbuild,
  };
  Kind kind = Kind::kRun;
  int line = 0;          // 1-based line of the instruction's first line
  std::string keyword;   // upper-cased name as written: "RUN", "MAINTAINER"
  std::string original;  // the logical line (continuations joined), trimmed
  // RUN/CMD/ENTRYPOINT/SHELL/COPY/ADD/VOLUME/HEALTHCHECK CMD written as a JSON
  // array (exec form).
  bool jsonForm = false;
  // Per kind:
  //  RUN/CMD/ENTRYPOINT: exec form argv, or {command line} in shell form
  //    (CMD [] and ENTRYPOINT [] give an empty list).
  //  COPY/ADD: sources..., dest. WORKDIR/USER/STOPSIGNAL: {value}.
  //  EXPOSE: normalized "port/proto" (ranges expanded, proto lower-cased).
  //  VOLUME: paths. SHELL: the new shell argv. ARG: the declared names.
  //  HEALTHCHECK: health->test. ONBUILD: {trigger text}. ENV/LABEL: empty.
  std::vector<std::string> args;
  // Flags as given ("--link" gives {"link","true"}). Accepted: COPY chown,
  // chmod, from, link; ADD chown, chmod, link, keep-git-dir, checksum, unpack;
  // RUN network (default|none|host); HEALTHCHECK interval, timeout,
  // start-period, start-interval, retries. Values substituted like args.
  std::map<std::string, std::string> flags;
  std::vector<std::string> excludes;  // COPY/ADD --exclude (repeatable), raw
  // ENV and LABEL pairs in order; ARG: the declared names that have a value
  // (build arg, default, or the global ARG of that name), with it.
  EnvList kv;
  EnvList env;                         // RUN only: the full environment it runs with
  std::vector<std::string> shell;      // shell-form RUN/CMD/ENTRYPOINT: SHELL in effect
  int fromStage = -1;                  // COPY --from naming a stage (by name or index)
  std::optional<HealthConfig> health;  // HEALTHCHECK
  bool onbuildTrigger = false;         // injected from the base's ONBUILD; line is the trigger's
};

struct Stage {
  std::string name;  // lower-cased `AS` name, "" if none
  int index = 0;
  std::string base;      // substituted FROM image reference, "scratch", or a stage name
  int baseStage = -1;    // index of the earlier stage `base` names, -1 for an image
  std::string platform;  // substituted FROM --platform, "" if not given
  int line = 0;
  bool substituted = false;  // false: not needed for the target, args as written
  std::vector<Instruction> instructions;
  // Needed stages: the image config's Env after the last instruction (the
  // base's Env, or PATH's default, then ENV; ARG values are build-time only).
  EnvList imageEnv;
  std::vector<int> deps;  // stages this one reads directly, ascending
};

struct Dockerfile {
  std::vector<Stage> stages;
  // ARGs declared before the first FROM, with their value after build args
  // and defaults (nullopt: declared without a value).
  std::vector<std::pair<std::string, std::optional<std::string>>> globalArgs;
  int target = 0;                            // index of the stage being built
  std::vector<int> needed;                   // the target's dependency closure, in build order
  char escape = '\\';                        // the `# escape=` directive in effect
  EnvList proxyEnv;                          // predefined proxy build args that were given
  std::vector<std::string> unusedBuildArgs;  // given but declared by no ARG (sorted)
};

// A base image's config, for substitution and RUN's env.
struct BaseImageConfig {
  EnvList env;
  std::vector<std::string> shell;    // empty: /bin/sh -c
  std::vector<std::string> onbuild;  // ONBUILD triggers to run first
};
// Supplies an image's config (ref is the substituted FROM reference; platform
// the stage's, possibly ""). Called once per needed stage whose base is an
// image other than scratch. An error fails the parse with its status.
using BaseImageResolver =
    std::function<Result<BaseImageConfig>(const std::string& ref, const std::string& platform)>;

struct ParseOptions {
  std::map<std::string, std::string> buildArgs;  // --build-arg NAME=VALUE
  std::string target;                            // --target; "" = the last stage
  // "os/arch[/variant]" for the TARGET* and BUILD* automatic ARGs; "" = the
  // platform this binary was built for (linux/amd64, linux/arm64, ...).
  std::string targetPlatform;
  std::string buildPlatform;
  BaseImageResolver resolveBase;  // optional
};

// Parses and substitutes a Dockerfile. Errors (kInvalidArgument, field
// "dockerfile", "Dockerfile:<line>: ..."): bad or repeated parser directive,
// empty file / no FROM, unknown instruction, instruction before FROM (other
// than ARG), missing or extra arguments, non-string JSON array, COPY/ADD with
// fewer than two arguments, unknown, duplicate or valueless flags, unsupported
// features (listed above), bad stage names, duplicate stage names, --from
// stage index out of range or not earlier than the copying stage, bad
// --chmod/EXPOSE/STOPSIGNAL/HEALTHCHECK values, `${V:?msg}` and other lexer
// errors ("failed to process ..."), an empty base name. --target naming no
// stage: kInvalidArgument, field "target". A resolver error is returned as is.
Result<Dockerfile> parseDockerfile(std::string_view text, const ParseOptions& opts);
Result<Dockerfile> parseDockerfile(std::string_view text,
                                   const std::map<std::string, std::string>& buildArgs);

// The stages needed to build `target` ("" = last stage), in build order.
// Errors: kInvalidArgument field "target" if no stage has that name; field
// "dockerfile" if a needed stage copies from a stage not defined before it.
Result<std::vector<int>> stagesFor(const Dockerfile& df, std::string_view target);

// BuildKit's shell lexer (shell/lex.go), for tests and for callers that
// expand words themselves. `env` lookups take the last entry of a name.
struct ShellLexOptions {
  char escape = '\\';
  bool rawQuotes = false;     // keep quote characters in the output
  bool rawEscapes = false;    // keep escape characters in the output
  bool skipUnsetEnv = false;  // leave $UNSET as written
};
// One word, spaces kept (ProcessWord). Errors: kInvalidArgument, field
// "dockerfile", message "failed to process \"<word>\": <why>".
Result<std::string> shellExpandWord(std::string_view word, const EnvList& env,
                                    const ShellLexOptions& opts = {});
// Expanded and split on unquoted whitespace (ProcessWords). Same errors.
Result<std::vector<std::string>> shellExpandWords(std::string_view word, const EnvList& env,
                                                  const ShellLexOptions& opts = {});

}  // namespace dsec::image
