// JSON forms of what crosses the platform-edge hop (docs/cluster.md): the
// edge's side of the link (edge/edge_server.cc) and the platform's
// (platform/remote_edge.cc) share them, so both ends agree by construction.
// Decoders never throw: a malformed field is kInvalidArgument naming it.
#pragma once

#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "common/status.h"
#include "image/layer_builder.h"
#include "proto/types.h"

namespace dsec::proto {

using json = nlohmann::json;

json toJson(const SandboxSpec& s);
Result<SandboxSpec> specFromJson(const json& j);
json toJson(const ExecSpec& s);
Result<ExecSpec> execFromJson(const json& j);
// {"rows": R, "cols": C}; kInvalidArgument naming `field` (not an object)
// or "rows"/"cols" (missing or out of 1..65535).
Result<TermSize> termSizeFromJson(const json& j, const std::string& field);
json toJson(const ExecResult& r);
Result<ExecResult> resultFromJson(const json& j);
json toJson(const EgressRule& r);
Result<EgressRule> ruleFromJson(const json& j);
json toJson(const InputAction& a);
Result<InputAction> inputFromJson(const json& j);
json toJson(const CgroupLimits& l);
Result<CgroupLimits> limitsFromJson(const json& j);
json toJson(const CgroupStats& s);
Result<CgroupStats> statsFromJson(const json& j);
// {interval_s, samples: [[t, cpu_usec, memory_bytes, pids], ...]} (compact:
// an hour is 240 of them per sandbox).
json toJson(const StatsSeries& s);
Result<StatsSeries> seriesFromJson(const json& j);
json toJson(const EgressDenials& d);
Result<EgressDenials> denialsFromJson(const json& j);
// A built layer's digests and sizes (not its local paths).
json toJson(const image::BuiltLayer& l);
Result<image::BuiltLayer> builtLayerFromJson(const json& j);
// What a node needs to fetch and mount a layer (GET /internal/v1/layers/…):
// {digest, size, data_digest, data_size, chunks_digest,
//  extra_data: [{digest, size, chunks_digest}]} (extra_data in EROFS device
// order; absent or [] for a layer with none).
json toJson(const LayerDesc& d);
Result<LayerDesc> layerDescFromJson(const json& j);

// The init frame's "fncall" object of a fncall sandbox with a scratch of
// `scratchBytes`: the node's languages besides python and bash, and the calls
// a python zygote forks (0: aether's default). Built by whoever places the
// sandbox, so every node of a cluster runs it the same way.
std::string fncallInitJson(int64_t scratchBytes,
                           const std::map<std::string, std::vector<std::string>>& languages,
                           int64_t zygoteMaxCalls);

// {"error": {"code", "message", "field"?, "errno"?}}
json errorJson(const Status& st);
// The Status an error object ({"code", "message", ...}) stands for.
Status statusFromError(const json& error);
// The Status an error body (or, failing that, an HTTP status) stands for.
Status statusFromBody(int httpStatus, const std::string& body);
// kInternal for a name no Code has.
Code codeFromName(const std::string& name);

}  // namespace dsec::proto
