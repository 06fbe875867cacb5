// JSON forms of what crosses the platform-edge hop (docs/cluster.md): the
// edge's internal API (edge_server.cc) and its client (platform/remote_edge.cc)
// share them, so both ends agree by construction.
#pragma once

#include <nlohmann/json.hpp>
#include <string>

#include "common/status.h"
#include "edge/edge_link.h"

namespace dsec::edge::wire {

using json = nlohmann::json;

json toJson(const SandboxSpec& s);
Result<SandboxSpec> specFromJson(const json& j);
json toJson(const ExecSpec& s);
Result<ExecSpec> execFromJson(const json& j);
json toJson(const ExecResult& r);
ExecResult resultFromJson(const json& j);
json toJson(const net::EgressRule& r);
json toJson(const InputAction& a);
Result<InputAction> inputFromJson(const json& j);
Result<net::EgressRule> ruleFromJson(const json& j);
// {"error": {"code", "message", "field"?}}
json errorJson(const Status& st);
// The Status an error body (or, failing that, an HTTP status) stands for.
Status statusFromBody(int httpStatus, const std::string& body);
Code codeFromName(const std::string& name);

}  // namespace dsec::edge::wire
