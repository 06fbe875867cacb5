// POST /v1/images/build: an image from a Dockerfile (docs/images.md,
// "Building from a Dockerfile"). The Dockerfile is parsed first (its errors
// answer 400 before anything runs); then each needed stage is built in
// order, its state a stack of layers, an image config and a cache key:
//  * RUN runs in a container sandbox of the stack so far, under the
//    `default` policy (no egress) or, when the build asks for network,
//    `setup`; its writes become a layer by pack_diff.
//  * COPY/ADD take files from the uploaded context (a tar blob, its
//    .dockerignore applied), or from another stage or image read through a
//    sandbox of it, and become a layer made from a synthesized tar
//    (image/build_context.h): nothing is extracted on the host.
//  * the other instructions change the config only.
// Each RUN/COPY/ADD is looked up in the step cache first (store's
// build_cache); a hit reuses its layer. Progress streams as NDJSON.
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <optional>
#include <set>

#include "common/log.h"
#include "common/sha256.h"
#include "common/util.h"
#include "image/build_context.h"
#include "image/dockerfile.h"
#include "image/layer_converter.h"
#include "image/registry_client.h"
#include "platform/api_util.h"
#include "platform/platform.h"

namespace dsec::platform {

namespace {

using image::Instruction;
using Kind = image::Instruction::Kind;

constexpr size_t kMaxDockerfile = 1 << 20;
constexpr int64_t kStepTimeoutS = 3600;          // one RUN, at most (policies may cap it lower)
constexpr int64_t kStepOutputCap = 256ll << 20;  // per stream of one RUN
constexpr size_t kMaxLayers = 128;               // what a sandbox stacks (checkCreate)
constexpr size_t kMaxEtcFile = 4 << 20;          // /etc/passwd, /etc/group read for --chown

bool validDigest(const std::string& d) {
  if (d.size() != 71 || !startsWith(d, "sha256:")) return false;
  for (size_t i = 7; i < d.size(); ++i) {
    char c = d[i];
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  }
  return true;
}

// The line of a "Dockerfile:N: ..." message, 0 if none.
int lineOf(const Status& st) {
  const std::string& m = st.message();
  if (!startsWith(m, "Dockerfile:")) return 0;
  int n = 0;
  for (size_t i = 11; i < m.size() && isdigit(static_cast<unsigned char>(m[i])); ++i) {
    n = n * 10 + (m[i] - '0');
    if (n > 100000000) return 0;
  }
  return n;
}

// `st` as a Dockerfile error of line `line`: its code kept, field
// "dockerfile", the message prefixed "Dockerfile:N: " unless it has it.
Status atLine(int line, const Status& st) {
  if (st.isOk() || lineOf(st) > 0) {
    return st.isOk() ? st : Status(st.code(), st.message(), st.sysErrno(), "dockerfile");
  }
  return Status(st.code(), "Dockerfile:" + std::to_string(line) + ": " + st.message(),
                st.sysErrno(), "dockerfile");
}

json errorObject(const Status& st) {
  json e = {{"code", codeName(st.code())}, {"message", st.message()}};
  if (!st.field().empty()) e["field"] = st.field();
  if (int line = lineOf(st); line > 0) e["line"] = line;
  return e;
}

// An error answered before the stream starts: the API's error object, with
// the Dockerfile line when the message names one.
void sendBuildError(http::Response& res, const Status& st) {
  auto [status, body] = errorAnswer(st);
  if (int line = lineOf(st); line > 0) {
    json j = json::parse(body, nullptr, false);
    if (j.is_object() && j["error"].is_object()) {
      j["error"]["line"] = line;
      body = dumpJson(j);
    }
  }
  sendJson(res, status, body);
}

// An EnvList as "K=V" strings, one per name (the last value wins, at the
// place of the first).
std::vector<std::string> envStrings(const image::EnvList& env) {
  std::vector<std::string> names;
  std::map<std::string, std::string> values;
  for (auto& [k, v] : env) {
    if (!values.count(k)) names.push_back(k);
    values[k] = v;
  }
  std::vector<std::string> out;
  for (auto& k : names) out.push_back(k + "=" + values[k]);
  return out;
}

bool isUrl(const std::string& s) {
  return startsWith(s, "http://") || startsWith(s, "https://") || startsWith(s, "git@") ||
         startsWith(s, "git://");
}

std::string parentOf(const std::string& abs) {
  size_t slash = abs.rfind('/');
  return slash == 0 || slash == std::string::npos ? "/" : abs.substr(0, slash);
}

std::string joinPath(const std::string& dir, const std::string& rel) {
  return dir == "/" ? "/" + rel : dir + "/" + rel;
}

uint32_t typeBits(const std::string& t) {
  if (t == "dir") return S_IFDIR;
  if (t == "symlink") return S_IFLNK;
  if (t == "file") return S_IFREG;
  return 0;
}

}  // namespace

// One build, run on the request's thread. Not thread-safe.
class ImageBuild {
 public:
  struct Options {
    std::string dockerfile;
    image::ParseOptions parse;    // build args and target; resolveBase is set here
    image::Dockerfile firstPass;  // the parse the request was checked with
    std::string platform;         // of FROM images pulled ("" = linux/amd64)
    bool network = false;
    bool noCache = false;
    bool insecure = false;
    ImageRecord target;  // name, tag, owner, visibility: checked
  };
  // Sends one event; false once the client is gone.
  using Emit = std::function<bool(const json&)>;

  ImageBuild(Platform& p, Options o, image::FileSet* context, std::string work, Emit emit)
      : p_(p),
        o_(std::move(o)),
        context_(context),
        work_(std::move(work)),
        emit_(std::move(emit)),
        id_("b-" + randomHex(6)) {}

  Result<ImageRecord> run();

 private:
  struct State {
    std::vector<std::string> layers;  // bottom first
    image::ImageConfig config;
    std::string key;      // the cache key of this state
    bool cmdSet = false;  // a CMD of this stage (ENTRYPOINT then keeps it)
  };
  // What a walk through a sandbox's file system found (walkPath).
  struct Walk {
    std::string path;                  // symlinks resolved; a missing tail as asked
    json st;                           // stat of `path`, null when it is missing
    std::map<std::string, json> dirs;  // stat of each existing directory on the way
  };
  // Destroys its sandbox when it goes.
  struct SandboxGuard {
    Platform* p = nullptr;
    std::string id;
    ~SandboxGuard() {
      if (!id.empty()) (void)p->destroy(id, SandboxState::kStopped, "build step done");
    }
  };

  bool emit(const json& ev) {
    if (gone_) return false;
    if (!emit_(ev)) gone_ = true;
    return !gone_;
  }
  Status alive() const {
    return gone_ ? Status(Code::kUnavailable, "the client went away; the build stopped")
                 : Status::ok();
  }
  void stepEvent(int stage, const Instruction& i, std::optional<bool> cached) {
    json ev = {{"type", "step"}, {"stage", stage}, {"line", i.line}, {"instruction", i.original}};
    if (cached) ev["cached"] = *cached;
    emit(ev);
  }

  Status buildStage(int index);
  Result<State> fromBase(const image::Stage& st);
  Status stepRun(int stage, State& s, const Instruction& i);
  Status stepCopy(int stage, State& s, const Instruction& i);
  void applyConfig(State& s, const Instruction& i);

  // A FROM or COPY --from image: local (as named, or as a pull would have
  // named it), else pulled.
  Result<ImageRecord> resolveImage(const std::string& ref, const std::string& platform);
  // An image's whole stack (a pack_diff snapshot's base, workspaces and
  // toolkits under its diffs) and the config that goes with it.
  Result<std::pair<std::vector<std::string>, image::ImageConfig>> stackOf(const ImageRecord& img);
  std::string stackIdentity(const std::vector<std::string>& layers);

  std::optional<std::string> cacheHit(const std::string& key);
  // Takes a RUN/COPY/ADD step from the cache if it is there: its layer goes
  // on the stack and the events say so. False: the step must run.
  Result<bool> fromCache(int stage, State& s, const Instruction& i, const std::string& key);
  void remember(const std::string& key, const std::string& layer, const Instruction& i);
  Status pushLayer(State& s, const std::string& layer, int line);

  Result<std::string> launch(const std::vector<std::string>& layers, const std::string& policy,
                             const std::string& user, const std::string& workdir);
  Result<json> agent(const std::string& sb, proto::AgentOp op, const json& args);
  Result<json> stat(const std::string& sb, const std::string& path);  // null: missing
  Result<Walk> walkPath(const std::string& sb, const std::string& abs);
  Result<std::optional<std::string>> readSmall(const std::string& sb, const std::string& path);
  Result<image::FileSet> readFromStack(const std::vector<std::string>& layers,
                                       const std::vector<std::string>& sources);
  Status readTree(const std::string& sb, const std::string& path, const std::string& setPath,
                  const json& st, image::FileSet& set, int depth);

  Result<std::string> commitPacked(const image::BuiltLayer& l);
  Result<std::string> commitConverted(const image::ConvertedLayer& c);
  std::string workDir() {
    return p_.opts_.dataDir + "/blobs/build-" + p_.workTag() + "-" + id_ + "-" +
           std::to_string(++seq_);
  }

  Platform& p_;
  Options o_;
  image::FileSet* context_;
  std::string work_;  // spools
  Emit emit_;
  std::string id_;
  image::Dockerfile df_;
  std::map<int, State> stages_;
  std::map<std::string, ImageRecord> images_;  // FROM / --from refs resolved
  std::set<std::string> made_;                 // step layers of this build
  int seq_ = 0;
  bool gone_ = false;
};

// ---- the build ------------------------------------------------------------------

Result<ImageRecord> ImageBuild::run() {
  // The second parse knows the base images' environments (their ENV is
  // visible to $VAR in the Dockerfile and to RUN), so their images are
  // resolved (and pulled) now.
  std::string failedRef;
  image::ParseOptions po = o_.parse;
  po.resolveBase = [&](const std::string& ref,
                       const std::string& platform) -> Result<image::BaseImageConfig> {
    auto img = resolveImage(ref, platform);
    if (!img.isOk()) {
      failedRef = ref;
      return img.status();
    }
    auto stack = stackOf(*img);
    if (!stack.isOk()) {
      failedRef = ref;
      return stack.status();
    }
    image::BaseImageConfig c;
    for (auto& kv : stack->second.env) {
      size_t eq = kv.find('=');
      if (eq != std::string::npos && eq > 0) {
        c.env.emplace_back(kv.substr(0, eq), kv.substr(eq + 1));
      }
    }
    return c;
  };
  auto df = image::parseDockerfile(o_.dockerfile, po);
  if (!df.isOk()) {
    if (!failedRef.empty()) {
      for (auto& st : o_.firstPass.stages) {
        if (st.base == failedRef) {
          return atLine(st.line, Status(df.status()).withContext("FROM " + failedRef));
        }
      }
    }
    return df.status();
  }
  df_ = std::move(df).value();
  log::info("build " + id_ + " of " + o_.target.name + ":" + o_.target.tag + ": " +
            std::to_string(df_.needed.size()) + " stage(s)");
  for (int index : df_.needed) RETURN_IF_ERROR(buildStage(index));
  const State& fin = stages_.at(df_.target);
  if (fin.layers.empty()) {
    return invalidArg("dockerfile",
                      "the image would have no layers (FROM scratch without a "
                      "RUN, COPY or ADD)");
  }
  ImageRecord img = o_.target;
  img.kind = "base";
  img.layers = fin.layers;
  img.config = fin.config;
  img.createdAt = nowSeconds();
  img.size = 0;
  ASSIGN_OR_RETURN(auto holds, p_.holdLayers(img.layers));  // other replicas' collections too
  {
    std::lock_guard gc(p_.gcMu_);  // a collection must not take the layers meanwhile
    for (auto& d : img.layers) {
      ASSIGN_OR_RETURN(BlobRecord blob, p_.store_->getBlob(d));
      img.size += blob.size;
      // The step layers become base layers; the base image's keep theirs.
      if (made_.count(d) && blob.kind.empty()) RETURN_IF_ERROR(p_.store_->setBlobKind(d, "base"));
    }
    RETURN_IF_ERROR(p_.store_->putImage(img));
  }
  log::info("build " + id_ + ": " + img.name + ":" + img.tag + ", " +
            std::to_string(img.layers.size()) + " layer(s)");
  return img;
}

Status ImageBuild::buildStage(int index) {
  const image::Stage& st = df_.stages[index];
  RETURN_IF_ERROR(alive());
  {
    Instruction from;
    from.line = st.line;
    from.original = "FROM " + st.base + (st.name.empty() ? "" : " AS " + st.name);
    stepEvent(index, from, std::nullopt);
  }
  auto base = fromBase(st);
  if (!base.isOk()) return atLine(st.line, base.status());
  State s = std::move(base).value();
  s.cmdSet = false;
  for (const Instruction& i : st.instructions) {
    RETURN_IF_ERROR(alive());
    Status r;
    switch (i.kind) {
      case Kind::kRun:
        r = stepRun(index, s, i);
        break;
      case Kind::kCopy:
      case Kind::kAdd:
        r = stepCopy(index, s, i);
        break;
      default:
        stepEvent(index, i, std::nullopt);
        applyConfig(s, i);
        break;
    }
    if (!r.isOk()) return atLine(i.line, r);
  }
  s.config.env = envStrings(st.imageEnv);
  stages_[index] = std::move(s);
  return Status::ok();
}

Result<ImageBuild::State> ImageBuild::fromBase(const image::Stage& st) {
  if (st.baseStage >= 0) {
    auto it = stages_.find(st.baseStage);
    if (it == stages_.end()) {
      return internalError("stage " + std::to_string(st.baseStage) + " not built");
    }
    return it->second;
  }
  State s;
  if (st.base == "scratch") {
    s.key = "sha256:" + sha256Hex("dsec-build-from\nscratch");
    return s;
  }
  auto it = images_.find(st.base);
  if (it == images_.end()) {
    ASSIGN_OR_RETURN(ImageRecord img, resolveImage(st.base, st.platform));
    it = images_.emplace(st.base, std::move(img)).first;
  }
  ASSIGN_OR_RETURN(auto stack, stackOf(it->second));
  s.layers = std::move(stack.first);
  s.config = std::move(stack.second);
  s.key = "sha256:" + sha256Hex("dsec-build-from\n" + stackIdentity(s.layers));
  return s;
}

void ImageBuild::applyConfig(State& s, const Instruction& i) {
  image::ImageConfig& c = s.config;
  auto argv = [&](const Instruction& x) {
    if (x.jsonForm) return x.args;
    std::vector<std::string> v =
        x.shell.empty() ? std::vector<std::string>{"/bin/sh", "-c"} : x.shell;
    if (!x.args.empty()) v.push_back(x.args[0]);
    return v;
  };
  switch (i.kind) {
    case Kind::kWorkdir:
      if (!i.args.empty()) c.workingDir = image::resolveDest(i.args[0], c.workingDir);
      break;
    case Kind::kUser:
      if (!i.args.empty()) c.user = i.args[0];
      break;
    case Kind::kLabel:
      for (auto& [k, v] : i.kv) c.labels[k] = v;
      break;
    case Kind::kCmd:
      c.cmd = argv(i);
      s.cmdSet = true;
      break;
    case Kind::kEntrypoint:
      c.entrypoint = argv(i);
      // As Docker: a new entrypoint drops the base's CMD, not this stage's.
      if (!s.cmdSet) c.cmd.clear();
      break;
    default:
      // ENV and ARG reach RUN through the parser (Instruction::env) and the
      // image through Stage::imageEnv; SHELL through Instruction::shell;
      // EXPOSE, VOLUME, STOPSIGNAL, HEALTHCHECK, ONBUILD are not kept.
      break;
  }
}

// ---- RUN -------------------------------------------------------------------------

Status ImageBuild::stepRun(int stage, State& s, const Instruction& i) {
  std::vector<std::string> argv;
  std::vector<std::string> shell;
  if (i.jsonForm) {
    argv = i.args;
  } else {
    shell = i.shell.empty() ? std::vector<std::string>{"/bin/sh", "-c"} : i.shell;
    argv = shell;
    argv.push_back(i.args.empty() ? "" : i.args[0]);
  }
  if (argv.empty() || argv[0].empty()) return invalidArg("dockerfile", "RUN has no command");
  auto net = i.flags.find("network");
  const bool network = o_.network && (net == i.flags.end() || net->second != "none");
  std::vector<std::string> env = envStrings(i.env);

  image::StepKeyInput k;
  k.parent = s.key;
  k.owner = o_.target.owner;
  k.instruction = image::instructionText(i);
  k.env = env;
  k.shell = shell;
  k.user = s.config.user;
  k.workdir = s.config.workingDir;
  k.network = network;
  const std::string key = image::stepCacheKey(k);
  ASSIGN_OR_RETURN(bool cached, fromCache(stage, s, i, key));
  if (cached) return Status::ok();
  stepEvent(stage, i, false);
  if (s.layers.empty()) {
    return invalidArg("dockerfile",
                      "RUN needs files to run: the stage is FROM scratch and has "
                      "no layers yet (COPY a shell in first)");
  }
  ASSIGN_OR_RETURN(std::string sb, launch(s.layers, network ? "setup" : "default", s.config.user,
                                          s.config.workingDir));
  SandboxGuard guard{&p_, sb};
  proto::ExecSpec spec;
  spec.argv = argv;
  spec.env = env;
  spec.cwd = s.config.workingDir.empty() ? "/" : s.config.workingDir;
  spec.user = s.config.user;
  spec.timeoutMs = kStepTimeoutS * 1000;
  const PolicyLimits caps = p_.policies_->limitsOf(network ? "setup" : "default");
  if (caps.maxExecTimeoutS > 0) {
    spec.timeoutMs = std::min<int64_t>(spec.timeoutMs, int64_t(caps.maxExecTimeoutS * 1000));
  }
  spec.maxOutput = kStepOutputCap;
  if (caps.maxOutputBytes > 0) {
    spec.maxOutput = std::min<int64_t>(spec.maxOutput, caps.maxOutputBytes);
  }
  auto sink = [this, line = i.line](bool isStderr, std::string_view data) -> Status {
    if (!emit({{"type", "output"},
               {"line", line},
               {"stream", isStderr ? "stderr" : "stdout"},
               {"data", std::string(data)}})) {
      return Status(Code::kUnavailable, "the client went away");
    }
    return Status::ok();
  };
  auto r = p_.cluster_->exec(sb, spec, sink);
  if (!r.isOk()) return Status(r.status()).withContext("RUN");
  if (r->timedOut) {
    return invalidArg("dockerfile",
                      "RUN timed out after " + std::to_string(spec.timeoutMs / 1000) + " s");
  }
  if (r->oomKilled) return invalidArg("dockerfile", "RUN ran out of memory (killed)");
  if (r->signal != 0) {
    return invalidArg("dockerfile", "RUN was killed by signal " + std::to_string(r->signal));
  }
  if (r->exitCode != 0) {
    return invalidArg("dockerfile", "RUN exited with status " + std::to_string(r->exitCode));
  }
  const std::string work = workDir();
  auto packed = p_.cluster_->packDiff(sb, work);
  if (!packed.isOk()) {
    (void)removeTree(work);
    return Status(packed.status()).withContext("RUN: pack its changes");
  }
  auto layer = commitPacked(*packed);
  (void)removeTree(work);
  if (!layer.isOk()) return layer.status();
  RETURN_IF_ERROR(pushLayer(s, *layer, i.line));
  s.key = key;
  remember(key, *layer, i);
  emit({{"type", "layer"}, {"line", i.line}, {"layer", *layer}, {"cached", false}});
  return Status::ok();
}

// ---- COPY and ADD ------------------------------------------------------------------

Status ImageBuild::stepCopy(int stage, State& s, const Instruction& i) {
  const bool add = i.kind == Kind::kAdd;
  const std::string what = add ? "ADD" : "COPY";
  if (i.args.size() < 2) {
    return invalidArg("dockerfile", what + " needs a source and a destination");
  }
  const std::vector<std::string> sources(i.args.begin(), i.args.end() - 1);
  const std::string& dest = i.args.back();
  for (auto& src : sources) {
    if (isUrl(src)) {
      return invalidArg("dockerfile", what + " from a URL (" + src +
                                          ") is not supported by dsec image build; "
                                          "RUN wget/curl with --network instead");
    }
  }
  // Where the files come from: the context, or a stage's or image's files.
  auto from = i.flags.find("from");
  std::vector<std::string> srcLayers;
  std::string source;
  std::optional<image::CopySelection> sel;
  if (from != i.flags.end()) {
    if (i.fromStage >= 0) {
      auto it = stages_.find(i.fromStage);
      if (it == stages_.end()) return internalError("stage " + from->second + " not built");
      srcLayers = it->second.layers;
    } else {
      auto img = images_.find(from->second);
      if (img == images_.end()) {
        ASSIGN_OR_RETURN(ImageRecord got, resolveImage(from->second, ""));
        img = images_.emplace(from->second, std::move(got)).first;
      }
      ASSIGN_OR_RETURN(auto stack, stackOf(img->second));
      srcLayers = std::move(stack.first);
    }
    source = "from:" + stackIdentity(srcLayers);
  } else {
    ASSIGN_OR_RETURN(sel, image::selectCopySources(*context_, sources, i.excludes, what));
  }
  image::StepKeyInput k;
  k.parent = s.key;
  k.owner = o_.target.owner;
  k.instruction = image::instructionText(i);
  k.user = s.config.user;
  k.workdir = s.config.workingDir;
  if (sel) k.files = sel->items;
  k.source = source;
  const std::string key = image::stepCacheKey(k);
  ASSIGN_OR_RETURN(bool cached, fromCache(stage, s, i, key));
  if (cached) return Status::ok();
  stepEvent(stage, i, false);

  image::FileSet fromSet;
  const image::FileSet* set = context_;
  if (from != i.flags.end()) {
    if (srcLayers.empty()) {
      return invalidArg("dockerfile", what + " --from=" + from->second + ": it has no files");
    }
    ASSIGN_OR_RETURN(fromSet, readFromStack(srcLayers, sources));
    ASSIGN_OR_RETURN(sel, image::selectCopySources(fromSet, sources, i.excludes, what));
    set = &fromSet;
  }

  // ADD unpacks a local archive it is named (not one inside a directory).
  std::vector<std::unique_ptr<image::FileSet>> archives(sel->items.size());
  if (add) {
    for (size_t n = 0; n < sel->items.size(); ++n) {
      const image::CopyItem& item = sel->items[n];
      if (!item.named || !S_ISREG(item.file->mode) || item.file->size == 0) continue;
      std::string head(512, '\0');
      auto in = set->open(*item.file);
      size_t got = 0;
      while (got < head.size()) {
        ASSIGN_OR_RETURN(size_t r, in->read(head.data() + got, head.size() - got));
        if (r == 0) break;
        got += r;
      }
      head.resize(got);
      if (!image::looksLikeArchive(head)) continue;
      auto whole = set->open(*item.file);
      bool notArchive = false;
      auto unpacked = image::readTarArchive(*whole, work_, "dockerfile", false, false, &notArchive);
      if (!unpacked.isOk()) {
        if (notArchive) continue;  // compressed, but not a tar: copied as it is
        return Status(unpacked.status()).withContext("ADD " + item.rel);
      }
      archives[n] = std::make_unique<image::FileSet>(std::move(unpacked).value());
    }
  }
  const bool anyArchive =
      std::any_of(archives.begin(), archives.end(), [](auto& a) { return a != nullptr; });

  // What the destination is in the image so far.
  bool destDirForm = false;
  const std::string destAbs = image::resolveDest(dest, s.config.workingDir, &destDirForm);
  Walk walk;
  walk.path = destAbs;
  std::optional<std::string> passwd, group;
  auto chown = i.flags.find("chown");
  if (!s.layers.empty()) {
    ASSIGN_OR_RETURN(std::string sb, launch(s.layers, "default", "", ""));
    SandboxGuard guard{&p_, sb};
    ASSIGN_OR_RETURN(walk, walkPath(sb, destAbs));
    if (chown != i.flags.end() && image::chownNeedsNames(chown->second)) {
      ASSIGN_OR_RETURN(passwd, readSmall(sb, "/etc/passwd"));
      ASSIGN_OR_RETURN(group, readSmall(sb, "/etc/group"));
    }
  }
  std::optional<image::Owner> owner;
  if (chown != i.flags.end()) {
    ASSIGN_OR_RETURN(owner, image::resolveChown(chown->second, passwd, group));
  }
  std::optional<uint32_t> chmod;
  if (auto c = i.flags.find("chmod"); c != i.flags.end()) {
    uint32_t v = 0;
    for (char ch : c->second) v = v * 8 + uint32_t(ch - '0');  // octal, checked by the parser
    chmod = v & 07777;
  }
  const bool existingDir = walk.st.is_object() && walk.st.value("type", "") == "dir";
  const bool destIsDir = destDirForm || !sel->singleFile || existingDir || anyArchive;
  if (walk.st.is_object() && !existingDir && destIsDir) {
    return invalidArg("dockerfile", what + ": " + walk.path + " is not a directory");
  }
  const std::string destDir = destIsDir ? walk.path : parentOf(walk.path);

  std::vector<image::LayerEntry> entries;
  // The destination's directories: as they are in the image, or made (0755,
  // the --chown owner, as BuildKit makes them).
  {
    std::vector<std::string> chain;
    for (std::string d = destDir; d != "/"; d = parentOf(d)) chain.push_back(d);
    std::reverse(chain.begin(), chain.end());
    for (const std::string& d : chain) {
      image::LayerEntry e;
      e.path = d;
      if (auto it = walk.dirs.find(d); it != walk.dirs.end()) {
        const json& st = it->second;
        e.mode = S_IFDIR | (st.value("mode", 0755u) & 07777);
        e.uid = st.value("uid", 0u);
        e.gid = st.value("gid", 0u);
        e.mtime = int64_t(st.value("mtime", 0.0));
      } else {
        e.mode = S_IFDIR | 0755;
        if (owner) {
          e.uid = owner->uid;
          e.gid = owner->gid;
        }
        e.mtime = int64_t(nowSeconds());
      }
      entries.push_back(std::move(e));
    }
  }
  std::set<std::string> seen;
  for (auto& e : entries) seen.insert(e.path);
  for (size_t n = 0; n < sel->items.size(); ++n) {
    const image::CopyItem& item = sel->items[n];
    if (archives[n]) {
      const image::FileSet& a = *archives[n];
      for (auto& [path, f] : a.files()) {
        image::LayerEntry e;
        e.path = joinPath(destDir, path);
        e.mode = f.mode;
        e.uid = owner ? owner->uid : f.uid;
        e.gid = owner ? owner->gid : f.gid;
        e.mtime = f.mtime;
        e.size = f.size;
        e.link = f.link;
        e.fd = a.fd();
        e.offset = f.offset;
        if (seen.insert(e.path).second) entries.push_back(std::move(e));
      }
      continue;
    }
    const image::BuildFile& f = *item.file;
    image::LayerEntry e;
    e.path = destIsDir ? joinPath(destDir, item.rel) : walk.path;
    e.mode = (f.mode & S_IFMT) | (chmod && !S_ISLNK(f.mode) ? *chmod : (f.mode & 07777));
    e.uid = owner ? owner->uid : f.uid;
    e.gid = owner ? owner->gid : f.gid;
    e.mtime = f.mtime;
    e.size = f.size;
    e.link = f.link;
    e.fd = set->fd();
    e.offset = f.offset;
    if (e.path == "/") continue;  // the root's own attributes are not copied
    if (seen.insert(e.path).second) entries.push_back(std::move(e));
  }
  const std::string work = workDir();
  auto tar = image::tarOf(std::move(entries));
  // Chunks earlier layers (pulled or built) stored are pointed at.
  image::TarLayerOptions topts;
  std::shared_ptr<image::ChunkSource> shared = p_.chunkSource();
  topts.shared = shared.get();
  auto converted = image::convertTarLayer(*tar, image::LayerCompression::kNone, work, topts);
  if (!converted.isOk()) {
    (void)removeTree(work);
    return Status(converted.status()).withContext(what + ": make its layer");
  }
  auto layer = commitConverted(*converted);  // `shared` holds its extra blobs until recorded
  (void)removeTree(work);
  if (!layer.isOk()) return layer.status();
  RETURN_IF_ERROR(pushLayer(s, *layer, i.line));
  s.key = key;
  remember(key, *layer, i);
  emit({{"type", "layer"}, {"line", i.line}, {"layer", *layer}, {"cached", false}});
  return Status::ok();
}

// ---- images ------------------------------------------------------------------------

Result<ImageRecord> ImageBuild::resolveImage(const std::string& ref, const std::string& platform) {
  std::string name, tag;
  if (parseImageRef(ref, name, tag).isOk()) {
    auto img = p_.visibleImage(name, tag);
    if (img.isOk()) return img;
    if (img.status().code() != Code::kNotFound) return img.status();
  }
  // Pulled only when the reference names its registry (127.0.0.1:5000/app,
  // docker.io/library/debian), as a sandbox create pulls: a bare name that is
  // not here is a plain not-found, never a trip to Docker Hub.
  size_t slash = ref.find('/');
  std::string first = ref.substr(0, slash);
  if (slash == std::string::npos ||
      (first.find('.') == std::string::npos && first.find(':') == std::string::npos &&
       first != "localhost")) {
    return notFound("image " + ref + " not found (to pull it, name its registry: docker.io/" +
                    (slash == std::string::npos ? "library/" : "") + ref + ")");
  }
  auto rr = image::parseRegistryRef(ref);
  if (!rr.isOk()) return notFound("image " + ref + " not found");
  // Pulled before for a build, or by POST /v1/images/pull: the host and
  // repository are the local name (under the tenant's own prefix for a user).
  const Caller& caller = currentCaller();
  ImageRecord r;
  r.name = rr->host + "/" + rr->repository;
  if (!caller.admin) r.name = caller.tenant + "/" + r.name;
  r.tag = !rr->tag.empty() ? rr->tag : "sha256-" + rr->digest.substr(7);
  if (auto have = p_.visibleImage(r.name, r.tag); have.isOk()) return have;
  r.owner = caller.tenant;
  RETURN_IF_ERROR(p_.mayWriteImage(r));
  ASSIGN_OR_RETURN(image::ImagePlatform plat,
                   image::parseImagePlatform(platform.empty() ? o_.platform : platform));
  image::RegistryOptions ro = p_.registryOptions(*rr);
  if (o_.insecure) ro.insecureHosts.push_back(rr->host);
  emit({{"type", "pull"}, {"ref", rr->str()}, {"image", r.name + ":" + r.tag}});
  ASSIGN_OR_RETURN(ImageRecord made, p_.pullAndWait(*rr, plat, std::move(r), ro));
  emit({{"type", "pulled"}, {"ref", rr->str()}, {"image", made.name + ":" + made.tag}});
  return made;
}

Result<std::pair<std::vector<std::string>, image::ImageConfig>> ImageBuild::stackOf(
    const ImageRecord& img) {
  if (img.kind == "disk") {
    return invalidArg("dockerfile", img.name + ":" + img.tag +
                                        " is a disk image (backend vm): it cannot be a base");
  }
  if (img.kind != "diff") return std::pair{img.layers, img.config};
  // A snapshot names its diffs only: its base stack comes from its parent.
  json parent = json::parse(img.parent, nullptr, false);
  if (!parent.is_object()) return std::pair{img.layers, img.config};
  std::vector<std::string> layers;
  image::ImageConfig config;
  std::string base = parent.value("image", "");
  if (!base.empty()) {
    ASSIGN_OR_RETURN(layers, p_.resolveLayers(base, "", "dockerfile"));
    std::string n, t;
    if (!startsWith(base, "sha256:") && parseImageRef(base, n, t).isOk()) {
      if (auto b = p_.visibleImage(n, t); b.isOk()) config = b->config;
    }
  }
  for (const char* f : {"workspaces", "toolkits"}) {
    for (auto& ref : parent.value(f, json::array())) {
      if (!ref.is_string()) continue;
      ASSIGN_OR_RETURN(auto more, p_.resolveLayers(ref.get<std::string>(), "", "dockerfile"));
      layers.insert(layers.end(), more.begin(), more.end());
    }
  }
  layers.insert(layers.end(), img.layers.begin(), img.layers.end());
  return std::pair{layers, config};
}

std::string ImageBuild::stackIdentity(const std::vector<std::string>& layers) {
  // Layer digests name metadata images; their data blobs go with them, so a
  // layer with the same tree but other bytes is another identity.
  std::string out;
  for (auto& l : layers) {
    out += l;
    if (auto b = p_.store_->getBlob(l); b.isOk() && !b->data.empty()) out += "+" + b->data;
    out += "\n";
  }
  return out;
}

// ---- the cache ----------------------------------------------------------------------

Result<bool> ImageBuild::fromCache(int stage, State& s, const Instruction& i,
                                   const std::string& key) {
  auto hit = cacheHit(key);
  if (!hit) return false;
  stepEvent(stage, i, true);
  RETURN_IF_ERROR(pushLayer(s, *hit, i.line));
  s.key = key;
  emit({{"type", "layer"}, {"line", i.line}, {"layer", *hit}, {"cached", true}});
  return true;
}

std::optional<std::string> ImageBuild::cacheHit(const std::string& key) {
  if (o_.noCache) return std::nullopt;
  auto e = p_.store_->getBuildCache(key);
  if (!e.isOk()) return std::nullopt;
  // Still whole: the layer, its data blob and their files (a layer deleted
  // since is a miss, and the step runs again).
  auto blob = p_.store_->getBlob(e->layer);
  if (!blob.isOk()) return std::nullopt;
  struct stat st;
  if (::stat(Platform::blobPath(p_.opts_.dataDir, e->layer).c_str(), &st) != 0) return std::nullopt;
  if (!blob->data.empty()) {
    auto has = p_.store_->hasBlob(blob->data);
    if (!has.isOk() || !*has) return std::nullopt;
    if (::stat(Platform::blobPath(p_.opts_.dataDir, blob->data).c_str(), &st) != 0) {
      return std::nullopt;
    }
  }
  if (!p_.layerUsable(e->layer, "dockerfile").isOk()) return std::nullopt;
  (void)p_.store_->touchBuildCache(key, nowSeconds());
  return e->layer;
}

void ImageBuild::remember(const std::string& key, const std::string& layer, const Instruction& i) {
  double now = nowSeconds();
  json what = {{"line", i.line}, {"instruction", i.original}, {"build", id_}};
  BuildCacheEntry e{key, layer, dumpJson(what), now, now};
  if (Status st = p_.store_->putBuildCache(e); !st.isOk()) {
    log::warn("build " + id_ + ": cache entry not stored: " + st.toString());
  }
}

Status ImageBuild::pushLayer(State& s, const std::string& layer, int /*line*/) {
  made_.insert(layer);
  if (!s.layers.empty() && s.layers.back() == layer) return Status::ok();  // changed nothing
  if (std::find(s.layers.begin(), s.layers.end(), layer) != s.layers.end()) {
    return invalidArg("dockerfile", "the step's layer " + layer +
                                        " repeats one lower in the stack (a sandbox stacks a "
                                        "layer once)");
  }
  if (s.layers.size() + 1 > kMaxLayers) {
    return invalidArg("dockerfile",
                      "the image would have more than " + std::to_string(kMaxLayers) + " layers");
  }
  s.layers.push_back(layer);
  return Status::ok();
}

// ---- sandboxes ----------------------------------------------------------------------

Result<std::string> ImageBuild::launch(const std::vector<std::string>& layers,
                                       const std::string& policy, const std::string& user,
                                       const std::string& workdir) {
  SandboxRecord r;
  r.owner = o_.target.owner;
  // Shown as its top layer: a digest, which no image delete waits for.
  r.image = layers.back();
  r.layers = layers;
  r.backend = BackendKind::kContainer;
  r.cpu = 2;
  r.memoryMb = 2048;
  r.diskMb = 4096;
  r.pids = 4096;
  r.ttlS = kStepTimeoutS * 2;  // a platform that dies mid-build leaves nothing for long
  r.policy = policy;
  r.user = user;
  r.workingDir = workdir;
  r.labels = {{"dsec.build", id_}};
  auto made = p_.launch(std::move(r));
  if (!made.isOk()) return Status(made.status()).withContext("start a build sandbox");
  return made->id;
}

Result<json> ImageBuild::agent(const std::string& sb, proto::AgentOp op, const json& args) {
  ASSIGN_OR_RETURN(std::string out, p_.cluster_->agentOp(sb, op, args.dump()));
  json j = json::parse(out, nullptr, false);
  if (!j.is_object()) return internalError("the sandbox's agent sent malformed JSON");
  return j;
}

Result<json> ImageBuild::stat(const std::string& sb, const std::string& path) {
  auto r = agent(sb, proto::AgentOp::kStat, {{"path", path}});
  if (!r.isOk() && r.status().code() == Code::kNotFound) return json(nullptr);
  return r;
}

Result<ImageBuild::Walk> ImageBuild::walkPath(const std::string& sb, const std::string& abs) {
  std::vector<std::string> todo;  // components left, reversed
  {
    auto parts = splitString(abs, '/');
    for (auto it = parts.rbegin(); it != parts.rend(); ++it) {
      if (!it->empty() && *it != ".") todo.push_back(*it);
    }
  }
  Walk w;
  std::vector<std::string> done;
  bool missing = false;
  int hops = 0;
  json last = nullptr;
  while (!todo.empty()) {
    std::string c = todo.back();
    todo.pop_back();
    if (c == "..") {
      if (!done.empty()) done.pop_back();
      continue;
    }
    std::string cur;
    for (auto& d : done) cur += "/" + d;
    cur += "/" + c;
    if (missing) {
      done.push_back(c);
      continue;
    }
    ASSIGN_OR_RETURN(json st, stat(sb, cur));
    if (st.is_null()) {
      missing = true;
      last = nullptr;
      done.push_back(c);
      continue;
    }
    std::string type = st.value("type", "");
    if (type == "symlink") {
      if (++hops > 40) return invalidArg("dockerfile", "too many symbolic links at " + cur);
      std::string target = st.value("target", "");
      if (!target.empty() && target[0] == '/') done.clear();
      auto parts = splitString(target, '/');
      for (auto it = parts.rbegin(); it != parts.rend(); ++it) {
        if (!it->empty() && *it != ".") todo.push_back(*it);
      }
      continue;
    }
    if (type != "dir" && !todo.empty()) {
      return invalidArg("dockerfile", cur + " is not a directory in the image");
    }
    if (type == "dir") w.dirs[cur] = st;
    last = st;
    done.push_back(c);
  }
  w.path.clear();
  for (auto& d : done) w.path += "/" + d;
  if (w.path.empty()) w.path = "/";
  w.st = missing ? json(nullptr) : last;
  if (w.path == "/") w.st = json{{"type", "dir"}};
  return w;
}

Result<std::optional<std::string>> ImageBuild::readSmall(const std::string& sb,
                                                         const std::string& path) {
  std::string out;
  Status st = p_.cluster_->readFile(
      sb, path, [](std::optional<uint64_t>) { return Status::ok(); },
      [&](std::string_view d) -> Status {
        if (out.size() + d.size() > kMaxEtcFile) {
          return Status(Code::kResourceExhausted, path + " is too large");
        }
        out.append(d);
        return Status::ok();
      });
  if (st.code() == Code::kNotFound) return std::optional<std::string>();
  RETURN_IF_ERROR(st);
  return std::optional<std::string>(std::move(out));
}

Result<image::FileSet> ImageBuild::readFromStack(const std::vector<std::string>& layers,
                                                 const std::vector<std::string>& sources) {
  ASSIGN_OR_RETURN(image::FileSet set, image::FileSet::create(work_));
  ASSIGN_OR_RETURN(std::string sb, launch(layers, "default", "", ""));
  SandboxGuard guard{&p_, sb};
  auto wildcard = [](const std::string& c) {
    return c.find_first_of("*?[\\") != std::string::npos;
  };
  for (const std::string& src : sources) {
    std::string clean = image::cleanPath("/" + src);
    std::vector<std::string> cands = {""};  // absolute paths ("" = the root)
    for (auto& c : splitString(clean, '/')) {
      if (c.empty()) continue;
      std::vector<std::string> next;
      for (auto& cand : cands) {
        if (!wildcard(c)) {
          next.push_back(cand + "/" + c);
          continue;
        }
        auto list = agent(sb, proto::AgentOp::kList, {{"path", cand.empty() ? "/" : cand}});
        if (!list.isOk()) {
          if (list.status().code() == Code::kNotFound ||
              list.status().code() == Code::kInvalidArgument) {
            continue;
          }
          return list.status();
        }
        for (auto& e : (*list)["entries"]) {
          std::string name = e.value("name", "");
          auto m = image::goFilepathMatch(c, name);
          if (m.isOk() && *m) next.push_back(cand + "/" + name);
        }
      }
      cands = std::move(next);
    }
    for (const std::string& cand : cands) {
      if (cand.empty()) {  // the root: all of it
        ASSIGN_OR_RETURN(json st, stat(sb, "/"));
        RETURN_IF_ERROR(readTree(sb, "/", "", st, set, 0));
        continue;
      }
      // The source itself is followed where it leads (as COPY follows a
      // source that is a symlink); it is kept under its own name.
      ASSIGN_OR_RETURN(Walk w, walkPath(sb, cand));
      if (w.st.is_null()) continue;  // missing: selectCopySources says so
      std::string setPath = cand.substr(1);
      // Its parents, so the set's walk from the root finds it.
      for (size_t slash = setPath.find('/'); slash != std::string::npos;
           slash = setPath.find('/', slash + 1)) {
        std::string parent = setPath.substr(0, slash);
        if (!set.find(parent)) RETURN_IF_ERROR(set.add({parent, S_IFDIR | 0755}));
      }
      RETURN_IF_ERROR(readTree(sb, w.path, setPath, w.st, set, 0));
    }
  }
  return set;
}

Status ImageBuild::readTree(const std::string& sb, const std::string& path,
                            const std::string& setPath, const json& st, image::FileSet& set,
                            int depth) {
  if (depth > 256) return invalidArg("dockerfile", "directories nested too deep at " + path);
  RETURN_IF_ERROR(alive());
  const std::string type = st.value("type", "");
  image::BuildFile f;
  f.path = setPath;
  f.mode = typeBits(type) | (st.value("mode", 0644u) & 07777);
  f.uid = st.value("uid", 0u);
  f.gid = st.value("gid", 0u);
  f.mtime = int64_t(st.value("mtime", 0.0));
  if (type == "dir") {
    if (!setPath.empty()) RETURN_IF_ERROR(set.add(f));
    ASSIGN_OR_RETURN(json list, agent(sb, proto::AgentOp::kList, {{"path", path}}));
    if (list.value("truncated", false)) {
      return Status(Code::kResourceExhausted, path + " has too many entries to copy");
    }
    for (auto& e : list["entries"]) {
      std::string name = e.value("name", "");
      if (name.empty()) continue;
      std::string child = joinPath(path, name);
      std::string childSet = setPath.empty() ? name : setPath + "/" + name;
      if (e.value("type", "") == "symlink") {  // the listing has no target
        ASSIGN_OR_RETURN(json ls, stat(sb, child));
        if (ls.is_null()) continue;
        RETURN_IF_ERROR(readTree(sb, child, childSet, ls, set, depth + 1));
      } else {
        RETURN_IF_ERROR(readTree(sb, child, childSet, e, set, depth + 1));
      }
    }
    return Status::ok();
  }
  if (type == "symlink") {
    f.link = st.value("target", "");
    if (f.link.empty()) return Status::ok();
    return set.add(f);
  }
  if (type == "file") {
    return set.addFileFrom(f, [&](const image::FileSet::Sink& sink) {
      return p_.cluster_->readFile(
          sb, path, [](std::optional<uint64_t>) { return Status::ok(); }, sink);
    });
  }
  return Status::ok();  // devices, FIFOs, sockets: not copied
}

// ---- layers into the store ------------------------------------------------------------

Result<std::string> ImageBuild::commitPacked(const image::BuiltLayer& l) {
  // As packDiffImage stores its layer, without making an image.
  ASSIGN_OR_RETURN(Platform::BlobHold hold, p_.moveLayerIntoStore(l));
  RETURN_IF_ERROR(p_.linkBlob(l.dataDigest, l.dataSize, ""));
  RETURN_IF_ERROR(p_.linkBlob(l.digest, l.size, l.dataDigest));
  return l.digest;
}

Result<std::string> ImageBuild::commitConverted(const image::ConvertedLayer& c) {
  RETURN_IF_ERROR(p_.storeConvertedLayer(c));
  return c.layer.digest;
}

// ---- the handler ---------------------------------------------------------------------

void Platform::buildImage(http::Request& req, http::Response& res) {
  auto j = parseObject(req, {"dockerfile", "context", "name", "tag", "build_args", "target",
                             "network", "no_cache", "platform", "insecure_registry", "visibility"});
  if (!j.isOk()) return sendError(res, j.status());
  ImageBuild::Options o;
  {
    auto it = j->find("dockerfile");
    if (it == j->end() || it->is_null()) {
      return sendError(res, invalidArg("dockerfile", "dockerfile (its text) is required"));
    }
    if (!it->is_string()) {
      return sendError(res, invalidArg("dockerfile", "dockerfile must be a string"));
    }
    o.dockerfile = it->get<std::string>();
    if (o.dockerfile.size() > kMaxDockerfile) {
      return sendError(res, invalidArg("dockerfile", "dockerfile is larger than 1 MiB"));
    }
  }
  auto context = getString(*j, "context", "", 80);
  if (!context.isOk()) return sendError(res, context.status());
  if (!context->empty() && !validDigest(*context)) {
    return sendError(res, invalidArg("context",
                                     "context must be the digest (sha256:<64 hex>) "
                                     "of a tar uploaded with PUT /v1/blobs/{digest}"));
  }
  auto name = getString(*j, "name", "", 200);
  if (!name.isOk()) return sendError(res, name.status());
  if (name->empty()) return sendError(res, invalidArg("name", "name is required"));
  auto tag = getString(*j, "tag", "latest", 128);
  if (!tag.isOk()) return sendError(res, tag.status());
  ImageRecord& target = o.target;
  if (Status st = parseImageRef(*name + ":" + *tag, target.name, target.tag); !st.isOk()) {
    return sendError(res, invalidArg(j->contains("tag") ? "tag" : "name", st.message()));
  }
  if (target.name != *name) {
    return sendError(res, invalidArg("name", "name must not contain a tag"));
  }
  {
    auto vis = getString(*j, "visibility", "", 16);
    if (!vis.isOk()) return sendError(res, vis.status());
    target.owner = currentCaller().tenant;
    target.visibility = *vis;
    if (Status st = mayWriteImage(target); !st.isOk()) return sendError(res, st);
  }
  auto args = getStringMap(*j, "build_args");
  if (!args.isOk()) return sendError(res, args.status());
  for (auto& [k, v] : *args) {
    if (k.empty() || k.find('=') != std::string::npos || k.find('\0') != std::string::npos ||
        v.find('\0') != std::string::npos) {
      return sendError(res, invalidArg("build_args", "build arg '" + k + "' is not NAME=VALUE"));
    }
  }
  o.parse.buildArgs = *args;
  auto buildTarget = getString(*j, "target", "", 128);
  if (!buildTarget.isOk()) return sendError(res, buildTarget.status());
  o.parse.target = *buildTarget;
  auto network = getBool(*j, "network", false);
  if (!network.isOk()) return sendError(res, network.status());
  o.network = *network;
  auto noCache = getBool(*j, "no_cache", false);
  if (!noCache.isOk()) return sendError(res, noCache.status());
  o.noCache = *noCache;
  auto insecure = getBool(*j, "insecure_registry", false);
  if (!insecure.isOk()) return sendError(res, insecure.status());
  o.insecure = *insecure;
  auto platform = getString(*j, "platform", "linux/amd64", 64);
  if (!platform.isOk()) return sendError(res, platform.status());
  if (auto pp = image::parseImagePlatform(*platform); !pp.isOk()) {
    return sendError(res, invalidArg("platform", pp.status().message()));
  }
  o.platform = *platform;

  // Syntax first: a Dockerfile that cannot build is a 400 with its line.
  auto first = image::parseDockerfile(o.dockerfile, o.parse);
  if (!first.isOk()) return sendBuildError(res, first.status());
  o.firstPass = std::move(first).value();

  // The context: read once into a spool (its .dockerignore applied), in a
  // work directory that goes with the build.
  std::string work = opts_.dataDir + "/build/" + randomHex(8);
  if (Status st = makeDirs(work, 0700); !st.isOk()) return sendError(res, st);
  struct Cleanup {
    std::string dir;
    ~Cleanup() { (void)removeTree(dir); }
  } cleanup{work};
  image::FileSet ctx;
  if (!context->empty()) {
    auto has = store_->hasBlob(*context);
    if (!has.isOk()) return sendError(res, has.status());
    if (!*has) {
      return sendError(res, invalidArg("context", "context " + *context +
                                                      " has not been uploaded (PUT /v1/blobs)"));
    }
    auto src = image::openFileSource(blobPath(opts_.dataDir, *context));
    if (!src.isOk()) return sendError(res, src.status());
    auto set = image::readTarArchive(**src, work, "context", true, true);
    if (!set.isOk()) {
      Status st = set.status();
      if (st.code() == Code::kDataLoss) st = invalidArg("context", "context: " + st.message());
      return sendError(res, st);
    }
    ctx = std::move(set).value();
    if (Status st = image::applyDockerIgnore(ctx); !st.isOk()) return sendError(res, st);
  } else {
    auto set = image::FileSet::create(work);
    if (!set.isOk()) return sendError(res, set.status());
    ctx = std::move(set).value();
  }

  if (Status st = res.beginChunked(200, "application/x-ndjson"); !st.isOk()) return;
  auto emit = [&res](const json& ev) { return res.write(dumpJson(ev) + "\n").isOk(); };
  ImageBuild build(*this, std::move(o), &ctx, work, emit);
  auto made = build.run();
  if (made.isOk()) {
    emit({{"type", "done"}, {"image", imageToApi(*made)}});
  } else {
    log::info("build failed: " + made.status().toString());
    emit({{"type", "error"}, {"error", errorObject(made.status())}});
  }
  (void)res.finish();
}

}  // namespace dsec::platform
