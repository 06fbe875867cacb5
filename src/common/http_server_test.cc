#include "common/http_server.h"

#include <gtest/gtest.h>

#include <thread>

#include "common/http_client.h"

namespace dsec::http {
namespace {

class HttpServerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ServerOptions o;
    o.port = 0;
    server_ = std::make_unique<Server>(o);
    ASSERT_TRUE(server_->listen().isOk());
    thread_ = std::thread([this] {
      server_->serve([](Request& req, Response& res) {
        if (req.path == "/echo") {
          auto body = req.readBody(1 << 20);
          if (!body.isOk()) {
            (void)res.send(413, "text/plain", "too big");
            return;
          }
          (void)res.send(200, "text/plain", req.method + " " + req.param("q").value_or("-") +
                                                " " + *body);
        } else if (req.path == "/chunks") {
          (void)res.beginChunked(200, "application/x-ndjson");
          for (int i = 0; i < 3; ++i) (void)res.write("line" + std::to_string(i) + "\n");
          (void)res.finish();
        } else {
          (void)res.send(404, "text/plain", "nope " + req.path);
        }
      });
    });
    auto c = Client::connect("http://127.0.0.1:" + std::to_string(server_->port()), "t");
    ASSERT_TRUE(c.isOk());
    client_ = std::move(c).value();
  }
  void TearDown() override {
    server_->stop();
    thread_.join();
  }
  std::unique_ptr<Server> server_;
  std::thread thread_;
  std::unique_ptr<Client> client_;
};

TEST_F(HttpServerTest, KeepAliveRequestsWithQueryAndBody) {
  for (int i = 0; i < 3; ++i) {
    auto r = client_->request("POST", "/echo?q=a%20b", "payload");
    ASSERT_TRUE(r.isOk()) << r.status().toString();
    EXPECT_EQ(r->status, 200);
    EXPECT_EQ(r->body, "POST a b payload");
  }
  auto r = client_->request("GET", "/x%2Fy");
  ASSERT_TRUE(r.isOk());
  EXPECT_EQ(r->status, 404);
  EXPECT_EQ(r->body, "nope /x/y");
}

TEST_F(HttpServerTest, ChunkedStream) {
  std::string got;
  auto r = client_->requestStreaming("GET", "/chunks", "", [&](std::string_view d) { got += d; });
  ASSERT_TRUE(r.isOk());
  EXPECT_EQ(got, "line0\nline1\nline2\n");
}

TEST_F(HttpServerTest, OversizeBodyRejected) {
  auto r = client_->request("POST", "/echo", std::string((1 << 20) + 10, 'x'));
  ASSERT_TRUE(r.isOk());
  EXPECT_EQ(r->status, 413);
}

TEST(PercentTest, DecodeEncode) {
  std::string out;
  EXPECT_TRUE(percentDecode("a%2fb", out));
  EXPECT_EQ(out, "a/b");
  EXPECT_FALSE(percentDecode("a%2", out));
  EXPECT_FALSE(percentDecode("a%zz", out));
  EXPECT_EQ(percentEncode("a b/c"), "a%20b/c");
}

}  // namespace
}  // namespace dsec::http
