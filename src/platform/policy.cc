#include "platform/policy.h"

#include <arpa/inet.h>

#include "common/util.h"
#include "edge/net/egress_rules.h"
#include "platform/store.h"

namespace dsec::platform {

using json = nlohmann::json;

namespace {

const std::vector<std::string> kSystemPaths = {"/usr",   "/bin",    "/sbin", "/lib", "/lib32",
                                               "/lib64", "/libx32", "/etc",  "/boot"};

bool validName(const std::string& n) {
  if (n.empty() || n.size() > 63 || !(islower(n[0]) || isdigit(n[0]))) return false;
  for (char c : n) {
    if (!(islower(c) || isdigit(c) || c == '-' || c == '_' || c == '.')) return false;
  }
  return true;
}

Result<std::vector<std::string>> stringList(const json& j, const char* field) {
  std::vector<std::string> out;
  auto it = j.find(field);
  if (it == j.end() || it->is_null()) return out;
  if (!it->is_array()) return invalidArg(field, std::string(field) + " must be a list of strings");
  for (auto& v : *it) {
    if (!v.is_string()) return invalidArg(field, std::string(field) + " must be a list of strings");
    out.push_back(v.get<std::string>());
  }
  return out;
}

Result<Policy> fromJson(const json& j, bool fromApi) {
  static const char* kKeys[] = {"name",   "description", "readonly_paths", "hidden_paths",
                                "egress", "dns",         "created_at",     "builtin"};
  if (!j.is_object()) return invalidArg("body", "a policy is a JSON object");
  for (auto& [k, v] : j.items()) {
    bool known = false;
    for (const char* key : kKeys) known = known || k == key;
    if (!known || (fromApi && (k == "created_at" || k == "builtin"))) {
      return invalidArg(k, "unknown field '" + k + "'");
    }
  }
  Policy p;
  auto name = j.find("name");
  if (name == j.end() || !name->is_string()) return invalidArg("name", "name is required");
  p.name = name->get<std::string>();
  if (!validName(p.name)) {
    return invalidArg("name",
                      "'" + p.name + "' is not a policy name (1-63 of a-z, 0-9, '-', '_', '.')");
  }
  if (auto d = j.find("description"); d != j.end() && !d->is_null()) {
    if (!d->is_string() || d->get<std::string>().size() > 1000) {
      return invalidArg("description", "description must be a string of at most 1000 bytes");
    }
    p.description = d->get<std::string>();
  }
  ASSIGN_OR_RETURN(p.readonlyPaths, stringList(j, "readonly_paths"));
  RETURN_IF_ERROR(validatePolicyPaths(p.readonlyPaths, "readonly_paths"));
  ASSIGN_OR_RETURN(p.hiddenPaths, stringList(j, "hidden_paths"));
  RETURN_IF_ERROR(validatePolicyPaths(p.hiddenPaths, "hidden_paths"));
  ASSIGN_OR_RETURN(p.egress, stringList(j, "egress"));
  RETURN_IF_ERROR(validateEgress(p.egress, "egress"));
  ASSIGN_OR_RETURN(p.dns, stringList(j, "dns"));
  RETURN_IF_ERROR(validateDns(p.dns, "dns"));
  if (auto c = j.find("created_at"); c != j.end() && c->is_number()) p.createdAt = *c;
  return p;
}

}  // namespace

json Policy::toJson() const {
  return {{"name", name},
          {"description", description},
          {"readonly_paths", readonlyPaths},
          {"hidden_paths", hiddenPaths},
          {"egress", egress},
          {"dns", dns},
          {"builtin", builtin},
          {"created_at", createdAt}};
}

std::vector<Policy> builtinPolicies(const std::vector<std::string>& setupEgress,
                                    const std::vector<std::string>& setupDns) {
  std::vector<Policy> out = {
      {"default",
       "closed: no egress; the sandbox may change any of its own files",
       {},
       {},
       {},
       {},
       true,
       0},
      {"setup",
       "preparing a workplace: egress only to the operator's allow-list (dsec up "
       "--setup-egress, --setup-dns; none unless given)",
       {},
       {},
       setupEgress,
       setupDns,
       true,
       0},
      {"rollout",
       "an agent at work: no egress; the sandbox may change any of its own files",
       {},
       {},
       {},
       {},
       true,
       0},
      {"eval",
       "grading: no egress; system paths read-only for every process whatever its uid (no "
       "replacing /bin/bash or a library); more paths may be hidden or made read-only",
       kSystemPaths,
       {},
       {},
       {},
       true,
       0},
  };
  return out;
}

Status validatePolicyPaths(const std::vector<std::string>& paths, const std::string& field) {
  if (paths.size() > 64) return invalidArg(field, "at most 64 paths");
  for (const auto& p : paths) {
    if (p.size() < 2 || p[0] != '/' || p.size() > 1024 || p.find('\0') != std::string::npos) {
      return invalidArg(field, "'" + p + "' is not an absolute path below /");
    }
    for (const auto& part : splitString(p.substr(1), '/')) {
      if (part.empty() || part == "." || part == "..") {
        return invalidArg(field, "'" + p + "' is not a normalised path");
      }
    }
    for (const char* sys : {"/proc", "/sys", "/dev"}) {
      if (p == sys || startsWith(p, std::string(sys) + "/")) {
        return invalidArg(field, "'" + p + "' is under " + sys + ", which policies leave alone");
      }
    }
  }
  return Status::ok();
}

Status validateEgress(const std::vector<std::string>& entries, const std::string& field) {
  if (entries.size() > 256) return invalidArg(field, "at most 256 egress entries");
  std::vector<edge::net::EgressEntry> addrs;
  for (size_t i = 0; i < entries.size(); ++i) {
    auto e = edge::net::parseEgressEntry(entries[i], field);
    if (!e.isOk()) return e.status();
    if (e->host.empty()) addrs.push_back(*e);
  }
  // Catches too many port ranges on nested prefixes now, not at apply time.
  if (auto r = edge::net::compileEgress(addrs, field); !r.isOk()) return r.status();
  return Status::ok();
}

Status validateDns(const std::vector<std::string>& servers, const std::string& field) {
  if (servers.size() > 3) return invalidArg(field, "at most 3 resolvers (resolv.conf's limit)");
  for (auto& s : servers) {
    unsigned char buf[16];
    if (inet_pton(AF_INET, s.c_str(), buf) != 1 && inet_pton(AF_INET6, s.c_str(), buf) != 1) {
      return invalidArg(field, "'" + s + "' is not an IPv4 or IPv6 address");
    }
  }
  return Status::ok();
}

Result<std::unique_ptr<Policies>> Policies::open(Store* store, std::vector<Policy> builtins) {
  std::unique_ptr<Policies> p(new Policies());
  p->store_ = store;
  p->builtins_ = std::move(builtins);
  ASSIGN_OR_RETURN(auto docs, store->loadPolicies());
  for (auto& d : docs) {
    json j = json::parse(d, nullptr, false);
    auto pol = fromJson(j, /*fromApi=*/false);
    if (!pol.isOk()) {
      return Status(Code::kDataLoss, "stored policy is unreadable: " + pol.status().toString());
    }
    p->custom_[pol->name] = *pol;
  }
  return p;
}

Result<Policy> Policies::find(const std::string& name, const std::string& field) const {
  for (const auto& p : builtins_) {
    if (p.name == name) return p;
  }
  std::lock_guard lk(mu_);
  if (auto it = custom_.find(name); it != custom_.end()) return it->second;
  std::string names;
  for (const auto& p : builtins_) names += (names.empty() ? "" : ", ") + p.name;
  for (const auto& [n, p] : custom_) names += ", " + n;
  return invalidArg(field, "unknown policy '" + name + "' (available: " + names + ")");
}

std::vector<Policy> Policies::list() const {
  std::vector<Policy> out = builtins_;
  std::lock_guard lk(mu_);
  for (const auto& [n, p] : custom_) out.push_back(p);
  return out;
}

Result<Policy> Policies::create(const json& doc) {
  ASSIGN_OR_RETURN(Policy p, fromJson(doc, /*fromApi=*/true));
  p.createdAt = nowSeconds();
  for (const auto& b : builtins_) {
    if (b.name == p.name) {
      return Status(Code::kAlreadyExists, "policy " + p.name + " is built in", 0, "name");
    }
  }
  std::lock_guard lk(mu_);
  if (custom_.count(p.name)) {
    return Status(Code::kAlreadyExists, "policy " + p.name + " exists", 0, "name");
  }
  json j = p.toJson();
  j.erase("builtin");
  // Stored before it is acknowledged.
  RETURN_IF_ERROR(store_->putPolicy(p.name, j.dump()));
  custom_[p.name] = p;
  return p;
}

Status Policies::remove(const std::string& name) {
  for (const auto& b : builtins_) {
    if (b.name == name) {
      return Status(Code::kFailedPrecondition, "policy " + name + " is built in", 0, "name");
    }
  }
  std::lock_guard lk(mu_);
  if (!custom_.count(name)) return notFound("policy " + name + " not found");
  RETURN_IF_ERROR(store_->deletePolicy(name));
  custom_.erase(name);
  return Status::ok();
}

}  // namespace dsec::platform
