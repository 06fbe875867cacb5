// openStore (store.h): the one place that maps a --store value to a Store.
#include "platform/pg_store.h"
#include "platform/store.h"

namespace dsec::platform {

Result<std::unique_ptr<Store>> openStore(const std::string& spec, const std::string& dataDir,
                                         std::string* where) {
  if (spec.empty() || spec == "sqlite") {
    std::string path = dataDir + "/state.db";
    if (where) *where = "sqlite " + path;
    ASSIGN_OR_RETURN(auto s, SqliteStore::open(path));
    return std::unique_ptr<Store>(std::move(s));
  }
  if (spec.rfind("postgres://", 0) == 0 || spec.rfind("postgresql://", 0) == 0) {
    if (where) *where = "postgresql " + redactPostgresUri(spec);
    ASSIGN_OR_RETURN(auto s, PostgresStore::open(spec));
    return std::unique_ptr<Store>(std::move(s));
  }
  // Not echoed whole: it may be a mistyped URI holding a password.
  return invalidArg("store", "must be `sqlite` or a postgres:// or postgresql:// URI, not " +
                                 redactPostgresUri(spec));
}

}  // namespace dsec::platform
