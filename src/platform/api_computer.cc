// Computer use on a sandbox with a display (backend vm, docs/vm.md):
// GET /v1/sandboxes/{id}/screenshot (image/png) and
// POST /v1/sandboxes/{id}/input (type, key, mouse).
#include "platform/api_util.h"
#include "platform/platform.h"

namespace dsec::platform {

void Platform::screenshot(const std::string& id, http::Response& res) {
  auto rec = runningSandbox(id);
  if (!rec.isOk()) return sendError(res, rec.status());
  if (rec->backend != BackendKind::kVm) {
    return sendError(res, Status(Code::kFailedPrecondition,
                                 "sandbox " + id + " (backend " + proto::backendName(rec->backend) +
                                     ") has no display: screenshots need backend vm"));
  }
  auto png = cluster_->screenshot(id);
  if (!png.isOk()) return sendError(res, png.status());
  (void)res.send(200, "image/png", *png);  // a client gone meanwhile is not ours to report
}

void Platform::sendInput(const std::string& id, http::Request& req, http::Response& res) {
  auto j = parseObject(req, {"type", "text", "key", "x", "y", "button"});
  if (!j.isOk()) return sendError(res, j.status());
  auto rec = runningSandbox(id);
  if (!rec.isOk()) return sendError(res, rec.status());
  if (rec->backend != BackendKind::kVm) {
    return sendError(res, Status(Code::kFailedPrecondition,
                                 "sandbox " + id + " (backend " + proto::backendName(rec->backend) +
                                     ") has no display: input needs backend vm"));
  }
  proto::InputAction a;
  auto type = getString(*j, "type", "", 16);
  if (!type.isOk()) return sendError(res, type.status());
  a.kind = *type;
  if (a.kind == "type") {
    auto text = getString(*j, "text", "", 4096);
    if (!text.isOk()) return sendError(res, text.status());
    if (text->empty()) return sendError(res, invalidArg("text", "text is required"));
    a.text = *text;
  } else if (a.kind == "key") {
    auto key = getString(*j, "key", "", 128);
    if (!key.isOk()) return sendError(res, key.status());
    if (key->empty()) return sendError(res, invalidArg("key", "key is required, e.g. ctrl+c"));
    a.key = *key;
  } else if (a.kind == "mouse") {
    for (auto [field, out] : {std::pair{"x", &a.x}, std::pair{"y", &a.y}}) {
      if (!j->contains(field)) return sendError(res, invalidArg(field, std::string(field) + " is required"));
      auto v = getInt(*j, field, 0, 0, 16384);
      if (!v.isOk()) return sendError(res, v.status());
      *out = int(*v);
    }
    auto button = getString(*j, "button", "", 16);
    if (!button.isOk()) return sendError(res, button.status());
    a.button = *button;
  } else {
    return sendError(res, invalidArg("type", "type must be type, key or mouse"));
  }
  if (Status st = cluster_->input(id, a); !st.isOk()) return sendError(res, st);
  sendJson(res, 200, json{{"ok", true}}.dump());
}

}  // namespace dsec::platform
