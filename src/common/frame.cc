#include "common/frame.h"

#include <cstring>

namespace dsec::proto {

namespace {
void putU32(std::string& out, uint32_t v) {
  char b[4] = {static_cast<char>(v & 0xff), static_cast<char>((v >> 8) & 0xff),
               static_cast<char>((v >> 16) & 0xff), static_cast<char>((v >> 24) & 0xff)};
  out.append(b, 4);
}
uint32_t getU32(const char* p) {
  const auto* u = reinterpret_cast<const unsigned char*>(p);
  return uint32_t(u[0]) | (uint32_t(u[1]) << 8) | (uint32_t(u[2]) << 16) | (uint32_t(u[3]) << 24);
}
}  // namespace

const char* frameTypeName(FrameType type) {
  switch (type) {
    case FrameType::kHello: return "hello";
    case FrameType::kInit: return "init";
    case FrameType::kReattach: return "reattach";
    case FrameType::kExec: return "exec";
    case FrameType::kStdin: return "stdin";
    case FrameType::kStdout: return "stdout";
    case FrameType::kStderr: return "stderr";
    case FrameType::kExit: return "exit";
    case FrameType::kSignal: return "signal";
    case FrameType::kResize: return "resize";
    case FrameType::kStarted: return "started";
    case FrameType::kFileWrite: return "file_write";
    case FrameType::kFileRead: return "file_read";
    case FrameType::kData: return "data";
    case FrameType::kList: return "list";
    case FrameType::kStat: return "stat";
    case FrameType::kMkdir: return "mkdir";
    case FrameType::kRemove: return "remove";
    case FrameType::kAudit: return "audit";
    case FrameType::kPolicy: return "policy";
    case FrameType::kDenied: return "denied";
    case FrameType::kPackUpper: return "pack_upper";
    case FrameType::kSetMeta: return "set_meta";
    case FrameType::kResult: return "result";
    case FrameType::kCancel: return "cancel";
  }
  return "unknown";
}

void appendFrame(std::string& out, uint32_t stream, FrameType type, std::string_view payload) {
  appendFrame(out, stream, static_cast<uint8_t>(type), payload);
}

void appendFrame(std::string& out, uint32_t stream, uint8_t type, std::string_view payload) {
  putU32(out, static_cast<uint32_t>(payload.size() + 5));
  putU32(out, stream);
  out.push_back(static_cast<char>(type));
  out.append(payload.data(), payload.size());
}

Status FrameDecoder::feed(const char* data, size_t n) {
  if (failed_) return Status(Code::kInvalidArgument, "frame decoder failed earlier");
  buf_.append(data, n);
  while (buf_.size() - pos_ >= 4) {
    uint32_t len = getU32(buf_.data() + pos_);
    if (len < 5 || len > kMaxPayload + 5) {
      failed_ = true;
      return Status(Code::kInvalidArgument, "bad frame length " + std::to_string(len));
    }
    if (buf_.size() - pos_ < 4 + size_t(len)) break;
    Frame f;
    f.stream = getU32(buf_.data() + pos_ + 4);
    f.type = static_cast<FrameType>(static_cast<unsigned char>(buf_[pos_ + 8]));
    f.payload.assign(buf_.data() + pos_ + kHeaderSize, len - 5);
    ready_.push_back(std::move(f));
    pos_ += 4 + len;
  }
  // Compact once the consumed prefix dominates, so the buffer stays bounded.
  if (pos_ > 0 && (pos_ == buf_.size() || pos_ > (64u << 10))) {
    buf_.erase(0, pos_);
    pos_ = 0;
  }
  return Status::ok();
}

bool FrameDecoder::next(Frame& out) {
  if (ready_.empty()) return false;
  out = std::move(ready_.front());
  ready_.pop_front();
  return true;
}

}  // namespace dsec::proto
