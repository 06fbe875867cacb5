#include "platform/tenants.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include "common/sha256.h"
#include "common/util.h"

namespace dsec::platform {
namespace {

TEST(TokenBucketTest, StartsFullRefillsAtRateAndCapsAtBurst) {
  TokenBucket b(2.0, 3.0, 100.0);
  EXPECT_TRUE(b.take(100.0));
  EXPECT_TRUE(b.take(100.0));
  EXPECT_TRUE(b.take(100.0));
  double wait = 0;
  EXPECT_FALSE(b.take(100.0, &wait));
  EXPECT_NEAR(wait, 0.5, 1e-9);
  EXPECT_FALSE(b.take(100.25));
  EXPECT_TRUE(b.take(100.5));  // one token after 0.5 s at 2/s
  EXPECT_FALSE(b.take(100.5));
  // A long idle refills to the burst, not beyond.
  for (int i = 0; i < 3; ++i) EXPECT_TRUE(b.take(1000.0));
  EXPECT_FALSE(b.take(1000.0));
  // Time going backwards takes nothing extra.
  EXPECT_FALSE(b.take(999.0));
}

TEST(TokenBucketTest, ReconfigureKeepsTokensUpToTheNewBurst) {
  TokenBucket b(1.0, 10.0, 0.0);
  b.reconfigure(1.0, 2.0);
  EXPECT_TRUE(b.take(0.0));
  EXPECT_TRUE(b.take(0.0));
  EXPECT_FALSE(b.take(0.0));
}

SandboxRecord sandbox(const std::string& owner, const std::string& state, double cpu, int64_t mb) {
  SandboxRecord r;
  r.owner = owner;
  r.state = *proto::parseState(state);
  r.cpu = cpu;
  r.memoryMb = mb;
  return r;
}

TEST(QuotaTest, UsageCountsOnlyTheTenantsLiveSandboxes) {
  std::map<std::string, SandboxRecord> all = {
      {"a", sandbox("acme", "running", 1, 100)}, {"b", sandbox("acme", "paused", 0.5, 50)},
      {"c", sandbox("acme", "creating", 1, 10)}, {"d", sandbox("acme", "stopped", 4, 4000)},
      {"e", sandbox("acme", "failed", 4, 4000)}, {"f", sandbox("other", "running", 8, 8000)}};
  Usage u = usageOf("acme", all);
  EXPECT_EQ(u.sandboxes, 3);
  EXPECT_DOUBLE_EQ(u.cpu, 2.5);
  EXPECT_EQ(u.memoryMb, 160);
}

TEST(QuotaTest, EachLimitNamesItsField) {
  TenantQuota q;
  Usage used{2, 1.5, 300};
  SandboxRecord asked = sandbox("acme", "creating", 0.5, 200);
  EXPECT_TRUE(checkQuota(q, used, asked).isOk());  // no limits
  q.maxSandboxes = 2;
  Status st = checkQuota(q, used, asked);
  EXPECT_EQ(st.code(), Code::kQuotaExceeded);
  EXPECT_EQ(st.field(), "max_sandboxes");
  q.maxSandboxes = 3;
  EXPECT_TRUE(checkQuota(q, used, asked).isOk());
  q.maxCpu = 1.9;
  EXPECT_EQ(checkQuota(q, used, asked).field(), "max_cpu");
  q.maxCpu = 2.0;  // exactly full is fine
  EXPECT_TRUE(checkQuota(q, used, asked).isOk());
  q.maxMemoryMb = 499;
  EXPECT_EQ(checkQuota(q, used, asked).field(), "max_memory_mb");
  q.maxMemoryMb = 500;
  EXPECT_TRUE(checkQuota(q, used, asked).isOk());
  // One-shot runs under way take sandboxes too (their cpu and memory are in
  // the sums already).
  used.runs = 1;
  st = checkQuota(q, used, asked);
  EXPECT_EQ(st.field(), "max_sandboxes");
  EXPECT_NE(st.message().find("1 runs under way"), std::string::npos) << st.message();
  q.maxSandboxes = 4;
  EXPECT_TRUE(checkQuota(q, used, asked).isOk());
  EXPECT_EQ(httpStatusFor(Code::kQuotaExceeded), 403);
  EXPECT_EQ(httpStatusFor(Code::kRateLimited), 429);
}

TEST(AuthorizerTest, AdminsSeeAllUsersTheirOwn) {
  Caller admin;
  Caller acme{"acme", false, "k"};
  EXPECT_TRUE(mayAccess(admin, "acme"));
  EXPECT_TRUE(mayAccess(acme, "acme"));
  EXPECT_FALSE(mayAccess(acme, "beta"));
  EXPECT_FALSE(mayAccess(acme, "admin"));
  EXPECT_FALSE(mayAccess(acme, ""));  // rows older than tenants are the admin's
  ImageRecord img;
  img.owner = "beta";
  img.visibility = "private";
  EXPECT_FALSE(imageVisible(acme, img));
  EXPECT_TRUE(imageVisible(admin, img));
  img.visibility = "public";
  EXPECT_TRUE(imageVisible(acme, img));
}

TEST(AuthorizerTest, TrajectoryIdsArePerTenant) {
  Caller admin;
  Caller acme{"acme", false, "k"};
  Caller ac{"ac", false, "k"};
  EXPECT_EQ(scopeTrajectory(admin, "t1"), "t1");
  EXPECT_EQ(scopeTrajectory(acme, "t1"), "t1@acme");
  EXPECT_EQ(trajectoryAsSeenBy(acme, "t1@acme"), "t1");
  EXPECT_EQ(trajectoryAsSeenBy(acme, "t1"), std::nullopt);
  EXPECT_EQ(trajectoryAsSeenBy(ac, "t1@acme"), std::nullopt);
  EXPECT_EQ(trajectoryAsSeenBy(acme, "@acme"), std::nullopt);
  EXPECT_EQ(trajectoryAsSeenBy(admin, "t1@acme"), "t1@acme");
}

TEST(AuthorizerTest, CallerScopeNestsAndRestores) {
  EXPECT_TRUE(currentCaller().admin);
  {
    CallerScope a(Caller{"acme", false, "k"});
    EXPECT_EQ(currentCaller().tenant, "acme");
    {
      CallerScope b(Caller{"beta", false, "j"});
      EXPECT_EQ(currentCaller().tenant, "beta");
    }
    EXPECT_EQ(currentCaller().tenant, "acme");
  }
  EXPECT_EQ(currentCaller().tenant, kAdminTenant);
}

TEST(ApiKeyTest, FormatAndHash) {
  NewApiKey k = makeApiKey("acme", "ci", 5);
  EXPECT_EQ(apiKeyId(k.key), k.record.id);
  EXPECT_EQ(k.record.hash, sha256Hex(k.key));
  EXPECT_EQ(k.key.find(k.record.hash), std::string::npos);
  EXPECT_NE(makeApiKey("acme", "", 5).key, k.key);
  EXPECT_EQ(apiKeyId("dsk_short"), "");
  EXPECT_EQ(apiKeyId(k.key.substr(0, k.key.size() - 1) + "Z"), "");
  EXPECT_EQ(apiKeyId(std::string(64, 'a')), "");  // a bootstrap token
}

TEST(ApiKeyTest, AuthenticateBootstrapKeysAndRevocation) {
  std::string dir = "/tmp/dsec-tenants-test-" + randomHex(4);
  ASSERT_TRUE(makeDirs(dir, 0700).isOk());
  auto store = SqliteStore::open(dir + "/state.db");
  ASSERT_TRUE(store.isOk());
  std::string boot = randomHex(32);
  auto t = Tenants::open(store->get(), boot);
  ASSERT_TRUE(t.isOk()) << t.status().toString();
  auto admin = (*store)->getTenant(kAdminTenant);
  ASSERT_TRUE(admin.isOk());
  EXPECT_EQ(admin->role, "admin");

  auto c = (*t)->authenticate(boot);
  ASSERT_TRUE(c.isOk());
  EXPECT_TRUE(c->admin);
  EXPECT_EQ((*t)->authenticate(boot + "x").status().code(), Code::kUnauthenticated);
  EXPECT_EQ((*t)->authenticate("").status().code(), Code::kUnauthenticated);

  TenantRecord acme;
  acme.id = "acme";
  ASSERT_TRUE((*store)->putTenant(acme).isOk());
  NewApiKey k = makeApiKey("acme", "", 1);
  ASSERT_TRUE((*store)->putApiKey(k.record).isOk());
  c = (*t)->authenticate(k.key);
  ASSERT_TRUE(c.isOk()) << c.status().toString();
  EXPECT_EQ(c->tenant, "acme");
  EXPECT_FALSE(c->admin);
  EXPECT_EQ(c->keyId, k.record.id);
  // Same id, another secret: refused.
  std::string forged = k.key;
  forged.back() = forged.back() == 'a' ? 'b' : 'a';
  EXPECT_EQ((*t)->authenticate(forged).status().code(), Code::kUnauthenticated);
  // Revoked: refused at once once the cache is told.
  k.record.revokedAt = 2;
  ASSERT_TRUE((*store)->putApiKey(k.record).isOk());
  (*t)->forgetKey(k.record.id);
  EXPECT_EQ((*t)->authenticate(k.key).status().code(), Code::kUnauthenticated);
  // A key of a deleted tenant is refused.
  NewApiKey k2 = makeApiKey("acme", "", 1);
  ASSERT_TRUE((*store)->putApiKey(k2.record).isOk());
  EXPECT_TRUE((*t)->authenticate(k2.key).isOk());
  ASSERT_TRUE((*store)->deleteTenant("acme").isOk());
  (*t)->forgetTenant("acme");
  EXPECT_EQ((*t)->authenticate(k2.key).status().code(), Code::kUnauthenticated);
  (void)removeTree(dir);
}

TEST(ApiKeyTest, CreateRateUsesTheTenantsBucket) {
  std::string dir = "/tmp/dsec-tenants-test-" + randomHex(4);
  ASSERT_TRUE(makeDirs(dir, 0700).isOk());
  auto store = SqliteStore::open(dir + "/state.db");
  ASSERT_TRUE(store.isOk());
  auto t = Tenants::open(store->get(), "");
  ASSERT_TRUE(t.isOk());
  TenantRecord r;
  r.id = "acme";
  EXPECT_TRUE((*t)->takeCreate(r, 0).isOk());  // no rate: always
  r.quota.createsPerS = 1;
  r.quota.createBurst = 2;
  EXPECT_TRUE((*t)->takeCreate(r, 10).isOk());
  EXPECT_TRUE((*t)->takeCreate(r, 10).isOk());
  Status st = (*t)->takeCreate(r, 10);
  EXPECT_EQ(st.code(), Code::kRateLimited);
  EXPECT_EQ(st.field(), "creates_per_s");
  EXPECT_TRUE((*t)->takeCreate(r, 11).isOk());
  (void)removeTree(dir);
}

}  // namespace
}  // namespace dsec::platform
