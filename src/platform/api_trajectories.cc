// The trajectories resource (Chronus, platform/chronus.h): list, export as
// JSON lines, delete.
#include "common/log.h"
#include "common/util.h"
#include "platform/api_util.h"
#include "platform/platform.h"

namespace dsec::platform {

void Platform::listTrajectories(http::Response& res) {
  auto list = store_->listTrajectories();
  if (!list.isOk()) return sendError(res, list.status());
  json arr = json::array();
  for (auto& t : *list) {
    arr.push_back({{"id", t.id},
                   {"steps", t.steps},
                   {"first_at", isoTime(t.firstAt)},
                   {"last_at", isoTime(t.lastAt)}});
  }
  sendJson(res, 200, dumpJson(json{{"trajectories", arr}}));
}

// One JSON object per step, in step order: the request as it was made, the
// result as it was returned (JSON, or base64 for file bytes), and timings:
// training data.
void Platform::exportTrajectory(const std::string& id, http::Response& res) {
  auto steps = store_->loadTrajectory(id);
  if (!steps.isOk()) return sendError(res, steps.status());
  if (steps->empty()) return sendError(res, notFound("trajectory " + id + " not found"));
  std::string out;
  for (auto& s : *steps) {
    json line = {{"trajectory_id", s.trajectory},
                 {"step", s.step},
                 {"kind", s.kind},
                 {"sandbox", s.sandbox},
                 {"digest", s.digest},
                 {"request", json::parse(s.request, nullptr, false)},
                 {"status", s.status},
                 {"started_at", isoTime(s.startedAt)},
                 {"duration_ms", (s.finishedAt - s.startedAt) * 1000}};
    json result =
        s.contentType == "application/json" ? json::parse(s.body, nullptr, false) : json(nullptr);
    if (result.is_discarded() || result.is_null()) {
      line["result_b64"] = base64Encode(s.body);
    } else {
      line["result"] = result;
    }
    out += dumpJson(line) + "\n";
  }
  (void)res.send(200, "application/x-ndjson", out);
}

void Platform::deleteTrajectory(const std::string& id, http::Response& res) {
  auto n = store_->deleteTrajectory(id);
  if (!n.isOk()) return sendError(res, n.status());
  if (*n == 0) return sendError(res, notFound("trajectory " + id + " not found"));
  log::info("trajectory " + id + " deleted (" + std::to_string(*n) + " steps)");
  sendJson(res, 200, dumpJson(json{{"deleted_steps", *n}}));
}

}  // namespace dsec::platform
