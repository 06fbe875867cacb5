// The Connect wire pieces the E2B envd surface uses (connect_rpc.h).
#include "platform/connect_rpc.h"

#include <gtest/gtest.h>

namespace dsec::platform::connect {
namespace {

TEST(ConnectRpcTest, EnvelopesAreFlagsBigEndianLengthPayload) {
  std::string e = envelope(R"({"a":1})");
  ASSERT_EQ(e.size(), 5u + 7u);
  EXPECT_EQ(e[0], '\0');
  EXPECT_EQ(std::string(e.data() + 1, 4), std::string("\0\0\0\x07", 4));
  EXPECT_EQ(e.substr(5), R"({"a":1})");
  std::string big = envelope(std::string(0x010203, 'x'));
  EXPECT_EQ(std::string(big.data() + 1, 4), std::string("\0\x01\x02\x03", 4));
  EXPECT_EQ(singleMessage(e).value(), R"({"a":1})");
}

TEST(ConnectRpcTest, EndStreamCarriesTheError) {
  std::string ok = endStream(Status::ok());
  EXPECT_EQ(static_cast<uint8_t>(ok[0]), kFlagEndStream);
  EXPECT_EQ(ok.substr(5), "{}");
  std::string bad = endStream(Status(Code::kNotFound, "process with pid 9 not found"));
  EXPECT_EQ(bad.substr(5),
            R"({"error":{"code":"not_found","message":"process with pid 9 not found"}})");
  EXPECT_EQ(errorJson(invalidArg("path", "bad")),
            R"x({"code":"invalid_argument","message":"bad (field path)"})x");
}

TEST(ConnectRpcTest, StreamRequestsAreExactlyOneUncompressedEnvelope) {
  EXPECT_EQ(singleMessage("").status().field(), "body");
  EXPECT_FALSE(singleMessage(std::string("\0\0\0\0\x05{}", 7)).isOk());  // short
  EXPECT_FALSE(singleMessage(envelope("{}") + "x").isOk());              // trailing bytes
  std::string compressed = envelope("{}");
  compressed[0] = static_cast<char>(kFlagCompressed);
  EXPECT_FALSE(singleMessage(compressed).isOk());
  EXPECT_FALSE(singleMessage(std::string("\0\x7f\xff\xff\xff", 5)).isOk());  // too large
  EXPECT_EQ(singleMessage(envelope("")).value(), "");
}

TEST(ConnectRpcTest, CodesAndStatusesFollowConnect) {
  EXPECT_STREQ(connect::codeName(Code::kNotFound), "not_found");
  EXPECT_STREQ(connect::codeName(Code::kAlreadyExists), "already_exists");
  EXPECT_STREQ(connect::codeName(Code::kDeadlineExceeded), "deadline_exceeded");
  EXPECT_STREQ(connect::codeName(Code::kRateLimited), "resource_exhausted");
  EXPECT_EQ(httpStatus(Code::kNotFound), 404);
  EXPECT_EQ(httpStatus(Code::kInvalidArgument), 400);
  EXPECT_EQ(httpStatus(Code::kUnauthenticated), 401);
  EXPECT_EQ(httpStatus(Code::kAlreadyExists), 409);
  EXPECT_EQ(httpStatus(Code::kUnavailable), 503);
}

TEST(ConnectRpcTest, ContentTypesAndTimeouts) {
  EXPECT_TRUE(isUnaryJson("application/json"));
  EXPECT_TRUE(isUnaryJson("Application/JSON; charset=utf-8"));
  EXPECT_FALSE(isUnaryJson("application/connect+json"));
  EXPECT_TRUE(isStreamJson("application/connect+json"));
  EXPECT_FALSE(isStreamJson("application/proto"));
  EXPECT_EQ(timeoutMs("").value(), 0);
  EXPECT_EQ(timeoutMs("60000").value(), 60000);
  EXPECT_EQ(timeoutMs("6e4").status().field(), "connect-timeout-ms");
  EXPECT_FALSE(timeoutMs("12345678901").isOk());
}

}  // namespace
}  // namespace dsec::platform::connect
