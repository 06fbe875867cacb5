#include "platform/tenants.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "common/sha256.h"
#include "common/util.h"

namespace dsec::platform {

namespace {

thread_local Caller tCaller;

constexpr size_t kKeyIdHex = 12;
constexpr size_t kKeySecretHex = 64;

bool isLowerHex(std::string_view s) {
  return std::all_of(s.begin(), s.end(),
                     [](char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'); });
}

std::string fmtNum(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", v);
  return buf;
}

}  // namespace

const Caller& currentCaller() { return tCaller; }

CallerScope::CallerScope(Caller c) : prev_(std::move(tCaller)) { tCaller = std::move(c); }
CallerScope::~CallerScope() { tCaller = std::move(prev_); }

bool mayAccess(const Caller& c, const std::string& owner) {
  if (c.admin) return true;
  return owner == c.tenant || (owner.empty() && c.tenant == kAdminTenant);
}

bool imageVisible(const Caller& c, const ImageRecord& img) {
  return img.visibility != "private" || mayAccess(c, img.owner);
}

std::string scopeTrajectory(const Caller& c, const std::string& id) {
  if (c.admin) return id;
  return id + "@" + c.tenant;
}

std::optional<std::string> trajectoryAsSeenBy(const Caller& c, const std::string& stored) {
  if (c.admin) return stored;
  std::string suffix = "@" + c.tenant;
  if (stored.size() > suffix.size() &&
      stored.compare(stored.size() - suffix.size(), suffix.size(), suffix) == 0) {
    return stored.substr(0, stored.size() - suffix.size());
  }
  return std::nullopt;
}

Status validateTenantId(const std::string& id, const std::string& field) {
  bool ok = !id.empty() && id.size() <= 40 && id.front() != '-';
  for (char c : id) ok = ok && ((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '-');
  if (!ok) {
    return invalidArg(field,
                      "tenant id '" + id + "' must be 1-40 of [a-z0-9-], not starting with '-'");
  }
  return Status::ok();
}

Usage usageOf(const std::string& tenant, const std::map<std::string, SandboxRecord>& sandboxes) {
  Usage u;
  for (auto& [id, r] : sandboxes) {
    if (r.owner != tenant || r.state == SandboxState::kStopped || r.state == SandboxState::kFailed) continue;
    ++u.sandboxes;
    u.cpu += r.cpu;
    u.memoryMb += r.memoryMb;
  }
  return u;
}

Status checkQuota(const TenantQuota& q, const Usage& used, const SandboxRecord& asked) {
  auto exceeded = [](const char* field, const std::string& msg) {
    return Status(Code::kQuotaExceeded, msg, 0, field);
  };
  if (q.maxSandboxes > 0 && used.sandboxes + used.runs + 1 > q.maxSandboxes) {
    return exceeded("max_sandboxes",
                    "quota exceeded: tenant has " + std::to_string(used.sandboxes) +
                        " live sandboxes" +
                        (used.runs > 0 ? " and " + std::to_string(used.runs) + " runs under way"
                                       : std::string()) +
                        ", its quota max_sandboxes is " + std::to_string(q.maxSandboxes));
  }
  // A small tolerance: cpu is a sum of decimals.
  if (q.maxCpu > 0 && used.cpu + asked.cpu > q.maxCpu + 1e-9) {
    return exceeded("max_cpu", "quota exceeded: tenant uses " + fmtNum(used.cpu) + " cpu, asking " +
                                   fmtNum(asked.cpu) + " more; its quota max_cpu is " +
                                   fmtNum(q.maxCpu));
  }
  if (q.maxMemoryMb > 0 && used.memoryMb + asked.memoryMb > q.maxMemoryMb) {
    return exceeded("max_memory_mb",
                    "quota exceeded: tenant uses " + std::to_string(used.memoryMb) +
                        " MB, asking " + std::to_string(asked.memoryMb) +
                        " MB more; its quota max_memory_mb is " + std::to_string(q.maxMemoryMb));
  }
  return Status::ok();
}

TokenBucket::TokenBucket(double rate, double burst, double now)
    : rate_(rate), burst_(burst), tokens_(burst), last_(now) {}

void TokenBucket::refill(double now) {
  if (now > last_) tokens_ = std::min(burst_, tokens_ + (now - last_) * rate_);
  last_ = std::max(last_, now);
}

bool TokenBucket::take(double now, double* retryAfterS) {
  refill(now);
  if (tokens_ >= 1.0) {
    tokens_ -= 1.0;
    return true;
  }
  if (retryAfterS) *retryAfterS = rate_ > 0 ? (1.0 - tokens_) / rate_ : 0;
  return false;
}

void TokenBucket::reconfigure(double rate, double burst) {
  rate_ = rate;
  burst_ = burst;
  tokens_ = std::min(tokens_, burst_);
}

NewApiKey makeApiKey(const std::string& tenant, const std::string& name, double now) {
  NewApiKey k;
  k.record.id = randomHex(kKeyIdHex / 2);
  k.key = "dsk_" + k.record.id + "_" + randomHex(kKeySecretHex / 2);
  k.record.tenant = tenant;
  k.record.hash = sha256Hex(k.key);
  k.record.name = name;
  k.record.createdAt = now;
  return k;
}

std::string apiKeyId(std::string_view key) {
  if (key.size() != 4 + kKeyIdHex + 1 + kKeySecretHex || key.substr(0, 4) != "dsk_" ||
      key[4 + kKeyIdHex] != '_') {
    return "";
  }
  std::string_view id = key.substr(4, kKeyIdHex);
  if (!isLowerHex(id) || !isLowerHex(key.substr(4 + kKeyIdHex + 1))) return "";
  return std::string(id);
}

Result<std::unique_ptr<Tenants>> Tenants::open(Store* store, std::string bootstrapToken) {
  std::unique_ptr<Tenants> t(new Tenants());
  t->store_ = store;
  t->bootstrap_ = std::move(bootstrapToken);
  auto admin = store->getTenant(kAdminTenant);
  if (!admin.isOk()) {
    if (admin.status().code() != Code::kNotFound) return admin.status();
    TenantRecord r;
    r.id = kAdminTenant;
    r.name = "built-in administrator";
    r.role = "admin";
    r.createdAt = nowSeconds();
    RETURN_IF_ERROR(store->putTenant(r));
  }
  return t;
}

Result<TenantRecord> Tenants::tenant(const std::string& id) {
  double now = nowSeconds();
  {
    std::lock_guard lk(mu_);
    auto it = tenants_.find(id);
    if (it != tenants_.end() && now - it->second.second < kCacheS) return it->second.first;
  }
  ASSIGN_OR_RETURN(auto r, store_->getTenant(id));
  std::lock_guard lk(mu_);
  if (tenants_.size() >= 4096) tenants_.clear();  // a cache, not a registry
  tenants_[id] = {r, now};
  return r;
}

void Tenants::forgetTenant(const std::string& id) {
  std::lock_guard lk(mu_);
  tenants_.erase(id);
  for (auto it = keys_.begin(); it != keys_.end();) {
    it = it->second.first.tenant == id ? keys_.erase(it) : std::next(it);
  }
}

void Tenants::forgetKey(const std::string& id) {
  std::lock_guard lk(mu_);
  keys_.erase(id);
}

Result<Caller> Tenants::authenticate(std::string_view token) {
  auto refused = [] { return Status(Code::kUnauthenticated, "invalid bearer token"); };
  std::string id = apiKeyId(token);
  if (id.empty()) {
    if (!bootstrap_.empty() && secretEquals(token, bootstrap_)) return Caller{};
    return refused();
  }
  double now = nowSeconds();
  std::optional<ApiKeyRecord> key;
  {
    std::lock_guard lk(mu_);
    auto it = keys_.find(id);
    if (it != keys_.end() && now - it->second.second < kCacheS) key = it->second.first;
  }
  if (!key) {
    auto r = store_->getApiKey(id);
    if (!r.isOk()) {
      if (r.status().code() == Code::kNotFound) return refused();
      return r.status();
    }
    key = *r;
    std::lock_guard lk(mu_);
    if (keys_.size() >= 4096) keys_.clear();
    keys_[id] = {*key, now};
  }
  // Hashes of equal length compared in constant time: the key's bytes never
  // decide how long a refusal takes.
  if (!secretEquals(sha256Hex(token), key->hash) || key->revokedAt > 0) return refused();
  auto t = tenant(key->tenant);
  if (!t.isOk()) {
    if (t.status().code() == Code::kNotFound) return refused();
    return t.status();
  }
  return Caller{t->id, t->role == "admin", id};
}

Status Tenants::takeCreate(const TenantRecord& t, double now) {
  if (t.quota.createsPerS <= 0) return Status::ok();
  double burst = t.quota.createBurst > 0 ? double(t.quota.createBurst)
                                         : std::max(1.0, std::floor(t.quota.createsPerS));
  std::lock_guard lk(mu_);
  auto it = buckets_.find(t.id);
  if (it == buckets_.end()) {
    it = buckets_.emplace(t.id, TokenBucket(t.quota.createsPerS, burst, now)).first;
  } else if (it->second.rate() != t.quota.createsPerS || it->second.burst() != burst) {
    it->second.reconfigure(t.quota.createsPerS, burst);
  }
  double wait = 0;
  if (it->second.take(now, &wait)) return Status::ok();
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.3f", wait);
  return Status(Code::kRateLimited,
                "rate limited: tenant " + t.id + " may create " + fmtNum(t.quota.createsPerS) +
                    " sandboxes a second (burst " + fmtNum(burst) + "); retry in " + buf + " s",
                0, "creates_per_s");
}

}  // namespace dsec::platform
