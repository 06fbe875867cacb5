// /v1/blobs and /v1/images.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/fd.h"
#include "common/sha256.h"
#include "common/util.h"
#include "platform/api_util.h"
#include "platform/platform.h"

namespace dsec::platform {

namespace {

bool validDigest(const std::string& d) {
  if (d.size() != 71 || !startsWith(d, "sha256:")) return false;
  for (size_t i = 7; i < d.size(); ++i) {
    if (!isxdigit(static_cast<unsigned char>(d[i])) || isupper(static_cast<unsigned char>(d[i]))) {
      return false;
    }
  }
  return true;
}

json imageToApi(const ImageRecord& r) {
  return {{"name", r.name},     {"tag", r.tag},   {"ref", r.name + ":" + r.tag},
          {"layers", r.layers}, {"size", r.size}, {"created_at", isoTime(r.createdAt)}};
}

}  // namespace

void Platform::putBlob(const std::string& digest, http::Request& req, http::Response& res) {
  if (!validDigest(digest)) {
    return sendError(res, invalidArg("digest", "digest must be sha256:<64 lower-case hex>"));
  }
  std::string final = blobPath(opts_.dataDir, digest);
  std::string tmp = final + ".upload." + randomHex(4);
  UniqueFd fd(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600));
  if (!fd) return sendError(res, sysError("create " + tmp));
  Sha256 h;
  int64_t size = 0;
  std::string buf(1 << 20, '\0');
  Status st;
  for (;;) {
    auto n = req.readSome(buf.data(), buf.size());
    if (!n.isOk()) {
      st = n.status();
      break;
    }
    if (*n == 0) break;
    h.update(buf.data(), *n);
    if (::write(fd.get(), buf.data(), *n) != ssize_t(*n)) {
      st = sysError("write " + tmp);
      break;
    }
    size += int64_t(*n);
  }
  if (st.isOk() && ::fsync(fd.get()) != 0) st = sysError("fsync " + tmp);
  fd.reset();
  if (st.isOk()) {
    std::string got = "sha256:" + h.hexDigest();
    if (got != digest) st = invalidArg("digest", "body hashes to " + got + ", not " + digest);
  }
  if (st.isOk() && ::rename(tmp.c_str(), final.c_str()) != 0) st = sysError("rename " + tmp);
  if (!st.isOk()) {
    ::unlink(tmp.c_str());
    return sendError(res, st);
  }
  if (Status ps = store_->putBlob(digest, size); !ps.isOk()) return sendError(res, ps);
  sendJson(res, 201, json{{"digest", digest}, {"size", size}}.dump());
}

void Platform::headBlob(const std::string& digest, http::Response& res) {
  if (!validDigest(digest)) {
    return sendError(res, invalidArg("digest", "digest must be sha256:<64 lower-case hex>"));
  }
  auto size = store_->blobSize(digest);
  if (!size.isOk()) return sendError(res, size.status());
  sendJson(res, 200, json{{"digest", digest}, {"size", *size}}.dump());
}

void Platform::createImage(http::Request& req, http::Response& res) {
  auto j = parseObject(req, {"name", "tag", "layers"});
  if (!j.isOk()) return sendError(res, j.status());
  auto name = getString(*j, "name", "", 200);
  if (!name.isOk()) return sendError(res, name.status());
  auto tag = getString(*j, "tag", "latest", 128);
  if (!tag.isOk()) return sendError(res, tag.status());
  ImageRecord r;
  if (Status st = parseImageRef(*name + ":" + *tag, r.name, r.tag); !st.isOk()) {
    return sendError(res, invalidArg(name->empty() ? "name" : "tag", st.message()));
  }
  if (r.name != *name) return sendError(res, invalidArg("name", "name must not contain ':'"));
  auto layers = j->find("layers");
  if (layers == j->end() || !layers->is_array() || layers->empty() || layers->size() > 128) {
    return sendError(res, invalidArg("layers", "layers must be a list of 1 to 128 digests"));
  }
  for (auto& l : *layers) {
    if (!l.is_string() || !validDigest(l.get<std::string>())) {
      return sendError(res, invalidArg("layers", "each layer must be sha256:<64 hex>"));
    }
    auto size = store_->blobSize(l.get<std::string>());
    if (!size.isOk()) {
      return sendError(res, invalidArg("layers", "layer " + l.get<std::string>() +
                                                     " has not been uploaded"));
    }
    r.layers.push_back(l.get<std::string>());
    r.size += *size;
  }
  r.createdAt = nowSeconds();
  if (Status st = store_->putImage(r); !st.isOk()) return sendError(res, st);
  sendJson(res, 201, imageToApi(r).dump());
}

void Platform::listImages(http::Response& res) {
  auto imgs = store_->listImages();
  if (!imgs.isOk()) return sendError(res, imgs.status());
  json arr = json::array();
  for (auto& r : *imgs) arr.push_back(imageToApi(r));
  sendJson(res, 200, json{{"images", arr}}.dump());
}

void Platform::getImage(const std::string& ref, http::Response& res) {
  std::string name, tag;
  if (Status st = parseImageRef(ref, name, tag); !st.isOk()) return sendError(res, st);
  auto img = store_->getImage(name, tag);
  if (!img.isOk()) return sendError(res, img.status());
  sendJson(res, 200, imageToApi(*img).dump());
}

void Platform::deleteImage(const std::string& ref, http::Response& res) {
  std::string name, tag;
  if (Status st = parseImageRef(ref, name, tag); !st.isOk()) return sendError(res, st);
  std::string full = name + ":" + tag;
  std::string user;
  {
    std::lock_guard lk(mu_);
    for (auto& [id, r] : sandboxes_) {
      if (r.image == full && !isFinal(r.state)) {
        user = id;
        break;
      }
    }
  }
  if (!user.empty()) {
    return sendError(res, Status(Code::kFailedPrecondition,
                                 "image " + full + " is in use by sandbox " + user));
  }
  if (Status st = store_->deleteImage(name, tag); !st.isOk()) return sendError(res, st);
  sendJson(res, 200, "{}");
}

}  // namespace dsec::platform
