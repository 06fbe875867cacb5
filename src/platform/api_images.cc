// /v1/blobs and /v1/images.
#include <fcntl.h>
#include <linux/falloc.h>
#include <stdio.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <map>
#include <optional>
#include <set>
#include <thread>

#include "common/fd.h"
#include "common/log.h"
#include "common/sha256.h"
#include "common/util.h"
#include "image/block_ranges.h"
#include "image/chunk_index.h"
#include "image/layer_builder.h"
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


// BlobRecord::extraReads as stored: one BlockRanges text per extra blob,
// joined by ";" ("" for none: not known). readsOf reads it back.
std::string extraReadsColumn(const std::vector<image::BlockRanges>& reads) {
  std::string out;
  for (size_t i = 0; i < reads.size(); ++i) out += (i ? ";" : "") + reads[i].format();
  return out;
}

// What layer `l` reads of its extra blob `data` (BlobRecord::extraReads),
// nullopt when not recorded or unreadable.
std::optional<image::BlockRanges> readsOf(const BlobRecord& l, const std::string& data) {
  if (l.extraReads.empty()) return std::nullopt;
  auto parts = splitString(l.extraReads, ';');
  auto at = std::find(l.extraData.begin(), l.extraData.end(), data);
  if (parts.size() != l.extraData.size() || at == l.extraData.end()) return std::nullopt;
  auto r = image::BlockRanges::parse(parts[size_t(at - l.extraData.begin())]);
  if (!r.isOk()) return std::nullopt;
  return *r;
}

// A data blob gc took chunks out of cannot be a layer's own data.
Status partialDataBlob(const std::string& data) {
  return Status(Code::kFailedPrecondition,
                "data blob " + data + " is partial (gc reclaimed chunks of it): upload it again", 0,
                "data");
}

bool validKind(const std::string& k) {
  return k == "base" || k == "workspace" || k == "toolkit" || k == "diff" || k == "disk";
}

}  // namespace

json imageToApi(const ImageRecord& r) {
  json j = {{"name", r.name}, {"tag", r.tag},   {"ref", r.name + ":" + r.tag},
            {"kind", r.kind}, {"layers", r.layers}, {"size", r.size},
            {"created_at", isoTime(r.createdAt)}};
  json parent = r.parent.empty() ? json(nullptr) : json::parse(r.parent, nullptr, false);
  j["parent"] = parent.is_discarded() ? json(nullptr) : parent;
  j["config"] = imageConfigToApi(r.config);
  j["owner"] = r.owner.empty() ? kAdminTenant : r.owner;
  j["visibility"] = r.visibility;
  json source = r.source.empty() ? json(nullptr) : json::parse(r.source, nullptr, false);
  j["source"] = source.is_discarded() ? json(nullptr) : source;
  return j;
}

void Platform::putBlob(const std::string& digest, http::Request& req, http::Response& res) {
  if (!validDigest(digest)) {
    return sendError(res, invalidArg("digest", "digest must be sha256:<64 lower-case hex>"));
  }
  // ?data=sha256:… : this blob is a layer's metadata image whose file data is
  // in that (already uploaded) blob.
  std::string data = req.param("data").value_or("");
  // The data blob is held from before it is checked until the layer naming
  // it is linked: no collection (of any replica) deletes it or takes chunks
  // out of it in between.
  std::optional<BlobHold> dataHold;
  if (!data.empty()) {
    if (!validDigest(data) || data == digest) {
      return sendError(res, invalidArg("data", "data must be the sha256 digest of another blob"));
    }
    if (Status st = holdBlob(data); !st.isOk()) return sendError(res, st);
    dataHold.emplace(this, data);
    auto rec = store_->getBlob(data);
    if (!rec.isOk() && rec.status().code() != Code::kNotFound) return sendError(res, rec.status());
    if (!rec.isOk()) return sendError(res, invalidArg("data", "data blob " + data + " not uploaded"));
    if (!rec->reclaimed.empty()) return sendError(res, partialDataBlob(data));
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
  // Held from before the rename until it is linked (which starts its grace
  // period): no collection punches the new bytes in between. Under gcMu_
  // for the rename: a blob an earlier collection left partial is whole
  // again, and no collection is halfway through removing chunks from it.
  std::optional<BlobHold> hold;
  if (st.isOk()) {
    st = holdBlob(digest);
    if (st.isOk()) hold.emplace(this, digest);
  }
  if (st.isOk()) {
    std::lock_guard gc(gcMu_);
    if (::rename(tmp.c_str(), final.c_str()) != 0) st = sysError("rename " + tmp);
    if (st.isOk()) st = markBlobWholeLocked(digest);
  }
  if (!st.isOk()) {
    ::unlink(tmp.c_str());
    return sendError(res, st);
  }
  if (Status ps = linkBlob(digest, size, data); !ps.isOk()) return sendError(res, ps);
  sendJson(res, 201, json{{"digest", digest}, {"size", size}}.dump());
}

Status Platform::linkBlob(const std::string& digest, int64_t size, const std::string& data,
                          const std::vector<std::string>& extraData,
                          const std::vector<image::BlockRanges>& extraReads) {
  if (!extraReads.empty() && extraReads.size() != extraData.size()) {
    return invalidArg("extra_reads", "layer " + digest + " has " +
                                         std::to_string(extraData.size()) + " extra data blobs but " +
                                         std::to_string(extraReads.size()) + " read sets");
  }
  std::lock_guard gc(gcMu_);
  // The extras are checked before anything is written. Under gcMu_ no
  // collection runs, so what is checked here stays until the layer keeps it.
  if (!extraData.empty() && data.empty()) {
    return invalidArg("extra_data", "layer " + digest + " has extra data blobs but no data blob");
  }
  std::set<std::string> seen{data};
  for (auto& x : extraData) {
    if (x == digest || !seen.insert(x).second) {
      return invalidArg("extra_data", "layer " + digest + " names " + x +
                                          " twice among its data blobs (or as itself)");
    }
    auto blob = store_->getBlob(x);
    if (!blob.isOk() && blob.status().code() == Code::kNotFound) {
      return notFound("extra data blob " + x + " of layer " + digest + " is not stored");
    }
    if (!blob.isOk()) return blob.status();
    if (blob->kind != "data") {
      return Status(Code::kFailedPrecondition,
                    "extra data blob " + x + " of layer " + digest + " is not a data blob (kind " +
                        (blob->kind.empty() ? std::string("unset") : blob->kind) + ")");
    }
  }
  if (!data.empty()) {
    // A layer's own data must be whole (gc reclaims chunks only of blobs no
    // layer owns): one an upload skipped because it existed is sent again.
    auto blob = store_->getBlob(data);
    if (blob.isOk() && !blob->reclaimed.empty()) return partialDataBlob(data);
  }
  RETURN_IF_ERROR(store_->putBlob(digest, size));
  if (data.empty()) return Status::ok();
  auto blob = store_->getBlob(data);
  if (!blob.isOk()) return blob.status();
  if (!blob->kind.empty() && blob->kind != "data") {
    return Status(Code::kConflict, data + " is a " + blob->kind + " layer, not a data blob");
  }
  RETURN_IF_ERROR(store_->setBlobKind(data, "data"));
  RETURN_IF_ERROR(ensureChunkIndex(store_, opts_.dataDir, data).status());
  // The extras before the data: a layer found with its data has its extras.
  if (!extraData.empty()) {
    RETURN_IF_ERROR(store_->setBlobExtraData(digest, extraData));
    RETURN_IF_ERROR(store_->setBlobExtraReads(digest, extraReadsColumn(extraReads)));
  }
  return store_->setBlobData(digest, data);
}

Result<Platform::BlobHold> Platform::moveLayerIntoStore(const image::BuiltLayer& l) {
  if (l.dataDigest.empty()) {
    std::lock_guard gc(gcMu_);
    if (::rename(l.path.c_str(), blobPath(opts_.dataDir, l.digest).c_str()) != 0) {
      return sysError("move a layer into the blob store");
    }
    return BlobHold(nullptr, "");
  }
  // The hold first (it may wait out another replica's collection), then the
  // rename under gcMu_.
  RETURN_IF_ERROR(holdBlob(l.dataDigest));
  BlobHold hold(this, l.dataDigest);
  std::lock_guard gc(gcMu_);
  if (::rename(l.dataPath.c_str(), blobPath(opts_.dataDir, l.dataDigest).c_str()) != 0 ||
      ::rename(l.path.c_str(), blobPath(opts_.dataDir, l.digest).c_str()) != 0) {
    return sysError("move a layer into the blob store");
  }
  RETURN_IF_ERROR(markBlobWholeLocked(l.dataDigest));
  return hold;
}

Result<std::vector<Platform::BlobHold>> Platform::holdLayers(
    const std::vector<std::string>& layers) {
  std::vector<BlobHold> holds;
  for (auto& d : std::set<std::string>(layers.begin(), layers.end())) {
    RETURN_IF_ERROR(holdBlob(d));
    holds.emplace_back(this, d);
  }
  return holds;
}

Status Platform::markBlobWholeLocked(const std::string& digest) {
  auto rec = store_->getBlob(digest);
  if (!rec.isOk()) return rec.status().code() == Code::kNotFound ? Status::ok() : rec.status();
  if (rec->reclaimed.empty()) return Status::ok();
  log::info("blob " + digest + " is whole again (gc had reclaimed " + rec->reclaimed + ")");
  return store_->setBlobReclaimed(digest, "");
}

namespace {
// On a store shared with other replicas, a hold is also a lease, so that
// their collectors see it: one per (blob, replica), taken with the
// replica's first hold on the blob and given up with its last. A replica
// that dies leaves it to lapse.
constexpr double kChunkHoldLeaseTtlS = 6 * 3600;
const std::string kChunkHoldLeasePrefix = "chunk-hold:";
// And a collector about to delete a blob or punch chunks out of it takes
// "blob-collect:<blob>" before it checks for holds, while a holder checks
// for that lease after taking its hold: whichever comes second sees the
// other (a holder waits the collection out; a collector skips a held blob).
const std::string kCollectLeasePrefix = "blob-collect:";
constexpr double kCollectLeaseTtlS = 120;
constexpr double kCollectWaitS = 60;
}  // namespace

Result<std::optional<ChunkLoc>> Platform::lookupChunkAndHold(const std::string& sha,
                                                             int64_t length) {
  // Most chunks a conversion asks for are new: the set answers those with no
  // store query. Its "maybe" goes on to the store, the truth. A set missing
  // chunks another replica stored since it was loaded only loses this
  // dedup chance (the converter stores the bytes itself); keys of chunks gc
  // has since forgotten only cost the query (chunk_keys.h).
  if (!chunkKeys_.mayContain(sha, length)) return std::optional<ChunkLoc>();
  ASSIGN_OR_RETURN(std::optional<ChunkLoc> loc, store_->findChunk(sha, length));
  if (!loc) return loc;
  RETURN_IF_ERROR(holdBlob(loc->data));
  // Held, then seen again: see collectGarbage for why this order is safe.
  auto again = store_->findChunk(sha, length);
  if (again.isOk() && *again && (*again)->data == loc->data && (*again)->block == loc->block) {
    return loc;
  }
  releaseChunkHolds({loc->data});
  if (!again.isOk()) return std::move(again).takeStatus();
  return std::optional<ChunkLoc>();
}

Status Platform::holdBlob(const std::string& data) {
  {
    std::lock_guard lk(chunkHoldMu_);
    // The lease is in the store before this hold counts: a second hold of the
    // same blob cannot go ahead of it.
    if (store_->shared() && !chunkHolds_.count(data)) {
      ASSIGN_OR_RETURN(bool mine,
                       store_->acquireLease(kChunkHoldLeasePrefix + data + "/" + opts_.replicaId,
                                            opts_.replicaId, kChunkHoldLeaseTtlS));
      if (!mine) return internalError("chunk hold on " + data + " taken by another holder");
    }
    chunkHolds_.insert(data);
  }
  if (!store_->shared()) return Status::ok();
  // A collector (of any replica) that looked for holds before this one was
  // visible may be deleting the blob or punching chunks out of it: the hold
  // counts once it is done.
  const double deadline = monoSeconds() + kCollectWaitS;
  for (;;) {
    auto leases = store_->listLeases();
    if (!leases.isOk()) {
      releaseChunkHolds({data});
      return leases.status();
    }
    bool collecting = false;
    for (auto& l : *leases) collecting |= l.live && l.name == kCollectLeasePrefix + data;
    if (!collecting) return Status::ok();
    if (monoSeconds() > deadline) {
      releaseChunkHolds({data});
      return Status(Code::kUnavailable, "blob " + data + " is being collected; try again");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

Result<bool> Platform::beginCollect(const std::string& data) {
  if (!store_->shared()) return true;
  return store_->acquireLease(kCollectLeasePrefix + data, opts_.replicaId, kCollectLeaseTtlS);
}

Result<std::optional<Platform::CollectClaim>> Platform::claimForCollection(
    const std::string& digest) {
  ASSIGN_OR_RETURN(bool mine, beginCollect(digest));
  if (!mine) return std::optional<CollectClaim>();
  CollectClaim claim(this, digest);
  ASSIGN_OR_RETURN(bool held, blobHeld(digest));
  if (held) return std::optional<CollectClaim>();
  return std::optional<CollectClaim>(std::move(claim));
}

void Platform::endCollect(const std::string& data) {
  if (!store_->shared()) return;
  if (Status st = store_->releaseLease(kCollectLeasePrefix + data, opts_.replicaId); !st.isOk()) {
    log::warn("gc: " + data + ": " + st.toString() + " (the lease lapses by itself)");
  }
}

Result<bool> Platform::blobHeld(const std::string& data) {
  {
    std::lock_guard lk(chunkHoldMu_);
    if (chunkHolds_.count(data)) return true;
  }
  if (store_->shared()) {
    // Another replica's converter may hold it.
    ASSIGN_OR_RETURN(auto leases, store_->listLeases());
    for (auto& l : leases) {
      if (l.live && startsWith(l.name, kChunkHoldLeasePrefix + data + "/")) return true;
    }
  }
  return false;
}

void Platform::releaseChunkHolds(const std::vector<std::string>& blobs) {
  std::lock_guard lk(chunkHoldMu_);
  for (auto& b : blobs) {
    auto it = chunkHolds_.find(b);
    if (it == chunkHolds_.end()) continue;
    chunkHolds_.erase(it);
    if (store_->shared() && !chunkHolds_.count(b)) {
      if (Status st = store_->releaseLease(kChunkHoldLeasePrefix + b + "/" + opts_.replicaId,
                                           opts_.replicaId);
          !st.isOk()) {
        log::warn("chunk hold on " + b + ": " + st.toString() + " (it lapses by itself)");
      }
    }
  }
}

Result<bool> Platform::deleteBlobUnlessHeld(const std::string& digest, bool dataBlob) {
  RETURN_IF_ERROR(store_->deleteChunksOf(digest));
  ASSIGN_OR_RETURN(auto claim, claimForCollection(digest));
  if (!claim) return false;
  // Named again since the listing? Another replica's converter may have
  // linked a layer pointing into it (its hold already gone); under the
  // lease with no hold live, no new one can. (One replica alone: linkBlob
  // waits for gcMu_, so the listing is still true.)
  // And a layer an image another replica stored since names (image makers
  // hold their layers first: holdLayers).
  if (store_->shared()) {
    ASSIGN_OR_RETURN(auto naming,
                     dataBlob ? store_->layersNaming(digest) : store_->imagesNaming(digest));
    if (!naming.empty()) return false;
  }
  RETURN_IF_ERROR(store_->deleteBlob(digest));
  std::string path = blobPath(opts_.dataDir, digest);
  if (::unlink(path.c_str()) != 0 && errno != ENOENT) log::warn("unlink " + path);
  ::unlink((path + ".chunks").c_str());
  return true;
}

Result<std::string> Platform::ensureChunkIndex(Store* store, const std::string& dataDir,
                                               const std::string& dataDigest) {
  ASSIGN_OR_RETURN(BlobRecord rec, store->getBlob(dataDigest));
  if (!rec.chunks.empty()) return rec.chunks;
  std::string path = blobPath(dataDir, dataDigest);
  ASSIGN_OR_RETURN(image::ChunkIndex idx, image::ChunkIndex::build(path, image::kChunkSize));
  std::string bytes = idx.serialize();
  RETURN_IF_ERROR(writeFileAtomic(path + ".chunks", bytes, 0600));
  std::string digest = "sha256:" + sha256Hex(bytes);
  RETURN_IF_ERROR(store->setBlobChunks(dataDigest, digest));
  return digest;
}

Result<proto::LayerDesc> Platform::describeLayer(Store* store, const std::string& dataDir,
                                                const std::string& digest) {
  ASSIGN_OR_RETURN(BlobRecord rec, store->getBlob(digest));
  proto::LayerDesc d;
  d.digest = digest;
  d.size = rec.size;
  if (rec.data.empty()) return d;  // a single-file layer (stored before the split)
  ASSIGN_OR_RETURN(BlobRecord data, store->getBlob(rec.data));
  d.dataDigest = rec.data;
  d.dataSize = data.size;
  ASSIGN_OR_RETURN(d.chunksDigest, ensureChunkIndex(store, dataDir, rec.data));
  for (auto& x : rec.extraData) {
    auto blob = store->getBlob(x);
    if (!blob.isOk() && blob.status().code() == Code::kNotFound) {
      // The layer's chunks point into it: without it the layer cannot be read.
      return Status(Code::kDataLoss,
                    "layer " + digest + " points into data blob " + x + ", which is not stored");
    }
    if (!blob.isOk()) return blob.status();
    proto::DataBlobDesc xd;
    xd.digest = x;
    xd.size = blob->size;
    xd.reclaimed = blob->reclaimed;
    ASSIGN_OR_RETURN(xd.chunksDigest, ensureChunkIndex(store, dataDir, x));
    d.extraData.push_back(std::move(xd));
  }
  return d;
}

Result<std::vector<std::string>> Platform::layersOfRef(Store* store, const std::string& ref) {
  if (startsWith(ref, "sha256:")) {
    if (!validDigest(ref)) return invalidArg("prestage", "invalid layer digest " + ref);
    RETURN_IF_ERROR(store->getBlob(ref).status());
    return std::vector<std::string>{ref};
  }
  std::string name, tag;
  RETURN_IF_ERROR(parseImageRef(ref, name, tag));
  ASSIGN_OR_RETURN(ImageRecord img, store->getImage(name, tag));
  return img.layers;
}

void Platform::headBlob(const std::string& digest, http::Response& res) {
  if (!validDigest(digest)) {
    return sendError(res, invalidArg("digest", "digest must be sha256:<64 lower-case hex>"));
  }
  auto rec = store_->getBlob(digest);
  if (!rec.isOk()) return sendError(res, rec.status());
  // A data blob gc took chunks out of is not all there: an uploader that
  // skips what exists sends it again, whole.
  if (!rec->reclaimed.empty()) {
    return sendError(res, notFound("blob " + digest + " is partial (gc reclaimed chunks of it)"));
  }
  sendJson(res, 200, json{{"digest", digest}, {"size", rec->size}}.dump());
}

void Platform::createImage(http::Request& req, http::Response& res) {
  auto j = parseObject(req, {"name", "tag", "layers", "kind", "from", "config", "visibility"});
  if (!j.isOk()) return sendError(res, j.status());
  auto name = getString(*j, "name", "", 200);
  if (!name.isOk()) return sendError(res, name.status());
  auto tag = getString(*j, "tag", "latest", 128);
  if (!tag.isOk()) return sendError(res, tag.status());
  auto from = getString(*j, "from", "", 330);
  if (!from.isOk()) return sendError(res, from.status());
  ImageRecord r;
  if (Status st = parseImageRef(*name + ":" + *tag, r.name, r.tag); !st.isOk()) {
    return sendError(res, invalidArg(name->empty() ? "name" : "tag", st.message()));
  }
  if (r.name != *name) return sendError(res, invalidArg("name", "name must not contain ':'"));
  {
    auto vis = getString(*j, "visibility", "", 16);
    if (!vis.isOk()) return sendError(res, vis.status());
    r.owner = currentCaller().tenant;
    r.visibility = *vis;
    if (Status st = mayWriteImage(r); !st.isOk()) return sendError(res, st);
  }
  if (!from->empty()) {
    // Tagging: the new name points at the same layers, with the same kind
    // and config.
    if (j->contains("layers") || j->contains("kind") || j->contains("config")) {
      return sendError(res, invalidArg("from", "give either from, or layers (kind, config)"));
    }
    std::string fname, ftag;
    if (Status st = parseImageRef(*from, fname, ftag); !st.isOk()) {
      return sendError(res, invalidArg("from", st.message()));
    }
    auto src = visibleImage(fname, ftag);
    if (!src.isOk()) return sendError(res, src.status());
    r.layers = src->layers;
    r.size = src->size;
    r.kind = src->kind;
    r.config = src->config;
  } else {
    auto kind = getString(*j, "kind", "base", 16);
    if (!kind.isOk()) return sendError(res, kind.status());
    if (!validKind(*kind)) {
      return sendError(res,
                       invalidArg("kind", "kind must be base, workspace, toolkit, diff or disk"));
    }
    r.kind = *kind;
    if (auto config = j->find("config"); config != j->end()) {
      auto parsed = parseImageConfig(*config);
      if (!parsed.isOk()) return sendError(res, parsed.status());
      r.config = std::move(parsed).value();
    }
    auto layers = j->find("layers");
    if (layers == j->end() || !layers->is_array() || layers->empty() || layers->size() > 128) {
      return sendError(res, invalidArg("layers", "layers must be a list of 1 to 128 digests"));
    }
    // A disk image (backend vm, docs/vm.md) is one bootable qcow2/raw blob.
    if (r.kind == "disk" && layers->size() != 1) {
      return sendError(res, invalidArg("layers", "a disk image is exactly one blob"));
    }
    for (auto& l : *layers) {
      if (!l.is_string() || !validDigest(l.get<std::string>())) {
        return sendError(res, invalidArg("layers", "each layer must be sha256:<64 hex>"));
      }
      auto blob = store_->getBlob(l.get<std::string>());
      if (blob.isOk()) {
        if (Status st = layerUsable(blob->digest, "layers"); !st.isOk()) {
          return sendError(res, invalidArg("layers", "layer " + l.get<std::string>() +
                                                         " has not been uploaded"));
        }
      }
      if (!blob.isOk()) {
        return sendError(res, invalidArg("layers", "layer " + l.get<std::string>() +
                                                       " has not been uploaded"));
      }
      if (!blob->kind.empty() && blob->kind != r.kind) {
        return sendError(res, Status(Code::kConflict, "layer " + blob->digest + " is a " +
                                                          blob->kind + " layer, not " + r.kind));
      }
      r.layers.push_back(blob->digest);
      r.size += blob->size;
    }
  }
  r.createdAt = nowSeconds();
  auto holds = holdLayers(r.layers);  // against collections of other replicas too
  if (!holds.isOk()) return sendError(res, holds.status());
  {
    std::lock_guard gc(gcMu_);  // a collection must not remove the layers meanwhile
    for (auto& d : r.layers) {
      auto has = store_->hasBlob(d);
      if (!has.isOk()) return sendError(res, has.status());
      if (!*has) return sendError(res, invalidArg("layers", "layer " + d + " has not been uploaded"));
      if (Status st = store_->setBlobKind(d, r.kind); !st.isOk()) return sendError(res, st);
    }
    if (Status st = store_->putImage(r); !st.isOk()) return sendError(res, st);
  }
  sendJson(res, 201, imageToApi(r).dump());
}

void Platform::packDiff(const std::string& id, http::Request& req, http::Response& res) {
  auto parsed = parseObject(req, {"name", "tag", "trajectory_id", "step"});
  if (!parsed.isOk()) return sendError(res, parsed.status());
  json j = *parsed;
  auto key = Chronus::parseKey(j.contains("trajectory_id") ? &j["trajectory_id"] : nullptr,
                               j.contains("step") ? &j["step"] : nullptr);
  if (!key.isOk()) return sendError(res, key.status());
  j.erase("trajectory_id");
  j.erase("step");
  auto name = getString(j, "name", "", 200);
  if (!name.isOk()) return sendError(res, name.status());
  auto tag = getString(j, "tag", "latest", 128);
  if (!tag.isOk()) return sendError(res, tag.status());
  ImageRecord img;
  if (Status st = parseImageRef(*name + ":" + *tag, img.name, img.tag); !st.isOk()) {
    return sendError(res, invalidArg(name->empty() ? "name" : "tag", st.message()));
  }
  if (img.name != *name) return sendError(res, invalidArg("name", "name must not contain ':'"));
  {
    // The snapshot belongs to the sandbox's owner; private unless an admin
    // packs its own sandbox.
    std::lock_guard lk(mu_);
    auto it = sandboxes_.find(id);
    if (it == sandboxes_.end()) return sendError(res, notFound("sandbox " + id + " not found"));
    img.owner = it->second.owner;
    img.visibility =
        currentCaller().admin && img.owner == currentCaller().tenant ? "public" : "private";
  }
  // A checkpoint named by the SDK's default (chronus/<trajectory>) goes under
  // a user tenant's own prefix, where its images must live: the SDK does not
  // know the caller's tenant.
  if (*key && !currentCaller().admin && startsWith(img.name, "chronus/")) {
    img.name = currentCaller().tenant + "/" + img.name;
  }
  if (Status st = mayWriteImage(img); !st.isOk()) return sendError(res, st);
  if (!*key) {
    auto made = packDiffImage(id, std::move(img));
    if (!made.isOk()) return sendError(res, made.status());
    return sendJson(res, 201, imageToApi(*made).dump());
  }
  // A checkpoint: a trajectory step like an exec. Its result (the image and
  // its layers) is kept; a repeat returns it without packing a new layer.
  // The request is what was asked, tag defaulted, so the digest is stable.
  json request = {{"name", img.name}, {"tag", img.tag}};
  const std::string sid = routeStep(id, (*key)->trajectory);
  auto out = chronus_->once(**key, "checkpoint", sid, request, [&]() -> Result<StepOutcome> {
    ASSIGN_OR_RETURN(ImageRecord made, packDiffImage(sid, img));
    return StepOutcome{201, "application/json", imageToApi(made).dump()};
  });
  if (!out.isOk()) return sendError(res, out.status());
  if (!out->replayed) noteStepSandbox((*key)->trajectory, sid);
  sendStep(res, **key, *out);
}

Result<ImageRecord> Platform::packDiffImage(const std::string& id, ImageRecord img) {
  ASSIGN_OR_RETURN(SandboxRecord sb, runningSandbox(id));
  // Built beside the blob store, so the result is renamed into it, not copied.
  std::string work = opts_.dataDir + "/blobs/pack-" + randomHex(6);
  auto layer = cluster_->packDiff(id, work);
  if (!layer.isOk()) {
    (void)removeTree(work);
    return layer.status();
  }
  if (layer->kind == "disk") return packDiskImage(sb, *layer, work, std::move(img));
  auto hold = moveLayerIntoStore(*layer);
  (void)removeTree(work);
  RETURN_IF_ERROR(hold.status());
  RETURN_IF_ERROR(linkBlob(layer->dataDigest, layer->dataSize, ""));
  RETURN_IF_ERROR(linkBlob(layer->digest, layer->size, layer->dataDigest));
  // A snapshot is the sandbox's own diffs plus this one, on the same stack.
  img.kind = "diff";
  for (auto& ref : sb.diffs) {
    ASSIGN_OR_RETURN(auto layers, resolveLayers(ref, "diff", "diffs"));
    img.layers.insert(img.layers.end(), layers.begin(), layers.end());
  }
  img.layers.push_back(layer->digest);
  for (auto& d : img.layers) {
    auto size = store_->blobSize(d);
    if (size.isOk()) img.size += *size;
  }
  img.parent = json{{"image", sb.image}, {"workspaces", sb.workspaces},
                    {"toolkits", sb.toolkits}}.dump();
  img.createdAt = nowSeconds();
  ASSIGN_OR_RETURN(auto holds, holdLayers(img.layers));
  {
    std::lock_guard gc(gcMu_);
    auto blob = store_->getBlob(layer->digest);
    if (blob.isOk() && !blob->kind.empty() && blob->kind != "diff") {
      return Status(Code::kConflict,
                    "the diff equals an existing " + blob->kind + " layer " + layer->digest);
    }
    for (auto& d : img.layers) {
      RETURN_IF_ERROR(store_->getBlob(d).status());  // still stored
      RETURN_IF_ERROR(store_->setBlobKind(d, "diff"));
    }
    RETURN_IF_ERROR(store_->putImage(img));
  }
  return img;
}

Result<ImageRecord> Platform::packDiskImage(const SandboxRecord& sb, const image::BuiltLayer& disk,
                                            const std::string& work, ImageRecord img) {
  // A vm's snapshot is a whole disk image (docs/vm.md): one blob of kind
  // disk, which boots like an imported one.
  Status st;
  if (::rename(disk.path.c_str(), blobPath(opts_.dataDir, disk.digest).c_str()) != 0) {
    st = sysError("move the disk image into the blob store");
  }
  (void)removeTree(work);
  RETURN_IF_ERROR(st);
  RETURN_IF_ERROR(linkBlob(disk.digest, disk.size, ""));
  img.kind = "disk";
  img.layers = {disk.digest};
  img.size = disk.size;
  img.parent = json{{"image", sb.image}}.dump();
  img.createdAt = nowSeconds();
  std::lock_guard gc(gcMu_);
  auto blob = store_->getBlob(disk.digest);
  if (blob.isOk() && !blob->kind.empty() && blob->kind != "disk") {
    return Status(Code::kConflict, "the disk equals an existing " + blob->kind + " layer");
  }
  RETURN_IF_ERROR(store_->setBlobKind(disk.digest, "disk"));
  RETURN_IF_ERROR(store_->putImage(img));
  return img;
}

std::set<std::string> Platform::layersInUse() {
  std::set<std::string> out;
  std::lock_guard lk(mu_);
  for (auto& [id, r] : sandboxes_) {
    if (!isFinal(r.state)) out.insert(r.layers.begin(), r.layers.end());
  }
  return out;
}

Result<std::vector<std::string>> Platform::resolveLayers(const std::string& ref,
                                                         const std::string& kind,
                                                         const std::string& field) {
  if (startsWith(ref, "sha256:")) {
    if (!validDigest(ref)) return invalidArg(field, "invalid layer digest " + ref);
    auto blob = store_->getBlob(ref);
    if (!blob.isOk()) return notFound("layer " + ref + " not found");
    RETURN_IF_ERROR(layerUsable(ref, field));
    if (!kind.empty() && !blob->kind.empty() && blob->kind != kind) {
      return invalidArg(field, ref + " is a " + blob->kind + " layer, not a " + kind);
    }
    return std::vector<std::string>{ref};
  }
  std::string name, tag;
  if (Status st = parseImageRef(ref, name, tag); !st.isOk()) return invalidArg(field, st.message());
  auto img = visibleImage(name, tag);
  if (!img.isOk()) return std::move(img).takeStatus();
  if (!kind.empty() && img->kind != kind) {
    return invalidArg(field, name + ":" + tag + " is a " + img->kind + " image, not a " + kind);
  }
  return img->layers;
}

Result<Platform::GcResult> Platform::collectGarbage(double graceS) {
  std::lock_guard gc(gcMu_);
  ASSIGN_OR_RETURN(auto blobs, store_->listBlobs());
  ASSIGN_OR_RETURN(auto images, store_->listImages());
  std::set<std::string> keep = layersInUse();
  // Layers pulls in flight made or found, not yet in an image.
  if (pulls_) keep.merge(pulls_->heldLayers());
  for (auto& i : images) keep.insert(i.layers.begin(), i.layers.end());
  double now = nowSeconds();
  // The build cache's layers (api_build.cc) stay while their entries are
  // used: a week after the last build that hit them.
  constexpr double kBuildCacheKeepS = 7 * 86400;
  ASSIGN_OR_RETURN(auto cached, store_->buildCacheLayers(now - kBuildCacheKeepS));
  keep.merge(cached);
  if (auto pruned = store_->deleteBuildCacheBefore(now - kBuildCacheKeepS); !pruned.isOk()) {
    log::warn("gc: build cache: " + pruned.status().toString());
  }
  // A layer's data blob, and the other layers' data blobs its chunks point
  // into (extraData), live as long as the layer.
  std::set<std::string> keepData;
  for (auto& b : blobs) {
    bool young = b.createdAt + graceS > now;
    if (!keep.count(b.digest) && !young) continue;
    if (!b.data.empty()) keepData.insert(b.data);
    keepData.insert(b.extraData.begin(), b.extraData.end());
  }
  // Unmounted first: a layer still mounted for a sandbox is in use after all,
  // and so are its data and extra data blobs.
  std::vector<const BlobRecord*> doomed;
  for (auto& b : blobs) {
    if (keep.count(b.digest) || keepData.count(b.digest) || b.createdAt + graceS > now) continue;
    if (cluster_->evictLayer(b.digest).isOk()) {
      doomed.push_back(&b);
      continue;
    }
    if (!b.data.empty()) keepData.insert(b.data);
    keepData.insert(b.extraData.begin(), b.extraData.end());
  }
  // Why a converter's chunk hold protects a blob (lookupChunkAndHold): the
  // converter (1) finds chunk row R in blob D, (2) holds D, (3) finds R again;
  // the collector (a) deletes D's rows, (b) checks for holds on D, (c) deletes
  // D only if there is none. If the converter uses D, (3) saw R, so (3) came
  // before (a): then (2) came before (b) and the collector sees the hold and
  // keeps D. If (a) came first, (3) finds no R and the converter does not use
  // D. The hold is released only after linkBlob (which waits for gcMu_) has
  // recorded the layer naming D, which keeps D from then on. A blob kept for
  // a hold has lost its rows: only later chunks do not find it, which is fine.
  GcResult out;
  std::vector<std::string>& removed = out.removed;
  // Layers before data blobs: a data blob goes only once no stored layer
  // names it (deleteBlobUnlessHeld asks the store again).
  std::stable_partition(doomed.begin(), doomed.end(),
                        [](const BlobRecord* b) { return b->kind != "data"; });
  for (const BlobRecord* b : doomed) {
    if (keepData.count(b->digest)) continue;
    ASSIGN_OR_RETURN(bool deleted, deleteBlobUnlessHeld(b->digest, b->kind == "data"));
    if (deleted) removed.push_back(b->digest);
  }
  if (!removed.empty()) log::info("gc: removed " + std::to_string(removed.size()) + " blobs");
  // Then chunks: what is left of the data blobs that only other layers read.
  ASSIGN_OR_RETURN(auto left, store_->listBlobs());
  ASSIGN_OR_RETURN(out.reclaimed, reclaimChunksLocked(left, graceS));
  // Bytes of write steps live apart from layers (stepBytesPath); those no
  // stored step keeps any more (retention, a crash before the step was
  // stored) go here.
  if (Status st = sweepStepBytes(); !st.isOk()) log::warn("gc: step bytes: " + st.toString());
  return out;
}

Result<std::vector<std::pair<std::string, int64_t>>> Platform::reclaimChunksLocked(
    const std::vector<BlobRecord>& blobs, double graceS) {
  // What the layers naming data blob `rec` (as data or extra) read of it,
  // when it may lose the rest: a data blob no layer owns, past its grace
  // period, that layers name as an extra and whose reads are all recorded
  // (a layer made before they were recorded keeps it whole). nullopt: leave
  // it alone.
  auto liveOf = [&](const BlobRecord& rec, const std::vector<const BlobRecord*>& naming)
      -> std::optional<image::BlockRanges> {
    if (rec.kind != "data" || rec.createdAt + graceS > nowSeconds()) return std::nullopt;
    image::BlockRanges live;
    for (const BlobRecord* l : naming) {
      if (l->data == rec.digest) return std::nullopt;  // some layer's own data
      auto reads = readsOf(*l, rec.digest);
      if (!reads) return std::nullopt;
      live.add(*reads);
    }
    if (naming.empty()) return std::nullopt;  // only kept for a hold
    return live;
  };
  std::map<std::string, const BlobRecord*> byDigest;
  std::map<std::string, std::vector<const BlobRecord*>> naming;  // data blob -> layers
  for (auto& b : blobs) {
    byDigest[b.digest] = &b;
    if (!b.data.empty()) naming[b.data].push_back(&b);
    for (auto& x : b.extraData) naming[x].push_back(&b);
  }
  constexpr int64_t kBlock = image::kFsBlockSize;
  std::vector<std::pair<std::string, int64_t>> out;
  for (const auto& [digest, layers] : naming) {
    auto self = byDigest.find(digest);
    if (self == byDigest.end()) continue;
    auto reclaim = [&]() -> Result<int64_t> {
      const BlobRecord* rec = self->second;
      std::optional<image::BlockRanges> live = liveOf(*rec, layers);
      if (!live) return int64_t(0);
      const std::string path = blobPath(opts_.dataDir, digest);
      ASSIGN_OR_RETURN(std::string indexBytes, readFile(path + ".chunks"));
      ASSIGN_OR_RETURN(image::ChunkIndex idx, image::ChunkIndex::parse(indexBytes));
      // The chunks none of `reads` touches, not reclaimed already, that hold
      // bytes (a chunk that is a hole already, all zeros, has nothing to
      // free and stays readable); only among `within`, when given.
      auto deadOf = [&](int fd, const image::BlockRanges& reads, const image::BlockRanges& gone,
                        const image::BlockRanges* within) {
        image::BlockRanges dead;
        for (int64_t i = 0; i < idx.chunkCount(); ++i) {
          const int64_t off = i * idx.chunkSize, len = idx.chunkLength(i);
          const auto [first, count] = idx.blocksOf(i);
          if (reads.intersects(first, count) || gone.covers(first, count)) continue;
          if (within && !within->covers(first, count)) continue;
          off_t at = ::lseek(fd, off, SEEK_DATA);
          if (at < 0 || at >= off + len) continue;
          dead.add(first, count);
        }
        return dead;
      };
      ASSIGN_OR_RETURN(image::BlockRanges gone, image::BlockRanges::parse(rec->reclaimed));
      image::BlockRanges dead;
      {
        UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
        if (!fd) return sysError("open " + path);
        dead = deadOf(fd.get(), *live, gone, nullptr);
      }
      if (dead.empty()) return int64_t(0);
      // No new layer finds these chunks from now on; then, as
      // deleteBlobUnlessHeld does, a converter that found one before holds
      // the blob (not this time), and another replica's collector or holder
      // is kept out while this one works (beginCollect).
      RETURN_IF_ERROR(store_->deleteChunksIn(digest, dead.ranges()));
      ASSIGN_OR_RETURN(auto claim, claimForCollection(digest));
      if (!claim) return int64_t(0);
      // Seen again now that nothing can change it: on a store shared with
      // other replicas, one may have linked a layer that reads (or owns) the
      // blob, stored it whole again, or reclaimed chunks of it since the
      // listing. Only chunks whose rows went above may go.
      ASSIGN_OR_RETURN(BlobRecord now, store_->getBlob(digest));
      ASSIGN_OR_RETURN(auto namingNow, store_->layersNaming(digest));
      std::vector<BlobRecord> layersNow;
      for (auto& l : namingNow) {
        auto r = store_->getBlob(l);
        if (r.isOk()) layersNow.push_back(std::move(*r));
        if (!r.isOk() && r.status().code() != Code::kNotFound) return r.status();
      }
      std::vector<const BlobRecord*> readersNow;
      for (auto& l : layersNow) readersNow.push_back(&l);
      std::optional<image::BlockRanges> liveNow = liveOf(now, readersNow);
      if (!liveNow) return int64_t(0);
      ASSIGN_OR_RETURN(image::BlockRanges goneNow, image::BlockRanges::parse(now.reclaimed));
      UniqueFd fd(::open(path.c_str(), O_RDWR | O_CLOEXEC));
      if (!fd) return sysError("open " + path);
      image::BlockRanges deadNow = deadOf(fd.get(), *liveNow, goneNow, &dead);
      if (deadNow.empty()) return int64_t(0);
      // Rows a failed conversion wrote after the first delete (its layer
      // never linked) go too: no converter may find them from here on.
      RETURN_IF_ERROR(store_->deleteChunksIn(digest, deadNow.ranges()));
      // Recorded before the holes are made: a node told a chunk is gone never
      // asks for it; one not told would find zeros where it expects bytes.
      image::BlockRanges all = goneNow;
      all.add(deadNow);
      RETURN_IF_ERROR(store_->setBlobReclaimed(digest, all.format()));
      struct stat before, after;
      if (::fstat(fd.get(), &before) != 0) return sysError("stat " + path);
      image::BlockRanges punched = goneNow;
      for (auto& [start, count] : deadNow.ranges()) {
        if (::fallocate(fd.get(), FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE,
                        off_t(start) * kBlock, off_t(count) * kBlock) != 0) {
          Status st = sysError("punch a hole in " + path);
          // What was not punched is still there: the record says so again
          // (the failed range stays recorded: a punch may have freed part of
          // it, and a chunk recorded gone that is there is harmless).
          punched.add(start, count);
          if (Status back = store_->setBlobReclaimed(digest, punched.format()); !back.isOk()) {
            log::warn("gc: " + digest + ": " + back.toString());
          }
          return st;
        }
        punched.add(start, count);
      }
      if (::fstat(fd.get(), &after) != 0) return sysError("stat " + path);
      return std::max<int64_t>(0, (int64_t(before.st_blocks) - int64_t(after.st_blocks)) * 512);
    };
    auto freed = reclaim();
    if (!freed.isOk()) {
      log::warn("gc: chunks of " + digest + ": " + freed.status().toString());
      continue;
    }
    if (*freed > 0) {
      log::info("gc: reclaimed " + std::to_string(*freed) + " bytes of " + digest +
                " (its layer is gone; other layers read the rest)");
      out.emplace_back(digest, *freed);
    }
  }
  return out;
}

void Platform::runGc(http::Request& req, http::Response& res) {
  auto j = parseObject(req, {"grace_s"}, true);
  if (!j.isOk()) return sendError(res, j.status());
  auto grace = getNumber(*j, "grace_s", opts_.gcGraceS, 0, 86400 * 365);
  if (!grace.isOk()) return sendError(res, grace.status());
  auto gc = collectGarbage(*grace);
  if (!gc.isOk()) return sendError(res, gc.status());
  json reclaimed = json::array();
  for (auto& [digest, bytes] : gc->reclaimed) {
    reclaimed.push_back({{"digest", digest}, {"bytes", bytes}});
  }
  sendJson(res, 200, json{{"removed", gc->removed}, {"reclaimed", reclaimed}}.dump());
}

namespace {
// Refs of the images that name `digest`.
json imagesNaming(const std::vector<ImageRecord>& images, const std::string& digest) {
  json refs = json::array();
  for (auto& i : images) {
    if (std::find(i.layers.begin(), i.layers.end(), digest) != i.layers.end()) {
      refs.push_back(i.name + ":" + i.tag);
    }
  }
  return refs;
}

// `records`: of the layer's data and extra data blobs (one missing: no size).
json layerToApi(const BlobRecord& b, const std::vector<ImageRecord>& images, bool inUse,
                const std::map<std::string, BlobRecord>& records) {
  auto blobToApi = [&](const std::string& digest) {
    json j = {{"digest", digest}};
    if (auto it = records.find(digest); it != records.end()) {
      j["size"] = it->second.size;
      // What gc removed of it: chunks no layer reads since its own went.
      j["reclaimed_bytes"] = it->second.size - it->second.storedBytes();
    }
    return j;
  };
  json data = b.data.empty() ? json(nullptr) : blobToApi(b.data);
  // Data blobs of other layers its chunks point into, in EROFS device order.
  json extra = json::array();
  for (auto& x : b.extraData) extra.push_back(blobToApi(x));
  return {{"digest", b.digest},
          {"kind", b.kind.empty() ? json(nullptr) : json(b.kind)},
          {"size", b.size},
          {"created_at", isoTime(b.createdAt)},
          {"images", imagesNaming(images, b.digest)},
          {"in_use", inUse},
          {"data", data},
          {"extra_data", extra}};
}
}  // namespace

void Platform::listLayers(http::Response& res) {
  auto blobs = store_->listBlobs();
  if (!blobs.isOk()) return sendError(res, blobs.status());
  auto images = store_->listImages();
  if (!images.isOk()) return sendError(res, images.status());
  std::set<std::string> inUse = layersInUse();
  std::map<std::string, BlobRecord> records;
  for (auto& b : *blobs) records[b.digest] = b;
  json arr = json::array();
  for (auto& b : *blobs) {
    if (b.kind == "data") continue;  // shown with its layer
    arr.push_back(layerToApi(b, *images, inUse.count(b.digest) > 0, records));
  }
  sendJson(res, 200, json{{"layers", arr}}.dump());
}

void Platform::getLayer(const std::string& digest, http::Response& res) {
  if (!validDigest(digest)) {
    return sendError(res, invalidArg("digest", "digest must be sha256:<64 lower-case hex>"));
  }
  auto blob = store_->getBlob(digest);
  if (!blob.isOk()) return sendError(res, blob.status());
  auto images = store_->listImages();
  if (!images.isOk()) return sendError(res, images.status());
  std::map<std::string, BlobRecord> records;
  std::vector<std::string> blobs = blob->extraData;
  if (!blob->data.empty()) blobs.push_back(blob->data);
  for (auto& d : blobs) {
    if (auto r = store_->getBlob(d); r.isOk()) records[d] = std::move(*r);
  }
  sendJson(res, 200, layerToApi(*blob, *images, layersInUse().count(digest) > 0, records).dump());
}

void Platform::deleteLayer(const std::string& digest, http::Response& res) {
  if (!validDigest(digest)) {
    return sendError(res, invalidArg("digest", "digest must be sha256:<64 lower-case hex>"));
  }
  std::lock_guard gc(gcMu_);
  auto blob = store_->getBlob(digest);
  if (!blob.isOk()) return sendError(res, blob.status());
  auto refs = store_->imagesNaming(digest);
  if (!refs.isOk()) return sendError(res, refs.status());
  if (!refs->empty()) {
    return sendError(res, Status(Code::kFailedPrecondition,
                                 "layer " + digest + " is part of image " + refs->front()));
  }
  if (layersInUse().count(digest) || !cluster_->evictLayer(digest).isOk()) {
    return sendError(res, Status(Code::kFailedPrecondition,
                                 "layer " + digest + " is in use by a sandbox"));
  }
  // Whether a layer other than `except` reads its chunks from data blob `d`.
  auto namedByLayer = [&](const std::string& d, const std::string& except) -> Result<bool> {
    ASSIGN_OR_RETURN(auto naming, store_->layersNaming(d));
    return std::any_of(naming.begin(), naming.end(), [&](auto& l) { return l != except; });
  };
  auto named = namedByLayer(digest, "");
  if (!named.isOk()) return sendError(res, named.status());
  if (*named) {
    return sendError(
        res, Status(Code::kFailedPrecondition, digest + " holds the data of another layer"));
  }
  auto gone = deleteBlobUnlessHeld(digest, false);
  if (!gone.isOk()) return sendError(res, gone.status());
  if (!*gone) {
    return sendError(res, Status(Code::kFailedPrecondition,
                                 digest + " is being pointed into by a layer in conversion"));
  }
  // Its data blob goes with it unless another layer reads from it, or a
  // converter is about to (a chunk hold). Its extra data blobs belong to
  // other layers, or to none any more: the collector removes those.
  if (!blob->data.empty()) {
    auto other = namedByLayer(blob->data, digest);
    if (!other.isOk()) {
      log::warn("delete layer " + digest + ": data blob: " + other.status().toString());
    } else if (!*other) {
      if (auto gone = deleteBlobUnlessHeld(blob->data, true); !gone.isOk()) {
        log::warn("delete layer " + digest + ": data blob: " + gone.status().toString());
      }
    }
  }
  sendJson(res, 200, "{}");
}

void Platform::listImages(http::Response& res) {
  auto imgs = store_->listImages();
  if (!imgs.isOk()) return sendError(res, imgs.status());
  json arr = json::array();
  for (auto& r : *imgs) {
    if (imageVisible(currentCaller(), r)) arr.push_back(imageToApi(r));
  }
  sendJson(res, 200, json{{"images", arr}}.dump());
}

Result<Platform::ImageBytes> Platform::imageBytes(const ImageRecord& img) {
  ImageBytes b;
  std::set<std::string> seen;
  auto add = [&](const BlobRecord& r) {
    b.logical += r.size;
    if (seen.insert(r.digest).second) b.stored += r.storedBytes();
  };
  // A layer whose chunks point into other layers' data blobs (extraData)
  // needs those blobs (what is stored of them) to be read: they count as its
  // own, like its data.
  for (auto& d : img.layers) {
    ASSIGN_OR_RETURN(BlobRecord meta, store_->getBlob(d));
    add(meta);
    if (meta.data.empty()) continue;
    ASSIGN_OR_RETURN(BlobRecord data, store_->getBlob(meta.data));
    add(data);
    for (auto& x : meta.extraData) {
      ASSIGN_OR_RETURN(BlobRecord extra, store_->getBlob(x));
      add(extra);
    }
  }
  return b;
}

void Platform::getImage(const std::string& ref, http::Response& res) {
  std::string name, tag;
  if (Status st = parseImageRef(ref, name, tag); !st.isOk()) return sendError(res, st);
  auto img = visibleImage(name, tag);
  if (!img.isOk()) return sendError(res, img.status());
  json j = imageToApi(*img);
  // What the image's layers hold (metadata and data, each layer as if alone)
  // and what its distinct blobs take in the store.
  if (auto b = imageBytes(*img); b.isOk()) {
    j["logical_bytes"] = b->logical;
    j["stored_bytes"] = b->stored;
  }
  sendJson(res, 200, j.dump());
}

void Platform::deleteImage(const std::string& ref, http::Response& res) {
  std::string name, tag;
  if (Status st = parseImageRef(ref, name, tag); !st.isOk()) return sendError(res, st);
  std::string full = name + ":" + tag;
  {
    auto img = visibleImage(name, tag);
    if (!img.isOk()) return sendError(res, img.status());
    if (!mayAccess(currentCaller(), img->owner)) {
      return sendError(res, Status(Code::kPermissionDenied,
                                   "image " + full + " is public but not yours to delete"));
    }
  }
  std::string user;
  {
    std::lock_guard lk(mu_);
    for (auto& [id, r] : sandboxes_) {
      if (isFinal(r.state)) continue;
      auto asked = {std::vector<std::string>{r.image}, r.workspaces, r.toolkits, r.diffs};
      for (auto& refs : asked) {
        for (auto& ref : refs) {
          std::string n, t;
          if (!startsWith(ref, "sha256:") && parseImageRef(ref, n, t).isOk() && n == name &&
              t == tag) {
            user = id;
          }
        }
      }
      if (!user.empty()) break;
    }
  }
  if (!user.empty()) {
    return sendError(res, Status(Code::kFailedPrecondition,
                                 "image " + full + " is in use by sandbox " + user));
  }
  std::lock_guard gc(gcMu_);
  if (Status st = store_->deleteImage(name, tag); !st.isOk()) return sendError(res, st);
  sendJson(res, 200, "{}");
}

}  // namespace dsec::platform
