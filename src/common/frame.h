// The agent protocol's framing (docs/agent-protocol.md): every message between
// the edge and dsec-aether is one frame
//
//   u32 length (little endian; bytes after this field = 5 + payload size)
//   u32 stream (little endian; 0 = connection control)
//   u8  type   (FrameType)
//   payload
//
// Frames of many streams interleave on one connection, which is how concurrent
// execs and file transfers share a socket or a serial line.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <string>
#include <string_view>

#include "common/status.h"

namespace dsec::proto {

enum class FrameType : uint8_t {
  kHello = 0x01,      // aether -> edge, stream 0: agent ready (JSON)
  kInit = 0x02,       // edge -> aether, stream 0: sandbox setup (JSON)
  kReattach = 0x03,   // edge -> aether, stream 0: a new edge took over the connection
  kExec = 0x10,       // edge -> aether: start a process (JSON)
  kStdin = 0x11,      // edge -> aether: stdin bytes; empty payload closes stdin
  kStdout = 0x12,     // aether -> edge: stdout bytes
  kStderr = 0x13,     // aether -> edge: stderr bytes
  kExit = 0x14,       // aether -> edge: process ended (JSON); ends the stream
  kSignal = 0x15,     // edge -> aether: signal the exec's process group (JSON)
  kResize = 0x16,     // edge -> aether: a PTY exec's new window size (JSON)
  kStarted = 0x17,    // aether -> edge: the exec's process started ({"pid": N})
  kFileWrite = 0x20,  // edge -> aether: begin writing a file (JSON), then kData
  kFileRead = 0x21,   // edge -> aether: read a file range (JSON)
  kData = 0x22,       // file bytes, either way; empty payload ends the transfer
  kList = 0x23,       // edge -> aether: list a directory (JSON)
  kStat = 0x24,       // edge -> aether: stat a path (JSON)
  kMkdir = 0x25,      // edge -> aether: make a directory (JSON)
  kRemove = 0x26,     // edge -> aether: remove a path (JSON)
  kAudit = 0x27,      // edge -> aether: denied-syscall counts ({}); kResult answers
  kPolicy = 0x28,     // edge -> aether: file rules of the policy in force (JSON)
  kDenied = 0x29,     // aether -> edge, stream 0, unasked: {"denied_total": N} (rate-limited)
  kPackUpper = 0x2A,  // edge -> aether: stream a microvm guest's upper dir as tar (kData)
  kSetMeta = 0x2B,    // edge -> aether: set a path's metadata (user.meta.* xattrs; JSON)
  kResult = 0x2F,     // aether -> edge: outcome of a request (JSON)
  kCancel = 0x31,     // edge -> aether: abandon the stream's request
};

constexpr size_t kHeaderSize = 9;
constexpr size_t kMaxPayload = 1u << 20;  // 1 MiB; larger frames are a protocol error
constexpr size_t kDataChunk = 64u << 10;  // size writers use for kData/kStdout chunks

const char* frameTypeName(FrameType type);

struct Frame {
  uint32_t stream = 0;
  FrameType type = FrameType::kHello;
  std::string payload;
  // The type byte as it came: protocols other than the agent's that share
  // this layout (proto/link.h) read their own types from it.
  uint8_t rawType() const { return static_cast<uint8_t>(type); }
};

// Appends one encoded frame to `out`. payload.size() must be <= kMaxPayload.
void appendFrame(std::string& out, uint32_t stream, FrameType type, std::string_view payload);
// The same with a raw type byte, for protocols with types of their own.
void appendFrame(std::string& out, uint32_t stream, uint8_t type, std::string_view payload);

// Incremental decoder: feed() whatever bytes arrived, then drain next().
// Not thread-safe; one per connection direction.
class FrameDecoder {
 public:
  // Buffers bytes and splits complete frames. Returns kInvalidArgument (and
  // stays failed) on a frame whose declared length is < 5 or > kMaxPayload + 5.
  Status feed(const char* data, size_t n);
  // Pops the next complete frame; false when none is complete yet.
  bool next(Frame& out);
  // Bytes buffered that do not yet form a complete frame.
  size_t pending() const { return buf_.size() - pos_; }

 private:
  std::string buf_;
  size_t pos_ = 0;
  std::deque<Frame> ready_;
  bool failed_ = false;
};

}  // namespace dsec::proto
