#include "common/status.h"

#include <gtest/gtest.h>

namespace dsec {
namespace {

Result<int> half(int x) {
  if (x % 2) return invalidArg("x", "odd");
  return x / 2;
}

Result<int> quarter(int x) {
  ASSIGN_OR_RETURN(int h, half(x));
  ASSIGN_OR_RETURN(int q, half(h));
  return q;
}

TEST(StatusTest, PropagatesThroughMacros) {
  EXPECT_EQ(*quarter(8), 2);
  auto r = quarter(6);
  ASSERT_FALSE(r.isOk());
  EXPECT_EQ(r.status().code(), Code::kInvalidArgument);
  EXPECT_EQ(r.status().field(), "x");
}

TEST(StatusTest, MapsErrnoAndHttp) {
  EXPECT_EQ(sysError("open /x", ENOENT).code(), Code::kNotFound);
  EXPECT_EQ(sysError("open /x", EACCES).code(), Code::kPermissionDenied);
  EXPECT_EQ(sysError("open /x", ENOENT).sysErrno(), ENOENT);
  EXPECT_EQ(httpStatusFor(Code::kNotFound), 404);
  EXPECT_EQ(httpStatusFor(Code::kUnauthenticated), 401);
  Status s = sysError("mount", EPERM);
  s.withContext("sandbox sb-1");
  EXPECT_EQ(s.message().rfind("sandbox sb-1: mount: ", 0), 0u);
}

}  // namespace
}  // namespace dsec
