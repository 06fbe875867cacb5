// Durable platform state. Store is the seam: SqliteStore (embedded, the
// default) and PostgresStore (platform/pg_store.h, shared by several platform
// processes); every write is durable when the call returns, so the platform
// can acknowledge right after it. A method added here is implemented by both,
// and store_test.cc runs its tests against both.
#pragma once

#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "image/image_config.h"
#include "proto/types.h"

struct sqlite3;
struct sqlite3_stmt;

namespace dsec::platform {

using proto::BackendKind;
using proto::SandboxState;
using proto::isFinal;

struct SandboxRecord {
  std::string id;
  BackendKind backend = BackendKind::kContainer;
  std::string image;                // reference as asked ("debian:latest" or a digest)
  // Extra layers stacked on the image at create time, as asked (refs or digests).
  std::vector<std::string> workspaces, toolkits, diffs;
  std::vector<std::string> layers;  // resolved, bottom first
  SandboxState state = SandboxState::kCreating;
  // Where a paused sandbox's memory is: "disk" when it was paused to disk
  // (VM backends: saved to a file, no process), else empty (kept in RAM).
  std::string pausedTo;
  std::string node = "local";
  // Placement (platform/scheduler.h): the node pool, and whether to spread
  // the tenant's sandboxes over nodes.
  std::string pool = "default";
  bool spread = true;
  bool burstable = false;  // may go to the burst pool when its pool is busy
  std::string error;
  double cpu = 1.0;
  int64_t memoryMb = 512;
  int64_t diskMb = 1024;
  // Whether the create request named disk_mb (passed to the edge with the
  // create, SandboxSpec::diskExplicit; not stored).
  bool diskExplicit = false;
  int64_t pids = 1024;
  int64_t ttlS = 3600;
  // Destroyed after this long without a call (0: never); paused after this
  // long without a call (0: never). A call to a paused sandbox resumes it.
  int64_t idleTimeoutS = 0;
  int64_t autoPauseS = 0;
  // The image config's Env with the create request's env over it, per key.
  std::map<std::string, std::string> env;
  // Who execs run as and where, when the call does not say: the create
  // request's user, else the image config's User; its WorkingDir. Empty: root,
  // and the user's home directory.
  std::string user;
  std::string workingDir;
  std::map<std::string, std::string> labels;
  double createdAt = 0;
  double updatedAt = 0;
  double expiresAt = 0;  // 0: never
  double stoppedAt = 0;
  // Security policy in force (platform/policy.h) with the caller's extra
  // paths, and every switch of it: the phases of the sandbox's life.
  std::string policy = "default";
  std::vector<std::string> readonlyPaths, hiddenPaths;
  struct Phase {
    std::string policy;
    double at = 0;
  };
  std::vector<Phase> phases;
  // Its exposed ports (api_ports.cc, docs/ports.md): the generation is part
  // of the URL token, so a rotation (gen + 1) voids the old one.
  struct ExposedPort {
    int port = 0;
    uint64_t gen = 1;
    double createdAt = 0;
    double expiresAt = 0;  // 0: while the sandbox lives
    bool liveAt(double now) const { return expiresAt == 0 || expiresAt > now; }
  };
  std::vector<ExposedPort> ports;
  // The tenant that owns it (platform/tenants.h); records written before
  // tenants existed belong to the built-in "admin" tenant.
  std::string owner = "admin";
  // The batch that made it (POST /v1/batches), empty for a single create.
  std::string batch;
  // The platform replica that created it (docs/cluster.md): while it is
  // `creating`, only that replica finishes it; if that replica dies, the
  // leader fails it.
  std::string replica;
};

// A batch's life: running (its sandboxes being created), done, failed (all
// or nothing, and one failed), deleted.
enum class BatchState : uint8_t { kRunning, kDone, kFailed, kDeleted };
// "running", "done", "failed", "deleted".
const char* batchStateName(BatchState s);
std::optional<BatchState> parseBatchState(std::string_view name);

// A batch creation (POST /v1/batches, docs/batches.md): `count` sandboxes of
// one spec, whose records (state `pending` until created) are stored with it
// in one transaction.
struct BatchRecord {
  std::string id;
  std::string owner = "admin";
  int64_t count = 0;
  bool allOrNothing = false;
  std::string spec;            // the create body as asked (JSON)
  BatchState state = BatchState::kRunning;
  std::string error;
  double createdAt = 0;
  double updatedAt = 0;
};

struct ImageRecord {
  std::string name;
  std::string tag;
  std::vector<std::string> layers;  // bottom first
  int64_t size = 0;
  double createdAt = 0;
  std::string kind = "base";  // base | workspace | toolkit | diff: the kind of all its layers
  // For a pack_diff snapshot: the stack it was made on, as JSON
  // {"image","workspaces","toolkits"}; empty otherwise.
  std::string parent;
  // User, Env and WorkingDir of the OCI image it was imported from; applied
  // to sandboxes created with it as their `image`.
  image::ImageConfig config;
  // The tenant that made it ("" in rows older than tenants: the built-in
  // admin) and who may see and stack it: "public" (every tenant) or
  // "private" (its owner and admins).
  std::string owner;
  std::string visibility = "public";
  // Pulled from a registry (POST /v1/images/pull): where from, as JSON
  // {"ref","repository","index_digest","manifest_digest","config_digest",
  // "platform"}; empty for images made otherwise.
  std::string source;
};

// A layer blob in the store. Its kind is set when an image first names it.
struct BlobRecord {
  std::string digest;
  int64_t size = 0;
  double createdAt = 0;
  std::string kind;  // empty until an image names it; "data" for a layer's data blob
  std::string data;  // for a layer's metadata image: the digest of its data blob
  std::string chunks;  // for a data blob: the digest of its chunk index (image/chunk_index.h)
  // For a layer converted from a registry layer: that layer's digest (of its
  // compressed tar), so the same registry layer is never fetched twice.
  std::string source;
  // For a layer's metadata image: the data blobs of other layers that some
  // of its chunks point into (chunks deduplicated across layers), in EROFS
  // device order (devices 2, 3, ...; device 1 is `data`). Empty for most.
  std::vector<std::string> extraData;
  // For a layer's metadata image with extraData: the blocks of each extra
  // blob its chunks read (image::BlockRanges text, one per extra blob in
  // extraData's order, joined by ";"). "" when not recorded (layers made
  // before 2026-12-08): the layer may read anything of its extras.
  std::string extraReads;
  // For a data blob: the chunks garbage collection removed (holes punched)
  // because no layer reads them any more (image::BlockRanges text, 4 KiB
  // blocks; "" for a whole blob). Platform::collectGarbage.
  std::string reclaimed;

  // Bytes the blob takes in the store: its size less what gc reclaimed.
  int64_t storedBytes() const;
};

// Where a chunk's bytes are stored (the platform-wide chunk table a converter
// consults to point at an existing chunk instead of storing it again).
struct ChunkLoc {
  std::string sha;     // 64 lower-case hex: SHA-256 of the chunk's bytes
  int64_t length = 0;  // its bytes (at most image::kChunkSize)
  std::string data;    // the data blob holding it, "sha256:<hex>"
  uint32_t block = 0;  // its 4 KiB block address in that blob
};

// A chunk table row's key (Store::listChunkKeys).
struct ChunkKey {
  std::string sha;     // 64 lower-case hex
  int64_t length = 0;
};

// A step of `dsec image build` (api_build.cc) whose result is kept for the
// next build: the layer it made, found by the step's cache key
// (image::stepCacheKey).
struct BuildCacheEntry {
  std::string key;     // "sha256:<hex>"
  std::string layer;   // the layer digest
  std::string config;  // JSON the builder keeps with it (what the step was)
  double createdAt = 0;
  double usedAt = 0;  // last hit (or creation)
};

// One step of a trajectory (Chronus): a call made once, its result kept so
// that a repeat returns it instead of running again.
struct TrajectoryStep {
  std::string trajectory;
  int64_t step = 0;
  std::string digest;       // "sha256:..." of the request (chronus.h)
  std::string kind;         // exec | write | read | mkdir | remove | checkpoint
  std::string sandbox;      // where it ran first
  std::string request;      // JSON summary of the request (for export)
  int status = 200;         // HTTP status of the stored result
  std::string contentType;  // of body
  std::string body;         // the result as sent
  double startedAt = 0;
  double finishedAt = 0;
  // For a write: "sha256:..." of the bytes written, kept by the platform (in
  // its data dir's steps/ folder) so the step can be re-executed by a
  // recover. Empty for other kinds and for writes logged before bytes were kept.
  std::string content;
};

// What the platform knows of a trajectory beyond its steps: the sandbox it
// runs in (the last to run a live step, or the one a recover made), that
// sandbox's record as it was then (so a recover can rebuild it after the
// record itself is purged), the sandboxes recovers replaced (steps sent to
// them go to `sandbox`), and the reports of those recovers.
struct TrajectoryRecord {
  std::string id;
  std::string sandbox;
  std::string sandboxDoc;             // sandboxToJson of `sandbox`'s record
  std::vector<std::string> replaced;  // oldest first
  std::string recoveries = "[]";      // JSON array of recover reports
  double updatedAt = 0;
};

struct TrajectorySummary {
  std::string id;
  int64_t steps = 0;
  double firstAt = 0;
  double lastAt = 0;
};

// A tenant (platform/tenants.h): who owns sandboxes, images and
// trajectories, its role and its quotas. A quota of 0 is no limit.
struct TenantQuota {
  int64_t maxSandboxes = 0;  // sandboxes not stopped or failed
  double maxCpu = 0;         // sum of their cpu
  int64_t maxMemoryMb = 0;   // sum of their memory_mb
  double createsPerS = 0;    // sandbox creations per second (token bucket)
  int64_t createBurst = 0;   // the bucket's size (0: max(1, createsPerS))
};

struct TenantRecord {
  std::string id;
  std::string name;
  std::string role = "user";  // admin | user
  TenantQuota quota;
  double createdAt = 0;
};

// An API key: only the SHA-256 of the key is kept, never the key.
struct ApiKeyRecord {
  std::string id;  // the visible part of the key, for listing and revoking
  std::string tenant;
  std::string hash;  // hex SHA-256 of the whole key
  std::string name;  // a label given at creation
  double createdAt = 0;
  double revokedAt = 0;  // 0: live
};

// A node of the cluster (platform/cluster.h): where it is reached, its
// credentials and liveness. Shared by every platform replica on the store.
struct NodeRecord {
  std::string name;
  std::string pool = "default";
  std::string url;
  std::string edgeKeyHash;  // hex SHA-256 of the edge key: it is only ever checked
  std::string platformKey;  // sent to the edge on each call, so kept as is
  double cpus = 0;
  int64_t memoryMb = 0;
  int64_t slots = 0;
  std::string state = "up";  // up | down
  double lastHeartbeat = 0;  // wall clock of the replica that took it
  std::string bootId;        // of the edge process last heard
  double joinedAt = 0;
};

// A named lease (leader election, replica liveness) as the store sees it now.
struct LeaseRecord {
  std::string name;
  std::string holder;
  bool live = false;  // not expired by the store's clock
};

std::string tenantToJson(const TenantRecord& r);
Result<TenantRecord> tenantFromJson(const std::string& s);
std::string apiKeyToJson(const ApiKeyRecord& r);
Result<ApiKeyRecord> apiKeyFromJson(const std::string& s);

class Store {
 public:
  virtual ~Store() = default;
  virtual Status putSandbox(const SandboxRecord& r) = 0;
  virtual Status deleteSandbox(const std::string& id) = 0;
  virtual Result<std::vector<SandboxRecord>> loadSandboxes() = 0;
  // Inserts or replaces every record of `rs` and deletes the records `drop`
  // names, in one transaction (one commit).
  virtual Status putSandboxes(const std::vector<SandboxRecord>& rs,
                              const std::vector<std::string>& drop = {}) = 0;
  // Batches: putBatch inserts or replaces the batch and, in the same
  // transaction, one record per id of `ids`: `pending` with that id (a new
  // batch's records differ only in their ids, so the record is written out
  // once). deleteBatch removes the batch row (kNotFound when absent), not its
  // sandboxes' records.
  virtual Status putBatch(const BatchRecord& b, const std::vector<std::string>& ids = {},
                          const SandboxRecord& pending = {}) = 0;
  virtual Result<std::vector<BatchRecord>> loadBatches() = 0;
  virtual Status deleteBatch(const std::string& id) = 0;

  virtual Status putBlob(const std::string& digest, int64_t size) = 0;
  virtual Result<bool> hasBlob(const std::string& digest) = 0;
  virtual Result<int64_t> blobSize(const std::string& digest) = 0;
  virtual Result<BlobRecord> getBlob(const std::string& digest) = 0;
  virtual Result<std::vector<BlobRecord>> listBlobs() = 0;
  virtual Status setBlobKind(const std::string& digest, const std::string& kind) = 0;
  // Records that layer `digest` keeps its file data in blob `data`.
  virtual Status setBlobData(const std::string& digest, const std::string& data) = 0;
  // Records the chunk index of data blob `digest`.
  virtual Status setBlobChunks(const std::string& digest, const std::string& chunks) = 0;
  // Deletes the blob's row and, in the same transaction, the chunk rows of
  // chunks stored in it (deleteChunksOf).
  virtual Status deleteBlob(const std::string& digest) = 0;
  // Marks layer `digest` as converted from registry layer `source`.
  virtual Status setBlobSource(const std::string& digest, const std::string& source) = 0;
  // The layer converted from registry layer `source`; kNotFound if none.
  virtual Result<std::string> findLayerBySource(const std::string& source) = 0;
  // Records the data blobs of other layers that layer `layer`'s chunks point
  // into (BlobRecord::extraData), replacing any; {} clears them. A digest
  // holds no space, so each is stored as given (callers check they exist).
  virtual Status setBlobExtraData(const std::string& layer,
                                  const std::vector<std::string>& blobs) = 0;
  // The images ("name:tag") whose layers include `layer`.
  virtual Result<std::vector<std::string>> imagesNaming(const std::string& layer) = 0;
  // The layers that name data blob `data` as their data or an extra data
  // blob (BlobRecord::data, extraData), in no particular order.
  virtual Result<std::vector<std::string>> layersNaming(const std::string& data) = 0;
  // Records BlobRecord::extraReads of layer `layer` (text, replacing any).
  virtual Status setBlobExtraReads(const std::string& layer, const std::string& reads) = 0;
  // Records BlobRecord::reclaimed of data blob `data` (text, replacing any).
  virtual Status setBlobReclaimed(const std::string& data, const std::string& reclaimed) = 0;

  // ---- The chunk table: where each distinct chunk (by SHA-256 and length)
  // was first stored. Rows name their data blob but are not checked against
  // the blobs table; deleteBlob(D) removes D's rows, and a collector that
  // must stop new references to D before deciding to delete it calls
  // deleteChunksOf(D) first (Platform::collectGarbage).
  // Records that `chunks` are stored in data blob `data` (each chunk's `data`
  // is ignored), in one transaction. The first location recorded for a
  // (sha, length) wins: a chunk already known keeps its row.
  virtual Status putChunks(const std::string& data, const std::vector<ChunkLoc>& chunks) = 0;
  // The recorded location of the chunk, or nullopt when none is.
  virtual Result<std::optional<ChunkLoc>> findChunk(const std::string& sha, int64_t length) = 0;
  // Removes every row whose chunk is in data blob `data` (none: ok).
  virtual Status deleteChunksOf(const std::string& data) = 0;
  // Removes the rows of the chunks of data blob `data` that overlap any of
  // `ranges` (4 KiB blocks: start, count; a chunk spans blocks [block,
  // block + ceil(length / 4096))), in one transaction.
  virtual Status deleteChunksIn(const std::string& data,
                                const std::vector<std::pair<uint64_t, uint64_t>>& ranges) = 0;
  // One page of the chunk table's keys, for a reader that wants them all
  // (platform/chunk_keys.h) without holding the table, or the whole of it in
  // memory, at once: at most `limit` keys, in an order of the store's own,
  // each strictly after `after` in that order (after.sha empty: from the
  // first). Pass the last key of a page to get the next; a page shorter than
  // `limit` is the last. Rows put or deleted between pages may or may not be
  // seen; no row there throughout is missed or repeated. kInvalidArgument
  // (field "limit") when `limit` is 0.
  virtual Result<std::vector<ChunkKey>> listChunkKeys(const ChunkKey& after, size_t limit) = 0;

  virtual Status putImage(const ImageRecord& r) = 0;
  virtual Result<ImageRecord> getImage(const std::string& name, const std::string& tag) = 0;
  virtual Result<std::vector<ImageRecord>> listImages() = 0;
  virtual Status deleteImage(const std::string& name, const std::string& tag) = 0;

  // The build step cache (api_build.cc). putBuildCache inserts or replaces;
  // getBuildCache is kNotFound when absent; touchBuildCache sets used_at (an
  // absent key is fine); buildCacheLayers lists the layers of the entries
  // used at or after `since`; deleteBuildCacheBefore drops the entries used
  // before `t` and returns how many.
  virtual Status putBuildCache(const BuildCacheEntry& e) = 0;
  virtual Result<BuildCacheEntry> getBuildCache(const std::string& key) = 0;
  virtual Status touchBuildCache(const std::string& key, double at) = 0;
  virtual Result<std::set<std::string>> buildCacheLayers(double since) = 0;
  virtual Result<int64_t> deleteBuildCacheBefore(double t) = 0;

  // User-defined security policies (platform/policy.h), as JSON documents.
  virtual Status putPolicy(const std::string& name, const std::string& doc) = 0;
  // kNotFound for an unknown name.
  virtual Status deletePolicy(const std::string& name) = 0;
  virtual Result<std::vector<std::string>> loadPolicies() = 0;

  // Trajectories. putStep refuses (kAlreadyExists) a step already stored.
  virtual Status putStep(const TrajectoryStep& s) = 0;
  // kNotFound when the step is not stored.
  virtual Result<TrajectoryStep> getStep(const std::string& trajectory, int64_t step) = 0;
  // Steps in order of step number.
  virtual Result<std::vector<TrajectoryStep>> loadTrajectory(const std::string& trajectory) = 0;
  virtual Result<std::vector<TrajectorySummary>> listTrajectories() = 0;
  // Returns how many steps went (0: unknown trajectory); its
  // TrajectoryRecord goes with them.
  virtual Result<int64_t> deleteTrajectory(const std::string& trajectory) = 0;
  // Deletes whole trajectories whose last step finished before `t` (and their
  // records); returns how many steps.
  virtual Result<int64_t> deleteTrajectoriesBefore(double t) = 0;
  // Every content digest some stored step keeps (TrajectoryStep::content).
  virtual Result<std::set<std::string>> stepContents() = 0;
  // Whether any stored step keeps content `digest`.
  virtual Result<bool> stepContentUsed(const std::string& digest) = 0;
  // Insert or replace; kNotFound from getTrajectory when there is none.
  virtual Status putTrajectory(const TrajectoryRecord& r) = 0;
  virtual Result<TrajectoryRecord> getTrajectory(const std::string& id) = 0;

  // Tenants and their API keys (platform/tenants.h). put* insert or replace;
  // get* return kNotFound when absent; deleteTenant (kNotFound when absent)
  // deletes the tenant's keys with it. listApiKeys("") lists every tenant's.
  virtual Status putTenant(const TenantRecord& r) = 0;
  virtual Result<TenantRecord> getTenant(const std::string& id) = 0;
  virtual Result<std::vector<TenantRecord>> listTenants() = 0;
  virtual Status deleteTenant(const std::string& id) = 0;
  virtual Status putApiKey(const ApiKeyRecord& r) = 0;
  virtual Result<ApiKeyRecord> getApiKey(const std::string& id) = 0;
  virtual Result<std::vector<ApiKeyRecord>> listApiKeys(const std::string& tenant) = 0;

  // ---- Replicas and nodes (platform/cluster.h, docs/cluster.md).
  // Whether other processes may write this store at the same time
  // (PostgreSQL): the platform then re-reads what they wrote.
  virtual bool shared() const { return false; }
  // kNotFound when absent.
  virtual Result<SandboxRecord> getSandbox(const std::string& id) = 0;
  // Sandboxes written (by anyone) at or after `since` on the store's clock,
  // and that clock's reading now in *now (the next call's `since`, less a
  // margin for writes committed late).
  virtual Result<std::vector<SandboxRecord>> sandboxesChangedSince(double since, double* now) = 0;
  // Writes r only if the stored record's state is `fromState`; false (and no
  // write) otherwise, or when there is no record.
  virtual Result<bool> casSandbox(const SandboxRecord& r, SandboxState fromState) = 0;
  // Insert or replace (a join).
  virtual Status putNode(const NodeRecord& r) = 0;
  virtual Result<std::vector<NodeRecord>> listNodes() = 0;
  // A heartbeat: url, pool, capacity, lastHeartbeat and bootId of r.name
  // (never its keys or state). kNotFound for an unknown node.
  virtual Status touchNode(const NodeRecord& r) = 0;
  // Sets the node's state to `to` if it is `from`; whether it did.
  virtual Result<bool> setNodeState(const std::string& name, const std::string& from,
                                    const std::string& to) = 0;
  // Takes or renews lease `name` for `holder` for ttlS seconds of the
  // store's clock; true when holder has it (it was free, expired or its own).
  virtual Result<bool> acquireLease(const std::string& name, const std::string& holder,
                                    double ttlS) = 0;
  // Gives the lease up if holder has it.
  virtual Status releaseLease(const std::string& name, const std::string& holder) = 0;
  virtual Result<std::vector<LeaseRecord>> listLeases() = 0;
  // The value of setting `name`, storing `value` first if it has none (the
  // first writer wins); e.g. the cluster's join token.
  virtual Result<std::string> settingOrPut(const std::string& name, const std::string& value) = 0;
  // When sandboxes were last called, through any replica (for the leader's
  // idle timeouts and auto-pause): noteCalls keeps the later of the stored
  // and the given time; lastCalls answers for those of `ids` it has. Rows go
  // with their sandbox's record.
  virtual Status noteCalls(const std::map<std::string, double>& calls) = 0;
  virtual Result<std::map<std::string, double>> lastCalls(const std::vector<std::string>& ids) = 0;
};

// SQLite in WAL mode with synchronous=NORMAL: a commit is in the OS when it
// returns (survives a crash of the process, not a power loss; see store.cc).
// Thread-safe (one connection behind a mutex).
class SqliteStore : public Store {
 public:
  static Result<std::unique_ptr<SqliteStore>> open(const std::string& path);
  ~SqliteStore() override;

  Status putSandbox(const SandboxRecord& r) override;
  Status deleteSandbox(const std::string& id) override;
  Result<std::vector<SandboxRecord>> loadSandboxes() override;
  Status putSandboxes(const std::vector<SandboxRecord>& rs,
                      const std::vector<std::string>& drop = {}) override;
  Status putBatch(const BatchRecord& b, const std::vector<std::string>& ids = {},
                  const SandboxRecord& pending = {}) override;
  Result<std::vector<BatchRecord>> loadBatches() override;
  Status deleteBatch(const std::string& id) override;
  Status putBlob(const std::string& digest, int64_t size) override;
  Result<bool> hasBlob(const std::string& digest) override;
  Result<int64_t> blobSize(const std::string& digest) override;
  Result<BlobRecord> getBlob(const std::string& digest) override;
  Result<std::vector<BlobRecord>> listBlobs() override;
  Status setBlobKind(const std::string& digest, const std::string& kind) override;
  Status setBlobData(const std::string& digest, const std::string& data) override;
  Status setBlobChunks(const std::string& digest, const std::string& chunks) override;
  Status deleteBlob(const std::string& digest) override;
  Status setBlobSource(const std::string& digest, const std::string& source) override;
  Result<std::string> findLayerBySource(const std::string& source) override;
  Status setBlobExtraData(const std::string& layer, const std::vector<std::string>& blobs) override;
  Status setBlobExtraReads(const std::string& layer, const std::string& reads) override;
  Result<std::vector<std::string>> layersNaming(const std::string& data) override;
  Result<std::vector<std::string>> imagesNaming(const std::string& layer) override;
  Status setBlobReclaimed(const std::string& data, const std::string& reclaimed) override;
  Status putChunks(const std::string& data, const std::vector<ChunkLoc>& chunks) override;
  Result<std::optional<ChunkLoc>> findChunk(const std::string& sha, int64_t length) override;
  Status deleteChunksOf(const std::string& data) override;
  Status deleteChunksIn(const std::string& data,
                        const std::vector<std::pair<uint64_t, uint64_t>>& ranges) override;
  Result<std::vector<ChunkKey>> listChunkKeys(const ChunkKey& after, size_t limit) override;
  Status putImage(const ImageRecord& r) override;
  Result<ImageRecord> getImage(const std::string& name, const std::string& tag) override;
  Result<std::vector<ImageRecord>> listImages() override;
  Status deleteImage(const std::string& name, const std::string& tag) override;
  Status putBuildCache(const BuildCacheEntry& e) override;
  Result<BuildCacheEntry> getBuildCache(const std::string& key) override;
  Status touchBuildCache(const std::string& key, double at) override;
  Result<std::set<std::string>> buildCacheLayers(double since) override;
  Result<int64_t> deleteBuildCacheBefore(double t) override;
  Status putPolicy(const std::string& name, const std::string& doc) override;
  Status deletePolicy(const std::string& name) override;
  Result<std::vector<std::string>> loadPolicies() override;
  Status putStep(const TrajectoryStep& s) override;
  Result<TrajectoryStep> getStep(const std::string& trajectory, int64_t step) override;
  Result<std::vector<TrajectoryStep>> loadTrajectory(const std::string& trajectory) override;
  Result<std::vector<TrajectorySummary>> listTrajectories() override;
  Result<int64_t> deleteTrajectory(const std::string& trajectory) override;
  Result<int64_t> deleteTrajectoriesBefore(double t) override;
  Result<std::set<std::string>> stepContents() override;
  Result<bool> stepContentUsed(const std::string& digest) override;
  Status putTrajectory(const TrajectoryRecord& r) override;
  Result<TrajectoryRecord> getTrajectory(const std::string& id) override;
  Status putTenant(const TenantRecord& r) override;
  Result<TenantRecord> getTenant(const std::string& id) override;
  Result<std::vector<TenantRecord>> listTenants() override;
  Status deleteTenant(const std::string& id) override;
  Status putApiKey(const ApiKeyRecord& r) override;
  Result<ApiKeyRecord> getApiKey(const std::string& id) override;
  Result<std::vector<ApiKeyRecord>> listApiKeys(const std::string& tenant) override;
  Result<SandboxRecord> getSandbox(const std::string& id) override;
  Result<std::vector<SandboxRecord>> sandboxesChangedSince(double since, double* now) override;
  Result<bool> casSandbox(const SandboxRecord& r, SandboxState fromState) override;
  Status putNode(const NodeRecord& r) override;
  Result<std::vector<NodeRecord>> listNodes() override;
  Status touchNode(const NodeRecord& r) override;
  Result<bool> setNodeState(const std::string& name, const std::string& from,
                            const std::string& to) override;
  Result<bool> acquireLease(const std::string& name, const std::string& holder,
                            double ttlS) override;
  Status releaseLease(const std::string& name, const std::string& holder) override;
  Result<std::vector<LeaseRecord>> listLeases() override;
  Result<std::string> settingOrPut(const std::string& name, const std::string& value) override;
  Status noteCalls(const std::map<std::string, double>& calls) override;
  Result<std::map<std::string, double>> lastCalls(const std::vector<std::string>& ids) override;

 private:
  SqliteStore() = default;
  // The node and lease tables (store.cc, at its end).
  Status openNodeTables();
  Status exec(const std::string& sql);
  // Upserts `rs` with the connection's lock held, inside a transaction.
  Status putSandboxesLocked(const std::vector<SandboxRecord>& rs);

  std::mutex mu_;  // guards db_
  sqlite3* db_ = nullptr;
  // findChunk's statement, prepared once: a converter asks for every chunk
  // it would store (guarded by mu_).
  sqlite3_stmt* findChunkStmt_ = nullptr;
};

std::string sandboxToJson(const SandboxRecord& r);
Result<SandboxRecord> sandboxFromJson(const std::string& s);
// sandboxToJson of one record under many ids, written out once: doc(id) is
// sandboxToJson(r) with r.id = id.
class SandboxDocs {
 public:
  explicit SandboxDocs(SandboxRecord r);
  std::string doc(const std::string& id) const;

 private:
  std::string rest_;  // the document after its id
};
std::string batchToJson(const BatchRecord& b);
Result<BatchRecord> batchFromJson(const std::string& s);

// Column encodings both stores share.
std::string imageConfigToColumn(const image::ImageConfig& c);
ImageRecord imageFromColumns(const std::string& name, const std::string& tag,
                             const std::string& layers, int64_t size, double created,
                             const std::string& kind, const std::string& parent,
                             const std::string& config, const std::string& owner = "",
                             const std::string& visibility = "public",
                             const std::string& source = "");
// BlobRecord::extraData as a column: digests separated by one space ("" for none).
std::string digestsToColumn(const std::vector<std::string>& digests);
std::vector<std::string> digestsFromColumn(const std::string& column);
// The checks both stores make before a write: kInvalidArgument for an empty
// digest or one holding white space (setBlobExtraData), an empty `data`, a sha
// that is not 64 lower-case hex or a length <= 0 (putChunks).
Status checkExtraData(const std::vector<std::string>& blobs);
Status checkChunks(const std::string& data, const std::vector<ChunkLoc>& chunks);
std::string trajectoryToDoc(const TrajectoryRecord& r);
Result<TrajectoryRecord> trajectoryFromDoc(const std::string& id, const std::string& doc);

// Opens the store `spec` names (`dsec up --store`): "sqlite" (or empty) is
// SqliteStore at <dataDir>/state.db; a postgres:// or postgresql:// URI is
// PostgresStore. kInvalidArgument (field "store") for anything else or a URI
// libpq cannot parse; kUnavailable when the server cannot be reached. Messages
// never hold the password. `where` gets a description fit for logs.
Result<std::unique_ptr<Store>> openStore(const std::string& spec, const std::string& dataDir,
                                         std::string* where = nullptr);

}  // namespace dsec::platform
