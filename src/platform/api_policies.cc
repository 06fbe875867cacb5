// The policies resource: built-ins and user-defined security policies.
#include <netdb.h>
#include <sys/socket.h>

#include <cstring>

#include "common/log.h"
#include "proto/egress.h"
#include "platform/api_util.h"
#include "platform/platform.h"
#include "platform/policy.h"

namespace dsec::platform {

using proto::EgressEntry;

void Platform::listPolicies(http::Response& res) {
  json arr = json::array();
  for (const auto& p : policies_->list()) arr.push_back(p.toJson());
  sendJson(res, 200, dumpJson(json{{"policies", arr}}));
}

void Platform::getPolicy(const std::string& name, http::Response& res) {
  auto p = policies_->find(name, "name");
  if (!p.isOk()) return sendError(res, notFound("policy " + name + " not found"));
  sendJson(res, 200, dumpJson(p->toJson()));
}

void Platform::createPolicy(http::Request& req, http::Response& res) {
  auto j =
      parseObject(req, {"name", "description", "readonly_paths", "hidden_paths", "egress", "dns",
                             "limits", "syscalls"});
  if (!j.isOk()) return sendError(res, j.status());
  auto p = policies_->create(*j);
  if (!p.isOk()) return sendError(res, p.status());
  log::info("policy " + p->name + " created");
  sendJson(res, 201, dumpJson(p->toJson()));
}

void Platform::deletePolicy(const std::string& name, http::Response& res) {
  {
    // A live sandbox's next phase switch or restart must find its policy.
    std::lock_guard lk(mu_);
    for (auto& [id, r] : sandboxes_) {
      if (r.policy == name && r.state != SandboxState::kStopped && r.state != SandboxState::kFailed) {
        return sendError(res, Status(Code::kConflict,
                                     "policy " + name + " is in use by sandbox " + id, 0, "name"));
      }
    }
  }
  if (Status st = policies_->remove(name); !st.isOk()) return sendError(res, st);
  log::info("policy " + name + " deleted");
  sendJson(res, 200, "{}");
}

Result<std::vector<proto::EgressRule>> Platform::egressRules(const Policy& p) {
  std::vector<EgressEntry> entries;
  for (auto& text : p.egress) {
    ASSIGN_OR_RETURN(EgressEntry e, proto::parseEgressEntry(text, "egress"));
    if (e.host.empty()) {
      entries.push_back(e);
      continue;
    }
    // Host names are the platform's to resolve, here, at the switch: the
    // sandbox never gets a resolver it was not given.
    addrinfo hints{};
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* res = nullptr;
    int rc = getaddrinfo(e.host.c_str(), nullptr, &hints, &res);
    if (rc != 0) {
      return Status(
          Code::kFailedPrecondition,
          "policy " + p.name + ": cannot resolve egress host '" + e.host + "': " + gai_strerror(rc),
          0, "egress");
    }
    for (addrinfo* a = res; a; a = a->ai_next) {
      EgressEntry x = e;
      x.host.clear();
      x.family = a->ai_family;
      x.addr = {};
      if (a->ai_family == AF_INET) {
        std::memcpy(x.addr.data(), &reinterpret_cast<sockaddr_in*>(a->ai_addr)->sin_addr, 4);
        x.prefixLen = 32;
      } else if (a->ai_family == AF_INET6) {
        std::memcpy(x.addr.data(), &reinterpret_cast<sockaddr_in6*>(a->ai_addr)->sin6_addr, 16);
        x.prefixLen = 128;
      } else {
        continue;
      }
      entries.push_back(x);
    }
    freeaddrinfo(res);
  }
  for (auto& server : p.dns) {
    ASSIGN_OR_RETURN(
        EgressEntry e,
        proto::parseEgressEntry(
            server.find(':') != std::string::npos ? "[" + server + "]:53" : server + ":53", "dns"));
    entries.push_back(e);
  }
  return proto::compileEgress(entries, "egress");
}

}  // namespace dsec::platform
