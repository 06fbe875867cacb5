#include "platform/session_reader.h"

#include "common/runtime.h"
#include "common/util.h"

namespace dsec::platform {

namespace {
constexpr size_t kReadSlice = 256u << 10;
}  // namespace

SessionReader::SessionReader(std::shared_ptr<ProcessSession> s, std::shared_ptr<http::Deferred> d,
                             uint64_t from, bool follow, double keepaliveS)
    : s_(std::move(s)), d_(std::move(d)), follow_(follow), keepaliveS_(keepaliveS), next_(from) {}

void SessionReader::start(const std::shared_ptr<SessionReader>& r) {
  uint64_t h = r->s_->watch([r] { return r->pump(); });
  std::weak_ptr<ProcessSession> ws = r->s_;
  r->d_->onClientGone([ws, h] {
    if (auto s = ws.lock()) s->unwatch(h);
  });
  if (r->follow_ && r->keepaliveS_ > 0) r->keepaliveLater();
}

bool SessionReader::pump() {
  std::lock_guard lk(mu_);
  while (!closed_) {
    if (d_->gone()) {
      closed_ = true;
      break;
    }
    if (d_->queuedBytes() > kReaderQueueBound) {
      retryLater();
      return true;
    }
    ProcessSession::Read r = s_->read(next_, kReadSlice);
    std::string out;
    if (r.gap) out += gap(next_, *r.gap);
    for (auto& c : r.chunks) out += chunk(c);
    next_ = r.next;
    if (r.ended) out += end(*r.result, next_);
    if (!out.empty()) {
      (void)d_->write(out);
      lastWrite_ = monoSeconds();
    }
    if (r.ended) {
      (void)d_->finish();
      closed_ = true;
      break;
    }
    if (r.chunks.empty() && !r.gap) {
      if (follow_) return true;
      std::string last = caughtUp();
      if (!last.empty()) (void)d_->write(last);
      (void)d_->finish();
      closed_ = true;
    }
  }
  return false;
}

void SessionReader::retryLater() {
  // The client has a queue to read; no output may come to wake this
  // reader, so look again shortly.
  if (retryPending_) return;
  retryPending_ = true;
  std::weak_ptr<SessionReader> weak = shared_from_this();
  Runtime::global().after(0.05, [weak] {
    if (auto self = weak.lock()) {
      {
        std::lock_guard lk(self->mu_);
        self->retryPending_ = false;
      }
      self->pump();
    }
  });
}

void SessionReader::keepaliveLater() {
  // Checked three times an interval: a quiet stream hears within
  // keepaliveS (and a bit) of its last byte.
  std::weak_ptr<SessionReader> weak = shared_from_this();
  Runtime::global().after(keepaliveS_ / 3, [weak] {
    auto self = weak.lock();
    if (!self) return;
    {
      std::lock_guard lk(self->mu_);
      if (self->closed_ || self->d_->gone()) return;
      if (monoSeconds() - self->lastWrite_ >= self->keepaliveS_) {
        (void)self->d_->write(self->keepalive(self->next_));
        self->lastWrite_ = monoSeconds();
      }
    }
    self->keepaliveLater();
  });
}

}  // namespace dsec::platform
