#include "proto/codec.h"
#include "proto/edge_link.h"

#include <gtest/gtest.h>
#include <sys/socket.h>

#include <functional>

namespace dsec::proto {
namespace {

using namespace std::string_literals;

// What a remote node is asked to create must be what the platform planned:
// every SandboxSpec field the node acts on survives the hop.
TEST(EdgeWire, SandboxSpecRoundTrips) {
  SandboxSpec s;
  s.id = "sb-0123456789abcdef";
  s.layers = {"sha256:aa", "sha256:bb"};
  s.cpu = 1.5;
  s.memoryBytes = 256ll << 20;
  s.diskBytes = 2ll << 30;
  s.diskExplicit = true;
  s.pids = 77;
  s.fncallInit = R"({"scratch_mb":8})";
  s.initPolicy = R"({"readonly":["/etc"],"syscalls":"strict"})";
  s.workingDir = "/work/dir";
  s.network = true;
  auto back = specFromJson(toJson(s));
  ASSERT_TRUE(back.isOk()) << back.status().toString();
  EXPECT_EQ(back->id, s.id);
  EXPECT_EQ(back->layers, s.layers);
  EXPECT_EQ(back->cpu, s.cpu);
  EXPECT_EQ(back->memoryBytes, s.memoryBytes);
  EXPECT_EQ(back->diskBytes, s.diskBytes);
  EXPECT_TRUE(back->diskExplicit);
  EXPECT_EQ(back->pids, s.pids);
  EXPECT_EQ(back->fncallInit, s.fncallInit);
  EXPECT_EQ(back->initPolicy, s.initPolicy);
  EXPECT_EQ(back->workingDir, s.workingDir);
  EXPECT_TRUE(back->network);
}

TEST(EdgeWire, SpecWithoutIdIsRefused) {
  auto bad = specFromJson(json{{"layers", json::array()}});
  ASSERT_FALSE(bad.isOk());
  EXPECT_EQ(bad.status().field(), "spec");
}

// Computer-use actions reach the node as the platform checked them.
TEST(EdgeWire, InputActionRoundTrips) {
  InputAction a;
  a.kind = "mouse";
  a.x = 640;
  a.y = 480;
  a.button = "wheel-up";
  auto back = inputFromJson(toJson(a));
  ASSERT_TRUE(back.isOk()) << back.status().toString();
  EXPECT_EQ(back->kind, "mouse");
  EXPECT_EQ(back->x, 640);
  EXPECT_EQ(back->y, 480);
  EXPECT_EQ(back->button, "wheel-up");
  a = InputAction{};
  a.kind = "type";
  a.text = "h\u00e9llo\n";
  EXPECT_EQ(inputFromJson(toJson(a))->text, a.text);
  auto bad = inputFromJson(json{{"text", "x"}});
  ASSERT_FALSE(bad.isOk());
  EXPECT_EQ(bad.status().field(), "input");
  EXPECT_FALSE(inputFromJson(json{{"kind", "mouse"}, {"x", "left"}}).isOk());
}

TEST(EdgeWire, InputActionEveryFieldRoundTrips) {
  InputAction a{"key", "text", "ctrl+c", -3, 7, "right"};
  auto back = inputFromJson(toJson(a));
  ASSERT_TRUE(back.isOk()) << back.status().toString();
  EXPECT_EQ(back->kind, a.kind);
  EXPECT_EQ(back->text, a.text);
  EXPECT_EQ(back->key, a.key);
  EXPECT_EQ(back->x, a.x);
  EXPECT_EQ(back->y, a.y);
  EXPECT_EQ(back->button, a.button);
}

// Output and stdin are bytes, not text: NULs and invalid UTF-8 survive.
TEST(EdgeWire, InteractiveExecSpecRoundTrips) {
  ExecSpec s;
  s.argv = {"/bin/bash", "-i"};
  s.interactive = true;
  s.pty = TermSize{33, 101};
  auto back = execFromJson(json::parse(toJson(s).dump()));
  ASSERT_TRUE(back.isOk()) << back.status().toString();
  EXPECT_TRUE(back->interactive);
  ASSERT_TRUE(back->pty);
  EXPECT_EQ(back->pty->rows, 33);
  EXPECT_EQ(back->pty->cols, 101);
  // Plain execs stay as they were on the wire.
  ExecSpec plain;
  plain.argv = {"true"};
  json pj = toJson(plain);
  EXPECT_FALSE(pj.contains("pty"));
  EXPECT_FALSE(pj.contains("interactive"));
  json bad = toJson(s);
  bad["pty"] = {{"rows", 0}, {"cols", 5}};
  EXPECT_EQ(execFromJson(bad).status().field(), "rows");
  bad["pty"] = "x";
  EXPECT_EQ(execFromJson(bad).status().field(), "pty");
}

// What the edge's link service does with an interactive exec's body.
class RecordingCall : public ExecCall {
 public:
  void cancel() override {}
  Status sendInput(std::string_view b) override {
    log.push_back("i:" + std::string(b));
    return Status::ok();
  }
  Status resize(TermSize s) override {
    log.push_back("r:" + std::to_string(s.rows) + "x" + std::to_string(s.cols));
    return Status::ok();
  }
  Status signal(int sig) override {
    log.push_back("s:" + std::to_string(sig));
    return Status::ok();
  }
  std::vector<std::string> log;
};

TEST(EdgeWire, ExecControlRecordsSurviveAnySplit) {
  std::string body = execInputRecord("ls\n") + execResizeRecord({50, 132}) +
                     execSignalRecord(2) + execInputRecord(std::string("\0\xff", 2)) +
                     execInputRecord("");
  const std::vector<std::string> want = {"i:ls\n", "r:50x132", "s:2",
                                         "i:" + std::string("\0\xff", 2), "i:"};
  for (size_t step : {size_t(1), size_t(3), size_t(7), body.size()}) {
    RecordingCall call;
    ExecControlDecoder d;
    for (size_t off = 0; off < body.size(); off += step) {
      ASSERT_TRUE(d.feed(std::string_view(body).substr(off, step), call).isOk());
    }
    EXPECT_EQ(call.log, want) << "step " << step;
  }
  RecordingCall call;
  ExecControlDecoder d;
  EXPECT_EQ(d.feed(std::string("x\0\0\0\0", 5), call).code(), Code::kInvalidArgument);
  ExecControlDecoder big;
  EXPECT_FALSE(big.feed(std::string("i\xff\xff\xff\x7f", 5), call).isOk());
  ExecControlDecoder badSize;
  std::string r = execResizeRecord({1, 1});
  r.replace(5, std::string::npos, "{\"rows\":0,\"cols\":1}");
  r[1] = static_cast<char>(r.size() - 5);
  EXPECT_EQ(badSize.feed(r, call).field(), "rows");
}

TEST(EdgeWire, ExecSpecRoundTrips) {
  ExecSpec s;
  s.argv = {"/bin/sh", "-c", "cat"};
  s.env = {"A=1", "B=two words"};
  s.cwd = "/tmp";
  s.user = "1000:1000";
  s.timeoutMs = 1234;
  s.maxOutput = 99;
  s.stdinData = "in\0\xff\n"s;
  s.fncallJson = R"j({"language":"python","code":"print(1)"})j";
  auto back = execFromJson(toJson(s));
  ASSERT_TRUE(back.isOk()) << back.status().toString();
  EXPECT_EQ(back->argv, s.argv);
  EXPECT_EQ(back->env, s.env);
  EXPECT_EQ(back->cwd, s.cwd);
  EXPECT_EQ(back->user, s.user);
  EXPECT_EQ(back->timeoutMs, s.timeoutMs);
  EXPECT_EQ(back->maxOutput, s.maxOutput);
  EXPECT_EQ(back->stdinData, s.stdinData);
  EXPECT_EQ(back->fncallJson, s.fncallJson);
  // An empty stdin is not no stdin.
  s.stdinData = "";
  back = execFromJson(toJson(s));
  ASSERT_TRUE(back.isOk()) << back.status().toString();
  EXPECT_EQ(back->stdinData, std::optional<std::string>(""));
}

TEST(EdgeWire, ExecResultRoundTrips) {
  ExecResult r;
  r.exitCode = 137;
  r.signal = 9;
  r.timedOut = true;
  r.truncated = true;
  r.oomKilled = true;
  r.durationMs = 12.5;
  r.call = true;
  r.limit = "memory";
  r.zygoteStarted = true;
  r.out = "o\0\xfe"s;
  r.err = "e\n";
  auto back = resultFromJson(toJson(r));
  ASSERT_TRUE(back.isOk()) << back.status().toString();
  EXPECT_EQ(back->exitCode, r.exitCode);
  EXPECT_EQ(back->signal, r.signal);
  EXPECT_TRUE(back->timedOut);
  EXPECT_TRUE(back->truncated);
  EXPECT_TRUE(back->oomKilled);
  EXPECT_EQ(back->durationMs, r.durationMs);
  EXPECT_TRUE(back->call);
  EXPECT_EQ(back->limit, r.limit);
  EXPECT_TRUE(back->zygoteStarted);
  EXPECT_EQ(back->out, r.out);
  EXPECT_EQ(back->err, r.err);
}

TEST(EdgeWire, EgressRuleRoundTrips) {
  EgressRule v4;
  v4.family = AF_INET;
  v4.addr = {10, 1, 2, 0};
  v4.prefixLen = 24;
  v4.ports = {{0, 0}, {80, 80}, {1024, 65535}};
  EgressRule v6;
  v6.family = AF_INET6;
  v6.addr = {0x20, 0x01, 0x0d, 0xb8, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff};
  v6.prefixLen = 128;
  v6.ports = {{443, 443}};
  for (const EgressRule& r : {v4, v6}) {
    auto back = ruleFromJson(toJson(r));
    ASSERT_TRUE(back.isOk()) << back.status().toString();
    EXPECT_EQ(*back, r);
  }
}

TEST(EdgeWire, LimitsStatsDenialsRoundTrip) {
  CgroupLimits l{2.25, 3ll << 30, 4096};
  auto lb = limitsFromJson(toJson(l));
  ASSERT_TRUE(lb.isOk()) << lb.status().toString();
  EXPECT_EQ(lb->cpu, l.cpu);
  EXPECT_EQ(lb->memoryBytes, l.memoryBytes);
  EXPECT_EQ(lb->pids, l.pids);

  CgroupStats s{3, 5, 7ll << 32};
  auto sb = statsFromJson(toJson(s));
  ASSERT_TRUE(sb.isOk()) << sb.status().toString();
  EXPECT_EQ(sb->oomKills, s.oomKills);
  EXPECT_EQ(sb->pidsLimitHits, s.pidsLimitHits);
  EXPECT_EQ(sb->memoryBytes, s.memoryBytes);
  s.cpuUsec = 123'456'789'012;
  s.pids = 17;
  sb = statsFromJson(toJson(s));
  ASSERT_TRUE(sb.isOk()) << sb.status().toString();
  EXPECT_EQ(sb->cpuUsec, s.cpuUsec);
  EXPECT_EQ(sb->pids, s.pids);
  // An older edge's figures have neither: 0.
  sb = statsFromJson(json{{"memory_bytes", 5}});
  ASSERT_TRUE(sb.isOk());
  EXPECT_EQ(sb->cpuUsec, 0);

  StatsSeries h{15, {{1700000000.125, 1, 2, 3}, {1700000015.5, 4, 5ll << 40, 6}}};
  auto hb = seriesFromJson(toJson(h));
  ASSERT_TRUE(hb.isOk()) << hb.status().toString();
  EXPECT_EQ(hb->intervalS, 15);
  ASSERT_EQ(hb->samples.size(), 2u);
  EXPECT_DOUBLE_EQ(hb->samples[0].t, 1700000000.125);
  EXPECT_EQ(hb->samples[1].memoryBytes, 5ll << 40);
  EXPECT_EQ(hb->samples[1].pids, 6);
  EXPECT_EQ(seriesFromJson(json{{"samples", {{1, 2}}}}).status().field(), "samples");
  EXPECT_FALSE(seriesFromJson(json::object()).isOk());

  EgressDenials d{(uint64_t(1) << 63) + 5, "[::1]:80"};  // above int64's range
  auto db = denialsFromJson(toJson(d));
  ASSERT_TRUE(db.isOk()) << db.status().toString();
  EXPECT_EQ(db->count, d.count);
  EXPECT_EQ(db->last, d.last);
}

// Digests and sizes cross; the builder's local paths do not.
TEST(EdgeWire, BuiltLayerRoundTripsWithoutPaths) {
  image::BuiltLayer l{"/w/meta.erofs", "sha256:aa", 4096,  "/w/data",
                      "sha256:bb",     1ll << 33,   "disk"};
  json j = toJson(l);
  EXPECT_FALSE(j.contains("path"));
  EXPECT_FALSE(j.contains("data_path"));
  auto back = builtLayerFromJson(j);
  ASSERT_TRUE(back.isOk()) << back.status().toString();
  EXPECT_EQ(back->digest, l.digest);
  EXPECT_EQ(back->size, l.size);
  EXPECT_EQ(back->dataDigest, l.dataDigest);
  EXPECT_EQ(back->dataSize, l.dataSize);
  EXPECT_EQ(back->kind, l.kind);
  EXPECT_EQ(back->path, "");
  EXPECT_EQ(back->dataPath, "");
}

TEST(EdgeWire, LayerDescRoundTripsWithItsExtraDataInOrder) {
  LayerDesc d;
  d.digest = "sha256:aa";
  d.size = 4096;
  d.dataDigest = "sha256:bb";
  d.dataSize = 1ll << 33;
  d.chunksDigest = "sha256:cc";
  d.extraData = {{"sha256:x2", 10, "sha256:i2"}, {"sha256:x1", 1ll << 40, "sha256:i1"}};
  json j = toJson(d);
  EXPECT_EQ(j["extra_data"][0]["chunks_digest"], "sha256:i2");
  auto back = layerDescFromJson(json::parse(j.dump()));
  ASSERT_TRUE(back.isOk()) << back.status().toString();
  EXPECT_EQ(back->digest, d.digest);
  EXPECT_EQ(back->size, d.size);
  EXPECT_EQ(back->dataDigest, d.dataDigest);
  EXPECT_EQ(back->dataSize, d.dataSize);
  EXPECT_EQ(back->chunksDigest, d.chunksDigest);
  ASSERT_EQ(back->extraData.size(), 2u);
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(back->extraData[i].digest, d.extraData[i].digest);
    EXPECT_EQ(back->extraData[i].size, d.extraData[i].size);
    EXPECT_EQ(back->extraData[i].chunksDigest, d.extraData[i].chunksDigest);
  }
  EXPECT_EQ(toJson(LayerDesc{})["extra_data"], json::array());
}

TEST(EdgeWire, LayerDescExtraDataCarriesItsReclaimedChunks) {
  LayerDesc d;
  d.digest = "sha256:aa";
  d.dataDigest = "sha256:bb";
  d.extraData = {{"sha256:x1", 1 << 20, "sha256:i1", "0+32,64+32"},
                 {"sha256:x2", 10, "sha256:i2", ""}};
  json j = toJson(d);
  EXPECT_EQ(j["extra_data"][0]["reclaimed"], "0+32,64+32");
  EXPECT_FALSE(j["extra_data"][1].contains("reclaimed"));  // a whole blob says nothing
  auto back = layerDescFromJson(json::parse(j.dump()));
  ASSERT_TRUE(back.isOk()) << back.status().toString();
  ASSERT_EQ(back->extraData.size(), 2u);
  EXPECT_EQ(back->extraData[0].reclaimed, "0+32,64+32");
  EXPECT_EQ(back->extraData[0].chunksDigest, "sha256:i1");
  EXPECT_EQ(back->extraData[1].reclaimed, "");
  // From a sender that knows no reclaimed chunks.
  auto old = layerDescFromJson(
      {{"digest", "sha256:aa"}, {"extra_data", {{{"digest", "sha256:x"}, {"size", 1}}}}});
  ASSERT_TRUE(old.isOk()) << old.status().toString();
  ASSERT_EQ(old->extraData.size(), 1u);
  EXPECT_EQ(old->extraData[0].reclaimed, "");
}

// What a decoder fills in for what the sender left out: the struct's defaults.
TEST(EdgeWire, MinimalObjectsDecodeToDefaults) {
  auto s = specFromJson(json{{"id", "sb-1"}});
  ASSERT_TRUE(s.isOk()) << s.status().toString();
  SandboxSpec ds;
  EXPECT_TRUE(s->layers.empty());
  EXPECT_EQ(s->cpu, ds.cpu);
  EXPECT_EQ(s->memoryBytes, 512ll << 20);
  EXPECT_EQ(s->diskBytes, 1ll << 30);
  EXPECT_FALSE(s->diskExplicit);
  EXPECT_EQ(s->pids, 1024);
  EXPECT_EQ(s->fncallInit, "");
  EXPECT_EQ(s->initPolicy, "");
  EXPECT_EQ(s->workingDir, "");
  EXPECT_FALSE(s->network);
  EXPECT_EQ(s->memoryBytes, ds.memoryBytes);
  EXPECT_EQ(s->diskBytes, ds.diskBytes);
  EXPECT_EQ(s->pids, ds.pids);

  auto e = execFromJson(json{{"argv", {"true"}}});
  ASSERT_TRUE(e.isOk()) << e.status().toString();
  EXPECT_TRUE(e->env.empty());
  EXPECT_EQ(e->cwd, "");
  EXPECT_EQ(e->user, "");
  EXPECT_EQ(e->timeoutMs, 60000);
  EXPECT_EQ(e->maxOutput, 1 << 20);
  EXPECT_FALSE(e->stdinData.has_value());
  EXPECT_EQ(e->fncallJson, "");

  auto r = resultFromJson(json::object());
  ASSERT_TRUE(r.isOk()) << r.status().toString();
  EXPECT_EQ(r->exitCode, 0);
  EXPECT_EQ(r->signal, 0);
  EXPECT_FALSE(r->timedOut || r->truncated || r->oomKilled || r->call || r->zygoteStarted);
  EXPECT_EQ(r->durationMs, 0);
  EXPECT_EQ(r->limit + r->out + r->err, "");

  auto a = inputFromJson(json{{"kind", "key"}});
  ASSERT_TRUE(a.isOk()) << a.status().toString();
  EXPECT_EQ(a->text + a->key + a->button, "");
  EXPECT_EQ(a->x, 0);
  EXPECT_EQ(a->y, 0);

  auto l = limitsFromJson(json{{"cpu", 0.5}});  // cpu has no default on the wire
  ASSERT_TRUE(l.isOk()) << l.status().toString();
  EXPECT_EQ(l->memoryBytes, 0);  // unlimited
  EXPECT_EQ(l->pids, 0);

  auto st = statsFromJson(json::object());
  ASSERT_TRUE(st.isOk()) << st.status().toString();
  EXPECT_EQ(st->oomKills + st->pidsLimitHits + st->memoryBytes, 0);

  auto d = denialsFromJson(json::object());
  ASSERT_TRUE(d.isOk()) << d.status().toString();
  EXPECT_EQ(d->count, 0u);
  EXPECT_EQ(d->last, "");

  auto b = builtLayerFromJson(json{{"digest", "sha256:aa"}});
  ASSERT_TRUE(b.isOk()) << b.status().toString();
  EXPECT_EQ(b->size, 0);
  EXPECT_EQ(b->dataDigest, "");
  EXPECT_EQ(b->dataSize, 0);
  EXPECT_EQ(b->kind, "");

  // A platform from before extra data sends none.
  auto ld = layerDescFromJson(json{{"digest", "sha256:aa"}});
  ASSERT_TRUE(ld.isOk()) << ld.status().toString();
  EXPECT_EQ(ld->size, 0);
  EXPECT_EQ(ld->dataDigest, "");
  EXPECT_EQ(ld->chunksDigest, "");
  EXPECT_TRUE(ld->extraData.empty());
}

// Bad input is kInvalidArgument with the decoder's field and, in the message,
// the key at fault; never a throw, never a wrapped or truncated number.
TEST(EdgeWire, MalformedInputNamesTheKey) {
  using Decode = std::function<Status(const json&)>;
  Decode spec = [](const json& j) { return specFromJson(j).status(); };
  Decode exec = [](const json& j) { return execFromJson(j).status(); };
  Decode result = [](const json& j) { return resultFromJson(j).status(); };
  Decode rule = [](const json& j) { return ruleFromJson(j).status(); };
  Decode input = [](const json& j) { return inputFromJson(j).status(); };
  Decode limits = [](const json& j) { return limitsFromJson(j).status(); };
  Decode stats = [](const json& j) { return statsFromJson(j).status(); };
  Decode denials = [](const json& j) { return denialsFromJson(j).status(); };
  Decode layer = [](const json& j) { return builtLayerFromJson(j).status(); };
  Decode desc = [](const json& j) { return layerDescFromJson(j).status(); };
  // A valid v4 rule with one key replaced.
  auto ruleWith = [](const char* k, json v) {
    EgressRule r;
    r.family = AF_INET;
    r.prefixLen = 8;
    r.addr = {10};
    r.ports = {{80, 80}};
    json j = toJson(r);
    j[k] = std::move(v);
    return j;
  };
  const json kSpec = {{"id", "sb-1"}};
  auto specWith = [&](const char* k, json v) {
    json j = kSpec;
    j[k] = std::move(v);
    return j;
  };
  struct Case {
    const char* what;
    Decode decode;
    json in;
    const char* field;
    const char* key;  // must appear in the message
  };
  const Case cases[] = {
      {"spec: not an object", spec, json::array({"sb-1"}), "spec", "object"},
      {"spec: no id", spec, json::object(), "spec", "id"},
      {"spec: id a number", spec, {{"id", 5}}, "spec", "id"},
      {"spec: layers a string", spec, specWith("layers", "sha256:aa"), "spec", "layers"},
      {"spec: cpu a string", spec, specWith("cpu", "2"), "spec", "cpu"},
      {"spec: cpu negative", spec, specWith("cpu", -1.0), "spec", "cpu"},
      {"spec: memory negative", spec, specWith("memory_bytes", -1), "spec", "memory_bytes"},
      {"spec: disk fractional", spec, specWith("disk_bytes", 1.5), "spec", "disk_bytes"},
      {"spec: disk_explicit 1", spec, specWith("disk_explicit", 1), "spec", "disk_explicit"},
      {"spec: pids negative", spec, specWith("pids", -5), "spec", "pids"},
      {"spec: pids above int64", spec, specWith("pids", uint64_t(1) << 63), "spec", "pids"},
      {"spec: network a string", spec, specWith("network", "yes"), "spec", "network"},
      {"spec: init_policy an object", spec, specWith("init_policy", json::object()), "spec",
       "init_policy"},
      {"exec: no argv", exec, json::object(), "exec", "argv"},
      {"exec: argv of numbers", exec, {{"argv", {1, 2}}}, "exec", "argv"},
      {"exec: env a string", exec, {{"argv", {"x"}}, {"env", "A=1"}}, "exec", "env"},
      {"exec: timeout negative", exec, {{"argv", {"x"}}, {"timeout_ms", -5}}, "exec", "timeout_ms"},
      {"exec: max_output a string",
       exec,
       {{"argv", {"x"}}, {"max_output", "1M"}},
       "exec",
       "max_output"},
      {"exec: stdin a number", exec, {{"argv", {"x"}}, {"stdin_b64", 5}}, "exec", "stdin_b64"},
      {"exec: stdin not base64",
       exec,
       {{"argv", {"x"}}, {"stdin_b64", "!!"}},
       "stdin_b64",
       "base64"},
      {"result: exit_code a string", result, {{"exit_code", "1"}}, "result", "exit_code"},
      {"result: exit_code fractional", result, {{"exit_code", 1.5}}, "result", "exit_code"},
      {"result: signal above int", result, {{"signal", int64_t(1) << 40}}, "result", "signal"},
      {"result: timed_out 1", result, {{"timed_out", 1}}, "result", "timed_out"},
      {"result: duration a string", result, {{"duration_ms", "5"}}, "result", "duration_ms"},
      {"result: out not base64", result, {{"out_b64", "%%"}}, "result", "out_b64"},
      {"result: err not base64", result, {{"err_b64", "%%"}}, "result", "err_b64"},
      {"rule: no family",
       rule,
       {{"addr", ""}, {"prefix", 0}, {"ports", json::array()}},
       "rules",
       "family"},
      {"rule: family 3", rule, ruleWith("family", 3), "rules", "family"},
      {"rule: addr 4 bytes", rule, ruleWith("addr", "CgAAAA=="), "rules", "addr"},
      {"rule: addr a number", rule, ruleWith("addr", 10), "rules", "addr"},
      {"rule: prefix 33 on v4", rule, ruleWith("prefix", 33), "rules", "prefix"},
      {"rule: prefix negative", rule, ruleWith("prefix", -1), "rules", "prefix"},
      {"rule: ports an object", rule, ruleWith("ports", {{"lo", 80}}), "rules", "ports"},
      {"rule: port above 65535", rule, ruleWith("ports", {{0, 70000}}), "rules", "ports"},
      {"rule: port negative", rule, ruleWith("ports", {{-1, 80}}), "rules", "ports"},
      {"rule: port lo above hi", rule, ruleWith("ports", {{90, 80}}), "rules", "ports"},
      {"rule: port range of one", rule, ruleWith("ports", {json::array({80})}), "rules", "ports"},
      {"input: no kind", input, {{"x", 1}}, "input", "kind"},
      {"input: x a string", input, {{"kind", "mouse"}, {"x", "left"}}, "input", "x"},
      {"input: y above int", input, {{"kind", "mouse"}, {"y", int64_t(1) << 40}}, "input", "y"},
      {"input: x fractional huge", input, {{"kind", "mouse"}, {"x", 1e10}}, "input", "x"},
      {"input: button a bool", input, {{"kind", "mouse"}, {"button", true}}, "input", "button"},
      {"limits: no cpu", limits, {{"pids", 5}}, "limits", "cpu"},
      {"limits: cpu a string", limits, {{"cpu", "1"}}, "limits", "cpu"},
      {"limits: cpu negative", limits, {{"cpu", -0.5}}, "limits", "cpu"},
      {"limits: memory negative",
       limits,
       {{"cpu", 1}, {"memory_bytes", -1}},
       "limits",
       "memory_bytes"},
      {"limits: pids negative", limits, {{"cpu", 1}, {"pids", -1}}, "limits", "pids"},
      {"stats: oom_kills a string", stats, {{"oom_kills", "3"}}, "stats", "oom_kills"},
      {"stats: memory fractional", stats, {{"memory_bytes", 1.5}}, "stats", "memory_bytes"},
      {"stats: not an object", stats, json("x"), "stats", "object"},
      {"denials: count negative", denials, {{"count", -1}}, "egress", "count"},
      {"denials: last a number", denials, {{"last", 5}}, "egress", "last"},
      {"layer: no digest", layer, {{"size", 1}}, "layer", "digest"},
      {"layer: size negative", layer, {{"digest", "sha256:aa"}, {"size", -1}}, "layer", "size"},
      {"layer: data_size a string",
       layer,
       {{"digest", "sha256:aa"}, {"data_size", "1"}},
       "layer",
       "data_size"},
      {"layer: kind a number", layer, {{"digest", "sha256:aa"}, {"kind", 3}}, "layer", "kind"},
      {"desc: no digest", desc, {{"size", 1}}, "layer", "digest"},
      {"desc: data_size negative",
       desc,
       {{"digest", "sha256:aa"}, {"data_size", -1}},
       "layer",
       "data_size"},
      {"desc: extra_data an object",
       desc,
       {{"digest", "sha256:aa"}, {"extra_data", json::object()}},
       "layer",
       "extra_data"},
      {"desc: extra blob without digest",
       desc,
       {{"digest", "sha256:aa"}, {"extra_data", {{{"digest", "sha256:x"}}, {{"size", 1}}}}},
       "layer",
       "extra_data[1].digest"},
      {"desc: extra blob size a string",
       desc,
       {{"digest", "sha256:aa"}, {"extra_data", {{{"digest", "sha256:x"}, {"size", "1"}}}}},
       "layer",
       "extra_data[0].size"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    Status st = c.decode(c.in);
    if (st.isOk()) {
      ADD_FAILURE() << "accepted " << c.in.dump();
      continue;
    }
    EXPECT_EQ(st.code(), Code::kInvalidArgument);
    EXPECT_EQ(st.field(), c.field);
    EXPECT_NE(st.message().find(c.key), std::string::npos) << st.message();
  }
}

TEST(EdgeWire, ErrorJsonRoundTripsThroughStatusFromError) {
  Status st(Code::kResourceExhausted, "no room", 28, "disk_mb");
  json j = errorJson(st);
  ASSERT_TRUE(j.contains("error"));
  Status back = statusFromError(j["error"]);
  EXPECT_EQ(back.code(), st.code());
  EXPECT_EQ(back.message(), st.message());
  EXPECT_EQ(back.sysErrno(), 28);
  EXPECT_EQ(back.field(), "disk_mb");
  EXPECT_EQ(statusFromBody(500, j.dump()).code(), Code::kResourceExhausted);

  // No field, no errno: neither key is sent.
  json bare = errorJson(Status(Code::kNotFound, "gone"))["error"];
  EXPECT_FALSE(bare.contains("field"));
  EXPECT_FALSE(bare.contains("errno"));
  EXPECT_EQ(statusFromError(bare).code(), Code::kNotFound);
}

TEST(EdgeWire, EveryCodeNameRoundTrips) {
  for (Code c : {Code::kInvalidArgument, Code::kUnauthenticated, Code::kPermissionDenied,
                 Code::kNotFound, Code::kAlreadyExists, Code::kConflict, Code::kFailedPrecondition,
                 Code::kPayloadTooLarge, Code::kResourceExhausted, Code::kDeadlineExceeded,
                 Code::kUnavailable, Code::kDataLoss, Code::kInternal}) {
    EXPECT_EQ(codeFromName(codeName(c)), c) << codeName(c);
    EXPECT_EQ(statusFromError(errorJson(Status(c, "m"))["error"]).code(), c) << codeName(c);
  }
  EXPECT_EQ(codeFromName("no_such_code"), Code::kInternal);
  EXPECT_EQ(codeFromName(""), Code::kInternal);
}

// A node's malformed error still fails, as kInternal, never as OK.
TEST(EdgeWire, MalformedErrorsAreInternal) {
  EXPECT_EQ(statusFromError(json("boom")).code(), Code::kInternal);
  Status odd = statusFromError(json{{"code", 3}, {"message", 4}, {"errno", "x"}, {"field", 1}});
  EXPECT_EQ(odd.code(), Code::kInternal);
  EXPECT_EQ(odd.message(), "");
  EXPECT_EQ(odd.sysErrno(), 0);
  EXPECT_EQ(odd.field(), "");
  EXPECT_EQ(statusFromError(json{{"code", "bogus"}}).code(), Code::kInternal);
  // Not an error body: the HTTP status decides.
  EXPECT_EQ(statusFromBody(401, "nope").code(), Code::kUnauthenticated);
  EXPECT_EQ(statusFromBody(404, "{}").code(), Code::kNotFound);
  EXPECT_EQ(statusFromBody(503, R"({"error":"down"})").code(), Code::kUnavailable);
  Status other = statusFromBody(502, "bad gateway");
  EXPECT_EQ(other.code(), Code::kInternal);
  EXPECT_NE(other.message().find("HTTP 502: bad gateway"), std::string::npos);
  EXPECT_LE(statusFromBody(500, std::string(1000, 'x')).message().size(), 220u);
}

// fncallInitJson has no decoder here (aether reads it): check what it writes.
TEST(EdgeWire, FncallInitJson) {
  json j = json::parse(fncallInitJson(64ll << 20, {{"node", {"/usr/bin/node", "-e"}}}, 200));
  EXPECT_EQ(j["scratch_mb"], 64);
  EXPECT_EQ(j["prestart"], json::array({"python"}));
  EXPECT_EQ(j["languages"]["node"], json::array({"/usr/bin/node", "-e"}));
  EXPECT_EQ(j["zygote_max_calls"], 200);
  // Less than a MiB still gets one; no languages and no call cap leave the keys out.
  j = json::parse(fncallInitJson(1000, {}, 0));
  EXPECT_EQ(j["scratch_mb"], 1);
  EXPECT_FALSE(j.contains("languages"));
  EXPECT_FALSE(j.contains("zygote_max_calls"));
}

// The names backends and states go by in the API and the store.
TEST(EdgeWire, BackendAndStateNamesRoundTrip) {
  for (BackendKind b : kAllBackends) EXPECT_EQ(parseBackend(backendName(b)), b);
  for (SandboxState s : kAllStates) EXPECT_EQ(parseState(stateName(s)), s);
  for (AgentOp op : {AgentOp::kList, AgentOp::kStat, AgentOp::kMkdir, AgentOp::kRemove,
                     AgentOp::kPolicy, AgentOp::kAudit}) {
    EXPECT_EQ(parseAgentOp(agentOpName(op)), op);
  }
  for (const char* bad : {"", "Container", "kvm", "fncall "}) {
    EXPECT_FALSE(parseBackend(bad).has_value()) << bad;
  }
  for (const char* bad : {"", "Running", "deleted"}) {
    EXPECT_FALSE(parseState(bad).has_value()) << bad;
  }
  EXPECT_FALSE(parseAgentOp("rm").has_value());
}

}  // namespace
}  // namespace dsec::proto
