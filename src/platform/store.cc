#include "platform/store.h"

#include <sqlite3.h>

#include <algorithm>
#include <nlohmann/json.hpp>
#include <optional>

#include "common/json_writer.h"
#include "common/util.h"
#include "image/block_ranges.h"

namespace dsec::platform {

int64_t BlobRecord::storedBytes() const {
  if (reclaimed.empty()) return size;
  auto r = image::BlockRanges::parse(reclaimed);
  if (!r.isOk()) return size;
  return std::max<int64_t>(0, size - int64_t(r->blocks()) * 4096);
}

using json = nlohmann::json;

namespace {

Status sqlError(sqlite3* db, const std::string& what) {
  return Status(Code::kInternal, what + ": " + sqlite3_errmsg(db));
}

// A prepared statement that finalizes itself.
class Stmt {
 public:
  Stmt(sqlite3* db, const char* sql) : db_(db) {
    rc_ = sqlite3_prepare_v2(db, sql, -1, &st_, nullptr);
  }
  Stmt(sqlite3* db, const std::string& sql) : Stmt(db, sql.c_str()) {}
  ~Stmt() { sqlite3_finalize(st_); }
  bool ok() const { return rc_ == SQLITE_OK; }
  Stmt& bind(int i, const std::string& v) {
    sqlite3_bind_text(st_, i, v.data(), int(v.size()), SQLITE_TRANSIENT);
    return *this;
  }
  Stmt& bind(int i, int64_t v) {
    sqlite3_bind_int64(st_, i, v);
    return *this;
  }
  Stmt& bind(int i, double v) {
    sqlite3_bind_double(st_, i, v);
    return *this;
  }
  Stmt& bindBlob(int i, const std::string& v) {
    sqlite3_bind_blob(st_, i, v.data(), int(v.size()), SQLITE_TRANSIENT);
    return *this;
  }
  int step() { return sqlite3_step(st_); }
  // For the next step with new bindings.
  void reset() {
    sqlite3_reset(st_);
    sqlite3_clear_bindings(st_);
  }
  // Text and blob columns alike (sqlite3_column_blob for a BLOB).
  std::string text(int col) {
    if (sqlite3_column_type(st_, col) == SQLITE_BLOB) {
      auto* b = static_cast<const char*>(sqlite3_column_blob(st_, col));
      return b ? std::string(b, sqlite3_column_bytes(st_, col)) : "";
    }
    auto* p = sqlite3_column_text(st_, col);
    return p ? std::string(reinterpret_cast<const char*>(p), sqlite3_column_bytes(st_, col)) : "";
  }
  int64_t i64(int col) { return sqlite3_column_int64(st_, col); }
  double dbl(int col) { return sqlite3_column_double(st_, col); }

 private:
  sqlite3* db_;
  sqlite3_stmt* st_ = nullptr;
  int rc_;
};

// Wall clock in SQL: one process writes this store, so its clock is the store's.
constexpr const char* kSqlNow = "((julianday('now') - 2440587.5) * 86400.0)";

// Every write of a sandbox row stamps `changed` itself. (AFTER INSERT/UPDATE
// triggers did until they were found to double the cost of each write: each
// fired a second UPDATE of the same row and of its index entry.)
const std::string kUpsertSandbox =
    std::string("INSERT INTO sandboxes(id, state, doc, changed) VALUES(?1, ?2, ?3, ") + kSqlNow +
    ") ON CONFLICT(id) DO UPDATE SET state=excluded.state, doc=excluded.doc, "
    "changed=excluded.changed";

}  // namespace

// Written with JsonWriter, not a json tree: it runs twice per sandbox created
// (pending, then running), and the tree cost more than the SQLite write.
std::string sandboxToJson(const SandboxRecord& r) {
  std::string out;
  out.reserve(768);
  JsonWriter w(out);
  w.beginObject()
      .member("id", r.id)
      .member("backend", proto::backendName(r.backend))
      .member("image", r.image)
      .member("layers", r.layers)
      .member("state", proto::stateName(r.state))
      .member("node", r.node)
      .member("pool", r.pool)
      .member("spread", r.spread)
      .member("burstable", r.burstable)
      .member("workspaces", r.workspaces)
      .member("toolkits", r.toolkits)
      .member("diffs", r.diffs)
      .member("error", r.error)
      .member("cpu", r.cpu)
      .member("memory_mb", r.memoryMb)
      .member("disk_mb", r.diskMb)
      .member("pids", r.pids)
      .member("ttl_s", r.ttlS)
      .member("idle_timeout_s", r.idleTimeoutS)
      .member("auto_pause_s", r.autoPauseS)
      .member("env", r.env)
      .member("user", r.user)
      .member("working_dir", r.workingDir)
      .member("labels", r.labels)
      .member("created_at", r.createdAt)
      .member("updated_at", r.updatedAt)
      .member("expires_at", r.expiresAt)
      .member("stopped_at", r.stoppedAt)
      .member("policy", r.policy)
      .member("readonly_paths", r.readonlyPaths)
      .member("hidden_paths", r.hiddenPaths)
      .member("owner", r.owner);
  if (!r.batch.empty()) w.member("batch", r.batch);
  if (!r.replica.empty()) w.member("replica", r.replica);
  if (!r.pausedTo.empty()) w.member("paused_to", r.pausedTo);
  w.key("phases").beginArray();
  for (auto& p : r.phases)
    w.beginObject().member("policy", p.policy).member("at", p.at).endObject();
  w.endArray();
  if (!r.ports.empty()) {
    w.key("ports").beginArray();
    for (auto& p : r.ports) {
      w.beginObject()
          .member("port", int64_t(p.port))
          .member("gen", int64_t(p.gen))
          .member("created_at", p.createdAt)
          .member("expires_at", p.expiresAt)
          .endObject();
    }
    w.endArray();
  }
  w.endObject();
  return out;
}

// The id is the document's first member: {"id":"...",<rest_>.
SandboxDocs::SandboxDocs(SandboxRecord r) {
  r.id.clear();
  rest_ = sandboxToJson(r);
  rest_.erase(0, std::string_view(R"({"id":"")").size());
}

std::string SandboxDocs::doc(const std::string& id) const {
  std::string out = R"({"id":)";
  out.reserve(out.size() + id.size() + 2 + rest_.size());
  appendJsonString(out, id);
  out += rest_;
  return out;
}

const char* batchStateName(BatchState s) {
  switch (s) {
    case BatchState::kRunning:
      return "running";
    case BatchState::kDone:
      return "done";
    case BatchState::kFailed:
      return "failed";
    case BatchState::kDeleted:
      return "deleted";
  }
  return "failed";
}

std::optional<BatchState> parseBatchState(std::string_view name) {
  for (BatchState s : {BatchState::kRunning, BatchState::kDone, BatchState::kFailed,
                       BatchState::kDeleted}) {
    if (name == batchStateName(s)) return s;
  }
  return std::nullopt;
}

std::string batchToJson(const BatchRecord& b) {
  return json{{"id", b.id},          {"owner", b.owner},           {"count", b.count},
              {"all_or_nothing", b.allOrNothing}, {"spec", b.spec},
              {"state", batchStateName(b.state)},
              {"error", b.error},    {"created_at", b.createdAt}, {"updated_at", b.updatedAt}}
      .dump();
}

Result<BatchRecord> batchFromJson(const std::string& s) {
  json j = json::parse(s, nullptr, false);
  if (j.is_discarded() || !j.is_object()) return internalError("corrupt batch record");
  try {
    BatchRecord b;
    b.id = j.at("id");
    b.owner = j.at("owner");
    b.count = j.at("count");
    b.allOrNothing = j.at("all_or_nothing");
    b.spec = j.at("spec");
    auto state = parseBatchState(j.at("state").get<std::string>());
    if (!state) return internalError("corrupt batch record: unknown state");
    b.state = *state;
    b.error = j.value("error", "");
    b.createdAt = j.at("created_at");
    b.updatedAt = j.at("updated_at");
    return b;
  } catch (const json::exception& e) {
    return internalError(std::string("corrupt batch record: ") + e.what());
  }
}

Result<SandboxRecord> sandboxFromJson(const std::string& s) {
  json j = json::parse(s, nullptr, false);
  if (j.is_discarded() || !j.is_object()) return internalError("corrupt sandbox record");
  try {
    SandboxRecord r;
    r.id = j.at("id");
    auto backend = proto::parseBackend(j.at("backend").get<std::string>());
    if (!backend) return internalError("corrupt sandbox record: unknown backend");
    r.backend = *backend;
    r.image = j.at("image");
    r.layers = j.at("layers").get<std::vector<std::string>>();
    using Strings = std::vector<std::string>;
    r.workspaces = j.value("workspaces", Strings{});
    r.toolkits = j.value("toolkits", Strings{});
    r.diffs = j.value("diffs", Strings{});
    auto state = proto::parseState(j.at("state").get<std::string>());
    if (!state) return internalError("corrupt sandbox record: unknown state");
    r.state = *state;
    r.node = j.value("node", "local");
    r.pool = j.value("pool", "default");
    r.spread = j.value("spread", true);
    r.burstable = j.value("burstable", false);
    r.error = j.value("error", "");
    r.cpu = j.at("cpu");
    r.memoryMb = j.at("memory_mb");
    r.diskMb = j.at("disk_mb");
    r.pids = j.at("pids");
    r.ttlS = j.at("ttl_s");
    r.idleTimeoutS = j.value("idle_timeout_s", int64_t(0));
    r.autoPauseS = j.value("auto_pause_s", int64_t(0));
    r.pausedTo = j.value("paused_to", "");
    r.env = j.at("env").get<std::map<std::string, std::string>>();
    r.user = j.value("user", "");  // absent in records written before image configs
    r.workingDir = j.value("working_dir", "");
    r.labels = j.at("labels").get<std::map<std::string, std::string>>();
    r.createdAt = j.at("created_at");
    r.updatedAt = j.at("updated_at");
    r.expiresAt = j.at("expires_at");
    r.stoppedAt = j.at("stopped_at");
    r.policy = j.value("policy", "default");
    r.readonlyPaths = j.value("readonly_paths", Strings{});
    r.hiddenPaths = j.value("hidden_paths", Strings{});
    r.owner = j.value("owner", "admin");  // absent in records older than tenants
    r.batch = j.value("batch", "");
    r.replica = j.value("replica", "");
    if (auto it = j.find("phases"); it != j.end() && it->is_array()) {
      for (auto& p : *it) r.phases.push_back({p.at("policy"), p.at("at")});
    }
    if (auto it = j.find("ports"); it != j.end() && it->is_array()) {
      for (auto& p : *it) {
        r.ports.push_back({p.at("port").get<int>(), p.at("gen").get<uint64_t>(),
                           p.value("created_at", 0.0), p.value("expires_at", 0.0)});
      }
    }
    return r;
  } catch (const json::exception& e) {
    return internalError(std::string("corrupt sandbox record: ") + e.what());
  }
}

Result<std::unique_ptr<SqliteStore>> SqliteStore::open(const std::string& path) {
  std::unique_ptr<SqliteStore> s(new SqliteStore());
  int rc = sqlite3_open_v2(path.c_str(), &s->db_,
                           SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE | SQLITE_OPEN_FULLMUTEX,
                           nullptr);
  if (rc != SQLITE_OK) return Status(Code::kInternal, "open " + path + ": " + sqlite3_errstr(rc));
  sqlite3_busy_timeout(s->db_, 5000);
  RETURN_IF_ERROR(s->exec("PRAGMA journal_mode=WAL"));
  // WAL + NORMAL: a commit reaches the OS before the call returns, so it
  // survives any crash of dsec; only a power loss can drop the last commits,
  // and a power loss also ends every sandbox those records describe.
  // Shared deployments use PostgreSQL with full durability.
  RETURN_IF_ERROR(s->exec("PRAGMA synchronous=NORMAL"));
  // Up to 64 MiB of pages in memory (SQLite's default is 2 MiB): with
  // hundreds of thousands of records, inserts at random ids otherwise read
  // most B-tree pages back from the OS (a batch of 32,768 took seconds).
  RETURN_IF_ERROR(s->exec("PRAGMA cache_size=-65536"));
  RETURN_IF_ERROR(s->exec(
      "CREATE TABLE IF NOT EXISTS sandboxes(id TEXT PRIMARY KEY, state TEXT NOT NULL, "
      "doc TEXT NOT NULL);"
      "CREATE TABLE IF NOT EXISTS blobs(digest TEXT PRIMARY KEY, size INTEGER NOT NULL, "
      "created_at REAL NOT NULL);"
      "CREATE TABLE IF NOT EXISTS images(name TEXT NOT NULL, tag TEXT NOT NULL, "
      "layers TEXT NOT NULL, size INTEGER NOT NULL, created_at REAL NOT NULL, "
      "PRIMARY KEY(name, tag));"
      "CREATE TABLE IF NOT EXISTS policies(name TEXT PRIMARY KEY, doc TEXT NOT NULL);"
      "CREATE TABLE IF NOT EXISTS trajectory_steps(trajectory TEXT NOT NULL, step INTEGER NOT NULL, "
      "digest TEXT NOT NULL, kind TEXT NOT NULL, sandbox TEXT NOT NULL, request TEXT NOT NULL, "
      "status INTEGER NOT NULL, content_type TEXT NOT NULL, body BLOB NOT NULL, "
      "started_at REAL NOT NULL, finished_at REAL NOT NULL, PRIMARY KEY(trajectory, step));"
      "CREATE TABLE IF NOT EXISTS trajectories(id TEXT PRIMARY KEY, doc TEXT NOT NULL);"
      "CREATE TABLE IF NOT EXISTS tenants(id TEXT PRIMARY KEY, doc TEXT NOT NULL);"
      "CREATE TABLE IF NOT EXISTS api_keys(id TEXT PRIMARY KEY, tenant TEXT NOT NULL, "
      "doc TEXT NOT NULL);"
      "CREATE TABLE IF NOT EXISTS batches(id TEXT PRIMARY KEY, doc TEXT NOT NULL);"
      "CREATE TABLE IF NOT EXISTS build_cache(key TEXT PRIMARY KEY, layer TEXT NOT NULL, "
      "config TEXT NOT NULL DEFAULT '', created_at REAL NOT NULL, used_at REAL NOT NULL);"
      "CREATE INDEX IF NOT EXISTS build_cache_used ON build_cache(used_at);"));
  // Columns added after the first release of the schema; "duplicate column"
  // means the database already has them.
  for (const char* alter : {"ALTER TABLE images ADD COLUMN kind TEXT NOT NULL DEFAULT 'base'",
                            "ALTER TABLE blobs ADD COLUMN kind TEXT NOT NULL DEFAULT ''",
                            "ALTER TABLE images ADD COLUMN parent TEXT NOT NULL DEFAULT ''",
                            "ALTER TABLE blobs ADD COLUMN data TEXT NOT NULL DEFAULT ''",
                            "ALTER TABLE blobs ADD COLUMN chunks TEXT NOT NULL DEFAULT ''",
                            "ALTER TABLE images ADD COLUMN config TEXT NOT NULL DEFAULT ''",
                            "ALTER TABLE trajectory_steps ADD COLUMN content TEXT NOT NULL "
                            "DEFAULT ''",
                            "ALTER TABLE images ADD COLUMN owner TEXT NOT NULL DEFAULT ''",
                            "ALTER TABLE images ADD COLUMN visibility TEXT NOT NULL DEFAULT "
                            "'public'",
                            "ALTER TABLE images ADD COLUMN source TEXT NOT NULL DEFAULT ''",
                            "ALTER TABLE blobs ADD COLUMN source TEXT NOT NULL DEFAULT ''",
                            "ALTER TABLE blobs ADD COLUMN extra_data TEXT NOT NULL DEFAULT ''",
                            "ALTER TABLE blobs ADD COLUMN extra_reads TEXT NOT NULL DEFAULT ''",
                            "ALTER TABLE blobs ADD COLUMN reclaimed TEXT NOT NULL DEFAULT ''"}) {
    Status st = s->exec(alter);
    if (!st.isOk() && st.message().find("duplicate column") == std::string::npos) return st;
  }
  RETURN_IF_ERROR(
      s->exec("CREATE INDEX IF NOT EXISTS blobs_source ON blobs(source) WHERE source <> ''"));
  // The chunk table (Store::putChunks): one row per distinct chunk.
  RETURN_IF_ERROR(
      s->exec("CREATE TABLE IF NOT EXISTS chunks(sha TEXT NOT NULL, length INTEGER NOT NULL, "
              "data TEXT NOT NULL, block INTEGER NOT NULL, PRIMARY KEY(sha, length)) "
              "WITHOUT ROWID;"
              "CREATE INDEX IF NOT EXISTS chunks_data ON chunks(data);"));
  RETURN_IF_ERROR(s->openNodeTables());
  return s;
}

SqliteStore::~SqliteStore() {
  sqlite3_finalize(findChunkStmt_);
  sqlite3_close(db_);
}

Status SqliteStore::exec(const std::string& sql) {
  char* err = nullptr;
  if (sqlite3_exec(db_, sql.c_str(), nullptr, nullptr, &err) != SQLITE_OK) {
    std::string msg = err ? err : "unknown";
    sqlite3_free(err);
    return Status(Code::kInternal, "sqlite: " + msg);
  }
  return Status::ok();
}

Status SqliteStore::putSandbox(const SandboxRecord& r) {
  std::lock_guard lk(mu_);
  Stmt st(db_, kUpsertSandbox);
  if (!st.ok()) return sqlError(db_, "prepare putSandbox");
  st.bind(1, r.id).bind(2, std::string(proto::stateName(r.state))).bind(3, sandboxToJson(r));
  if (st.step() != SQLITE_DONE) return sqlError(db_, "putSandbox");
  return Status::ok();
}

Status SqliteStore::putSandboxesLocked(const std::vector<SandboxRecord>& rs) {
  Stmt st(db_, kUpsertSandbox);
  if (!st.ok()) return sqlError(db_, "prepare putSandboxes");
  for (auto& r : rs) {
    st.bind(1, r.id).bind(2, std::string(proto::stateName(r.state))).bind(3, sandboxToJson(r));
    if (st.step() != SQLITE_DONE) return sqlError(db_, "putSandboxes");
    st.reset();
  }
  return Status::ok();
}

Status SqliteStore::putSandboxes(const std::vector<SandboxRecord>& rs,
                                 const std::vector<std::string>& drop) {
  if (rs.empty() && drop.empty()) return Status::ok();
  std::lock_guard lk(mu_);
  RETURN_IF_ERROR(exec("BEGIN IMMEDIATE"));
  Status st = putSandboxesLocked(rs);
  if (st.isOk() && !drop.empty()) {
    Stmt del(db_, "DELETE FROM sandboxes WHERE id=?1");
    for (auto& id : drop) {
      del.bind(1, id);
      if (del.step() != SQLITE_DONE) {
        st = sqlError(db_, "putSandboxes delete");
        break;
      }
      del.reset();
    }
  }
  if (!st.isOk()) {
    (void)exec("ROLLBACK");
    return st;
  }
  return exec("COMMIT");
}

Status SqliteStore::putBatch(const BatchRecord& b, const std::vector<std::string>& ids,
                             const SandboxRecord& pending) {
  std::optional<SandboxDocs> docs;
  if (!ids.empty()) docs.emplace(pending);
  std::lock_guard lk(mu_);
  RETURN_IF_ERROR(exec("BEGIN IMMEDIATE"));
  Stmt st(db_, "INSERT INTO batches(id, doc) VALUES(?1, ?2) "
               "ON CONFLICT(id) DO UPDATE SET doc=excluded.doc");
  Status s = st.ok() ? Status::ok() : sqlError(db_, "prepare putBatch");
  if (s.isOk()) {
    st.bind(1, b.id).bind(2, batchToJson(b));
    if (st.step() != SQLITE_DONE) s = sqlError(db_, "putBatch");
  }
  if (s.isOk() && docs) {
    Stmt row(db_, kUpsertSandbox);
    if (!row.ok()) s = sqlError(db_, "prepare putBatch sandboxes");
    for (size_t i = 0; s.isOk() && i < ids.size(); ++i) {
      row.bind(1, ids[i]).bind(2, std::string(proto::stateName(pending.state))).bind(3, docs->doc(ids[i]));
      if (row.step() != SQLITE_DONE) s = sqlError(db_, "putBatch sandboxes");
      row.reset();
    }
  }
  if (!s.isOk()) {
    (void)exec("ROLLBACK");
    return s;
  }
  return exec("COMMIT");
}

Result<std::vector<BatchRecord>> SqliteStore::loadBatches() {
  std::lock_guard lk(mu_);
  Stmt st(db_, "SELECT doc FROM batches ORDER BY id");
  if (!st.ok()) return sqlError(db_, "prepare loadBatches");
  std::vector<BatchRecord> out;
  int rc;
  while ((rc = st.step()) == SQLITE_ROW) {
    ASSIGN_OR_RETURN(auto b, batchFromJson(st.text(0)));
    out.push_back(std::move(b));
  }
  if (rc != SQLITE_DONE) return sqlError(db_, "loadBatches");
  return out;
}

Status SqliteStore::deleteBatch(const std::string& id) {
  std::lock_guard lk(mu_);
  Stmt st(db_, "DELETE FROM batches WHERE id=?1");
  st.bind(1, id);
  if (st.step() != SQLITE_DONE) return sqlError(db_, "deleteBatch");
  if (sqlite3_changes(db_) == 0) return notFound("batch " + id + " not found");
  return Status::ok();
}

Status SqliteStore::deleteSandbox(const std::string& id) {
  std::lock_guard lk(mu_);
  Stmt st(db_, "DELETE FROM sandboxes WHERE id=?1");
  st.bind(1, id);
  if (st.step() != SQLITE_DONE) return sqlError(db_, "deleteSandbox");
  return Status::ok();
}

Result<std::vector<SandboxRecord>> SqliteStore::loadSandboxes() {
  std::lock_guard lk(mu_);
  Stmt st(db_, "SELECT doc FROM sandboxes");
  std::vector<SandboxRecord> out;
  int rc;
  while ((rc = st.step()) == SQLITE_ROW) {
    ASSIGN_OR_RETURN(auto r, sandboxFromJson(st.text(0)));
    out.push_back(std::move(r));
  }
  if (rc != SQLITE_DONE) return sqlError(db_, "loadSandboxes");
  return out;
}

Status SqliteStore::putBlob(const std::string& digest, int64_t size) {
  std::lock_guard lk(mu_);
  // A re-upload refreshes created_at (the GC grace period) and keeps the kind.
  Stmt st(db_,
          "INSERT INTO blobs(digest, size, created_at) "
          "VALUES(?1, ?2, (julianday('now') - 2440587.5) * 86400.0) "
          "ON CONFLICT(digest) DO UPDATE SET created_at=excluded.created_at");
  st.bind(1, digest).bind(2, size);
  if (st.step() != SQLITE_DONE) return sqlError(db_, "putBlob");
  return Status::ok();
}

Result<bool> SqliteStore::hasBlob(const std::string& digest) {
  auto size = blobSize(digest);
  if (size.isOk()) return true;
  if (size.status().code() == Code::kNotFound) return false;
  return std::move(size).takeStatus();
}

Result<int64_t> SqliteStore::blobSize(const std::string& digest) {
  std::lock_guard lk(mu_);
  Stmt st(db_, "SELECT size FROM blobs WHERE digest=?1");
  st.bind(1, digest);
  int rc = st.step();
  if (rc == SQLITE_ROW) return st.i64(0);
  if (rc == SQLITE_DONE) return notFound("blob " + digest);
  return sqlError(db_, "blobSize");
}

Result<BlobRecord> SqliteStore::getBlob(const std::string& digest) {
  std::lock_guard lk(mu_);
  Stmt st(db_,
          "SELECT digest, size, created_at, kind, data, chunks, source, extra_data, extra_reads, "
          "reclaimed FROM blobs "
          "WHERE digest=?1");
  st.bind(1, digest);
  int rc = st.step();
  if (rc == SQLITE_ROW) {
    return BlobRecord{st.text(0), st.i64(1),  st.dbl(2), st.text(3),
                      st.text(4), st.text(5), st.text(6), digestsFromColumn(st.text(7)),
                      st.text(8), st.text(9)};
  }
  if (rc == SQLITE_DONE) return notFound("layer " + digest + " not found");
  return sqlError(db_, "getBlob");
}

Result<std::vector<BlobRecord>> SqliteStore::listBlobs() {
  std::lock_guard lk(mu_);
  Stmt st(db_,
          "SELECT digest, size, created_at, kind, data, chunks, source, extra_data, extra_reads, "
          "reclaimed FROM blobs "
          "ORDER BY digest");
  std::vector<BlobRecord> out;
  int rc;
  while ((rc = st.step()) == SQLITE_ROW) {
    out.push_back(BlobRecord{st.text(0), st.i64(1), st.dbl(2), st.text(3), st.text(4), st.text(5),
                             st.text(6), digestsFromColumn(st.text(7)), st.text(8),
                             st.text(9)});
  }
  if (rc != SQLITE_DONE) return sqlError(db_, "listBlobs");
  return out;
}

Status SqliteStore::setBlobKind(const std::string& digest, const std::string& kind) {
  std::lock_guard lk(mu_);
  Stmt st(db_, "UPDATE blobs SET kind=?2 WHERE digest=?1");
  st.bind(1, digest).bind(2, kind);
  if (st.step() != SQLITE_DONE) return sqlError(db_, "setBlobKind");
  return Status::ok();
}

Status SqliteStore::setBlobData(const std::string& digest, const std::string& data) {
  std::lock_guard lk(mu_);
  Stmt st(db_, "UPDATE blobs SET data=?2 WHERE digest=?1");
  st.bind(1, digest).bind(2, data);
  if (st.step() != SQLITE_DONE) return sqlError(db_, "setBlobData");
  return Status::ok();
}

Status SqliteStore::setBlobChunks(const std::string& digest, const std::string& chunks) {
  std::lock_guard lk(mu_);
  Stmt st(db_, "UPDATE blobs SET chunks=?2 WHERE digest=?1");
  st.bind(1, digest).bind(2, chunks);
  if (st.step() != SQLITE_DONE) return sqlError(db_, "setBlobChunks");
  return Status::ok();
}

Status SqliteStore::deleteBlob(const std::string& digest) {
  std::lock_guard lk(mu_);
  RETURN_IF_ERROR(exec("BEGIN IMMEDIATE"));
  Status s;
  for (const char* sql :
       {"DELETE FROM chunks WHERE data=?1", "DELETE FROM blobs WHERE digest=?1"}) {
    Stmt st(db_, sql);
    st.bind(1, digest);
    if (st.step() != SQLITE_DONE) {
      s = sqlError(db_, "deleteBlob");
      break;
    }
  }
  if (!s.isOk()) {
    (void)exec("ROLLBACK");
    return s;
  }
  return exec("COMMIT");
}

Status SqliteStore::setBlobSource(const std::string& digest, const std::string& source) {
  std::lock_guard lk(mu_);
  Stmt st(db_, "UPDATE blobs SET source=?2 WHERE digest=?1");
  st.bind(1, digest).bind(2, source);
  if (st.step() != SQLITE_DONE) return sqlError(db_, "setBlobSource");
  return Status::ok();
}

Result<std::string> SqliteStore::findLayerBySource(const std::string& source) {
  std::lock_guard lk(mu_);
  Stmt st(db_, "SELECT digest FROM blobs WHERE source=?1 ORDER BY created_at DESC LIMIT 1");
  st.bind(1, source);
  int rc = st.step();
  if (rc == SQLITE_ROW) return st.text(0);
  if (rc == SQLITE_DONE) return notFound("no layer converted from " + source);
  return sqlError(db_, "findLayerBySource");
}

Status SqliteStore::setBlobExtraData(const std::string& layer,
                                     const std::vector<std::string>& blobs) {
  RETURN_IF_ERROR(checkExtraData(blobs));
  std::lock_guard lk(mu_);
  Stmt st(db_, "UPDATE blobs SET extra_data=?2 WHERE digest=?1");
  st.bind(1, layer).bind(2, digestsToColumn(blobs));
  if (st.step() != SQLITE_DONE) return sqlError(db_, "setBlobExtraData");
  return Status::ok();
}

Result<std::vector<std::string>> SqliteStore::imagesNaming(const std::string& layer) {
  std::lock_guard lk(mu_);
  // layers is a JSON array of digests: the quoted digest is one element.
  Stmt st(db_, "SELECT name, tag FROM images WHERE instr(layers, '\"' || ?1 || '\"') > 0");
  st.bind(1, layer);
  std::vector<std::string> out;
  int rc;
  while ((rc = st.step()) == SQLITE_ROW) out.push_back(st.text(0) + ":" + st.text(1));
  if (rc != SQLITE_DONE) return sqlError(db_, "imagesNaming");
  return out;
}

Result<std::vector<std::string>> SqliteStore::layersNaming(const std::string& data) {
  std::lock_guard lk(mu_);
  // extra_data is digests separated by one space (digestsToColumn).
  Stmt st(db_,
          "SELECT digest FROM blobs WHERE data=?1 OR instr(' ' || extra_data || ' ', ' ' || ?1 || ' ') > 0");
  st.bind(1, data);
  std::vector<std::string> out;
  int rc;
  while ((rc = st.step()) == SQLITE_ROW) out.push_back(st.text(0));
  if (rc != SQLITE_DONE) return sqlError(db_, "layersNaming");
  return out;
}

Status SqliteStore::setBlobExtraReads(const std::string& layer, const std::string& reads) {
  std::lock_guard lk(mu_);
  Stmt st(db_, "UPDATE blobs SET extra_reads=?2 WHERE digest=?1");
  st.bind(1, layer).bind(2, reads);
  if (st.step() != SQLITE_DONE) return sqlError(db_, "setBlobExtraReads");
  return Status::ok();
}

Status SqliteStore::setBlobReclaimed(const std::string& data, const std::string& reclaimed) {
  std::lock_guard lk(mu_);
  Stmt st(db_, "UPDATE blobs SET reclaimed=?2 WHERE digest=?1");
  st.bind(1, data).bind(2, reclaimed);
  if (st.step() != SQLITE_DONE) return sqlError(db_, "setBlobReclaimed");
  return Status::ok();
}

Status SqliteStore::putChunks(const std::string& data, const std::vector<ChunkLoc>& chunks) {
  RETURN_IF_ERROR(checkChunks(data, chunks));
  if (chunks.empty()) return Status::ok();
  std::lock_guard lk(mu_);
  RETURN_IF_ERROR(exec("BEGIN IMMEDIATE"));
  Stmt st(db_,
          "INSERT INTO chunks(sha, length, data, block) VALUES(?1, ?2, ?3, ?4) "
          "ON CONFLICT(sha, length) DO NOTHING");
  Status s = st.ok() ? Status::ok() : sqlError(db_, "prepare putChunks");
  for (size_t i = 0; s.isOk() && i < chunks.size(); ++i) {
    st.bind(1, chunks[i].sha).bind(2, chunks[i].length).bind(3, data);
    st.bind(4, int64_t(chunks[i].block));
    if (st.step() != SQLITE_DONE) s = sqlError(db_, "putChunks");
    st.reset();
  }
  if (!s.isOk()) {
    (void)exec("ROLLBACK");
    return s;
  }
  return exec("COMMIT");
}

Result<std::optional<ChunkLoc>> SqliteStore::findChunk(const std::string& sha, int64_t length) {
  std::lock_guard lk(mu_);
  if (!findChunkStmt_ &&
      sqlite3_prepare_v2(db_, "SELECT data, block FROM chunks WHERE sha=?1 AND length=?2", -1,
                         &findChunkStmt_, nullptr) != SQLITE_OK) {
    return sqlError(db_, "findChunk");
  }
  sqlite3_stmt* st = findChunkStmt_;
  sqlite3_bind_text(st, 1, sha.data(), int(sha.size()), SQLITE_TRANSIENT);
  sqlite3_bind_int64(st, 2, length);
  int rc = sqlite3_step(st);
  std::optional<ChunkLoc> out;
  if (rc == SQLITE_ROW) {
    auto* data = sqlite3_column_text(st, 0);
    out = ChunkLoc{sha, length,
                   data ? std::string(reinterpret_cast<const char*>(data),
                                      size_t(sqlite3_column_bytes(st, 0)))
                        : std::string(),
                   uint32_t(sqlite3_column_int64(st, 1))};
  }
  Status err = rc == SQLITE_ROW || rc == SQLITE_DONE ? Status::ok() : sqlError(db_, "findChunk");
  sqlite3_reset(st);
  sqlite3_clear_bindings(st);
  if (!err.isOk()) return err;
  return out;
}

Status SqliteStore::deleteChunksIn(const std::string& data,
                                   const std::vector<std::pair<uint64_t, uint64_t>>& ranges) {
  if (ranges.empty()) return Status::ok();
  std::lock_guard lk(mu_);
  RETURN_IF_ERROR(exec("BEGIN IMMEDIATE"));
  Stmt st(db_,
          "DELETE FROM chunks WHERE data=?1 AND block < ?3 AND block + (length + 4095) / 4096 > ?2");
  Status s;
  for (auto& [start, count] : ranges) {
    st.reset();
    st.bind(1, data).bind(2, int64_t(start)).bind(3, int64_t(start + count));
    if (st.step() != SQLITE_DONE) {
      s = sqlError(db_, "deleteChunksIn");
      break;
    }
  }
  if (!s.isOk()) {
    (void)exec("ROLLBACK");
    return s;
  }
  return exec("COMMIT");
}

Status SqliteStore::deleteChunksOf(const std::string& data) {
  std::lock_guard lk(mu_);
  Stmt st(db_, "DELETE FROM chunks WHERE data=?1");
  st.bind(1, data);
  if (st.step() != SQLITE_DONE) return sqlError(db_, "deleteChunksOf");
  return Status::ok();
}

Result<std::vector<ChunkKey>> SqliteStore::listChunkKeys(const ChunkKey& after, size_t limit) {
  if (limit == 0) return invalidArg("limit", "a page of chunk keys needs a limit above 0");
  // A range of the primary key (the table is WITHOUT ROWID: the key is its
  // b-tree), in its BINARY order: each page one seek and `limit` rows.
  std::lock_guard lk(mu_);
  Stmt st(db_,
          "SELECT sha, length FROM chunks WHERE (sha, length) > (?1, ?2) "
          "ORDER BY sha, length LIMIT ?3");
  if (!st.ok()) return sqlError(db_, "prepare listChunkKeys");
  st.bind(1, after.sha).bind(2, after.length).bind(3, int64_t(limit));
  std::vector<ChunkKey> out;
  int rc;
  while ((rc = st.step()) == SQLITE_ROW) out.push_back({st.text(0), st.i64(1)});
  if (rc != SQLITE_DONE) return sqlError(db_, "listChunkKeys");
  return out;
}

namespace {
bool isLowerHex(std::string_view s) {
  for (char c : s) {
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  }
  return true;
}
}  // namespace

std::string digestsToColumn(const std::vector<std::string>& digests) {
  std::string out;
  for (auto& d : digests) {
    if (!out.empty()) out += ' ';
    out += d;
  }
  return out;
}

std::vector<std::string> digestsFromColumn(const std::string& column) {
  std::vector<std::string> out;
  for (auto& d : splitString(column, ' ')) {
    if (!d.empty()) out.push_back(std::move(d));
  }
  return out;
}

Status checkExtraData(const std::vector<std::string>& blobs) {
  for (auto& d : blobs) {
    if (d.empty() || d.find_first_of(" \t\n") != std::string::npos) {
      return invalidArg("extra_data", "bad data blob digest \"" + d + "\"");
    }
  }
  return Status::ok();
}

Status checkChunks(const std::string& data, const std::vector<ChunkLoc>& chunks) {
  if (data.empty()) return invalidArg("data", "a chunk's data blob must be named");
  for (auto& c : chunks) {
    if (c.sha.size() != 64 || !isLowerHex(c.sha)) {
      return invalidArg("sha", "chunk sha must be 64 lower-case hex, not \"" + c.sha + "\"");
    }
    if (c.length <= 0) {
      return invalidArg("length", "chunk " + c.sha + " has length " + std::to_string(c.length));
    }
  }
  return Status::ok();
}

// The config column: '' when the image has none, else {"user","env","working_dir"}
// and, when set, "entrypoint", "cmd" and "labels".
std::string imageConfigToColumn(const image::ImageConfig& c) {
  if (c.empty()) return "";
  json j = {{"user", c.user}, {"env", c.env}, {"working_dir", c.workingDir}};
  if (!c.entrypoint.empty()) j["entrypoint"] = c.entrypoint;
  if (!c.cmd.empty()) j["cmd"] = c.cmd;
  if (!c.labels.empty()) j["labels"] = c.labels;
  return j.dump(-1, ' ', false, json::error_handler_t::replace);
}

namespace {
image::ImageConfig configFromColumn(const std::string& text) {
  image::ImageConfig c;
  json j = json::parse(text, nullptr, false);
  if (!j.is_object()) return c;
  if (auto u = j.find("user"); u != j.end() && u->is_string()) c.user = *u;
  if (auto w = j.find("working_dir"); w != j.end() && w->is_string()) c.workingDir = *w;
  if (auto e = j.find("env"); e != j.end() && e->is_array()) {
    for (auto& kv : *e) {
      if (kv.is_string()) c.env.push_back(kv);
    }
  }
  for (auto [key, out] : {std::pair{"entrypoint", &c.entrypoint}, std::pair{"cmd", &c.cmd}}) {
    if (auto a = j.find(key); a != j.end() && a->is_array()) {
      for (auto& x : *a) {
        if (x.is_string()) out->push_back(x);
      }
    }
  }
  if (auto l = j.find("labels"); l != j.end() && l->is_object()) {
    for (auto& [k, v] : l->items()) {
      if (v.is_string()) c.labels[k] = v;
    }
  }
  return c;
}
}  // namespace

Status SqliteStore::putImage(const ImageRecord& r) {
  std::lock_guard lk(mu_);
  Stmt st(db_,
          "INSERT OR REPLACE INTO images(name, tag, layers, size, created_at, kind, parent, "
          "config, owner, visibility, source) VALUES(?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, "
          "?11)");
  st.bind(1, r.name).bind(2, r.tag).bind(3, json(r.layers).dump()).bind(4, r.size);
  st.bind(5, r.createdAt).bind(6, r.kind).bind(7, r.parent).bind(8, imageConfigToColumn(r.config));
  st.bind(9, r.owner).bind(10, r.visibility).bind(11, r.source);
  if (st.step() != SQLITE_DONE) return sqlError(db_, "putImage");
  return Status::ok();
}

ImageRecord imageFromColumns(const std::string& name, const std::string& tag,
                             const std::string& layers, int64_t size, double created,
                             const std::string& kind, const std::string& parent,
                             const std::string& config, const std::string& owner,
                             const std::string& visibility, const std::string& source) {
  ImageRecord r{name, tag, {}, size, created, kind, parent, configFromColumn(config)};
  r.owner = owner;
  r.source = source;
  r.visibility = visibility.empty() ? "public" : visibility;
  json j = json::parse(layers, nullptr, false);
  if (j.is_array()) {
    for (auto& l : j) {
      if (l.is_string()) r.layers.push_back(l);
    }
  }
  return r;
}

Result<ImageRecord> SqliteStore::getImage(const std::string& name, const std::string& tag) {
  std::lock_guard lk(mu_);
  Stmt st(db_,
          "SELECT name, tag, layers, size, created_at, kind, parent, config, owner, visibility, "
          "source FROM images "
          "WHERE name=?1 AND tag=?2");
  st.bind(1, name).bind(2, tag);
  int rc = st.step();
  if (rc == SQLITE_ROW) {
    return imageFromColumns(st.text(0), st.text(1), st.text(2), st.i64(3), st.dbl(4), st.text(5),
                            st.text(6), st.text(7), st.text(8), st.text(9), st.text(10));
  }
  if (rc == SQLITE_DONE) return notFound("image " + name + ":" + tag + " not found");
  return sqlError(db_, "getImage");
}

Result<std::vector<ImageRecord>> SqliteStore::listImages() {
  std::lock_guard lk(mu_);
  Stmt st(db_,
          "SELECT name, tag, layers, size, created_at, kind, parent, config, owner, visibility, "
          "source FROM images "
          "ORDER BY name, tag");
  std::vector<ImageRecord> out;
  int rc;
  while ((rc = st.step()) == SQLITE_ROW) {
    out.push_back(imageFromColumns(st.text(0), st.text(1), st.text(2), st.i64(3), st.dbl(4),
                                   st.text(5), st.text(6), st.text(7), st.text(8), st.text(9),
                                   st.text(10)));
  }
  if (rc != SQLITE_DONE) return sqlError(db_, "listImages");
  return out;
}

Status SqliteStore::deleteImage(const std::string& name, const std::string& tag) {
  std::lock_guard lk(mu_);
  Stmt st(db_, "DELETE FROM images WHERE name=?1 AND tag=?2");
  st.bind(1, name).bind(2, tag);
  if (st.step() != SQLITE_DONE) return sqlError(db_, "deleteImage");
  if (sqlite3_changes(db_) == 0) return notFound("image " + name + ":" + tag + " not found");
  return Status::ok();
}

Status SqliteStore::putBuildCache(const BuildCacheEntry& e) {
  std::lock_guard lk(mu_);
  Stmt st(db_,
          "INSERT OR REPLACE INTO build_cache(key, layer, config, created_at, used_at) "
          "VALUES(?1, ?2, ?3, ?4, ?5)");
  st.bind(1, e.key).bind(2, e.layer).bind(3, e.config).bind(4, e.createdAt).bind(5, e.usedAt);
  if (st.step() != SQLITE_DONE) return sqlError(db_, "putBuildCache");
  return Status::ok();
}

Result<BuildCacheEntry> SqliteStore::getBuildCache(const std::string& key) {
  std::lock_guard lk(mu_);
  Stmt st(db_, "SELECT key, layer, config, created_at, used_at FROM build_cache WHERE key=?1");
  st.bind(1, key);
  int rc = st.step();
  if (rc == SQLITE_DONE) return notFound("no build cache entry " + key);
  if (rc != SQLITE_ROW) return sqlError(db_, "getBuildCache");
  return BuildCacheEntry{st.text(0), st.text(1), st.text(2), st.dbl(3), st.dbl(4)};
}

Status SqliteStore::touchBuildCache(const std::string& key, double at) {
  std::lock_guard lk(mu_);
  Stmt st(db_, "UPDATE build_cache SET used_at=MAX(used_at, ?2) WHERE key=?1");
  st.bind(1, key).bind(2, at);
  if (st.step() != SQLITE_DONE) return sqlError(db_, "touchBuildCache");
  return Status::ok();
}

Result<std::set<std::string>> SqliteStore::buildCacheLayers(double since) {
  std::lock_guard lk(mu_);
  Stmt st(db_, "SELECT DISTINCT layer FROM build_cache WHERE used_at >= ?1");
  st.bind(1, since);
  std::set<std::string> out;
  int rc;
  while ((rc = st.step()) == SQLITE_ROW) out.insert(st.text(0));
  if (rc != SQLITE_DONE) return sqlError(db_, "buildCacheLayers");
  return out;
}

Result<int64_t> SqliteStore::deleteBuildCacheBefore(double t) {
  std::lock_guard lk(mu_);
  Stmt st(db_, "DELETE FROM build_cache WHERE used_at < ?1");
  st.bind(1, t);
  if (st.step() != SQLITE_DONE) return sqlError(db_, "deleteBuildCacheBefore");
  return int64_t(sqlite3_changes(db_));
}

Status SqliteStore::putPolicy(const std::string& name, const std::string& doc) {
  std::lock_guard lk(mu_);
  Stmt st(db_, "INSERT OR REPLACE INTO policies(name, doc) VALUES(?1, ?2)");
  st.bind(1, name).bind(2, doc);
  if (st.step() != SQLITE_DONE) return sqlError(db_, "putPolicy");
  return Status::ok();
}

Status SqliteStore::deletePolicy(const std::string& name) {
  std::lock_guard lk(mu_);
  Stmt st(db_, "DELETE FROM policies WHERE name=?1");
  st.bind(1, name);
  if (st.step() != SQLITE_DONE) return sqlError(db_, "deletePolicy");
  if (sqlite3_changes(db_) == 0) return notFound("policy " + name + " not found");
  return Status::ok();
}

Result<std::vector<std::string>> SqliteStore::loadPolicies() {
  std::lock_guard lk(mu_);
  Stmt st(db_, "SELECT doc FROM policies ORDER BY name");
  std::vector<std::string> out;
  int rc;
  while ((rc = st.step()) == SQLITE_ROW) out.push_back(st.text(0));
  if (rc != SQLITE_DONE) return sqlError(db_, "loadPolicies");
  return out;
}

namespace {
TrajectoryStep stepFromRow(Stmt& st) {
  TrajectoryStep s;
  s.trajectory = st.text(0);
  s.step = st.i64(1);
  s.digest = st.text(2);
  s.kind = st.text(3);
  s.sandbox = st.text(4);
  s.request = st.text(5);
  s.status = int(st.i64(6));
  s.contentType = st.text(7);
  s.body = st.text(8);
  s.startedAt = st.dbl(9);
  s.finishedAt = st.dbl(10);
  s.content = st.text(11);
  return s;
}
constexpr const char* kStepColumns =
    "trajectory, step, digest, kind, sandbox, request, status, content_type, body, started_at, "
    "finished_at, content";
}  // namespace

Status SqliteStore::putStep(const TrajectoryStep& s) {
  std::lock_guard lk(mu_);
  Stmt st(db_, std::string("INSERT INTO trajectory_steps(") + kStepColumns +
                   ") VALUES(?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12)");
  st.bind(1, s.trajectory).bind(2, s.step).bind(3, s.digest).bind(4, s.kind).bind(5, s.sandbox);
  st.bind(6, s.request).bind(7, int64_t(s.status)).bind(8, s.contentType).bindBlob(9, s.body);
  st.bind(10, s.startedAt).bind(11, s.finishedAt).bind(12, s.content);
  int rc = st.step();
  if (rc == SQLITE_CONSTRAINT) {
    return Status(Code::kAlreadyExists, "step " + std::to_string(s.step) + " of trajectory " +
                                            s.trajectory + " is already stored");
  }
  if (rc != SQLITE_DONE) return sqlError(db_, "putStep");
  return Status::ok();
}

Result<TrajectoryStep> SqliteStore::getStep(const std::string& trajectory, int64_t step) {
  std::lock_guard lk(mu_);
  Stmt st(db_, std::string("SELECT ") + kStepColumns +
                   " FROM trajectory_steps WHERE trajectory=?1 AND step=?2");
  st.bind(1, trajectory).bind(2, step);
  int rc = st.step();
  if (rc == SQLITE_ROW) return stepFromRow(st);
  if (rc == SQLITE_DONE) return notFound("step not stored");
  return sqlError(db_, "getStep");
}

Result<std::vector<TrajectoryStep>> SqliteStore::loadTrajectory(const std::string& trajectory) {
  std::lock_guard lk(mu_);
  Stmt st(db_, std::string("SELECT ") + kStepColumns +
                   " FROM trajectory_steps WHERE trajectory=?1 ORDER BY step");
  st.bind(1, trajectory);
  std::vector<TrajectoryStep> out;
  int rc;
  while ((rc = st.step()) == SQLITE_ROW) out.push_back(stepFromRow(st));
  if (rc != SQLITE_DONE) return sqlError(db_, "loadTrajectory");
  return out;
}

Result<std::vector<TrajectorySummary>> SqliteStore::listTrajectories() {
  std::lock_guard lk(mu_);
  Stmt st(db_,
          "SELECT trajectory, COUNT(*), MIN(started_at), MAX(finished_at) FROM trajectory_steps "
          "GROUP BY trajectory ORDER BY trajectory");
  std::vector<TrajectorySummary> out;
  int rc;
  while ((rc = st.step()) == SQLITE_ROW) {
    out.push_back({st.text(0), st.i64(1), st.dbl(2), st.dbl(3)});
  }
  if (rc != SQLITE_DONE) return sqlError(db_, "listTrajectories");
  return out;
}

Result<int64_t> SqliteStore::deleteTrajectory(const std::string& trajectory) {
  std::lock_guard lk(mu_);
  RETURN_IF_ERROR(exec("BEGIN IMMEDIATE"));
  Stmt st(db_, "DELETE FROM trajectory_steps WHERE trajectory=?1");
  st.bind(1, trajectory);
  if (st.step() != SQLITE_DONE) {
    Status err = sqlError(db_, "deleteTrajectory");
    (void)exec("ROLLBACK");
    return err;
  }
  int64_t n = sqlite3_changes(db_);
  Stmt rec(db_, "DELETE FROM trajectories WHERE id=?1");
  rec.bind(1, trajectory);
  if (rec.step() != SQLITE_DONE) {
    Status err = sqlError(db_, "deleteTrajectory record");
    (void)exec("ROLLBACK");
    return err;
  }
  RETURN_IF_ERROR(exec("COMMIT"));
  return n;
}

Result<int64_t> SqliteStore::deleteTrajectoriesBefore(double t) {
  std::lock_guard lk(mu_);
  Stmt st(db_,
          "DELETE FROM trajectory_steps WHERE trajectory IN (SELECT trajectory FROM "
          "trajectory_steps GROUP BY trajectory HAVING MAX(finished_at) < ?1)");
  st.bind(1, t);
  if (st.step() != SQLITE_DONE) return sqlError(db_, "deleteTrajectoriesBefore");
  int64_t n = sqlite3_changes(db_);
  // Records of trajectories without steps, whatever removed the steps.
  RETURN_IF_ERROR(exec(
      "DELETE FROM trajectories WHERE id NOT IN (SELECT DISTINCT trajectory FROM trajectory_steps)"));
  return n;
}

Result<std::set<std::string>> SqliteStore::stepContents() {
  std::lock_guard lk(mu_);
  Stmt st(db_, "SELECT DISTINCT content FROM trajectory_steps WHERE content != ''");
  std::set<std::string> out;
  int rc;
  while ((rc = st.step()) == SQLITE_ROW) out.insert(st.text(0));
  if (rc != SQLITE_DONE) return sqlError(db_, "stepContents");
  return out;
}

Result<bool> SqliteStore::stepContentUsed(const std::string& digest) {
  std::lock_guard lk(mu_);
  Stmt st(db_, "SELECT 1 FROM trajectory_steps WHERE content=?1 LIMIT 1");
  st.bind(1, digest);
  int rc = st.step();
  if (rc == SQLITE_ROW) return true;
  if (rc == SQLITE_DONE) return false;
  return sqlError(db_, "stepContentUsed");
}

std::string trajectoryToDoc(const TrajectoryRecord& r) {
  json doc = {{"sandbox", r.sandbox},
              {"sandbox_doc", r.sandboxDoc},
              {"replaced", r.replaced},
              {"recoveries", json::parse(r.recoveries, nullptr, false)},
              {"updated_at", r.updatedAt}};
  if (doc["recoveries"].is_discarded()) doc["recoveries"] = json::array();
  return doc.dump();
}

Result<TrajectoryRecord> trajectoryFromDoc(const std::string& id, const std::string& text) {
  json doc = json::parse(text, nullptr, false);
  if (!doc.is_object()) return Status(Code::kInternal, "trajectory " + id + ": corrupt record");
  TrajectoryRecord r;
  r.id = id;
  r.sandbox = doc.value("sandbox", "");
  r.sandboxDoc = doc.value("sandbox_doc", "");
  r.replaced = doc.value("replaced", std::vector<std::string>{});
  r.recoveries = doc.value("recoveries", json::array()).dump();
  r.updatedAt = doc.value("updated_at", 0.0);
  return r;
}

Status SqliteStore::putTrajectory(const TrajectoryRecord& r) {
  std::string doc = trajectoryToDoc(r);
  std::lock_guard lk(mu_);
  Stmt st(db_, "INSERT INTO trajectories(id, doc) VALUES(?1, ?2) "
               "ON CONFLICT(id) DO UPDATE SET doc=excluded.doc");
  st.bind(1, r.id).bind(2, doc);
  if (st.step() != SQLITE_DONE) return sqlError(db_, "putTrajectory");
  return Status::ok();
}

Result<TrajectoryRecord> SqliteStore::getTrajectory(const std::string& id) {
  std::string text;
  {
    std::lock_guard lk(mu_);
    Stmt st(db_, "SELECT doc FROM trajectories WHERE id=?1");
    st.bind(1, id);
    int rc = st.step();
    if (rc == SQLITE_DONE) return notFound("trajectory " + id + " has no record");
    if (rc != SQLITE_ROW) return sqlError(db_, "getTrajectory");
    text = st.text(0);
  }
  return trajectoryFromDoc(id, text);
}

// ---------------------------------------------------------------- tenants

std::string tenantToJson(const TenantRecord& r) {
  return json{{"id", r.id},
              {"name", r.name},
              {"role", r.role},
              {"created_at", r.createdAt},
              {"quota",
               {{"max_sandboxes", r.quota.maxSandboxes},
                {"max_cpu", r.quota.maxCpu},
                {"max_memory_mb", r.quota.maxMemoryMb},
                {"creates_per_s", r.quota.createsPerS},
                {"create_burst", r.quota.createBurst}}}}
      .dump();
}

Result<TenantRecord> tenantFromJson(const std::string& s) {
  json j = json::parse(s, nullptr, false);
  if (!j.is_object()) return internalError("corrupt tenant record");
  try {
    TenantRecord r;
    r.id = j.at("id");
    r.name = j.value("name", "");
    r.role = j.value("role", "user");
    r.createdAt = j.value("created_at", 0.0);
    json q = j.value("quota", json::object());
    r.quota.maxSandboxes = q.value("max_sandboxes", int64_t(0));
    r.quota.maxCpu = q.value("max_cpu", 0.0);
    r.quota.maxMemoryMb = q.value("max_memory_mb", int64_t(0));
    r.quota.createsPerS = q.value("creates_per_s", 0.0);
    r.quota.createBurst = q.value("create_burst", int64_t(0));
    return r;
  } catch (const json::exception& e) {
    return internalError(std::string("corrupt tenant record: ") + e.what());
  }
}

std::string apiKeyToJson(const ApiKeyRecord& r) {
  return json{{"id", r.id},     {"tenant", r.tenant},        {"hash", r.hash},
              {"name", r.name}, {"created_at", r.createdAt}, {"revoked_at", r.revokedAt}}
      .dump();
}

Result<ApiKeyRecord> apiKeyFromJson(const std::string& s) {
  json j = json::parse(s, nullptr, false);
  if (!j.is_object()) return internalError("corrupt api key record");
  try {
    ApiKeyRecord r;
    r.id = j.at("id");
    r.tenant = j.at("tenant");
    r.hash = j.at("hash");
    r.name = j.value("name", "");
    r.createdAt = j.value("created_at", 0.0);
    r.revokedAt = j.value("revoked_at", 0.0);
    return r;
  } catch (const json::exception& e) {
    return internalError(std::string("corrupt api key record: ") + e.what());
  }
}

Status SqliteStore::putTenant(const TenantRecord& r) {
  std::lock_guard lk(mu_);
  Stmt st(db_,
          "INSERT INTO tenants(id, doc) VALUES(?1, ?2) "
          "ON CONFLICT(id) DO UPDATE SET doc=excluded.doc");
  st.bind(1, r.id).bind(2, tenantToJson(r));
  if (st.step() != SQLITE_DONE) return sqlError(db_, "putTenant");
  return Status::ok();
}

Result<TenantRecord> SqliteStore::getTenant(const std::string& id) {
  std::string text;
  {
    std::lock_guard lk(mu_);
    Stmt st(db_, "SELECT doc FROM tenants WHERE id=?1");
    st.bind(1, id);
    int rc = st.step();
    if (rc == SQLITE_DONE) return notFound("tenant " + id + " not found");
    if (rc != SQLITE_ROW) return sqlError(db_, "getTenant");
    text = st.text(0);
  }
  return tenantFromJson(text);
}

Result<std::vector<TenantRecord>> SqliteStore::listTenants() {
  std::vector<std::string> docs;
  {
    std::lock_guard lk(mu_);
    Stmt st(db_, "SELECT doc FROM tenants ORDER BY id");
    int rc;
    while ((rc = st.step()) == SQLITE_ROW) docs.push_back(st.text(0));
    if (rc != SQLITE_DONE) return sqlError(db_, "listTenants");
  }
  std::vector<TenantRecord> out;
  for (auto& d : docs) {
    ASSIGN_OR_RETURN(auto r, tenantFromJson(d));
    out.push_back(std::move(r));
  }
  return out;
}

Status SqliteStore::deleteTenant(const std::string& id) {
  std::lock_guard lk(mu_);
  // One transaction: the tenant and its keys go together.
  RETURN_IF_ERROR(exec("BEGIN IMMEDIATE"));
  bool existed = false;
  for (int i = 0; i < 2; ++i) {
    Stmt st(db_,
            i == 0 ? "DELETE FROM tenants WHERE id=?1" : "DELETE FROM api_keys WHERE tenant=?1");
    st.bind(1, id);
    if (st.step() != SQLITE_DONE) {
      Status err = sqlError(db_, "deleteTenant");
      (void)exec("ROLLBACK");
      return err;
    }
    if (i == 0) existed = sqlite3_changes(db_) > 0;
  }
  RETURN_IF_ERROR(exec("COMMIT"));
  if (!existed) return notFound("tenant " + id + " not found");
  return Status::ok();
}

Status SqliteStore::putApiKey(const ApiKeyRecord& r) {
  std::lock_guard lk(mu_);
  Stmt st(db_,
          "INSERT INTO api_keys(id, tenant, doc) VALUES(?1, ?2, ?3) "
          "ON CONFLICT(id) DO UPDATE SET tenant=excluded.tenant, doc=excluded.doc");
  st.bind(1, r.id).bind(2, r.tenant).bind(3, apiKeyToJson(r));
  if (st.step() != SQLITE_DONE) return sqlError(db_, "putApiKey");
  return Status::ok();
}

Result<ApiKeyRecord> SqliteStore::getApiKey(const std::string& id) {
  std::string text;
  {
    std::lock_guard lk(mu_);
    Stmt st(db_, "SELECT doc FROM api_keys WHERE id=?1");
    st.bind(1, id);
    int rc = st.step();
    if (rc == SQLITE_DONE) return notFound("api key " + id + " not found");
    if (rc != SQLITE_ROW) return sqlError(db_, "getApiKey");
    text = st.text(0);
  }
  return apiKeyFromJson(text);
}

Result<std::vector<ApiKeyRecord>> SqliteStore::listApiKeys(const std::string& tenant) {
  std::vector<std::string> docs;
  {
    std::lock_guard lk(mu_);
    Stmt st(db_, tenant.empty() ? "SELECT doc FROM api_keys ORDER BY id"
                                : "SELECT doc FROM api_keys WHERE tenant=?1 ORDER BY id");
    if (!tenant.empty()) st.bind(1, tenant);
    int rc;
    while ((rc = st.step()) == SQLITE_ROW) docs.push_back(st.text(0));
    if (rc != SQLITE_DONE) return sqlError(db_, "listApiKeys");
  }
  std::vector<ApiKeyRecord> out;
  for (auto& d : docs) {
    ASSIGN_OR_RETURN(auto r, apiKeyFromJson(d));
    out.push_back(std::move(r));
  }
  return out;
}

// ---------------------------------------------------------------- replicas and nodes

namespace {
NodeRecord nodeFromRow(Stmt& st) {
  NodeRecord r;
  r.name = st.text(0);
  r.pool = st.text(1);
  r.url = st.text(2);
  r.edgeKeyHash = st.text(3);
  r.platformKey = st.text(4);
  r.cpus = st.dbl(5);
  r.memoryMb = st.i64(6);
  r.slots = st.i64(7);
  r.state = st.text(8);
  r.lastHeartbeat = st.dbl(9);
  r.bootId = st.text(10);
  r.joinedAt = st.dbl(11);
  return r;
}
}  // namespace

Status SqliteStore::openNodeTables() {
  RETURN_IF_ERROR(exec(
      "CREATE TABLE IF NOT EXISTS nodes(name TEXT PRIMARY KEY, pool TEXT NOT NULL, "
      "url TEXT NOT NULL, edge_key_hash TEXT NOT NULL, platform_key TEXT NOT NULL, "
      "cpus REAL NOT NULL, memory_mb INTEGER NOT NULL, slots INTEGER NOT NULL, "
      "state TEXT NOT NULL, last_heartbeat REAL NOT NULL, boot_id TEXT NOT NULL, "
      "joined_at REAL NOT NULL);"
      "CREATE TABLE IF NOT EXISTS leases(name TEXT PRIMARY KEY, holder TEXT NOT NULL, "
      "expires REAL NOT NULL);"
      "CREATE TABLE IF NOT EXISTS settings(name TEXT PRIMARY KEY, value TEXT NOT NULL);"
      "CREATE TABLE IF NOT EXISTS sandbox_calls(id TEXT PRIMARY KEY, at REAL NOT NULL);"
      "CREATE TRIGGER IF NOT EXISTS sandbox_calls_gone AFTER DELETE ON sandboxes "
      "BEGIN DELETE FROM sandbox_calls WHERE id=OLD.id; END;"));
  Status st = exec("ALTER TABLE sandboxes ADD COLUMN changed REAL NOT NULL DEFAULT 0");
  if (!st.isOk() && st.message().find("duplicate column") == std::string::npos) return st;
  // Stamped by every statement that writes a row (kUpsertSandbox, casSandbox);
  // the triggers that did it before are dropped (see kUpsertSandbox).
  return exec(
      "CREATE INDEX IF NOT EXISTS sandboxes_changed ON sandboxes(changed);"
      "DROP TRIGGER IF EXISTS sandboxes_changed_ins;"
      "DROP TRIGGER IF EXISTS sandboxes_changed_upd;");
}

Result<SandboxRecord> SqliteStore::getSandbox(const std::string& id) {
  std::lock_guard lk(mu_);
  Stmt st(db_, "SELECT doc FROM sandboxes WHERE id=?1");
  st.bind(1, id);
  int rc = st.step();
  if (rc == SQLITE_DONE) return notFound("sandbox " + id + " not found");
  if (rc != SQLITE_ROW) return sqlError(db_, "getSandbox");
  return sandboxFromJson(st.text(0));
}

Result<std::vector<SandboxRecord>> SqliteStore::sandboxesChangedSince(double since, double* now) {
  std::lock_guard lk(mu_);
  if (now) {
    Stmt t(db_, std::string("SELECT ") + kSqlNow);
    if (t.step() != SQLITE_ROW) return sqlError(db_, "store clock");
    *now = t.dbl(0);
  }
  Stmt st(db_, "SELECT doc FROM sandboxes WHERE changed >= ?1");
  st.bind(1, since);
  std::vector<SandboxRecord> out;
  int rc;
  while ((rc = st.step()) == SQLITE_ROW) {
    ASSIGN_OR_RETURN(auto r, sandboxFromJson(st.text(0)));
    out.push_back(std::move(r));
  }
  if (rc != SQLITE_DONE) return sqlError(db_, "sandboxesChangedSince");
  return out;
}

Result<bool> SqliteStore::casSandbox(const SandboxRecord& r, SandboxState fromState) {
  std::lock_guard lk(mu_);
  Stmt st(db_, std::string("UPDATE sandboxes SET state=?2, doc=?3, changed=") + kSqlNow +
                   " WHERE id=?1 AND state=?4");
  st.bind(1, r.id).bind(2, std::string(proto::stateName(r.state))).bind(3, sandboxToJson(r)).bind(4, std::string(proto::stateName(fromState)));
  if (st.step() != SQLITE_DONE) return sqlError(db_, "casSandbox");
  return sqlite3_changes(db_) > 0;
}

Status SqliteStore::putNode(const NodeRecord& r) {
  std::lock_guard lk(mu_);
  Stmt st(db_,
          "INSERT OR REPLACE INTO nodes(name, pool, url, edge_key_hash, platform_key, cpus, "
          "memory_mb, slots, state, last_heartbeat, boot_id, joined_at) "
          "VALUES(?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12)");
  st.bind(1, r.name).bind(2, r.pool).bind(3, r.url).bind(4, r.edgeKeyHash).bind(5, r.platformKey);
  st.bind(6, r.cpus).bind(7, r.memoryMb).bind(8, r.slots).bind(9, r.state);
  st.bind(10, r.lastHeartbeat).bind(11, r.bootId).bind(12, r.joinedAt);
  if (st.step() != SQLITE_DONE) return sqlError(db_, "putNode");
  return Status::ok();
}

Result<std::vector<NodeRecord>> SqliteStore::listNodes() {
  std::lock_guard lk(mu_);
  Stmt st(db_,
          "SELECT name, pool, url, edge_key_hash, platform_key, cpus, memory_mb, slots, state, "
          "last_heartbeat, boot_id, joined_at FROM nodes ORDER BY name");
  std::vector<NodeRecord> out;
  int rc;
  while ((rc = st.step()) == SQLITE_ROW) out.push_back(nodeFromRow(st));
  if (rc != SQLITE_DONE) return sqlError(db_, "listNodes");
  return out;
}

Status SqliteStore::touchNode(const NodeRecord& r) {
  std::lock_guard lk(mu_);
  Stmt st(db_,
          "UPDATE nodes SET url=?2, pool=?3, cpus=?4, memory_mb=?5, slots=?6, "
          "last_heartbeat=MAX(last_heartbeat, ?7), boot_id=?8 WHERE name=?1");
  st.bind(1, r.name).bind(2, r.url).bind(3, r.pool).bind(4, r.cpus).bind(5, r.memoryMb);
  st.bind(6, r.slots).bind(7, r.lastHeartbeat).bind(8, r.bootId);
  if (st.step() != SQLITE_DONE) return sqlError(db_, "touchNode");
  if (sqlite3_changes(db_) == 0) return notFound("node " + r.name + " not found");
  return Status::ok();
}

Result<bool> SqliteStore::setNodeState(const std::string& name, const std::string& from,
                                       const std::string& to) {
  std::lock_guard lk(mu_);
  Stmt st(db_, "UPDATE nodes SET state=?3 WHERE name=?1 AND state=?2");
  st.bind(1, name).bind(2, from).bind(3, to);
  if (st.step() != SQLITE_DONE) return sqlError(db_, "setNodeState");
  return sqlite3_changes(db_) > 0;
}

Result<bool> SqliteStore::acquireLease(const std::string& name, const std::string& holder,
                                       double ttlS) {
  std::lock_guard lk(mu_);
  Stmt st(db_, std::string("INSERT INTO leases(name, holder, expires) VALUES(?1, ?2, ") + kSqlNow +
                   " + ?3) ON CONFLICT(name) DO UPDATE SET holder=excluded.holder, "
                   "expires=excluded.expires WHERE leases.holder=excluded.holder OR "
                   "leases.expires < " +
                   kSqlNow);
  st.bind(1, name).bind(2, holder).bind(3, ttlS);
  if (st.step() != SQLITE_DONE) return sqlError(db_, "acquireLease");
  return sqlite3_changes(db_) > 0;
}

Status SqliteStore::releaseLease(const std::string& name, const std::string& holder) {
  std::lock_guard lk(mu_);
  Stmt st(db_, "DELETE FROM leases WHERE name=?1 AND holder=?2");
  st.bind(1, name).bind(2, holder);
  if (st.step() != SQLITE_DONE) return sqlError(db_, "releaseLease");
  return Status::ok();
}

Result<std::vector<LeaseRecord>> SqliteStore::listLeases() {
  std::lock_guard lk(mu_);
  Stmt st(db_, std::string("SELECT name, holder, expires >= ") + kSqlNow +
                   " FROM leases ORDER BY name");
  std::vector<LeaseRecord> out;
  int rc;
  while ((rc = st.step()) == SQLITE_ROW) out.push_back({st.text(0), st.text(1), st.i64(2) != 0});
  if (rc != SQLITE_DONE) return sqlError(db_, "listLeases");
  return out;
}

Result<std::string> SqliteStore::settingOrPut(const std::string& name, const std::string& value) {
  std::lock_guard lk(mu_);
  {
    Stmt st(db_, "INSERT OR IGNORE INTO settings(name, value) VALUES(?1, ?2)");
    st.bind(1, name).bind(2, value);
    if (st.step() != SQLITE_DONE) return sqlError(db_, "settingOrPut");
  }
  Stmt st(db_, "SELECT value FROM settings WHERE name=?1");
  st.bind(1, name);
  if (st.step() != SQLITE_ROW) return sqlError(db_, "settingOrPut");
  return st.text(0);
}

Status SqliteStore::noteCalls(const std::map<std::string, double>& calls) {
  std::lock_guard lk(mu_);
  for (auto& [id, at] : calls) {
    Stmt st(db_, "INSERT INTO sandbox_calls(id, at) VALUES(?1, ?2) ON CONFLICT(id) DO UPDATE "
                 "SET at=MAX(at, excluded.at)");
    st.bind(1, id).bind(2, at);
    if (st.step() != SQLITE_DONE) return sqlError(db_, "noteCalls");
  }
  return Status::ok();
}

Result<std::map<std::string, double>> SqliteStore::lastCalls(const std::vector<std::string>& ids) {
  std::lock_guard lk(mu_);
  std::map<std::string, double> out;
  for (auto& id : ids) {
    Stmt st(db_, "SELECT at FROM sandbox_calls WHERE id=?1");
    st.bind(1, id);
    int rc = st.step();
    if (rc == SQLITE_ROW) out[id] = st.dbl(0);
    else if (rc != SQLITE_DONE) return sqlError(db_, "lastCalls");
  }
  return out;
}

}  // namespace dsec::platform
