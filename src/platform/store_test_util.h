// Test-only: each Store test runs against both stores (TEST_P over
// StoreKind), so a method added to Store later is tested on both.
#pragma once

#include <gtest/gtest.h>

#include <memory>
#include <string>

#include "platform/pg_test_cluster.h"
#include "platform/store.h"

namespace dsec::platform {

enum class StoreKind { kSqlite, kPostgres };

// "Sqlite" / "Postgres": the suffix of each instantiated test's name.
std::string storeKindName(const ::testing::TestParamInfo<StoreKind>& info);

// A fresh place for a store of one kind: a temp dir (both kinds: for files
// beside the store) and, for PostgreSQL, an empty schema on the shared test
// cluster (pg_test_cluster.h). Both go in the destructor.
class TestStoreEnv {
 public:
  // kUnavailable (PostgreSQL cannot run here): skip with that reason.
  static Result<std::unique_ptr<TestStoreEnv>> make(StoreKind kind);
  ~TestStoreEnv();
  // A new store on the same place (a reopen sees what earlier ones wrote).
  Result<std::unique_ptr<Store>> open();

  StoreKind kind;
  std::string dir;
  PgTestCluster* cluster = nullptr;  // PostgreSQL only
  std::string schema;                // PostgreSQL only
  std::string uri;                   // PostgreSQL only: the store's URI
};

}  // namespace dsec::platform

// In a fixture's SetUp (or a test): makes `env` (a
// std::unique_ptr<TestStoreEnv>) for `kind`, or skips printing why PostgreSQL
// is unavailable (fails instead with DSEC_TESTS_STRICT=1).
#define DSEC_MAKE_TEST_STORE_ENV(env, kind)                                                     \
  do {                                                                                          \
    auto made_ = ::dsec::platform::TestStoreEnv::make(kind);                                    \
    if (!made_.isOk() && made_.status().code() == ::dsec::Code::kUnavailable) {                 \
      const char* strict_ = getenv("DSEC_TESTS_STRICT");                                        \
      if (strict_ && std::string(strict_) == "1") {                                             \
        FAIL() << "PostgreSQL unavailable (DSEC_TESTS_STRICT=1): " << made_.status().message(); \
      }                                                                                         \
      GTEST_SKIP() << "PostgreSQL unavailable: " << made_.status().message();                   \
    }                                                                                           \
    ASSERT_TRUE(made_.isOk()) << made_.status().toString();                                     \
    env = std::move(*made_);                                                                    \
  } while (0)

#define DSEC_INSTANTIATE_FOR_BOTH_STORES(suite)                                       \
  INSTANTIATE_TEST_SUITE_P(Stores, suite,                                             \
                           ::testing::Values(::dsec::platform::StoreKind::kSqlite,    \
                                             ::dsec::platform::StoreKind::kPostgres), \
                           ::dsec::platform::storeKindName)
