#include "common/http_client.h"

#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>

namespace dsec::http {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace bhttp = boost::beast::http;
using tcp = asio::ip::tcp;

struct Client::Impl {
  asio::io_context ioc;
  tcp::socket sock{ioc};
  beast::flat_buffer buf;
  std::string host, port, token;

  template <class Req>
  void prepare(Req& req) {
    req.set(bhttp::field::host, host + ":" + port);
    req.set(bhttp::field::user_agent, "dsec-cli");
    if (!token.empty()) req.set(bhttp::field::authorization, "Bearer " + token);
    req.keep_alive(true);
  }
};

Client::Client(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Client::~Client() = default;

Result<std::unique_ptr<Client>> Client::connect(const std::string& url, std::string token) {
  std::string rest = url;
  if (rest.rfind("http://", 0) == 0) {
    rest = rest.substr(7);
  } else if (rest.find("://") != std::string::npos) {
    return invalidArg("url", "only http:// URLs are supported: " + url);
  }
  while (!rest.empty() && rest.back() == '/') rest.pop_back();
  auto impl = std::make_unique<Impl>();
  size_t colon = rest.rfind(':');
  impl->host = colon == std::string::npos ? rest : rest.substr(0, colon);
  impl->port = colon == std::string::npos ? "80" : rest.substr(colon + 1);
  impl->token = std::move(token);
  beast::error_code ec;
  tcp::resolver resolver(impl->ioc);
  auto eps = resolver.resolve(impl->host, impl->port, ec);
  if (!ec) asio::connect(impl->sock, eps, ec);
  if (ec) return Status(Code::kUnavailable, "connect to " + url + ": " + ec.message());
  impl->sock.set_option(tcp::no_delay(true), ec);
  return std::unique_ptr<Client>(new Client(std::move(impl)));
}

Result<ClientResponse> Client::request(std::string_view method, std::string_view target,
                                       std::string_view body) {
  return requestStreaming(method, target, body, nullptr);
}

namespace {
template <class Parser>
ClientResponse headOf(Parser& p) {
  ClientResponse r;
  r.status = int(p.get().result_int());
  r.contentType = std::string(p.get()[bhttp::field::content_type]);
  return r;
}
}  // namespace

Result<ClientResponse> Client::requestStreaming(
    std::string_view method, std::string_view target, std::string_view body,
    const std::function<void(std::string_view)>& onData) {
  bhttp::request<bhttp::string_body> req{bhttp::string_to_verb(method), target, 11};
  impl_->prepare(req);
  if (!body.empty() || method == "POST" || method == "PUT") {
    req.set(bhttp::field::content_type, "application/json");
    req.body() = std::string(body);
    req.prepare_payload();
  }
  beast::error_code ec;
  bhttp::write(impl_->sock, req, ec);
  if (ec) return Status(Code::kUnavailable, "send request: " + ec.message());
  bhttp::response_parser<bhttp::buffer_body> parser;
  parser.body_limit(boost::none);
  bhttp::read_header(impl_->sock, impl_->buf, parser, ec);
  if (ec) return Status(Code::kUnavailable, "read response: " + ec.message());
  ClientResponse out = headOf(parser);
  char chunk[65536];
  while (!parser.is_done()) {
    parser.get().body().data = chunk;
    parser.get().body().size = sizeof chunk;
    bhttp::read(impl_->sock, impl_->buf, parser, ec);
    if (ec == bhttp::error::need_buffer) ec = {};
    if (ec) return Status(Code::kUnavailable, "read response body: " + ec.message());
    size_t n = sizeof chunk - parser.get().body().size;
    if (onData && n > 0) {
      onData(std::string_view(chunk, n));
    } else {
      out.body.append(chunk, n);
    }
  }
  return out;
}

Result<ClientResponse> Client::uploadFile(std::string_view method, std::string_view target,
                                          const std::string& path) {
  bhttp::request<bhttp::file_body> req{bhttp::string_to_verb(method), target, 11};
  impl_->prepare(req);
  beast::error_code ec;
  req.body().open(path.c_str(), beast::file_mode::scan, ec);
  if (ec) return Status(Code::kNotFound, "open " + path + ": " + ec.message());
  req.set(bhttp::field::content_type, "application/octet-stream");
  req.prepare_payload();
  bhttp::write(impl_->sock, req, ec);
  if (ec) return Status(Code::kUnavailable, "upload " + path + ": " + ec.message());
  bhttp::response<bhttp::string_body> res;
  bhttp::read(impl_->sock, impl_->buf, res, ec);
  if (ec) return Status(Code::kUnavailable, "read response: " + ec.message());
  ClientResponse out;
  out.status = int(res.result_int());
  out.contentType = std::string(res[bhttp::field::content_type]);
  out.body = std::move(res.body());
  return out;
}

}  // namespace dsec::http
