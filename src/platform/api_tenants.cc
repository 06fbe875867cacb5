// /v1/tenants, /v1/tenants/{id}/keys, /v1/whoami; and the checks every other
// route makes through here: who may call it, whose sandboxes and images a
// caller sees, quota admission of a create (platform/tenants.h).
#include <algorithm>
#include <set>

#include "common/log.h"
#include "common/util.h"
#include "platform/api_util.h"
#include "platform/platform.h"
#include "platform/tenants.h"

namespace dsec::platform {

namespace {

json quotaToApi(const TenantQuota& q) {
  return {{"max_sandboxes", q.maxSandboxes},
          {"max_cpu", q.maxCpu},
          {"max_memory_mb", q.maxMemoryMb},
          {"creates_per_s", q.createsPerS},
          {"create_burst", q.createBurst}};
}

json usageToApi(const Usage& u) {
  return {{"sandboxes", u.sandboxes}, {"runs", u.runs}, {"cpu", u.cpu}, {"memory_mb", u.memoryMb}};
}

json keyToApi(const ApiKeyRecord& k) {
  return {{"id", k.id},
          {"tenant", k.tenant},
          {"name", k.name},
          {"prefix", "dsk_" + k.id},
          {"created_at", isoTime(k.createdAt)},
          {"revoked_at", k.revokedAt > 0 ? json(isoTime(k.revokedAt)) : json(nullptr)}};
}

// Applies the fields of a "quota" object over q; errors name quota.<field>.
Status parseQuota(const json& j, TenantQuota& q) {
  if (!j.is_object()) return invalidArg("quota", "quota must be an object");
  for (auto& [k, v] : j.items()) {
    std::string field = "quota." + k;
    if (k == "max_cpu" || k == "creates_per_s") {
      if (!v.is_number() || v.get<double>() < 0 || v.get<double>() > 1e9) {
        return invalidArg(field, field + " must be a number >= 0 (0: no limit)");
      }
      (k == "max_cpu" ? q.maxCpu : q.createsPerS) = v.get<double>();
    } else if (k == "max_sandboxes" || k == "max_memory_mb" || k == "create_burst") {
      if (!v.is_number_integer() || v.get<int64_t>() < 0) {
        return invalidArg(field, field + " must be an integer >= 0 (0: no limit)");
      }
      int64_t n = v.get<int64_t>();
      (k == "max_sandboxes"   ? q.maxSandboxes
       : k == "max_memory_mb" ? q.maxMemoryMb
                              : q.createBurst) = n;
    } else {
      return invalidArg(field, "unknown quota " + k +
                                   " (known: max_sandboxes, max_cpu, max_memory_mb, "
                                   "creates_per_s, create_burst)");
    }
  }
  return Status::ok();
}

Status parseRole(const json& j, std::string& role) {
  auto r = getString(j, "role", role, 16);
  if (!r.isOk()) return r.status();
  if (*r != "admin" && *r != "user") return invalidArg("role", "role must be admin or user");
  role = *r;
  return Status::ok();
}

}  // namespace

// ----- authorization, once for every route ---------------------------------------

Status Platform::authorize(const std::vector<std::string>& parts, const std::string& method) {
  const Caller& c = currentCaller();
  if (c.admin || parts.size() < 3) return Status::ok();
  const std::string& coll = parts[2];
  // Node-wide state and the management of tenants: an admin's business.
  static const std::set<std::string> kAdminOnly = {"tenants", "layers", "gc", "node", "metrics"};
  if (kAdminOnly.count(coll) || (coll == "policies" && method != "GET")) {
    return Status(Code::kPermissionDenied, method + " /v1/" + coll +
                                               " needs the admin role; tenant " + c.tenant +
                                               " has the user role");
  }
  if (coll == "sandboxes" && parts.size() >= 4) {
    // Another tenant's sandbox is not found, as if it did not exist.
    std::lock_guard lk(mu_);
    auto it = sandboxes_.find(parts[3]);
    if (it != sandboxes_.end() && !mayAccess(c, it->second.owner)) {
      return notFound("sandbox " + parts[3] + " not found");
    }
  }
  return Status::ok();
}

Status Platform::checkAdmin(const std::string& authorization) {
  if (!startsWith(authorization, "Bearer ")) {
    return Status(Code::kUnauthenticated,
                  authorization.empty() ? "missing bearer token" : "invalid bearer token");
  }
  ASSIGN_OR_RETURN(Caller c, tenants_->authenticate(std::string_view(authorization).substr(7)));
  if (!c.admin) {
    return Status(Code::kPermissionDenied,
                  "/v1/nodes needs the admin role; tenant " + c.tenant + " has the user role");
  }
  return Status::ok();
}

Result<ImageRecord> Platform::visibleImage(const std::string& name, const std::string& tag) {
  auto img = store_->getImage(name, tag);
  if (img.isOk() && !imageVisible(currentCaller(), *img)) {
    return notFound("image " + name + ":" + tag + " not found");
  }
  return img;
}

Status Platform::layerUsable(const std::string& digest, const std::string& field) {
  const Caller& c = currentCaller();
  if (c.admin) return Status::ok();
  // A layer some image the caller cannot see names, and none it can: the
  // digest alone does not open another tenant's private image.
  ASSIGN_OR_RETURN(auto imgs, store_->listImages());
  bool hidden = false;
  for (auto& img : imgs) {
    if (std::find(img.layers.begin(), img.layers.end(), digest) == img.layers.end()) continue;
    if (imageVisible(c, img)) return Status::ok();
    hidden = true;
  }
  if (hidden) return Status(Code::kNotFound, "layer " + digest + " not found", 0, field);
  return Status::ok();
}

Status Platform::mayWriteImage(ImageRecord& img) {
  const Caller& c = currentCaller();
  if (img.visibility.empty()) img.visibility = c.admin ? "public" : "private";
  if (img.visibility != "public" && img.visibility != "private") {
    return invalidArg("visibility", "visibility must be public or private");
  }
  if (c.admin) return Status::ok();
  if (img.visibility == "public") {
    return Status(Code::kPermissionDenied, "only an admin may publish an image", 0, "visibility");
  }
  // A user tenant's images live under its name: no tenant can take, or learn
  // of, another's image names.
  if (!startsWith(img.name, c.tenant + "/")) {
    return invalidArg("name", "tenant " + c.tenant + "'s images are named " + c.tenant +
                                  "/<name>, not " + img.name);
  }
  auto had = store_->getImage(img.name, img.tag);
  if (had.isOk() && !mayAccess(c, had->owner)) {
    return Status(Code::kPermissionDenied,
                  "image " + img.name + ":" + img.tag + " belongs to another tenant", 0, "name");
  }
  return Status::ok();
}

Status Platform::admitLocked(const SandboxRecord& r, const TenantRecord& owner) {
  // Counting the owner's usage walks every record: only when a limit needs it.
  const TenantQuota& q = owner.quota;
  if (q.maxSandboxes > 0 || q.maxCpu > 0 || q.maxMemoryMb > 0) {
    RETURN_IF_ERROR(checkQuota(q, usageLocked(owner.id), r));
  }
  return tenants_->takeCreate(owner, nowSeconds());
}

Usage Platform::usageLocked(const std::string& tenant) const {
  Usage u = usageOf(tenant, sandboxes_);
  if (auto it = runsInFlight_.find(tenant); it != runsInFlight_.end()) {
    u.runs = it->second.runs;
    u.cpu += it->second.cpu;
    u.memoryMb += it->second.memoryMb;
  }
  return u;
}

// ----- /v1/whoami and /v1/tenants ---------------------------------------------------

json Platform::tenantToApi(const TenantRecord& t) {
  Usage u;
  {
    std::lock_guard lk(mu_);
    u = usageLocked(t.id);
  }
  return {{"id", t.id},
          {"name", t.name},
          {"role", t.role},
          {"created_at", isoTime(t.createdAt)},
          {"quota", quotaToApi(t.quota)},
          {"usage", usageToApi(u)}};
}

void Platform::whoami(http::Response& res) {
  const Caller& c = currentCaller();
  auto t = tenants_->tenant(c.tenant);
  if (!t.isOk()) return sendError(res, t.status());
  json j = {{"tenant", c.tenant},
            {"role", c.admin ? "admin" : "user"},
            {"key_id", c.keyId.empty() ? json(nullptr) : json(c.keyId)},
            {"quota", quotaToApi(t->quota)}};
  j["usage"] = tenantToApi(*t)["usage"];
  sendJson(res, 200, dumpJson(j));
}

void Platform::tenantsApi(const std::vector<std::string>& parts, http::Request& req,
                          http::Response& res) {
  // authorize() let only admins through.
  const std::string& m = req.method;
  size_t n = parts.size();
  auto methodNotAllowed = [&] { sendError(res, platform::methodNotAllowed(req)); };
  if (n == 3) {
    if (m == "GET") {
      auto list = store_->listTenants();
      if (!list.isOk()) return sendError(res, list.status());
      json arr = json::array();
      for (auto& t : *list) arr.push_back(tenantToApi(t));
      return sendJson(res, 200, dumpJson(json{{"tenants", arr}}));
    }
    if (m != "POST") return methodNotAllowed();
    auto j = parseObject(req, {"id", "name", "role", "quota"});
    if (!j.isOk()) return sendError(res, j.status());
    TenantRecord t;
    auto id = getString(*j, "id", "", 64);
    if (!id.isOk()) return sendError(res, id.status());
    t.id = id->empty() ? "t-" + randomHex(6) : *id;
    if (Status st = validateTenantId(t.id, "id"); !st.isOk()) return sendError(res, st);
    auto name = getString(*j, "name", t.id, 200);
    if (!name.isOk()) return sendError(res, name.status());
    t.name = *name;
    if (Status st = parseRole(*j, t.role); !st.isOk()) return sendError(res, st);
    if (auto q = j->find("quota"); q != j->end()) {
      if (Status st = parseQuota(*q, t.quota); !st.isOk()) return sendError(res, st);
    }
    t.createdAt = nowSeconds();
    std::lock_guard lk(tenantsMu_);  // no two creates of one id both succeed
    auto had = store_->getTenant(t.id);
    if (had.isOk()) {
      return sendError(res, Status(Code::kAlreadyExists, "tenant " + t.id + " exists", 0, "id"));
    }
    if (had.status().code() != Code::kNotFound) return sendError(res, had.status());
    if (Status st = store_->putTenant(t); !st.isOk()) return sendError(res, st);
    log::info("tenant " + t.id + " created (" + t.role + ")");
    return sendJson(res, 201, dumpJson(tenantToApi(t)));
  }
  const std::string& id = parts[3];
  if (n == 4) {
    if (m == "GET") {
      auto t = store_->getTenant(id);
      if (!t.isOk()) return sendError(res, t.status());
      return sendJson(res, 200, dumpJson(tenantToApi(*t)));
    }
    if (m == "PATCH") {
      auto j = parseObject(req, {"name", "role", "quota"});
      if (!j.isOk()) return sendError(res, j.status());
      std::lock_guard lk(tenantsMu_);
      auto t = store_->getTenant(id);
      if (!t.isOk()) return sendError(res, t.status());
      auto name = getString(*j, "name", t->name, 200);
      if (!name.isOk()) return sendError(res, name.status());
      t->name = *name;
      if (Status st = parseRole(*j, t->role); !st.isOk()) return sendError(res, st);
      if (id == kAdminTenant && t->role != "admin") {
        return sendError(res, invalidArg("role", "the built-in admin tenant stays an admin"));
      }
      if (auto q = j->find("quota"); q != j->end()) {
        if (Status st = parseQuota(*q, t->quota); !st.isOk()) return sendError(res, st);
      }
      if (Status st = store_->putTenant(*t); !st.isOk()) return sendError(res, st);
      tenants_->forgetTenant(id);
      return sendJson(res, 200, dumpJson(tenantToApi(*t)));
    }
    if (m == "DELETE") {
      if (id == kAdminTenant) {
        return sendError(
            res, Status(Code::kFailedPrecondition, "the built-in admin tenant cannot be deleted"));
      }
      std::lock_guard lk(tenantsMu_);
      Usage u;
      {
        std::lock_guard slk(mu_);
        u = usageOf(id, sandboxes_);
      }
      if (u.sandboxes > 0) {
        return sendError(res, Status(Code::kFailedPrecondition,
                                     "tenant " + id + " has " + std::to_string(u.sandboxes) +
                                         " live sandboxes; destroy them first"));
      }
      auto keys = store_->listApiKeys(id);
      if (!keys.isOk()) return sendError(res, keys.status());
      if (Status st = store_->deleteTenant(id); !st.isOk()) return sendError(res, st);
      tenants_->forgetTenant(id);
      log::info("tenant " + id + " deleted with its " + std::to_string(keys->size()) + " keys");
      return sendJson(res, 200,
                      dumpJson(json{{"id", id}, {"deleted_keys", int64_t(keys->size())}}));
    }
    return methodNotAllowed();
  }
  if (parts[4] != "keys" || n > 6) return sendError(res, notFound("no such endpoint: " + req.path));
  auto t = store_->getTenant(id);
  if (!t.isOk()) return sendError(res, t.status());
  if (n == 5) {
    if (m == "GET") {
      auto keys = store_->listApiKeys(id);
      if (!keys.isOk()) return sendError(res, keys.status());
      json arr = json::array();
      for (auto& k : *keys) arr.push_back(keyToApi(k));
      return sendJson(res, 200, dumpJson(json{{"keys", arr}}));
    }
    if (m != "POST") return methodNotAllowed();
    auto j = parseObject(req, {"name"}, true);
    if (!j.isOk()) return sendError(res, j.status());
    auto name = getString(*j, "name", "", 200);
    if (!name.isOk()) return sendError(res, name.status());
    NewApiKey k = makeApiKey(id, *name, nowSeconds());
    if (Status st = store_->putApiKey(k.record); !st.isOk()) return sendError(res, st);
    log::info("api key " + k.record.id + " created for tenant " + id);
    json out = keyToApi(k.record);
    out["key"] = k.key;  // the one time it is shown
    return sendJson(res, 201, dumpJson(out));
  }
  // n == 6: one key.
  if (m != "DELETE") return methodNotAllowed();
  auto k = store_->getApiKey(parts[5]);
  if (!k.isOk() || k->tenant != id) {
    return sendError(res, notFound("api key " + parts[5] + " of tenant " + id + " not found"));
  }
  if (k->revokedAt == 0) {
    k->revokedAt = nowSeconds();
    if (Status st = store_->putApiKey(*k); !st.isOk()) return sendError(res, st);
    log::info("api key " + k->id + " of tenant " + id + " revoked");
  }
  tenants_->forgetKey(k->id);
  sendJson(res, 200, dumpJson(keyToApi(*k)));
}

}  // namespace dsec::platform
