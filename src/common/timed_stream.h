// Internal to http_server.cc and http_client.cc (it carries Boost types, which
// stay out of dsec's public headers).
#pragma once

#include <sys/socket.h>
#include <sys/uio.h>

#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/core/stream_traits.hpp>
#include <cerrno>

namespace dsec::http::internal {

namespace asio = boost::asio;
namespace beast = boost::beast;

// SO_RCVTIMEO / SO_SNDTIMEO on fd; seconds <= 0 leaves the call unbounded.
inline void setSocketTimeout(int fd, int opt, double seconds) {
  if (seconds <= 0) return;
  timeval tv{};
  tv.tv_sec = time_t(seconds);
  tv.tv_usec = suseconds_t((seconds - double(tv.tv_sec)) * 1e6);
  if (tv.tv_sec == 0 && tv.tv_usec == 0) tv.tv_usec = 1;  // {0,0} would mean "forever"
  (void)::setsockopt(fd, SOL_SOCKET, opt, &tv, sizeof tv);
}


// A blocking SyncReadStream/SyncWriteStream over a connected socket's fd that
// honours SO_RCVTIMEO/SO_SNDTIMEO. Asio's own synchronous socket calls do not:
// when recv(2)/send(2) give up with EAGAIN at the timeout, Asio poll(2)s with
// no timeout and waits on (sync_recv/sync_send in asio's socket_ops.ipp), so
// the options alone never fire. Here a timeout is asio::error::timed_out.
class TimedStream {
 public:
  explicit TimedStream(int fd = -1) : fd_(fd) {}

  template <class Buffers>
  size_t read_some(const Buffers& bufs, beast::error_code& ec) {
    iovec iov[kMaxIov];
    msghdr mh{};
    mh.msg_iov = iov;
    if (fill<asio::mutable_buffer>(bufs, iov, mh.msg_iovlen) == 0) {
      ec = {};
      return 0;
    }
    for (;;) {
      ssize_t n = ::recvmsg(fd_, &mh, 0);
      if (n > 0) {
        ec = {};
        return size_t(n);
      }
      if (n == 0) {
        ec = asio::error::eof;
        return 0;
      }
      if (errno == EINTR) continue;
      ec = errorFor(errno);
      return 0;
    }
  }
  template <class Buffers>
  size_t write_some(const Buffers& bufs, beast::error_code& ec) {
    iovec iov[kMaxIov];
    msghdr mh{};
    mh.msg_iov = iov;
    if (fill<asio::const_buffer>(bufs, iov, mh.msg_iovlen) == 0) {
      ec = {};
      return 0;
    }
    for (;;) {
      // MSG_NOSIGNAL: a peer that went away is an error here, not SIGPIPE.
      ssize_t n = ::sendmsg(fd_, &mh, MSG_NOSIGNAL);
      if (n >= 0) {
        ec = {};
        return size_t(n);
      }
      if (errno == EINTR) continue;
      ec = errorFor(errno);
      return 0;
    }
  }
  // The throwing forms complete the stream concepts; dsec calls only the above.
  template <class Buffers>
  size_t read_some(const Buffers& bufs) {
    beast::error_code ec;
    size_t n = read_some(bufs, ec);
    if (ec) throw beast::system_error(ec);
    return n;
  }
  template <class Buffers>
  size_t write_some(const Buffers& bufs) {
    beast::error_code ec;
    size_t n = write_some(bufs, ec);
    if (ec) throw beast::system_error(ec);
    return n;
  }

 private:
  static constexpr size_t kMaxIov = 64;

  static beast::error_code errorFor(int err) {
    if (err == EAGAIN || err == EWOULDBLOCK) return asio::error::timed_out;
    return beast::error_code(err, boost::system::system_category());
  }
  // Fills iov from a buffer sequence (first kMaxIov non-empty buffers; a short
  // transfer is fine for read_some/write_some); returns the byte total.
  template <class Buf, class Buffers>
  static size_t fill(const Buffers& bufs, iovec* iov, size_t& count) {
    size_t total = 0;
    count = 0;
    for (auto it = asio::buffer_sequence_begin(bufs);
         it != asio::buffer_sequence_end(bufs) && count < kMaxIov; ++it) {
      Buf b(*it);
      if (b.size() == 0) continue;
      iov[count].iov_base = const_cast<void*>(static_cast<const void*>(b.data()));
      iov[count].iov_len = b.size();
      total += b.size();
      ++count;
    }
    return total;
  }

  int fd_;
};
static_assert(beast::is_sync_read_stream<TimedStream>::value);
static_assert(beast::is_sync_write_stream<TimedStream>::value);

}  // namespace dsec::http::internal
