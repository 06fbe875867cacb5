#include "platform/pg_store.h"

#include <libpq-fe.h>

#include <charconv>
#include <cstdlib>
#include <nlohmann/json.hpp>
#include <string_view>

#include "common/util.h"

namespace dsec::platform {

using json = nlohmann::json;

namespace {

// Migrations, oldest first; schema version N is the first N applied. Never
// edit one that has shipped: append another.
constexpr const char* kMigrations[] = {
    // 1: the schema of the SQLite store as of the first PostgreSQL release.
    "CREATE TABLE sandboxes(id TEXT PRIMARY KEY, state TEXT NOT NULL, doc TEXT NOT NULL);"
    "CREATE TABLE blobs(digest TEXT PRIMARY KEY, size BIGINT NOT NULL, "
    "created_at DOUBLE PRECISION NOT NULL, kind TEXT NOT NULL DEFAULT '', "
    "data TEXT NOT NULL DEFAULT '', chunks TEXT NOT NULL DEFAULT '');"
    "CREATE TABLE images(name TEXT NOT NULL, tag TEXT NOT NULL, layers TEXT NOT NULL, "
    "size BIGINT NOT NULL, created_at DOUBLE PRECISION NOT NULL, "
    "kind TEXT NOT NULL DEFAULT 'base', parent TEXT NOT NULL DEFAULT '', "
    "config TEXT NOT NULL DEFAULT '', PRIMARY KEY(name, tag));"
    "CREATE TABLE policies(name TEXT PRIMARY KEY, doc TEXT NOT NULL);"
    "CREATE TABLE trajectory_steps(trajectory TEXT NOT NULL, step BIGINT NOT NULL, "
    "digest TEXT NOT NULL, kind TEXT NOT NULL, sandbox TEXT NOT NULL, request TEXT NOT NULL, "
    "status INTEGER NOT NULL, content_type TEXT NOT NULL, body BYTEA NOT NULL, "
    "started_at DOUBLE PRECISION NOT NULL, finished_at DOUBLE PRECISION NOT NULL, "
    "content TEXT NOT NULL DEFAULT '', PRIMARY KEY(trajectory, step));"
    "CREATE INDEX trajectory_steps_content ON trajectory_steps(content) WHERE content <> '';"
    "CREATE TABLE trajectories(id TEXT PRIMARY KEY, doc TEXT NOT NULL);",
    // 2: tenants, their API keys (hashes only), and who owns an image.
    "CREATE TABLE tenants(id TEXT PRIMARY KEY, doc TEXT NOT NULL);"
    "CREATE TABLE api_keys(id TEXT PRIMARY KEY, tenant TEXT NOT NULL, doc TEXT NOT NULL);"
    "CREATE INDEX api_keys_tenant ON api_keys(tenant);"
    "ALTER TABLE images ADD COLUMN owner TEXT NOT NULL DEFAULT '';"
    "ALTER TABLE images ADD COLUMN visibility TEXT NOT NULL DEFAULT 'public';",
    // 3: replicas (docs/cluster.md): the node registry, leases, settings, and
    // when each sandbox row last changed (stamped by the server, so replicas
    // can follow each other's writes).
    "CREATE TABLE nodes(name TEXT PRIMARY KEY, pool TEXT NOT NULL, url TEXT NOT NULL, "
    "edge_key_hash TEXT NOT NULL, platform_key TEXT NOT NULL, cpus DOUBLE PRECISION NOT NULL, "
    "memory_mb BIGINT NOT NULL, slots BIGINT NOT NULL, state TEXT NOT NULL, "
    "last_heartbeat DOUBLE PRECISION NOT NULL, boot_id TEXT NOT NULL, "
    "joined_at DOUBLE PRECISION NOT NULL);"
    "CREATE TABLE leases(name TEXT PRIMARY KEY, holder TEXT NOT NULL, "
    "expires DOUBLE PRECISION NOT NULL);"
    "CREATE TABLE settings(name TEXT PRIMARY KEY, value TEXT NOT NULL);"
    "CREATE TABLE sandbox_calls(id TEXT PRIMARY KEY REFERENCES sandboxes(id) ON DELETE CASCADE, "
    "at DOUBLE PRECISION NOT NULL);"
    "ALTER TABLE sandboxes ADD COLUMN changed DOUBLE PRECISION NOT NULL DEFAULT 0;"
    "CREATE INDEX sandboxes_changed ON sandboxes(changed);"
    "CREATE FUNCTION dsec_sandbox_changed() RETURNS trigger AS $$ BEGIN "
    "NEW.changed := EXTRACT(EPOCH FROM clock_timestamp()); RETURN NEW; END $$ LANGUAGE plpgsql;"
    "CREATE TRIGGER sandboxes_changed BEFORE INSERT OR UPDATE ON sandboxes "
    "FOR EACH ROW EXECUTE FUNCTION dsec_sandbox_changed();",
    // 4: batch creations (POST /v1/batches).
    "CREATE TABLE batches(id TEXT PRIMARY KEY, doc TEXT NOT NULL);",
    // 5: registry pulls: where an image and a layer came from.
    "ALTER TABLE images ADD COLUMN source TEXT NOT NULL DEFAULT '';"
    "ALTER TABLE blobs ADD COLUMN source TEXT NOT NULL DEFAULT '';"
    "CREATE INDEX blobs_source ON blobs(source) WHERE source <> '';",
    // 6: the build step cache (POST /v1/images/build).
    "CREATE TABLE build_cache(key TEXT PRIMARY KEY, layer TEXT NOT NULL, "
    "config TEXT NOT NULL DEFAULT '', created_at DOUBLE PRECISION NOT NULL, "
    "used_at DOUBLE PRECISION NOT NULL);"
    "CREATE INDEX build_cache_used ON build_cache(used_at);",
    // 7: chunks deduplicated across layers: the data blobs of other layers a
    // layer's chunks point into, and where each distinct chunk is stored.
    "ALTER TABLE blobs ADD COLUMN extra_data TEXT NOT NULL DEFAULT '';"
    "CREATE TABLE chunks(sha TEXT NOT NULL, length BIGINT NOT NULL, data TEXT NOT NULL, "
    "block BIGINT NOT NULL, PRIMARY KEY(sha, length));"
    "CREATE INDEX chunks_data ON chunks(data);",
    // 8: chunk-granular gc: what a layer reads of its extra blobs, and what
    // gc removed from a data blob.
    "ALTER TABLE blobs ADD COLUMN extra_reads TEXT NOT NULL DEFAULT '';"
    "ALTER TABLE blobs ADD COLUMN reclaimed TEXT NOT NULL DEFAULT '';",
};
constexpr int kSchemaVersion = int(std::size(kMigrations));
// pg_advisory_xact_lock key serializing migrations ("dsec" "schema").
constexpr int64_t kMigrationLock = 0x6473656373636831;

using ResultPtr = std::unique_ptr<PGresult, decltype(&PQclear)>;

std::string trimmed(const char* msg) {
  std::string s = msg ? msg : "";
  while (!s.empty() && (s.back() == '\n' || s.back() == ' ')) s.pop_back();
  return s;
}

// Query parameters, all sent as text except bytea ones (binary).
class Params {
 public:
  Params& add(const std::string& v) {
    vals_.push_back(v);
    fmts_.push_back(0);
    return *this;
  }
  Params& add(int64_t v) { return add(std::to_string(v)); }
  Params& add(double v) {
    char buf[64];
    auto r = std::to_chars(buf, buf + sizeof buf, v);  // shortest exact round trip
    return add(std::string(buf, r.ptr));
  }
  Params& addBytes(const std::string& v) {
    vals_.push_back(v);
    fmts_.push_back(1);
    return *this;
  }
  // A text[] in binary form (TextArray below).
  Params& addTextArray(std::string v) {
    vals_.push_back(std::move(v));
    fmts_.push_back(1);
    return *this;
  }
  int size() const { return int(vals_.size()); }
  std::vector<const char*> values() const {
    std::vector<const char*> v;
    for (auto& s : vals_) v.push_back(s.data());
    return v;
  }
  std::vector<int> lengths() const {
    std::vector<int> v;
    for (auto& s : vals_) v.push_back(int(s.size()));
    return v;
  }
  const int* formats() const { return fmts_.data(); }

 private:
  std::vector<std::string> vals_;
  std::vector<int> fmts_;
};

// A text[] parameter in PostgreSQL's binary array format (array_send: a
// header, then each element's length and bytes), for $n::text[]. Unlike a
// JSON or text array literal, nothing in it is quoted or escaped, so neither
// side spends time on the bytes of, say, 32,768 sandbox documents.
class TextArray {
 public:
  TextArray() {
    for (uint32_t v : {1u, 0u, kTextOid, 0u, 1u}) put32(v);  // ndim, flags, type, count, lbound
  }
  void push(std::string_view s) {
    put32(uint32_t(s.size()));
    buf_.append(s);
    ++n_;
  }
  std::string take() && {
    if (n_ == 0) {  // empty: no dimensions
      buf_.clear();
      for (uint32_t v : {0u, 0u, kTextOid}) put32(v);
      return std::move(buf_);
    }
    for (int k = 0; k < 4; ++k) buf_[12 + k] = char(n_ >> (24 - 8 * k));
    return std::move(buf_);
  }

 private:
  static constexpr uint32_t kTextOid = 25;
  void put32(uint32_t v) {
    for (int k = 0; k < 4; ++k) buf_.push_back(char(v >> (24 - 8 * k)));
  }
  std::string buf_;
  uint32_t n_ = 0;
};

// The rows of a finished query (text format).
class Rows {
 public:
  explicit Rows(PGresult* r) : r_(r, &PQclear) {}
  int size() const { return PQntuples(r_.get()); }
  std::string text(int row, int col) const {
    return std::string(PQgetvalue(r_.get(), row, col), size_t(PQgetlength(r_.get(), row, col)));
  }
  int64_t i64(int row, int col) const {
    return std::strtoll(PQgetvalue(r_.get(), row, col), nullptr, 10);
  }
  double dbl(int row, int col) const {
    return std::strtod(PQgetvalue(r_.get(), row, col), nullptr);
  }
  std::string bytes(int row, int col) const {
    size_t n = 0;
    unsigned char* b =
        PQunescapeBytea(reinterpret_cast<const unsigned char*>(PQgetvalue(r_.get(), row, col)), &n);
    if (!b) return "";
    std::string out(reinterpret_cast<char*>(b), n);
    PQfreemem(b);
    return out;
  }
  // Rows a DELETE or UPDATE touched.
  int64_t affected() const { return std::strtoll(PQcmdTuples(r_.get()), nullptr, 10); }

 private:
  ResultPtr r_;
};

void quietNotices(void*, const char*) {}

// Session settings every connection gets (also after a reset).
Status setupSession(PGconn* c, const std::string& where) {
  PQsetNoticeProcessor(c, quietNotices, nullptr);
  ResultPtr r(PQexec(c, "SET synchronous_commit TO on; SET client_min_messages TO warning"),
              &PQclear);
  if (PQresultStatus(r.get()) != PGRES_COMMAND_OK) {
    return Status(Code::kUnavailable,
                  "postgres " + where + ": session setup: " + trimmed(PQerrorMessage(c)));
  }
  return Status::ok();
}

}  // namespace

// One statement on a pooled connection, retried once on a fresh connection
// when the first lost its connection and `retry` says repeating is harmless.
class PostgresStore::Query {
 public:
  // `retried`, if given, tells whether a second attempt was made.
  static Result<Rows> run(PostgresStore* s, const char* what, const char* sql, const Params& p,
                          bool retry, bool* retried = nullptr) {
    auto vals = p.values();
    auto lens = p.lengths();
    for (int attempt = 0;; ++attempt) {
      if (retried) *retried = attempt > 0;
      ASSIGN_OR_RETURN(PGconn * c, s->acquire());
      PGresult* r =
          PQexecParams(c, sql, p.size(), nullptr, vals.data(), lens.data(), p.formats(), 0);
      ExecStatusType es = PQresultStatus(r);
      if (r && (es == PGRES_COMMAND_OK || es == PGRES_TUPLES_OK)) {
        s->release(c);
        return Rows(r);
      }
      bool lost = PQstatus(c) == CONNECTION_BAD;
      const char* state = r ? PQresultErrorField(r, PG_DIAG_SQLSTATE) : nullptr;
      std::string sqlstate = state ? state : "";
      std::string msg = trimmed(r ? PQresultErrorMessage(r) : PQerrorMessage(c));
      if (msg.empty()) msg = trimmed(PQerrorMessage(c));
      PQclear(r);
      if (lost) {
        // What cut this one (a server restart, failover, a network cut) has
        // most likely cut the idle ones too: the retry gets a new connection.
        s->discard(c);
      } else {
        s->release(c);
      }
      if (lost && retry && attempt == 0) continue;
      if (lost) {
        return Status(Code::kUnavailable,
                      std::string("postgres ") + what + ": connection to " + s->where_ + " lost" +
                          (retry ? "" : " (whether the change was made is unknown)") + ": " + msg);
      }
      if (sqlstate == "23505") {
        return Status(Code::kAlreadyExists, std::string("postgres ") + what + ": " + msg);
      }
      return Status(Code::kInternal, std::string("postgres ") + what + ": " + msg);
    }
  }
};

namespace {
constexpr bool kRetry = true;
constexpr bool kNoRetry = false;
}  // namespace

std::string redactPostgresUri(const std::string& uri) {
  size_t scheme = uri.find("://");
  if (scheme == std::string::npos) {
    // key=value form: drop the password's value.
    std::string out;
    for (auto& kv : splitString(uri, ' ')) {
      if (!out.empty()) out += " ";
      out += kv.rfind("password=", 0) == 0 ? "password=***" : kv;
    }
    return out;
  }
  size_t start = scheme + 3;
  size_t end = uri.find_first_of("/?", start);
  std::string authority =
      uri.substr(start, end == std::string::npos ? std::string::npos : end - start);
  std::string rest = end == std::string::npos ? "" : uri.substr(end);
  if (size_t at = authority.rfind('@'); at != std::string::npos) {
    std::string user = authority.substr(0, at);
    if (size_t colon = user.find(':'); colon != std::string::npos) {
      authority = user.substr(0, colon) + ":***" + authority.substr(at);
    }
  }
  if (size_t q = rest.find('?'); q != std::string::npos) {
    std::string out = rest.substr(0, q + 1);
    bool first = true;
    for (auto& kv : splitString(rest.substr(q + 1), '&')) {
      if (!first) out += "&";
      first = false;
      out += kv.rfind("password=", 0) == 0 ? "password=***" : kv;
    }
    rest = out;
  }
  return uri.substr(0, start) + authority + rest;
}

Result<std::unique_ptr<PostgresStore>> PostgresStore::open(const std::string& uri,
                                                           PostgresOptions opts) {
  if (uri.rfind("postgres://", 0) != 0 && uri.rfind("postgresql://", 0) != 0) {
    return invalidArg(
        "store", "not a PostgreSQL URI (postgres:// or postgresql://): " + redactPostgresUri(uri));
  }
  char* err = nullptr;
  PQconninfoOption* parsed = PQconninfoParse(uri.c_str(), &err);
  if (!parsed) {
    std::string msg = trimmed(err ? err : "out of memory");
    PQfreemem(err);
    return invalidArg("store", "bad PostgreSQL URI " + redactPostgresUri(uri) + ": " + msg);
  }
  PQconninfoFree(parsed);
  if (opts.poolSize < 1) return invalidArg("store", "pool size must be at least 1");
  std::unique_ptr<PostgresStore> s(new PostgresStore(uri, redactPostgresUri(uri), opts));
  ASSIGN_OR_RETURN(PGconn * c, s->acquire());
  s->release(c);
  RETURN_IF_ERROR(s->migrate());
  return s;
}

int PostgresStore::schemaVersion() { return kSchemaVersion; }

PostgresStore::~PostgresStore() {
  std::lock_guard lk(mu_);
  for (PGconn* c : idle_) PQfinish(c);
}

Result<PGconn*> PostgresStore::connect() {
  // Defaults first: the URI (dbname, expanded) comes last and overrides them.
  const char* keys[] = {"connect_timeout",     "keepalives",       "keepalives_idle",
                        "keepalives_interval", "keepalives_count", "tcp_user_timeout",
                        "application_name",    "dbname",           nullptr};
  const char* vals[] = {"10", "1", "10", "5", "3", "15000", "dsec", uri_.c_str(), nullptr};
  PGconn* c = PQconnectdbParams(keys, vals, 1);
  if (!c) return Status(Code::kResourceExhausted, "postgres: out of memory connecting");
  if (PQstatus(c) != CONNECTION_OK) {
    std::string msg = trimmed(PQerrorMessage(c));
    PQfinish(c);
    return Status(Code::kUnavailable, "cannot connect to PostgreSQL at " + where_ + ": " + msg);
  }
  if (Status st = setupSession(c, where_); !st.isOk()) {
    PQfinish(c);
    return st;
  }
  return c;
}

Result<PGconn*> PostgresStore::acquire() {
  PGconn* c = nullptr;
  {
    std::unique_lock lk(mu_);
    freed_.wait(lk, [&] { return !idle_.empty() || open_ < opts_.poolSize; });
    if (!idle_.empty()) {
      c = idle_.back();
      idle_.pop_back();
    } else {
      ++open_;
    }
  }
  if (!c) {
    auto fresh = connect();
    if (!fresh.isOk()) {
      std::lock_guard lk(mu_);
      --open_;
      freed_.notify_one();
      return fresh;
    }
    return *fresh;
  }
  if (PQstatus(c) == CONNECTION_OK) return c;
  // Lost since its last use (server restart, terminated backend, network).
  PQreset(c);
  if (PQstatus(c) != CONNECTION_OK) {
    std::string msg = trimmed(PQerrorMessage(c));
    release(c);
    return Status(Code::kUnavailable, "cannot reconnect to PostgreSQL at " + where_ + ": " + msg);
  }
  if (Status st = setupSession(c, where_); !st.isOk()) {
    release(c);
    return st;
  }
  return c;
}

void PostgresStore::discard(PGconn* lost) {
  std::vector<PGconn*> gone;
  {
    std::lock_guard lk(mu_);
    gone.swap(idle_);
    gone.push_back(lost);
    open_ -= int(gone.size());
    freed_.notify_all();
  }
  for (PGconn* c : gone) PQfinish(c);
}

void PostgresStore::release(PGconn* c) {
  std::lock_guard lk(mu_);
  idle_.push_back(c);
  freed_.notify_one();
}

Status PostgresStore::migrate() {
  ASSIGN_OR_RETURN(PGconn * c, acquire());
  auto fail = [&](const std::string& what) {
    std::string msg = trimmed(PQerrorMessage(c));
    ResultPtr(PQexec(c, "ROLLBACK"), &PQclear);
    release(c);
    return Status(Code::kInternal,
                  "postgres " + where_ + ": schema migration: " + what + ": " + msg);
  };
  auto ok = [&](PGresult* r) {
    ResultPtr p(r, &PQclear);
    auto es = PQresultStatus(r);
    return es == PGRES_COMMAND_OK || es == PGRES_TUPLES_OK;
  };
  if (!ok(PQexec(c, "BEGIN"))) return fail("begin");
  std::string lock = std::to_string(kMigrationLock);
  const char* lockParam[] = {lock.c_str()};
  // Held to the end of the transaction: another process opening the database
  // now waits here, then finds the migrations done.
  if (!ok(PQexecParams(c, "SELECT pg_advisory_xact_lock($1::bigint)", 1, nullptr, lockParam,
                       nullptr, nullptr, 0))) {
    return fail("lock");
  }
  if (!ok(PQexec(c,
                 "CREATE TABLE IF NOT EXISTS dsec_schema(version INTEGER NOT NULL, "
                 "applied_at DOUBLE PRECISION NOT NULL)"))) {
    return fail("create dsec_schema");
  }
  ResultPtr cur(PQexec(c, "SELECT COALESCE(MAX(version), 0) FROM dsec_schema"), &PQclear);
  if (PQresultStatus(cur.get()) != PGRES_TUPLES_OK) return fail("read version");
  int have = std::atoi(PQgetvalue(cur.get(), 0, 0));
  if (have > kSchemaVersion) {
    ResultPtr(PQexec(c, "ROLLBACK"), &PQclear);
    release(c);
    return Status(Code::kFailedPrecondition,
                  "postgres " + where_ + ": the database's schema is version " +
                      std::to_string(have) + ", newer than this dsec knows (" +
                      std::to_string(kSchemaVersion) + "): upgrade dsec");
  }
  for (int v = have + 1; v <= kSchemaVersion; ++v) {
    if (!ok(PQexec(c, kMigrations[v - 1]))) return fail("version " + std::to_string(v));
    std::string vs = std::to_string(v);
    const char* p[] = {vs.c_str()};
    if (!ok(PQexecParams(c,
                         "INSERT INTO dsec_schema(version, applied_at) "
                         "VALUES($1::integer, EXTRACT(EPOCH FROM clock_timestamp())::float8)",
                         1, nullptr, p, nullptr, nullptr, 0))) {
      return fail("record version " + vs);
    }
  }
  if (!ok(PQexec(c, "COMMIT"))) return fail("commit");
  release(c);
  return Status::ok();
}

// ---------------------------------------------------------------- sandboxes

Status PostgresStore::putSandbox(const SandboxRecord& r) {
  return Query::run(this, "putSandbox",
                    "INSERT INTO sandboxes(id, state, doc) VALUES($1, $2, $3) "
                    "ON CONFLICT(id) DO UPDATE SET state=excluded.state, doc=excluded.doc",
                    Params().add(r.id).add(std::string(proto::stateName(r.state))).add(sandboxToJson(r)), kRetry)
      .takeStatus();
}

Status PostgresStore::deleteSandbox(const std::string& id) {
  return Query::run(this, "deleteSandbox", "DELETE FROM sandboxes WHERE id=$1", Params().add(id),
                    kRetry)
      .takeStatus();
}

namespace {
// Many sandbox records as three text[] parameters ($1 ids, $2 states, $3
// documents), so one statement (one transaction, one commit) upserts them all.
struct SandboxRows {
  TextArray ids, states, docs;
  void push(const std::string& id, const std::string& state, const std::string& doc) {
    ids.push(id);
    states.push(state);
    docs.push(doc);
  }
  Params params() && {
    return std::move(Params()
                         .addTextArray(std::move(ids).take())
                         .addTextArray(std::move(states).take())
                         .addTextArray(std::move(docs).take()));
  }
};
constexpr const char* kUpsertRows =
    "INSERT INTO sandboxes(id, state, doc) SELECT * FROM unnest($1::text[], $2::text[], "
    "$3::text[]) ON CONFLICT(id) DO UPDATE SET state=excluded.state, doc=excluded.doc";
}  // namespace

Status PostgresStore::putSandboxes(const std::vector<SandboxRecord>& rs,
                                   const std::vector<std::string>& drop) {
  if (rs.empty() && drop.empty()) return Status::ok();
  SandboxRows rows;
  for (auto& r : rs) rows.push(r.id, std::string(proto::stateName(r.state)), sandboxToJson(r));
  TextArray dropped;
  for (auto& id : drop) dropped.push(id);
  // Upserts and deletes: repeating them is harmless.
  std::string sql =
      std::string("WITH d AS (DELETE FROM sandboxes WHERE id = ANY($4::text[])) ") + kUpsertRows;
  return Query::run(this, "putSandboxes", sql.c_str(),
                    std::move(rows).params().addTextArray(std::move(dropped).take()), kRetry)
      .takeStatus();
}

Status PostgresStore::putBatch(const BatchRecord& b, const std::vector<std::string>& ids,
                               const SandboxRecord& pending) {
  SandboxRows rows;
  if (!ids.empty()) {
    SandboxDocs docs(pending);
    for (auto& id : ids) rows.push(id, std::string(proto::stateName(pending.state)), docs.doc(id));
  }
  std::string sql = std::string(
                        "WITH b AS (INSERT INTO batches(id, doc) VALUES($4, $5) "
                        "ON CONFLICT(id) DO UPDATE SET doc=excluded.doc) ") +
                    kUpsertRows;
  return Query::run(this, "putBatch", sql.c_str(),
                    std::move(rows).params().add(b.id).add(batchToJson(b)), kRetry)
      .takeStatus();
}

Result<std::vector<BatchRecord>> PostgresStore::loadBatches() {
  ASSIGN_OR_RETURN(Rows rows, Query::run(this, "loadBatches",
                                         "SELECT doc FROM batches ORDER BY id COLLATE \"C\"",
                                         Params(), kRetry));
  std::vector<BatchRecord> out;
  for (int i = 0; i < rows.size(); ++i) {
    ASSIGN_OR_RETURN(auto b, batchFromJson(rows.text(i, 0)));
    out.push_back(std::move(b));
  }
  return out;
}

Status PostgresStore::deleteBatch(const std::string& id) {
  ASSIGN_OR_RETURN(Rows rows, Query::run(this, "deleteBatch", "DELETE FROM batches WHERE id=$1",
                                         Params().add(id), kNoRetry));
  if (rows.affected() == 0) return notFound("batch " + id + " not found");
  return Status::ok();
}

Result<std::vector<SandboxRecord>> PostgresStore::loadSandboxes() {
  ASSIGN_OR_RETURN(
      Rows rows,
      Query::run(this, "loadSandboxes", "SELECT doc FROM sandboxes ORDER BY id", Params(), kRetry));
  std::vector<SandboxRecord> out;
  for (int i = 0; i < rows.size(); ++i) {
    ASSIGN_OR_RETURN(auto r, sandboxFromJson(rows.text(i, 0)));
    out.push_back(std::move(r));
  }
  return out;
}

// ---------------------------------------------------------------- blobs

Status PostgresStore::putBlob(const std::string& digest, int64_t size) {
  // A re-upload refreshes created_at (the GC grace period) and keeps the kind.
  return Query::run(this, "putBlob",
                    "INSERT INTO blobs(digest, size, created_at) "
                    "VALUES($1, $2::bigint, EXTRACT(EPOCH FROM clock_timestamp())::float8) "
                    "ON CONFLICT(digest) DO UPDATE SET created_at=excluded.created_at",
                    Params().add(digest).add(size), kRetry)
      .takeStatus();
}

Result<bool> PostgresStore::hasBlob(const std::string& digest) {
  auto size = blobSize(digest);
  if (size.isOk()) return true;
  if (size.status().code() == Code::kNotFound) return false;
  return std::move(size).takeStatus();
}

Result<int64_t> PostgresStore::blobSize(const std::string& digest) {
  ASSIGN_OR_RETURN(Rows rows, Query::run(this, "blobSize", "SELECT size FROM blobs WHERE digest=$1",
                                         Params().add(digest), kRetry));
  if (rows.size() == 0) return notFound("blob " + digest);
  return rows.i64(0, 0);
}

namespace {
constexpr const char* kBlobColumns =
    "digest, size, created_at, kind, data, chunks, source, extra_data, extra_reads, reclaimed";
BlobRecord blobFromRow(const Rows& r, int i) {
  return BlobRecord{r.text(i, 0), r.i64(i, 1),  r.dbl(i, 2), r.text(i, 3),
                    r.text(i, 4), r.text(i, 5), r.text(i, 6), digestsFromColumn(r.text(i, 7)),
                    r.text(i, 8), r.text(i, 9)};
}
}  // namespace

Result<BlobRecord> PostgresStore::getBlob(const std::string& digest) {
  std::string sql = std::string("SELECT ") + kBlobColumns + " FROM blobs WHERE digest=$1";
  ASSIGN_OR_RETURN(Rows rows,
                   Query::run(this, "getBlob", sql.c_str(), Params().add(digest), kRetry));
  if (rows.size() == 0) return notFound("layer " + digest + " not found");
  return blobFromRow(rows, 0);
}

Result<std::vector<BlobRecord>> PostgresStore::listBlobs() {
  std::string sql = std::string("SELECT ") + kBlobColumns + " FROM blobs ORDER BY digest";
  ASSIGN_OR_RETURN(Rows rows, Query::run(this, "listBlobs", sql.c_str(), Params(), kRetry));
  std::vector<BlobRecord> out;
  for (int i = 0; i < rows.size(); ++i) out.push_back(blobFromRow(rows, i));
  return out;
}

Status PostgresStore::setBlobKind(const std::string& digest, const std::string& kind) {
  return Query::run(this, "setBlobKind", "UPDATE blobs SET kind=$2 WHERE digest=$1",
                    Params().add(digest).add(kind), kRetry)
      .takeStatus();
}

Status PostgresStore::setBlobData(const std::string& digest, const std::string& data) {
  return Query::run(this, "setBlobData", "UPDATE blobs SET data=$2 WHERE digest=$1",
                    Params().add(digest).add(data), kRetry)
      .takeStatus();
}

Status PostgresStore::setBlobChunks(const std::string& digest, const std::string& chunks) {
  return Query::run(this, "setBlobChunks", "UPDATE blobs SET chunks=$2 WHERE digest=$1",
                    Params().add(digest).add(chunks), kRetry)
      .takeStatus();
}

Status PostgresStore::deleteBlob(const std::string& digest) {
  // One statement: the chunk rows go in the same transaction.
  return Query::run(this, "deleteBlob",
                    "WITH c AS (DELETE FROM chunks WHERE data=$1) "
                    "DELETE FROM blobs WHERE digest=$1",
                    Params().add(digest), kRetry)
      .takeStatus();
}

Status PostgresStore::setBlobSource(const std::string& digest, const std::string& source) {
  return Query::run(this, "setBlobSource", "UPDATE blobs SET source=$2 WHERE digest=$1",
                    Params().add(digest).add(source), kRetry)
      .takeStatus();
}

Result<std::string> PostgresStore::findLayerBySource(const std::string& source) {
  ASSIGN_OR_RETURN(Rows rows, Query::run(this, "findLayerBySource",
                                         "SELECT digest FROM blobs WHERE source=$1 "
                                         "ORDER BY created_at DESC LIMIT 1",
                                         Params().add(source), kRetry));
  if (rows.size() == 0) return notFound("no layer converted from " + source);
  return rows.text(0, 0);
}

Status PostgresStore::setBlobExtraData(const std::string& layer,
                                       const std::vector<std::string>& blobs) {
  RETURN_IF_ERROR(checkExtraData(blobs));
  return Query::run(this, "setBlobExtraData", "UPDATE blobs SET extra_data=$2 WHERE digest=$1",
                    Params().add(layer).add(digestsToColumn(blobs)), kRetry)
      .takeStatus();
}

Result<std::vector<std::string>> PostgresStore::imagesNaming(const std::string& layer) {
  // layers is a JSON array of digests: the quoted digest is one element.
  ASSIGN_OR_RETURN(Rows rows, Query::run(this, "imagesNaming",
                                         "SELECT name, tag FROM images WHERE "
                                         "strpos(layers, '\"' || $1 || '\"') > 0",
                                         Params().add(layer), kRetry));
  std::vector<std::string> out;
  for (int i = 0; i < rows.size(); ++i) out.push_back(rows.text(i, 0) + ":" + rows.text(i, 1));
  return out;
}

Result<std::vector<std::string>> PostgresStore::layersNaming(const std::string& data) {
  // extra_data is digests separated by one space (digestsToColumn).
  ASSIGN_OR_RETURN(Rows rows, Query::run(this, "layersNaming",
                                         "SELECT digest FROM blobs WHERE data=$1 OR "
                                         "$1 = ANY(string_to_array(extra_data, ' '))",
                                         Params().add(data), kRetry));
  std::vector<std::string> out;
  for (int i = 0; i < rows.size(); ++i) out.push_back(rows.text(i, 0));
  return out;
}

Status PostgresStore::setBlobExtraReads(const std::string& layer, const std::string& reads) {
  return Query::run(this, "setBlobExtraReads", "UPDATE blobs SET extra_reads=$2 WHERE digest=$1",
                    Params().add(layer).add(reads), kRetry)
      .takeStatus();
}

Status PostgresStore::setBlobReclaimed(const std::string& data, const std::string& reclaimed) {
  return Query::run(this, "setBlobReclaimed", "UPDATE blobs SET reclaimed=$2 WHERE digest=$1",
                    Params().add(data).add(reclaimed), kRetry)
      .takeStatus();
}

Status PostgresStore::putChunks(const std::string& data, const std::vector<ChunkLoc>& chunks) {
  RETURN_IF_ERROR(checkChunks(data, chunks));
  if (chunks.empty()) return Status::ok();
  // One statement over three text[] parameters (binary, nothing escaped):
  // one round trip and one commit for a layer's ~8,000 chunks per GB. DO
  // NOTHING also covers a chunk repeated within `chunks` (the first wins), so
  // repeating the statement after a lost connection is harmless.
  TextArray shas, lengths, blocks;
  for (auto& c : chunks) {
    shas.push(c.sha);
    lengths.push(std::to_string(c.length));
    blocks.push(std::to_string(c.block));
  }
  return Query::run(this, "putChunks",
                    "INSERT INTO chunks(sha, length, data, block) "
                    "SELECT s, l::bigint, $4, b::bigint "
                    "FROM unnest($1::text[], $2::text[], $3::text[]) AS t(s, l, b) "
                    "ON CONFLICT(sha, length) DO NOTHING",
                    Params()
                        .addTextArray(std::move(shas).take())
                        .addTextArray(std::move(lengths).take())
                        .addTextArray(std::move(blocks).take())
                        .add(data),
                    kRetry)
      .takeStatus();
}

Result<std::optional<ChunkLoc>> PostgresStore::findChunk(const std::string& sha, int64_t length) {
  ASSIGN_OR_RETURN(Rows rows,
                   Query::run(this, "findChunk",
                              "SELECT data, block FROM chunks WHERE sha=$1 AND length=$2::bigint",
                              Params().add(sha).add(length), kRetry));
  if (rows.size() == 0) return std::optional<ChunkLoc>();
  return std::optional<ChunkLoc>(ChunkLoc{sha, length, rows.text(0, 0), uint32_t(rows.i64(0, 1))});
}

Status PostgresStore::deleteChunksIn(const std::string& data,
                                     const std::vector<std::pair<uint64_t, uint64_t>>& ranges) {
  if (ranges.empty()) return Status::ok();
  TextArray starts, ends;
  for (auto& [start, count] : ranges) {
    starts.push(std::to_string(start));
    ends.push(std::to_string(start + count));
  }
  // One statement over the ranges (a chunk overlapping any goes).
  return Query::run(this, "deleteChunksIn",
                    "DELETE FROM chunks c USING unnest($2::text[], $3::text[]) AS r(s, e) "
                    "WHERE c.data=$1 AND c.block < r.e::bigint "
                    "AND c.block + (c.length + 4095) / 4096 > r.s::bigint",
                    Params()
                        .add(data)
                        .addTextArray(std::move(starts).take())
                        .addTextArray(std::move(ends).take()),
                    kRetry)
      .takeStatus();
}

Status PostgresStore::deleteChunksOf(const std::string& data) {
  return Query::run(this, "deleteChunksOf", "DELETE FROM chunks WHERE data=$1", Params().add(data),
                    kRetry)
      .takeStatus();
}

Result<std::vector<ChunkKey>> PostgresStore::listChunkKeys(const ChunkKey& after, size_t limit) {
  if (limit == 0) return invalidArg("limit", "a page of chunk keys needs a limit above 0");
  // A range scan of the primary key's index from `after` (the row comparison
  // and the ORDER BY use the column's collation alike, so pages never skip or
  // repeat a row whatever it is): a page costs one round trip and `limit`
  // rows, never a sort of the table.
  ASSIGN_OR_RETURN(Rows rows,
                   Query::run(this, "listChunkKeys",
                              "SELECT sha, length FROM chunks "
                              "WHERE (sha, length) > ($1, $2::bigint) "
                              "ORDER BY sha, length LIMIT $3::bigint",
                              Params().add(after.sha).add(after.length).add(int64_t(limit)),
                              kRetry));
  std::vector<ChunkKey> out;
  out.reserve(size_t(rows.size()));
  for (int i = 0; i < rows.size(); ++i) out.push_back({rows.text(i, 0), rows.i64(i, 1)});
  return out;
}

// ---------------------------------------------------------------- images

Status PostgresStore::putImage(const ImageRecord& r) {
  return Query::run(this, "putImage",
                    "INSERT INTO images(name, tag, layers, size, created_at, kind, parent, config, "
                    "owner, visibility, source) VALUES($1, $2, $3, $4::bigint, $5::float8, $6, $7, "
                    "$8, $9, $10, $11) ON CONFLICT(name, tag) DO UPDATE SET layers=excluded.layers, "
                    "size=excluded.size, created_at=excluded.created_at, kind=excluded.kind, "
                    "parent=excluded.parent, config=excluded.config, owner=excluded.owner, "
                    "visibility=excluded.visibility, source=excluded.source",
                    Params()
                        .add(r.name)
                        .add(r.tag)
                        .add(json(r.layers).dump())
                        .add(r.size)
                        .add(r.createdAt)
                        .add(r.kind)
                        .add(r.parent)
                        .add(imageConfigToColumn(r.config))
                        .add(r.owner)
                        .add(r.visibility)
                        .add(r.source),
                    kRetry)
      .takeStatus();
}

namespace {
constexpr const char* kImageColumns =
    "name, tag, layers, size, created_at, kind, parent, config, owner, visibility, source";
ImageRecord imageFromRow(const Rows& r, int i) {
  return imageFromColumns(r.text(i, 0), r.text(i, 1), r.text(i, 2), r.i64(i, 3), r.dbl(i, 4),
                          r.text(i, 5), r.text(i, 6), r.text(i, 7), r.text(i, 8), r.text(i, 9),
                          r.text(i, 10));
}
}  // namespace

Result<ImageRecord> PostgresStore::getImage(const std::string& name, const std::string& tag) {
  std::string sql =
      std::string("SELECT ") + kImageColumns + " FROM images WHERE name=$1 AND tag=$2";
  ASSIGN_OR_RETURN(Rows rows,
                   Query::run(this, "getImage", sql.c_str(), Params().add(name).add(tag), kRetry));
  if (rows.size() == 0) return notFound("image " + name + ":" + tag + " not found");
  return imageFromRow(rows, 0);
}

Result<std::vector<ImageRecord>> PostgresStore::listImages() {
  // COLLATE "C": the byte order SQLite sorts by, whatever the database's locale.
  std::string sql = std::string("SELECT ") + kImageColumns +
                    " FROM images ORDER BY name COLLATE \"C\", tag COLLATE \"C\"";
  ASSIGN_OR_RETURN(Rows rows, Query::run(this, "listImages", sql.c_str(), Params(), kRetry));
  std::vector<ImageRecord> out;
  for (int i = 0; i < rows.size(); ++i) out.push_back(imageFromRow(rows, i));
  return out;
}

Status PostgresStore::deleteImage(const std::string& name, const std::string& tag) {
  ASSIGN_OR_RETURN(Rows rows,
                   Query::run(this, "deleteImage", "DELETE FROM images WHERE name=$1 AND tag=$2",
                              Params().add(name).add(tag), kNoRetry));
  if (rows.affected() == 0) return notFound("image " + name + ":" + tag + " not found");
  return Status::ok();
}

// ---------------------------------------------------------------- build cache

Status PostgresStore::putBuildCache(const BuildCacheEntry& e) {
  return Query::run(this, "putBuildCache",
                    "INSERT INTO build_cache(key, layer, config, created_at, used_at) "
                    "VALUES($1, $2, $3, $4::float8, $5::float8) ON CONFLICT(key) DO UPDATE SET "
                    "layer=excluded.layer, config=excluded.config, "
                    "created_at=excluded.created_at, used_at=excluded.used_at",
                    Params().add(e.key).add(e.layer).add(e.config).add(e.createdAt).add(e.usedAt),
                    kRetry)
      .takeStatus();
}

Result<BuildCacheEntry> PostgresStore::getBuildCache(const std::string& key) {
  ASSIGN_OR_RETURN(Rows rows, Query::run(this, "getBuildCache",
                                         "SELECT key, layer, config, created_at, used_at "
                                         "FROM build_cache WHERE key=$1",
                                         Params().add(key), kRetry));
  if (rows.size() == 0) return notFound("no build cache entry " + key);
  return BuildCacheEntry{rows.text(0, 0), rows.text(0, 1), rows.text(0, 2), rows.dbl(0, 3),
                         rows.dbl(0, 4)};
}

Status PostgresStore::touchBuildCache(const std::string& key, double at) {
  return Query::run(this, "touchBuildCache",
                    "UPDATE build_cache SET used_at=GREATEST(used_at, $2::float8) WHERE key=$1",
                    Params().add(key).add(at), kRetry)
      .takeStatus();
}

Result<std::set<std::string>> PostgresStore::buildCacheLayers(double since) {
  ASSIGN_OR_RETURN(Rows rows, Query::run(this, "buildCacheLayers",
                                         "SELECT DISTINCT layer FROM build_cache "
                                         "WHERE used_at >= $1::float8",
                                         Params().add(since), kRetry));
  std::set<std::string> out;
  for (int i = 0; i < rows.size(); ++i) out.insert(rows.text(i, 0));
  return out;
}

Result<int64_t> PostgresStore::deleteBuildCacheBefore(double t) {
  ASSIGN_OR_RETURN(Rows rows, Query::run(this, "deleteBuildCacheBefore",
                                         "DELETE FROM build_cache WHERE used_at < $1::float8",
                                         Params().add(t), kRetry));
  return rows.affected();
}

// ---------------------------------------------------------------- policies

Status PostgresStore::putPolicy(const std::string& name, const std::string& doc) {
  return Query::run(this, "putPolicy",
                    "INSERT INTO policies(name, doc) VALUES($1, $2) "
                    "ON CONFLICT(name) DO UPDATE SET doc=excluded.doc",
                    Params().add(name).add(doc), kRetry)
      .takeStatus();
}

Status PostgresStore::deletePolicy(const std::string& name) {
  ASSIGN_OR_RETURN(Rows rows, Query::run(this, "deletePolicy", "DELETE FROM policies WHERE name=$1",
                                         Params().add(name), kNoRetry));
  if (rows.affected() == 0) return notFound("policy " + name + " not found");
  return Status::ok();
}

Result<std::vector<std::string>> PostgresStore::loadPolicies() {
  ASSIGN_OR_RETURN(Rows rows, Query::run(this, "loadPolicies",
                                         "SELECT doc FROM policies ORDER BY name COLLATE \"C\"",
                                         Params(), kRetry));
  std::vector<std::string> out;
  for (int i = 0; i < rows.size(); ++i) out.push_back(rows.text(i, 0));
  return out;
}

// ---------------------------------------------------------------- trajectories

namespace {
constexpr const char* kStepColumns =
    "trajectory, step, digest, kind, sandbox, request, status, content_type, body, started_at, "
    "finished_at, content";

TrajectoryStep stepFromRow(const Rows& r, int i) {
  TrajectoryStep s;
  s.trajectory = r.text(i, 0);
  s.step = r.i64(i, 1);
  s.digest = r.text(i, 2);
  s.kind = r.text(i, 3);
  s.sandbox = r.text(i, 4);
  s.request = r.text(i, 5);
  s.status = int(r.i64(i, 6));
  s.contentType = r.text(i, 7);
  s.body = r.bytes(i, 8);
  s.startedAt = r.dbl(i, 9);
  s.finishedAt = r.dbl(i, 10);
  s.content = r.text(i, 11);
  return s;
}

bool sameStep(const TrajectoryStep& a, const TrajectoryStep& b) {
  return a.trajectory == b.trajectory && a.step == b.step && a.digest == b.digest &&
         a.kind == b.kind && a.sandbox == b.sandbox && a.request == b.request &&
         a.status == b.status && a.contentType == b.contentType && a.body == b.body &&
         a.startedAt == b.startedAt && a.finishedAt == b.finishedAt && a.content == b.content;
}
}  // namespace

Status PostgresStore::putStep(const TrajectoryStep& s) {
  std::string sql = std::string("INSERT INTO trajectory_steps(") + kStepColumns +
                    ") VALUES($1, $2::bigint, $3, $4, $5, $6, $7::integer, $8, $9::bytea, "
                    "$10::float8, $11::float8, $12)";
  Params p;
  p.add(s.trajectory).add(s.step).add(s.digest).add(s.kind).add(s.sandbox).add(s.request);
  p.add(int64_t(s.status)).add(s.contentType).addBytes(s.body).add(s.startedAt).add(s.finishedAt);
  p.add(s.content);
  // Retried on a lost connection: if the first attempt did commit, the retry
  // meets that very row, which is then no conflict. Without a retry any
  // existing row is one, as with SQLite.
  bool retried = false;
  auto r = Query::run(this, "putStep", sql.c_str(), p, kRetry, &retried);
  if (r.isOk()) return Status::ok();
  if (r.status().code() != Code::kAlreadyExists) return std::move(r).takeStatus();
  if (retried) {
    auto stored = getStep(s.trajectory, s.step);
    if (stored.isOk() && sameStep(*stored, s)) return Status::ok();
  }
  return Status(Code::kAlreadyExists, "step " + std::to_string(s.step) + " of trajectory " +
                                          s.trajectory + " is already stored");
}

Result<TrajectoryStep> PostgresStore::getStep(const std::string& trajectory, int64_t step) {
  std::string sql = std::string("SELECT ") + kStepColumns +
                    " FROM trajectory_steps WHERE trajectory=$1 AND step=$2::bigint";
  ASSIGN_OR_RETURN(Rows rows, Query::run(this, "getStep", sql.c_str(),
                                         Params().add(trajectory).add(step), kRetry));
  if (rows.size() == 0) return notFound("step not stored");
  return stepFromRow(rows, 0);
}

Result<std::vector<TrajectoryStep>> PostgresStore::loadTrajectory(const std::string& trajectory) {
  std::string sql = std::string("SELECT ") + kStepColumns +
                    " FROM trajectory_steps WHERE trajectory=$1 ORDER BY step";
  ASSIGN_OR_RETURN(
      Rows rows, Query::run(this, "loadTrajectory", sql.c_str(), Params().add(trajectory), kRetry));
  std::vector<TrajectoryStep> out;
  for (int i = 0; i < rows.size(); ++i) out.push_back(stepFromRow(rows, i));
  return out;
}

Result<std::vector<TrajectorySummary>> PostgresStore::listTrajectories() {
  ASSIGN_OR_RETURN(Rows rows,
                   Query::run(this, "listTrajectories",
                              "SELECT trajectory, COUNT(*), MIN(started_at), MAX(finished_at) "
                              "FROM trajectory_steps GROUP BY trajectory "
                              "ORDER BY trajectory COLLATE \"C\"",
                              Params(), kRetry));
  std::vector<TrajectorySummary> out;
  for (int i = 0; i < rows.size(); ++i) {
    out.push_back({rows.text(i, 0), rows.i64(i, 1), rows.dbl(i, 2), rows.dbl(i, 3)});
  }
  return out;
}

Result<int64_t> PostgresStore::deleteTrajectory(const std::string& trajectory) {
  // One statement, so one transaction: the steps and the record go together.
  ASSIGN_OR_RETURN(Rows rows,
                   Query::run(this, "deleteTrajectory",
                              "WITH s AS (DELETE FROM trajectory_steps WHERE trajectory=$1 "
                              "RETURNING 1), r AS (DELETE FROM trajectories WHERE id=$1) "
                              "SELECT COUNT(*) FROM s",
                              Params().add(trajectory), kNoRetry));
  return rows.i64(0, 0);
}

Result<int64_t> PostgresStore::deleteTrajectoriesBefore(double t) {
  // The sub-statements share one snapshot: `r` sees the steps `s` deletes, so
  // it names those trajectories itself; it also takes records of trajectories
  // without steps, whatever removed them.
  ASSIGN_OR_RETURN(
      Rows rows,
      Query::run(this, "deleteTrajectoriesBefore",
                 "WITH old AS (SELECT trajectory FROM trajectory_steps GROUP BY trajectory "
                 "HAVING MAX(finished_at) < $1::float8), "
                 "s AS (DELETE FROM trajectory_steps WHERE trajectory IN (SELECT trajectory FROM "
                 "old) RETURNING 1), "
                 "r AS (DELETE FROM trajectories t WHERE t.id IN (SELECT trajectory FROM old) OR "
                 "NOT EXISTS (SELECT 1 FROM trajectory_steps x WHERE x.trajectory = t.id)) "
                 "SELECT COUNT(*) FROM s",
                 Params().add(t), kNoRetry));
  return rows.i64(0, 0);
}

Result<std::set<std::string>> PostgresStore::stepContents() {
  ASSIGN_OR_RETURN(Rows rows, Query::run(this, "stepContents",
                                         "SELECT DISTINCT content FROM trajectory_steps "
                                         "WHERE content <> ''",
                                         Params(), kRetry));
  std::set<std::string> out;
  for (int i = 0; i < rows.size(); ++i) out.insert(rows.text(i, 0));
  return out;
}

Result<bool> PostgresStore::stepContentUsed(const std::string& digest) {
  ASSIGN_OR_RETURN(Rows rows, Query::run(this, "stepContentUsed",
                                         "SELECT 1 FROM trajectory_steps WHERE content=$1 LIMIT 1",
                                         Params().add(digest), kRetry));
  return rows.size() > 0;
}

Status PostgresStore::putTrajectory(const TrajectoryRecord& r) {
  return Query::run(this, "putTrajectory",
                    "INSERT INTO trajectories(id, doc) VALUES($1, $2) "
                    "ON CONFLICT(id) DO UPDATE SET doc=excluded.doc",
                    Params().add(r.id).add(trajectoryToDoc(r)), kRetry)
      .takeStatus();
}

Result<TrajectoryRecord> PostgresStore::getTrajectory(const std::string& id) {
  ASSIGN_OR_RETURN(Rows rows,
                   Query::run(this, "getTrajectory", "SELECT doc FROM trajectories WHERE id=$1",
                              Params().add(id), kRetry));
  if (rows.size() == 0) return notFound("trajectory " + id + " has no record");
  return trajectoryFromDoc(id, rows.text(0, 0));
}

// ---------------------------------------------------------------- tenants

Status PostgresStore::putTenant(const TenantRecord& r) {
  return Query::run(this, "putTenant",
                    "INSERT INTO tenants(id, doc) VALUES($1, $2) "
                    "ON CONFLICT(id) DO UPDATE SET doc=excluded.doc",
                    Params().add(r.id).add(tenantToJson(r)), kRetry)
      .takeStatus();
}

Result<TenantRecord> PostgresStore::getTenant(const std::string& id) {
  ASSIGN_OR_RETURN(Rows rows, Query::run(this, "getTenant", "SELECT doc FROM tenants WHERE id=$1",
                                         Params().add(id), kRetry));
  if (rows.size() == 0) return notFound("tenant " + id + " not found");
  return tenantFromJson(rows.text(0, 0));
}

Result<std::vector<TenantRecord>> PostgresStore::listTenants() {
  ASSIGN_OR_RETURN(
      Rows rows, Query::run(this, "listTenants",
                            "SELECT doc FROM tenants ORDER BY id COLLATE \"C\"", Params(), kRetry));
  std::vector<TenantRecord> out;
  for (int i = 0; i < rows.size(); ++i) {
    ASSIGN_OR_RETURN(auto r, tenantFromJson(rows.text(i, 0)));
    out.push_back(std::move(r));
  }
  return out;
}

Status PostgresStore::deleteTenant(const std::string& id) {
  // One statement, so one transaction: the tenant and its keys go together.
  ASSIGN_OR_RETURN(Rows rows, Query::run(this, "deleteTenant",
                                         "WITH k AS (DELETE FROM api_keys WHERE tenant=$1), "
                                         "t AS (DELETE FROM tenants WHERE id=$1 RETURNING 1) "
                                         "SELECT COUNT(*) FROM t",
                                         Params().add(id), kNoRetry));
  if (rows.i64(0, 0) == 0) return notFound("tenant " + id + " not found");
  return Status::ok();
}

Status PostgresStore::putApiKey(const ApiKeyRecord& r) {
  return Query::run(this, "putApiKey",
                    "INSERT INTO api_keys(id, tenant, doc) VALUES($1, $2, $3) "
                    "ON CONFLICT(id) DO UPDATE SET tenant=excluded.tenant, doc=excluded.doc",
                    Params().add(r.id).add(r.tenant).add(apiKeyToJson(r)), kRetry)
      .takeStatus();
}

Result<ApiKeyRecord> PostgresStore::getApiKey(const std::string& id) {
  ASSIGN_OR_RETURN(Rows rows, Query::run(this, "getApiKey", "SELECT doc FROM api_keys WHERE id=$1",
                                         Params().add(id), kRetry));
  if (rows.size() == 0) return notFound("api key " + id + " not found");
  return apiKeyFromJson(rows.text(0, 0));
}

Result<std::vector<ApiKeyRecord>> PostgresStore::listApiKeys(const std::string& tenant) {
  ASSIGN_OR_RETURN(
      Rows rows,
      Query::run(
          this, "listApiKeys",
          "SELECT doc FROM api_keys WHERE $1::text = '' OR tenant=$1 ORDER BY id COLLATE \"C\"",
          Params().add(tenant), kRetry));
  std::vector<ApiKeyRecord> out;
  for (int i = 0; i < rows.size(); ++i) {
    ASSIGN_OR_RETURN(auto r, apiKeyFromJson(rows.text(i, 0)));
    out.push_back(std::move(r));
  }
  return out;
}

// ---------------------------------------------------------------- replicas and nodes

namespace {
constexpr const char* kNodeColumns =
    "name, pool, url, edge_key_hash, platform_key, cpus, memory_mb, slots, state, "
    "last_heartbeat, boot_id, joined_at";
}  // namespace

Result<SandboxRecord> PostgresStore::getSandbox(const std::string& id) {
  ASSIGN_OR_RETURN(Rows rows, Query::run(this, "getSandbox", "SELECT doc FROM sandboxes WHERE id=$1",
                                         Params().add(id), kRetry));
  if (rows.size() == 0) return notFound("sandbox " + id + " not found");
  return sandboxFromJson(rows.text(0, 0));
}

Result<std::vector<SandboxRecord>> PostgresStore::sandboxesChangedSince(double since, double* now) {
  if (now) {
    // Read first: a row stamped after this reading is seen by the next call.
    ASSIGN_OR_RETURN(Rows t, Query::run(this, "store clock",
                                        "SELECT EXTRACT(EPOCH FROM clock_timestamp())::float8",
                                        Params(), kRetry));
    *now = t.dbl(0, 0);
  }
  ASSIGN_OR_RETURN(Rows rows, Query::run(this, "sandboxesChangedSince",
                                         "SELECT doc FROM sandboxes WHERE changed >= $1::float8",
                                         Params().add(since), kRetry));
  std::vector<SandboxRecord> out;
  for (int i = 0; i < rows.size(); ++i) {
    ASSIGN_OR_RETURN(auto r, sandboxFromJson(rows.text(i, 0)));
    out.push_back(std::move(r));
  }
  return out;
}

Result<bool> PostgresStore::casSandbox(const SandboxRecord& r, SandboxState fromState) {
  ASSIGN_OR_RETURN(Rows rows,
                   Query::run(this, "casSandbox",
                              "UPDATE sandboxes SET state=$2, doc=$3 WHERE id=$1 AND state=$4",
                              Params().add(r.id).add(std::string(proto::stateName(r.state))).add(sandboxToJson(r)).add(std::string(proto::stateName(fromState))),
                              kRetry));
  return rows.affected() > 0;
}

Status PostgresStore::putNode(const NodeRecord& r) {
  return Query::run(this, "putNode",
                    "INSERT INTO nodes(name, pool, url, edge_key_hash, platform_key, cpus, "
                    "memory_mb, slots, state, last_heartbeat, boot_id, joined_at) "
                    "VALUES($1, $2, $3, $4, $5, $6::float8, $7::bigint, $8::bigint, $9, "
                    "$10::float8, $11, $12::float8) ON CONFLICT(name) DO UPDATE SET "
                    "pool=excluded.pool, url=excluded.url, edge_key_hash=excluded.edge_key_hash, "
                    "platform_key=excluded.platform_key, cpus=excluded.cpus, "
                    "memory_mb=excluded.memory_mb, slots=excluded.slots, state=excluded.state, "
                    "last_heartbeat=excluded.last_heartbeat, boot_id=excluded.boot_id, "
                    "joined_at=excluded.joined_at",
                    Params()
                        .add(r.name)
                        .add(r.pool)
                        .add(r.url)
                        .add(r.edgeKeyHash)
                        .add(r.platformKey)
                        .add(r.cpus)
                        .add(r.memoryMb)
                        .add(r.slots)
                        .add(r.state)
                        .add(r.lastHeartbeat)
                        .add(r.bootId)
                        .add(r.joinedAt),
                    kRetry)
      .takeStatus();
}

Result<std::vector<NodeRecord>> PostgresStore::listNodes() {
  ASSIGN_OR_RETURN(Rows rows, Query::run(this, "listNodes",
                                         (std::string("SELECT ") + kNodeColumns +
                                          " FROM nodes ORDER BY name")
                                             .c_str(),
                                         Params(), kRetry));
  std::vector<NodeRecord> out;
  for (int i = 0; i < rows.size(); ++i) {
    NodeRecord r;
    r.name = rows.text(i, 0);
    r.pool = rows.text(i, 1);
    r.url = rows.text(i, 2);
    r.edgeKeyHash = rows.text(i, 3);
    r.platformKey = rows.text(i, 4);
    r.cpus = rows.dbl(i, 5);
    r.memoryMb = rows.i64(i, 6);
    r.slots = rows.i64(i, 7);
    r.state = rows.text(i, 8);
    r.lastHeartbeat = rows.dbl(i, 9);
    r.bootId = rows.text(i, 10);
    r.joinedAt = rows.dbl(i, 11);
    out.push_back(std::move(r));
  }
  return out;
}

Status PostgresStore::touchNode(const NodeRecord& r) {
  ASSIGN_OR_RETURN(
      Rows rows,
      Query::run(this, "touchNode",
                 "UPDATE nodes SET url=$2, pool=$3, cpus=$4::float8, memory_mb=$5::bigint, "
                 "slots=$6::bigint, last_heartbeat=GREATEST(last_heartbeat, $7::float8), "
                 "boot_id=$8 WHERE name=$1",
                 Params()
                     .add(r.name)
                     .add(r.url)
                     .add(r.pool)
                     .add(r.cpus)
                     .add(r.memoryMb)
                     .add(r.slots)
                     .add(r.lastHeartbeat)
                     .add(r.bootId),
                 kRetry));
  if (rows.affected() == 0) return notFound("node " + r.name + " not found");
  return Status::ok();
}

Result<bool> PostgresStore::setNodeState(const std::string& name, const std::string& from,
                                         const std::string& to) {
  ASSIGN_OR_RETURN(Rows rows,
                   Query::run(this, "setNodeState",
                              "UPDATE nodes SET state=$3 WHERE name=$1 AND state=$2",
                              Params().add(name).add(from).add(to), kRetry));
  return rows.affected() > 0;
}

Result<bool> PostgresStore::acquireLease(const std::string& name, const std::string& holder,
                                         double ttlS) {
  // One statement: two replicas racing for a free lease cannot both win.
  ASSIGN_OR_RETURN(
      Rows rows,
      Query::run(this, "acquireLease",
                 "INSERT INTO leases(name, holder, expires) "
                 "VALUES($1, $2, EXTRACT(EPOCH FROM clock_timestamp())::float8 + $3::float8) "
                 "ON CONFLICT(name) DO UPDATE SET holder=excluded.holder, "
                 "expires=excluded.expires WHERE leases.holder=excluded.holder OR "
                 "leases.expires < EXTRACT(EPOCH FROM clock_timestamp())::float8 RETURNING holder",
                 Params().add(name).add(holder).add(ttlS), kRetry));
  return rows.size() > 0;
}

Status PostgresStore::releaseLease(const std::string& name, const std::string& holder) {
  return Query::run(this, "releaseLease", "DELETE FROM leases WHERE name=$1 AND holder=$2",
                    Params().add(name).add(holder), kRetry)
      .takeStatus();
}

Result<std::vector<LeaseRecord>> PostgresStore::listLeases() {
  ASSIGN_OR_RETURN(Rows rows, Query::run(this, "listLeases",
                                         "SELECT name, holder, (expires >= EXTRACT(EPOCH FROM "
                                         "clock_timestamp())::float8)::int FROM leases "
                                         "ORDER BY name",
                                         Params(), kRetry));
  std::vector<LeaseRecord> out;
  for (int i = 0; i < rows.size(); ++i) {
    out.push_back({rows.text(i, 0), rows.text(i, 1), rows.i64(i, 2) != 0});
  }
  return out;
}

Result<std::string> PostgresStore::settingOrPut(const std::string& name, const std::string& value) {
  ASSIGN_OR_RETURN(Rows rows, Query::run(this, "settingOrPut",
                                         "INSERT INTO settings(name, value) VALUES($1, $2) "
                                         "ON CONFLICT(name) DO UPDATE SET value=settings.value "
                                         "RETURNING value",
                                         Params().add(name).add(value), kRetry));
  if (rows.size() == 0) return internalError("postgres settingOrPut: no row");
  return rows.text(0, 0);
}

Status PostgresStore::noteCalls(const std::map<std::string, double>& calls) {
  for (auto& [id, at] : calls) {
    // A sandbox purged meanwhile (foreign key) is no error: nothing to time.
    auto r = Query::run(this, "noteCalls",
                        "INSERT INTO sandbox_calls(id, at) SELECT $1, $2::float8 "
                        "WHERE EXISTS (SELECT 1 FROM sandboxes WHERE id=$1) "
                        "ON CONFLICT(id) DO UPDATE SET at=GREATEST(sandbox_calls.at, excluded.at)",
                        Params().add(id).add(at), kRetry);
    if (!r.isOk() && r.status().message().find("foreign key") == std::string::npos) {
      return r.status();
    }
  }
  return Status::ok();
}

Result<std::map<std::string, double>> PostgresStore::lastCalls(const std::vector<std::string>& ids) {
  std::map<std::string, double> out;
  if (ids.empty()) return out;
  std::string arr = "{";
  for (size_t i = 0; i < ids.size(); ++i) {
    if (i) arr += ",";
    arr += "\"";
    for (char c : ids[i]) {
      if (c == '"' || c == '\\') arr += '\\';
      arr += c;
    }
    arr += "\"";
  }
  arr += "}";
  ASSIGN_OR_RETURN(Rows rows,
                   Query::run(this, "lastCalls",
                              "SELECT id, at FROM sandbox_calls WHERE id = ANY($1::text[])",
                              Params().add(arr), kRetry));
  for (int i = 0; i < rows.size(); ++i) out[rows.text(i, 0)] = rows.dbl(i, 1);
  return out;
}

}  // namespace dsec::platform
