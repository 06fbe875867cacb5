#include "platform/policy.h"

#include <arpa/inet.h>

#include "common/util.h"
#include "proto/egress.h"
#include "platform/api_util.h"
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

Result<PolicyLimits> limitsFromJson(const json& j) {
  PolicyLimits l;
  auto it = j.find("limits");
  if (it == j.end() || it->is_null()) return l;
  if (!it->is_object()) return invalidArg("limits", "limits must be an object");
  // The same ranges as a sandbox's own limits and an exec's options.
  struct Num {
    const char* key;
    double min, max;
    bool integer;
  };
  const Num nums[] = {{"cpu", 0.05, 64, false},
                      {"memory_mb", 16, 262144, true},
                      {"pids", 16, 65536, true},
                      {"max_output_bytes", 0, 64 << 20, true},
                      {"max_exec_timeout_s", 0.001, 86400, false}};
  for (auto& [k, v] : it->items()) {
    const Num* n = nullptr;
    for (auto& x : nums) {
      if (k == x.key) n = &x;
    }
    std::string field = "limits." + k;
    if (!n) return invalidArg(field, "unknown limit '" + k + "'");
    if (!v.is_number() || (n->integer && !v.is_number_integer())) {
      return invalidArg(field, field + " must be a" + (n->integer ? "n integer" : " number"));
    }
    double d = v.get<double>();
    if (d < n->min || d > n->max) {
      char range[64];
      snprintf(range, sizeof range, "%g and %g", n->min, n->max);
      return invalidArg(field, field + " must be between " + range);
    }
    if (k == "cpu") l.cpu = d;
    if (k == "memory_mb") l.memoryMb = v.get<int64_t>();
    if (k == "pids") l.pids = v.get<int64_t>();
    if (k == "max_output_bytes") l.maxOutputBytes = v.get<int64_t>();
    if (k == "max_exec_timeout_s") l.maxExecTimeoutS = d;
  }
  return l;
}

Result<Policy> fromJson(const json& j, bool fromApi) {
  static const char* kKeys[] = {"name", "description", "readonly_paths", "hidden_paths", "egress",
                                "dns",  "limits",      "syscalls",       "created_at",   "builtin"};
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
  ASSIGN_OR_RETURN(p.readonlyPaths, getStringList(j, "readonly_paths"));
  RETURN_IF_ERROR(validatePolicyPaths(p.readonlyPaths, "readonly_paths"));
  ASSIGN_OR_RETURN(p.hiddenPaths, getStringList(j, "hidden_paths"));
  RETURN_IF_ERROR(validatePolicyPaths(p.hiddenPaths, "hidden_paths"));
  ASSIGN_OR_RETURN(p.egress, getStringList(j, "egress"));
  RETURN_IF_ERROR(validateEgress(p.egress, "egress"));
  ASSIGN_OR_RETURN(p.dns, getStringList(j, "dns"));
  RETURN_IF_ERROR(validateDns(p.dns, "dns"));
  ASSIGN_OR_RETURN(p.limits, limitsFromJson(j));
  if (auto sc = j.find("syscalls"); sc != j.end() && !sc->is_null()) {
    if (!sc->is_string() || (*sc != "default" && *sc != "strict")) {
      return invalidArg("syscalls", "syscalls must be \"default\" or \"strict\"");
    }
    p.syscalls = sc->get<std::string>();
  }
  if (auto c = j.find("created_at"); c != j.end() && c->is_number()) p.createdAt = *c;
  return p;
}

}  // namespace

json limitsToJson(const PolicyLimits& l) {
  json j = json::object();
  if (l.cpu > 0) j["cpu"] = l.cpu;
  if (l.memoryMb > 0) j["memory_mb"] = l.memoryMb;
  if (l.pids > 0) j["pids"] = l.pids;
  if (l.maxOutputBytes > 0) j["max_output_bytes"] = l.maxOutputBytes;
  if (l.maxExecTimeoutS > 0) j["max_exec_timeout_s"] = l.maxExecTimeoutS;
  return j;
}

json Policy::toJson() const {
  return {{"name", name},
          {"description", description},
          {"readonly_paths", readonlyPaths},
          {"hidden_paths", hiddenPaths},
          {"egress", egress},
          {"dns", dns},
          {"limits", limitsToJson(limits)},
          {"syscalls", syscalls},
          {"builtin", builtin},
          {"created_at", createdAt}};
}

std::vector<Policy> builtinPolicies(const std::vector<std::string>& setupEgress,
                                    const std::vector<std::string>& setupDns) {
  auto make = [](const char* name, const char* description) {
    Policy p;
    p.name = name;
    p.description = description;
    p.builtin = true;
    return p;
  };
  std::vector<Policy> out;
  out.push_back(make("default", "closed: no egress; the sandbox may change any of its own files"));
  out.push_back(make("setup",
                     "preparing a workplace: egress only to the operator's allow-list (dsec up "
                     "--setup-egress, --setup-dns; none unless given)"));
  out.back().egress = setupEgress;
  out.back().dns = setupDns;
  out.push_back(
      make("rollout", "an agent at work: no egress; the sandbox may change any of its own files"));
  out.push_back(make("eval",
                     "grading: no egress; system paths read-only for every process whatever its "
                     "uid (no replacing /bin/bash or a library); more paths may be hidden or made "
                     "read-only; the strict syscall profile"));
  out.back().readonlyPaths = kSystemPaths;
  out.back().syscalls = "strict";
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
  std::vector<proto::EgressEntry> addrs;
  for (size_t i = 0; i < entries.size(); ++i) {
    auto e = proto::parseEgressEntry(entries[i], field);
    if (!e.isOk()) return e.status();
    if (e->host.empty()) addrs.push_back(*e);
  }
  // Catches too many port ranges on nested prefixes now, not at apply time.
  if (auto r = proto::compileEgress(addrs, field); !r.isOk()) return r.status();
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

PolicyLimits Policies::limitsOf(const std::string& name) const {
  for (const auto& p : builtins_) {
    if (p.name == name) return p.limits;
  }
  std::lock_guard lk(mu_);
  auto it = custom_.find(name);
  return it == custom_.end() ? PolicyLimits{} : it->second.limits;
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
