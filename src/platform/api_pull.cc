// POST /v1/images/pull: an image from an OCI registry, its layers made dsec
// layers once per cluster (pull_manager.h), progress streamed as NDJSON.
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <future>
#include <map>

#include "common/log.h"
#include "common/sha256.h"
#include "common/util.h"
#include "image/layer_converter.h"
#include "image/oci_import.h"
#include "image/registry_client.h"
#include "platform/api_util.h"
#include "platform/platform.h"
#include "platform/pull_manager.h"

namespace dsec::platform {

namespace {

json sourceJson(const image::ResolvedImage& r) {
  return {{"ref", r.ref.str()},
          {"repository", r.ref.host + "/" + r.ref.repository},
          {"index_digest", r.indexDigest},
          {"manifest_digest", r.manifestDigest},
          {"config_digest", r.configDigest},
          {"platform", r.platform}};
}

json sourceOf(const ImageRecord& r) {
  if (r.source.empty()) return nullptr;
  json j = json::parse(r.source, nullptr, false);
  return j.is_discarded() ? json(nullptr) : j;
}

std::string sourceField(const ImageRecord& r, const char* key) {
  json j = sourceOf(r);
  if (!j.is_object()) return "";
  auto it = j.find(key);
  return it != j.end() && it->is_string() ? it->get<std::string>() : "";
}

json layerEvent(const LayerProgress& p) {
  json j = {{"type", "layer"},   {"digest", p.digest}, {"status", layerPhaseName(p.phase)},
            {"bytes", p.bytes},  {"total", p.total}};
  if (!p.layer.empty()) j["layer"] = p.layer;
  return j;
}

json errorEvent(const Status& st) {
  json e = {{"code", codeName(st.code())}, {"message", st.message()}};
  if (!st.field().empty()) e["field"] = st.field();
  return {{"type", "error"}, {"error", e}};
}

}  // namespace

std::shared_ptr<image::ChunkSource> Platform::chunkSource() {
  // Every blob answered is held (lookupChunkAndHold) until the source goes,
  // after the layer pointing into it is recorded with it as an extra blob.
  class Source final : public image::ChunkSource {
   public:
    explicit Source(Platform* p) : p_(p) {}
    ~Source() override { p_->releaseChunkHolds(held_); }
    Result<std::optional<Location>> find(const std::string& sha, uint64_t length) override {
      ASSIGN_OR_RETURN(auto loc, p_->lookupChunkAndHold(sha, int64_t(length)));
      if (!loc) return std::optional<Location>();
      held_.push_back(loc->data);
      auto size = sizes_.find(loc->data);
      if (size == sizes_.end()) {
        auto rec = p_->store_->getBlob(loc->data);
        if (!rec.isOk()) {
          if (rec.status().code() == Code::kNotFound) return std::optional<Location>();
          return rec.status();
        }
        size = sizes_.emplace(loc->data, uint64_t(rec->size)).first;
      }
      return std::optional{Location{loc->data, size->second, loc->block}};
    }

   private:
    Platform* p_;
    std::vector<std::string> held_;
    std::map<std::string, uint64_t> sizes_;
  };
  return std::make_shared<Source>(this);
}

Result<image::ConvertedLayer> Platform::convertPulledLayer(const std::string& spool,
                                                          const image::RegistryLayer& layer,
                                                          const std::string& work) {
  // Streamed from the compressed spool into EROFS: nothing is extracted.
  // fetchBlob checked the spool against the layer's digest as it came, and
  // nothing reads the diff_id: neither is hashed again.
  image::TarLayerOptions topts;
  topts.hashInput = false;
  topts.hashDiffId = false;
  // Chunks any earlier layer stored are pointed at, not stored again.
  std::shared_ptr<image::ChunkSource> shared = chunkSource();
  topts.shared = shared.get();
  auto c = image::convertTarFile(spool, layer.compression, work, topts);
  if (!c.isOk()) {
    Status st = c.status();
    return Status(st.code(), st.message(), st.sysErrno(), st.field() == "layer" ? "ref" : st.field());
  }
  c->sourceDigest = layer.digest;
  c->sharedFrom = std::move(shared);
  return c;
}

Status Platform::storeConvertedLayer(const image::ConvertedLayer& c) {
  // Renamed into the store as pack_diff's layers are; the same bytes made
  // again by another pull are simply the same blob. The chunk index made
  // while converting saves reading the data blob again.
  const image::BuiltLayer& layer = c.layer;
  const std::string dataPath = blobPath(opts_.dataDir, layer.dataDigest);
  ASSIGN_OR_RETURN(BlobHold hold, moveLayerIntoStore(layer));
  RETURN_IF_ERROR(linkBlob(layer.dataDigest, layer.dataSize, ""));
  if (auto rec = store_->getBlob(layer.dataDigest); rec.isOk() && rec->chunks.empty()) {
    RETURN_IF_ERROR(writeFileAtomic(dataPath + ".chunks", c.chunkIndex, 0600));
    RETURN_IF_ERROR(store_->setBlobChunks(layer.dataDigest, "sha256:" + sha256Hex(c.chunkIndex)));
  }
  // Where its chunks are, for the layers converted after it.
  std::vector<ChunkLoc> chunks;
  chunks.reserve(c.stored.size());
  for (const auto& s : c.stored) chunks.push_back({s.sha, s.length, layer.dataDigest, s.block});
  RETURN_IF_ERROR(store_->putChunks(layer.dataDigest, chunks));
  // Known here from now on (another replica learns them at its next start).
  chunkKeys_.add(chunks);
  return linkBlob(layer.digest, layer.size, layer.dataDigest, c.extraData, c.extraReads);
}

Status Platform::commitPulledLayer(const image::ConvertedLayer& c, const std::string& source) {
  RETURN_IF_ERROR(storeConvertedLayer(c));
  return store_->setBlobSource(c.layer.digest, source);
}

std::optional<std::string> Platform::pulledLayer(const std::string& source) {
  auto digest = store_->findLayerBySource(source);
  if (!digest.isOk()) return std::nullopt;
  auto blob = store_->getBlob(*digest);
  if (!blob.isOk()) return std::nullopt;
  if (!blob->data.empty()) {
    auto has = store_->hasBlob(blob->data);
    if (!has.isOk() || !*has) return std::nullopt;
  }
  struct stat st;
  if (::stat(blobPath(opts_.dataDir, *digest).c_str(), &st) != 0) return std::nullopt;
  return *digest;
}

std::string Platform::workTag() const {
  // Per replica (its id), in a form no other id's tag starts with.
  return sha256Hex(opts_.replicaId).substr(0, 8);
}

void Platform::startPulls() {
  PullHooks hooks;
  hooks.knownLayer = [this](const std::string& source) { return pulledLayer(source); };
  hooks.convert = [this](const std::string& spool, const image::RegistryLayer& l,
                         const std::string& work) { return convertPulledLayer(spool, l, work); };
  hooks.commit = [this](const image::ConvertedLayer& b, const std::string& source) {
    return commitPulledLayer(b, source);
  };
  // Replicas on one store fetch each registry layer once between them.
  std::string holder = (opts_.replicaId.empty() ? "platform" : opts_.replicaId) + "/" + randomHex(4);
  hooks.claim = [this, holder](const std::string& source, double ttlS) {
    return store_->acquireLease("pull-layer:" + source, holder, ttlS);
  };
  hooks.unclaim = [this, holder](const std::string& source) {
    if (Status st = store_->releaseLease("pull-layer:" + source, holder); !st.isOk()) {
      log::warn("pull: releasing the claim on " + source + ": " + st.toString());
    }
  };
  // Work a crash cut short, before any starts: build context spools (this
  // data dir's own), and conversion and build-step directories (this
  // replica's, in the shared blob directory; never another replica's).
  const std::string tag = workTag(), blobs = opts_.dataDir + "/blobs";
  (void)removeTree(opts_.dataDir + "/build");
  if (auto names = dirEntries(blobs); names.isOk()) {
    for (auto& n : *names) {
      if ((startsWith(n, "pull-" + tag + "-") || startsWith(n, "build-" + tag + "-")) &&
          removeTree(blobs + "/" + n).isOk()) {
        log::info("removed " + blobs + "/" + n + " (work a crash left)");
      }
    }
  }
  pulls_ = std::make_unique<PullManager>(opts_.dataDir + "/pull", blobs + "/pull-" + tag,
                                         std::move(hooks), opts_.pullWorkers);
}

Result<ImageRecord> Platform::finishPull(ImageRecord r, const image::ResolvedImage& resolved,
                                         const std::vector<std::string>& layers) {
  ASSIGN_OR_RETURN(r.config, image::parseImageConfig(resolved.config, "the image config"));
  r.kind = "base";
  r.layers = layers;
  r.size = 0;
  r.source = sourceJson(resolved).dump();
  r.createdAt = nowSeconds();
  // Held (against other replicas' collections too), then seen under gcMu_.
  ASSIGN_OR_RETURN(auto holds, holdLayers(r.layers));
  std::lock_guard gc(gcMu_);  // a collection must not take the layers meanwhile
  for (auto& d : r.layers) {
    ASSIGN_OR_RETURN(BlobRecord blob, store_->getBlob(d));
    if (!blob.kind.empty() && blob.kind != r.kind) {
      return Status(Code::kConflict, "layer " + d + " is a " + blob.kind + " layer, not base");
    }
    r.size += blob.size;
  }
  for (auto& d : r.layers) RETURN_IF_ERROR(store_->setBlobKind(d, r.kind));
  RETURN_IF_ERROR(store_->putImage(r));
  return r;
}

image::RegistryOptions Platform::registryOptions(const image::RegistryRef& ref) const {
  image::RegistryOptions ro;
  ro.caFile = opts_.registryCa;
  ro.insecureHosts = opts_.insecureRegistries;
  // A tenant's reference must not reach the platform's own network (SSRF),
  // unless the operator allowed that registry.
  auto listed = [&](const std::vector<std::string>& hosts) {
    return std::find(hosts.begin(), hosts.end(), ref.host) != hosts.end();
  };
  if (!currentCaller().admin && !listed(opts_.registryAllow) &&
      !listed(opts_.insecureRegistries)) {
    ro.allowAddress = publicAddress;
  }
  if (!opts_.registryAuth.empty()) {
    auto c = image::credentialsFromDockerConfig(opts_.registryAuth, ref.host);
    if (c.isOk() && *c) ro.credentials = **c;
  }
  return ro;
}

std::optional<ImageRecord> Platform::pulledAlready(const std::string& name, const std::string& tag,
                                                   const std::string& manifestDigest) {
  auto have = store_->getImage(name, tag);
  if (!have.isOk() || sourceField(*have, "manifest_digest") != manifestDigest) return std::nullopt;
  for (auto& l : have->layers) {
    auto has = store_->hasBlob(l);
    if (!has.isOk() || !*has) return std::nullopt;
  }
  return *have;
}

Result<ImageRecord> Platform::pullAndWait(const image::RegistryRef& ref,
                                          const image::ImagePlatform& platform, ImageRecord target,
                                          const image::RegistryOptions& ro) {
  auto client = std::make_shared<image::RegistryClient>(ro);
  ASSIGN_OR_RETURN(image::ResolvedImage resolved, client->resolve(ref, platform));
  if (auto have = pulledAlready(target.name, target.tag, resolved.manifestDigest)) return *have;
  std::promise<Result<std::vector<std::string>>> done;
  auto layers = done.get_future();
  pulls_->pullLayers(client, resolved, nullptr,
                     [&done](Result<std::vector<std::string>> r) { done.set_value(std::move(r)); });
  ASSIGN_OR_RETURN(std::vector<std::string> got, layers.get());
  ASSIGN_OR_RETURN(ImageRecord made, finishPull(std::move(target), resolved, got));
  log::info("pulled " + resolved.ref.str() + " as " + made.name + ":" + made.tag);
  return made;
}

Result<ImageRecord> Platform::pullOnCreate(const std::string& name, const std::string& tag) {
  // Only a reference that names its registry ("127.0.0.1:5000/app",
  // "ghcr.io/org/app"): a bare "debian" missing locally is a plain 404, not a
  // trip to Docker Hub.
  size_t slash = name.find('/');
  std::string first = name.substr(0, slash);
  if (slash == std::string::npos ||
      (first.find('.') == std::string::npos && first.find(':') == std::string::npos &&
       first != "localhost")) {
    return notFound("image " + name + ":" + tag + " not found");
  }
  ASSIGN_OR_RETURN(image::RegistryRef ref, image::parseRegistryRef(name + ":" + tag));
  ImageRecord r;
  r.name = name;
  r.tag = tag;
  r.owner = currentCaller().tenant;
  RETURN_IF_ERROR(mayWriteImage(r));
  return pullAndWait(ref, image::ImagePlatform{}, std::move(r), registryOptions(ref));
}

void Platform::pullImage(http::Request& req, http::Response& res) {
  auto j = parseObject(req, {"ref", "name", "tag", "platform", "insecure_registry", "auth",
                             "visibility"});
  if (!j.isOk()) return sendError(res, j.status());
  auto refText = getString(*j, "ref", "", 512);
  if (!refText.isOk()) return sendError(res, refText.status());
  if (refText->empty()) return sendError(res, invalidArg("ref", "ref is required"));
  auto ref = image::parseRegistryRef(*refText);
  if (!ref.isOk()) return sendError(res, ref.status());
  auto platText = getString(*j, "platform", "linux/amd64", 64);
  if (!platText.isOk()) return sendError(res, platText.status());
  auto platform = image::parseImagePlatform(*platText);
  if (!platform.isOk()) return sendError(res, platform.status());
  auto insecure = getBool(*j, "insecure_registry", false);
  if (!insecure.isOk()) return sendError(res, insecure.status());

  // The local name: the repository with its host, as Docker shows it; an
  // image pulled by digest alone is tagged with the digest.
  std::string defTag = !ref->tag.empty() ? ref->tag : "sha256-" + ref->digest.substr(7);
  auto name = getString(*j, "name", ref->host + "/" + ref->repository, 200);
  if (!name.isOk()) return sendError(res, name.status());
  auto tag = getString(*j, "tag", defTag, 128);
  if (!tag.isOk()) return sendError(res, tag.status());
  ImageRecord r;
  if (Status st = parseImageRef(*name + ":" + *tag, r.name, r.tag); !st.isOk()) {
    return sendError(res, invalidArg(j->contains("tag") ? "tag" : "name", st.message()));
  }
  if (r.name != *name) return sendError(res, invalidArg("name", "name must not contain a tag"));
  {
    auto vis = getString(*j, "visibility", "", 16);
    if (!vis.isOk()) return sendError(res, vis.status());
    r.owner = currentCaller().tenant;
    r.visibility = *vis;
    if (Status st = mayWriteImage(r); !st.isOk()) return sendError(res, st);
  }

  image::RegistryOptions ro = registryOptions(*ref);
  if (*insecure) ro.insecureHosts.push_back(ref->host);
  if (auto a = j->find("auth"); a != j->end() && !a->is_null()) {
    auto creds = parseObjectText(a->dump(), {"username", "password", "identity_token"});
    if (!creds.isOk() || !a->is_object()) {
      return sendError(res, invalidArg("auth", "auth must be {username, password} or "
                                               "{identity_token}"));
    }
    image::RegistryCredentials c;
    auto u = getString(*creds, "username", "", 256);
    auto p = getString(*creds, "password", "", 4096);
    auto t = getString(*creds, "identity_token", "", 8192);
    if (!u.isOk() || !p.isOk() || !t.isOk() || (u->empty() != p->empty()) ||
        (u->empty() && t->empty())) {
      return sendError(res, invalidArg("auth", "auth must be {username, password} or "
                                               "{identity_token}"));
    }
    c.username = *u;
    c.password = *p;
    c.identityToken = *t;
    ro.credentials = c;
  }
  auto client = std::make_shared<image::RegistryClient>(ro);
  auto resolved = client->resolve(*ref, *platform);
  if (!resolved.isOk()) return sendError(res, resolved.status());

  auto d = res.defer();
  (void)d->beginChunked(200, "application/x-ndjson");
  auto send = [d](const json& ev) { (void)d->write(dumpJson(ev) + "\n"); };
  json layersJson = json::array();
  for (auto& l : resolved->layers) {
    layersJson.push_back({{"digest", l.digest}, {"size", l.size}, {"media_type", l.mediaType}});
  }
  send({{"type", "resolved"},
        {"ref", resolved->ref.str()},
        {"manifest_digest", resolved->manifestDigest},
        {"index_digest", resolved->indexDigest},
        {"platform", resolved->platform},
        {"layers", layersJson}});

  // Pulled before, under this name, and the registry still says the same:
  // nothing to do.
  if (auto have = pulledAlready(r.name, r.tag, resolved->manifestDigest)) {
    send({{"type", "done"}, {"unchanged", true}, {"image", imageToApi(*have)}});
    (void)d->finish();
    return;
  }
  auto img = std::make_shared<image::ResolvedImage>(std::move(resolved).value());
  pulls_->pullLayers(
      client, *img, [send](const LayerProgress& p) { send(layerEvent(p)); },
      [this, d, send, img, r](Result<std::vector<std::string>> layers) {
        Result<ImageRecord> made =
            layers.isOk() ? finishPull(r, *img, *layers) : Result<ImageRecord>(layers.status());
        if (made.isOk()) {
          log::info("pulled " + img->ref.str() + " as " + made->name + ":" + made->tag);
          send({{"type", "done"}, {"unchanged", false}, {"image", imageToApi(*made)}});
        } else {
          send(errorEvent(made.status()));
        }
        (void)d->finish();
      });
}

void Platform::writeImageMetrics(metrics::Writer& w) {
  // The store's blobs against what the images would take with nothing
  // shared: the ratio is what content addressing saves.
  auto blobs = store_->listBlobs();
  auto images = store_->listImages();
  if (blobs.isOk() && images.isOk()) {
    std::map<std::string, const BlobRecord*> byDigest;
    double stored = 0;
    for (auto& b : *blobs) {
      byDigest[b.digest] = &b;
      stored += double(b.storedBytes());
    }
    double logical = 0;
    for (auto& img : *images) {
      for (auto& d : img.layers) {
        auto it = byDigest.find(d);
        if (it == byDigest.end()) continue;
        logical += double(it->second->size);
        if (auto data = byDigest.find(it->second->data); data != byDigest.end()) {
          logical += double(data->second->size);
        }
        // Blobs of other layers it reads chunks from, as imageBytes counts them.
        for (auto& x : it->second->extraData) {
          if (auto e = byDigest.find(x); e != byDigest.end()) logical += double(e->second->size);
        }
      }
    }
    w.gauge("dsec_blobs_stored_bytes", "Bytes of every blob in the platform's blob store.", stored);
    w.gauge("dsec_images_logical_bytes",
            "Bytes the images' layers would take with nothing shared (each image's layers, "
            "metadata and data, counted for every image naming them).",
            logical);
    w.gauge("dsec_images", "Images (name:tag) in the store.", double(images->size()));
  }
  ChunkKeys::Stats ck = chunkKeys_.stats();
  const char* lookupsHelp =
      "Chunk lookups of layer conversions (pulls, build steps), by who answered: the in-memory "
      "chunk key set (absent: known new, no store query) or the store.";
  w.counter("dsec_chunk_lookups_total", lookupsHelp, double(ck.absent), {{"answer", "absent"}});
  w.counter("dsec_chunk_lookups_total", lookupsHelp, double(ck.passed), {{"answer", "store"}});
  w.gauge("dsec_chunk_keys",
          "Chunk keys held in memory (chunks stored, as far as this replica knows).",
          double(ck.keys));
  w.gauge("dsec_chunk_keys_loaded",
          "1 once the chunk keys are loaded from the store (before: every lookup asks the store).",
          ck.loaded ? 1 : 0);
  if (!pulls_) return;
  PullStats s = pulls_->stats();
  const char* help =
      "Registry layers a pull needed, by how they were had: fetched (downloaded and converted), "
      "reused (converted before), joined (another pull was fetching it), awaited (another "
      "replica fetched it while this one waited), failed.";
  w.counter("dsec_pull_layers_total", help, double(s.layersFetched), {{"result", "fetched"}});
  w.counter("dsec_pull_layers_total", help, double(s.layersReused), {{"result", "reused"}});
  w.counter("dsec_pull_layers_total", help, double(s.layersJoined), {{"result", "joined"}});
  w.counter("dsec_pull_layers_total", help, double(s.layersAwaited), {{"result", "awaited"}});
  w.counter("dsec_pull_layers_total", help, double(s.failures), {{"result", "failed"}});
  w.counter("dsec_pull_bytes_total", "Bytes downloaded from registries (compressed layers).",
            double(s.bytesFetched));
  w.gauge("dsec_pull_layers_in_flight", "Registry layers being fetched or converted now.",
          double(s.inFlight));
}

}  // namespace dsec::platform
