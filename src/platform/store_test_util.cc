#include "platform/store_test_util.h"

#include "common/util.h"
#include "platform/pg_store.h"

namespace dsec::platform {

std::string storeKindName(const ::testing::TestParamInfo<StoreKind>& info) {
  return info.param == StoreKind::kSqlite ? "Sqlite" : "Postgres";
}

Result<std::unique_ptr<TestStoreEnv>> TestStoreEnv::make(StoreKind kind) {
  auto e = std::make_unique<TestStoreEnv>();
  e->kind = kind;
  if (kind == StoreKind::kPostgres) {
    ASSIGN_OR_RETURN(e->cluster, sharedPgTestCluster());
    ASSIGN_OR_RETURN(e->schema, e->cluster->createSchema("t"));
    e->uri = e->cluster->uri("dsec", e->schema);
  }
  e->dir = "/tmp/dsec-store-test-" + randomHex(4);
  RETURN_IF_ERROR(makeDirs(e->dir));
  return e;
}

TestStoreEnv::~TestStoreEnv() {
  if (!dir.empty()) (void)removeTree(dir);
  if (cluster && !schema.empty()) {
    Status st = cluster->dropSchema(schema);
    EXPECT_TRUE(st.isOk()) << st.toString();
  }
}

Result<std::unique_ptr<Store>> TestStoreEnv::open() {
  if (kind == StoreKind::kSqlite) {
    ASSIGN_OR_RETURN(auto s, SqliteStore::open(dir + "/state.db"));
    return std::unique_ptr<Store>(std::move(s));
  }
  ASSIGN_OR_RETURN(auto s, PostgresStore::open(uri));
  return std::unique_ptr<Store>(std::move(s));
}

}  // namespace dsec::platform
