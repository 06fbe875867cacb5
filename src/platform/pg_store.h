// PostgresStore: the Store (store.h) kept in a PostgreSQL database, so that
// several platform processes can share their state (DESIGN.md §7).
#pragma once

#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "platform/store.h"

typedef struct pg_conn PGconn;

namespace dsec::platform {

struct PostgresOptions {
  // Most connections open at once; a call waits for a free one beyond that.
  // Connections are opened on demand (the first one by open()).
  int poolSize = 8;
};

// Every call runs on one of a small pool of libpq connections, with
// synchronous_commit=on forced for the session: a write is flushed to the
// server's WAL before the call returns (the database's own durability settings,
// such as fsync, still apply). Values only ever travel as query parameters;
// step bodies are bytea.
//
// open() connects (connect_timeout 10 s unless the URI says otherwise, TCP
// keepalives on) and brings the schema up to date: migrations run in one
// transaction under a transaction-scoped advisory lock, so processes opening
// the same database at once apply each migration once; a database whose
// schema is newer than this build is refused (kFailedPrecondition).
//
// A call that loses its connection closes it and every idle one (what cut
// one most likely cut all: a server restart, a failover), and is retried once
// on a new connection when repeating it is harmless (reads, upserts; putStep checks that a
// conflicting row is its own); others (deleteImage, deletePolicy, deleteTrajectory,
// deleteTrajectoriesBefore) return kUnavailable saying the outcome is unknown. A server that cannot
// be reached gives kUnavailable naming it, never a hang. Errors and log lines name the server by
// redactPostgresUri(): never the password.
//
// Thread-safe.
class PostgresStore : public Store {
 public:
  // `uri`: a libpq connection URI (postgres:// or postgresql://).
  static Result<std::unique_ptr<PostgresStore>> open(const std::string& uri,
                                                     PostgresOptions opts = {});
  ~PostgresStore() override;

  // Newest schema version this build knows (the dsec_schema table holds the
  // database's).
  static int schemaVersion();

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
  bool shared() const override { return true; }
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

  class Query;  // pg_store.cc

 private:
  friend class Query;
  PostgresStore(std::string uri, std::string where, PostgresOptions opts)
      : uri_(std::move(uri)), where_(std::move(where)), opts_(opts) {}
  Result<PGconn*> connect();
  Result<PGconn*> acquire();
  void release(PGconn* c);
  // Closes `lost` and every idle connection.
  void discard(PGconn* lost);
  Status migrate();

  const std::string uri_;    // as given (holds the password, if any: never printed)
  const std::string where_;  // redacted, for messages
  const PostgresOptions opts_;

  std::mutex mu_;  // guards idle_, open_
  std::condition_variable freed_;
  std::vector<PGconn*> idle_;
  int open_ = 0;  // connections in existence (idle or in use)
};

// The URI without its password (user info and `password=` parameter), for
// messages and logs.
std::string redactPostgresUri(const std::string& uri);

}  // namespace dsec::platform
