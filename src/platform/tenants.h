// Tenants, API keys, roles and quotas (docs/tenants.md).
//
// Every API call is made by a Caller: a tenant and its role. The bootstrap
// token `dsec up` writes on first start is the built-in "admin" tenant's
// credential; other credentials are API keys, "dsk_<id>_<secret>", of which
// the store keeps only the SHA-256 (the id is the visible part, for listing
// and revoking).
//
// Roles: an admin manages tenants, keys and quotas and sees every resource;
// a user sees only what its tenant owns (sandboxes, private images,
// trajectories) plus public images. Another tenant's resource is "not found",
// never "forbidden", so ids do not leak.
//
// Trajectory ids are chosen by clients, so they are per tenant: a user
// tenant's id "t" is stored as "t@<tenant>" ('@' is outside the ids a client
// may send, so no client id collides with it); an admin addresses stored ids
// as they are.
#pragma once

#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>

#include "common/status.h"
#include "platform/store.h"

namespace dsec::platform {

inline constexpr const char* kAdminTenant = "admin";

struct Caller {
  std::string tenant = kAdminTenant;
  bool admin = true;
  std::string keyId;  // empty for the bootstrap token and internal work
};

// The caller of the API request this thread serves (set by CallerScope);
// internal work (start-up, the janitor) runs as the built-in admin.
const Caller& currentCaller();

// Makes `c` the thread's caller until destroyed. Not copyable.
class CallerScope {
 public:
  explicit CallerScope(Caller c);
  ~CallerScope();
  CallerScope(const CallerScope&) = delete;
  CallerScope& operator=(const CallerScope&) = delete;

 private:
  Caller prev_;
};

// Whether `c` may see and act on a resource `owner` owns ("" is the built-in
// admin, as in rows older than tenants).
bool mayAccess(const Caller& c, const std::string& owner);
// Whether `c` may see and stack image `img`: public, its own, or an admin.
bool imageVisible(const Caller& c, const ImageRecord& img);

// The stored id of trajectory `id` as `c` names it (see the header comment).
std::string scopeTrajectory(const Caller& c, const std::string& id);
// The id `c` knows stored trajectory `stored` by, or nullopt when it is not
// `c`'s to see.
std::optional<std::string> trajectoryAsSeenBy(const Caller& c, const std::string& stored);

// A tenant id: 1-40 of [a-z0-9-], starting with a letter or digit. Errors
// name `field`.
Status validateTenantId(const std::string& id, const std::string& field);

// What a tenant's live sandboxes (neither stopped nor failed) hold, and its
// one-shot calls (POST /v1/run) under way: each of those holds a warm
// sandbox, so it counts against max_sandboxes, max_cpu and max_memory_mb too.
struct Usage {
  int64_t sandboxes = 0;
  double cpu = 0;  // of both
  int64_t memoryMb = 0;
  int64_t runs = 0;  // POST /v1/run calls under way
};
Usage usageOf(const std::string& tenant, const std::map<std::string, SandboxRecord>& sandboxes);
// Whether `asked` fits quota `q` next to `used`: kQuotaExceeded naming the
// quota's field (max_sandboxes, max_cpu, max_memory_mb) otherwise.
Status checkQuota(const TenantQuota& q, const Usage& used, const SandboxRecord& asked);

// A token bucket: `rate` tokens a second, at most `burst` held; starts full.
// Not thread-safe (Tenants guards its buckets).
class TokenBucket {
 public:
  TokenBucket(double rate, double burst, double now);
  // Takes a token if one is there; else false and, when retryAfterS is set,
  // the seconds until one will be.
  bool take(double now, double* retryAfterS = nullptr);
  // New limits, keeping the tokens held (capped at the new burst).
  void reconfigure(double rate, double burst);
  double rate() const { return rate_; }
  double burst() const { return burst_; }

 private:
  void refill(double now);
  double rate_, burst_, tokens_, last_;
};

// A fresh API key for `tenant`: the key (shown once) and its record.
struct NewApiKey {
  std::string key;
  ApiKeyRecord record;
};
NewApiKey makeApiKey(const std::string& tenant, const std::string& name, double now);
// The id part of a well-formed key "dsk_<12 hex>_<64 hex>", else "".
std::string apiKeyId(std::string_view key);

// The authenticator and the tenants' cache and buckets. Thread-safe.
//
// Records read from the store are cached for up to kCacheS, so a key revoked
// or a quota changed through another platform process sharing the store
// takes effect there within that time; through this one, at once.
class Tenants {
 public:
  static constexpr double kCacheS = 1.0;

  // Ensures the built-in admin tenant exists in `store` (not owned).
  static Result<std::unique_ptr<Tenants>> open(Store* store, std::string bootstrapToken);

  // Who presents bearer `token`: the bootstrap token is the built-in admin;
  // an API key its tenant with the tenant's role. kUnauthenticated when
  // nothing matches, the key is revoked or its tenant is gone.
  Result<Caller> authenticate(std::string_view token);
  // The tenant's record (cached); kNotFound when none.
  Result<TenantRecord> tenant(const std::string& id);
  // Drops what is cached of a tenant or a key, after a change.
  void forgetTenant(const std::string& id);
  void forgetKey(const std::string& id);
  // Takes a sandbox creation from the tenant's bucket: kRateLimited (field
  // creates_per_s) when it is empty. A quota without a rate always passes.
  Status takeCreate(const TenantRecord& t, double now);

 private:
  Tenants() = default;

  Store* store_ = nullptr;
  std::string bootstrap_;
  std::mutex mu_;                                                   // guards the maps below
  std::map<std::string, std::pair<ApiKeyRecord, double>> keys_;     // id -> (record, read at)
  std::map<std::string, std::pair<TenantRecord, double>> tenants_;  // id -> (record, read at)
  std::map<std::string, TokenBucket> buckets_;                      // tenant -> bucket
};

}  // namespace dsec::platform
