#include "platform/policy.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>

#include "common/util.h"
#include "platform/store.h"
#include "platform/store_test_util.h"

namespace dsec::platform {
namespace {

using json = nlohmann::json;

class PolicyTest : public ::testing::TestWithParam<StoreKind> {
 protected:
  void SetUp() override {
    DSEC_MAKE_TEST_STORE_ENV(env_, GetParam());
    open();
  }
  void TearDown() override {
    policies_.reset();
    store_.reset();
    env_.reset();
  }
  void open() {
    policies_.reset();
    store_.reset();
    auto s = env_->open();
    ASSERT_TRUE(s.isOk()) << s.status().toString();
    store_ = std::move(*s);
    auto p = Policies::open(store_.get(), builtinPolicies({"10.0.0.0/8:80"}, {"10.0.0.53"}));
    ASSERT_TRUE(p.isOk()) << p.status().toString();
    policies_ = std::move(*p);
  }
  std::unique_ptr<TestStoreEnv> env_;
  std::unique_ptr<Store> store_;
  std::unique_ptr<Policies> policies_;
};
DSEC_INSTANTIATE_FOR_BOTH_STORES(PolicyTest);

TEST_P(PolicyTest, BuiltinsAreClosedButSetupAndEvalLocksSystemPaths) {
  for (const char* name : {"default", "rollout", "eval"}) {
    auto p = policies_->find(name, "policy");
    ASSERT_TRUE(p.isOk()) << name;
    EXPECT_TRUE(p->egress.empty()) << name;
    EXPECT_TRUE(p->dns.empty()) << name;
    EXPECT_TRUE(p->builtin);
  }
  auto setup = policies_->find("setup", "policy");
  ASSERT_TRUE(setup.isOk());
  EXPECT_EQ(setup->egress, std::vector<std::string>{"10.0.0.0/8:80"});
  EXPECT_EQ(setup->dns, std::vector<std::string>{"10.0.0.53"});
  EXPECT_TRUE(builtinPolicies()[1].egress.empty());  // setup allows nothing unless told
  auto eval = policies_->find("eval", "policy");
  for (const char* path : {"/usr", "/bin", "/lib", "/etc"}) {
    EXPECT_NE(std::find(eval->readonlyPaths.begin(), eval->readonlyPaths.end(), path),
              eval->readonlyPaths.end())
        << path;
  }
  auto bad = policies_->find("setup-ish", "phase.policy");
  EXPECT_EQ(bad.status().code(), Code::kInvalidArgument);
  EXPECT_EQ(bad.status().field(), "phase.policy");
  EXPECT_NE(bad.status().message().find("default, setup, rollout, eval"), std::string::npos);
}

TEST_P(PolicyTest, UserPoliciesAreValidatedStoredAndSurviveReopen) {
  json doc = {{"name", "grading-v2"},
              {"description", "hide the answers"},
              {"hidden_paths", {"/srv/answers"}},
              {"readonly_paths", {"/opt/tests"}},
              {"egress", {"192.0.2.0/24:443", "mirror.example:80"}},
              {"dns", {"192.0.2.53"}},
              {"limits", {{"cpu", 0.5}, {"pids", 64}, {"max_output_bytes", 1024}}}};
  auto p = policies_->create(doc);
  ASSERT_TRUE(p.isOk()) << p.status().toString();
  EXPECT_FALSE(p->builtin);
  EXPECT_GT(p->createdAt, 0);
  auto again = policies_->create(doc);
  EXPECT_EQ(again.status().code(), Code::kAlreadyExists);
  EXPECT_EQ(policies_->create({{"name", "eval"}}).status().code(), Code::kAlreadyExists);

  open();  // a restart
  auto found = policies_->find("grading-v2", "policy");
  ASSERT_TRUE(found.isOk()) << found.status().toString();
  EXPECT_EQ(found->hiddenPaths, std::vector<std::string>{"/srv/answers"});
  EXPECT_EQ(found->egress.size(), 2u);
  EXPECT_EQ(found->dns, std::vector<std::string>{"192.0.2.53"});
  EXPECT_EQ(found->limits, (PolicyLimits{0.5, 0, 64, 1024, 0}));
  EXPECT_EQ(policies_->limitsOf("grading-v2"), found->limits);
  EXPECT_EQ(policies_->limitsOf("eval"), PolicyLimits{});
  EXPECT_EQ(policies_->limitsOf("no-such-policy"), PolicyLimits{});
  EXPECT_EQ(policies_->list().size(), 5u);

  EXPECT_EQ(policies_->remove("eval").code(), Code::kFailedPrecondition);
  EXPECT_TRUE(policies_->remove("grading-v2").isOk());
  EXPECT_EQ(policies_->remove("grading-v2").code(), Code::kNotFound);
  open();
  EXPECT_FALSE(policies_->find("grading-v2", "policy").isOk());
}

TEST_P(PolicyTest, BadDocumentsNameTheField) {
  struct Case {
    json doc;
    const char* field;
  };
  const Case cases[] = {
      {json{{"description", "x"}}, "name"},
      {json{{"name", "Bad Name"}}, "name"},
      {json{{"name", "x"}, {"egress", {"10.0.0.0/33"}}}, "egress"},
      {json{{"name", "x"}, {"egress", "10.0.0.1"}}, "egress"},
      {json{{"name", "x"}, {"dns", {"resolver.example"}}}, "dns"},
      {json{{"name", "x"}, {"dns", {"1.1.1.1", "1.0.0.1", "8.8.8.8", "8.8.4.4"}}}, "dns"},
      {json{{"name", "x"}, {"hidden_paths", {"/proc/1"}}}, "hidden_paths"},
      {json{{"name", "x"}, {"readonly_paths", {"rel"}}}, "readonly_paths"},
      {json{{"name", "x"}, {"builtin", true}}, "builtin"},
      {json{{"name", "x"}, {"colour", "red"}}, "colour"},
      {json{{"name", "x"}, {"limits", {{"pids", 4}}}}, "limits.pids"},
      {json{{"name", "x"}, {"limits", {{"memory_mb", 1.5}}}}, "limits.memory_mb"},
      {json{{"name", "x"}, {"limits", {{"swap", 1}}}}, "limits.swap"},
      {json{{"name", "x"}, {"limits", 3}}, "limits"},
  };
  for (auto& c : cases) {
    auto p = policies_->create(c.doc);
    ASSERT_FALSE(p.isOk()) << c.doc.dump();
    EXPECT_EQ(p.status().code(), Code::kInvalidArgument) << c.doc.dump();
    EXPECT_EQ(p.status().field(), c.field) << c.doc.dump();
  }
  EXPECT_EQ(policies_->list().size(), 4u);  // nothing half-made
}

TEST(PolicyPaths, MustBeAbsoluteNormalisedAndOutsideProcSysDev) {
  EXPECT_TRUE(validatePolicyPaths({"/srv/answers", "/opt", "/a/b.c/d-e"}, "f").isOk());
  for (const char* bad : {"", "/", "relative", "/a//b", "/a/./b", "/a/../b", "/a/", "/proc",
                          "/proc/self", "/sys/fs", "/dev", "/dev/null"}) {
    Status st = validatePolicyPaths({bad}, "hidden_paths");
    EXPECT_EQ(st.code(), Code::kInvalidArgument) << bad;
    EXPECT_EQ(st.field(), "hidden_paths") << bad;
  }
  EXPECT_TRUE(validatePolicyPaths({"/devices", "/process"}, "f").isOk());  // only whole names
  std::vector<std::string> many(65, "/x");
  EXPECT_EQ(validatePolicyPaths(many, "f").code(), Code::kInvalidArgument);
}

}  // namespace
}  // namespace dsec::platform
