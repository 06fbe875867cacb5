#include "platform/chunk_keys.h"

#include <chrono>
#include <random>
#include <string>

#include "common/log.h"
#include "common/util.h"

namespace dsec::platform {
namespace {

constexpr size_t kInitialSlots = 1024;  // a power of two

// Where a key's probe starts. Keys come from sha256 and are uniform, but the
// bytes hashed are a tenant's files: a salt this process picks keeps anyone
// from crafting chunks that pile into one run of slots.
uint64_t slotHash(uint64_t key, uint64_t salt) {
  uint64_t z = key ^ salt;  // splitmix64's finalizer
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

uint64_t processSalt() {
  static const uint64_t salt = [] {
    std::random_device rd;
    return (uint64_t(rd()) << 32) ^ uint64_t(rd());
  }();
  return salt;
}

}  // namespace

ChunkKeys::ChunkKeys() : table_(kInitialSlots, 0) {}

ChunkKeys::~ChunkKeys() {
  stop();
  if (loader_.joinable()) loader_.join();
}

std::optional<uint64_t> ChunkKeys::keyOf(std::string_view sha, int64_t length) {
  if (sha.size() < 16) return std::nullopt;
  uint64_t prefix = 0;
  for (size_t i = 0; i < 16; ++i) {
    char c = sha[i];
    uint64_t v;
    if (c >= '0' && c <= '9') {
      v = uint64_t(c - '0');
    } else if (c >= 'a' && c <= 'f') {
      v = uint64_t(c - 'a' + 10);
    } else {
      return std::nullopt;
    }
    prefix = prefix << 4 | v;
  }
  // The length multiplied by an odd constant spreads it over all 64 bits: the
  // same bytes at two lengths (never the same chunk) get unrelated keys.
  uint64_t key = prefix ^ (uint64_t(length) * 0x9e3779b97f4a7c15ull);
  return key == 0 ? 1 : key;  // 0 marks an empty slot
}

bool ChunkKeys::containsLocked(uint64_t key) const {
  const size_t mask = table_.size() - 1;
  for (size_t i = slotHash(key, processSalt()) & mask;; i = (i + 1) & mask) {
    if (table_[i] == key) return true;
    if (table_[i] == 0) return false;  // never full: grown at 70%
  }
}

void ChunkKeys::insertLocked(uint64_t key) {
  if ((count_ + 1) * 10 > table_.size() * 7) {
    std::vector<uint64_t> old(table_.size() * 2, 0);
    old.swap(table_);
    count_ = 0;
    for (uint64_t k : old) {
      if (k) insertLocked(k);
    }
  }
  const size_t mask = table_.size() - 1;
  for (size_t i = slotHash(key, processSalt()) & mask;; i = (i + 1) & mask) {
    if (table_[i] == key) return;
    if (table_[i] == 0) {
      table_[i] = key;
      ++count_;
      return;
    }
  }
}

bool ChunkKeys::mayContain(std::string_view sha, int64_t length) {
  if (loaded_.load(std::memory_order_acquire)) {
    if (auto key = keyOf(sha, length)) {
      std::shared_lock lk(mu_);
      if (!containsLocked(*key)) {
        absent_.fetch_add(1, std::memory_order_relaxed);
        return false;
      }
    }
  }
  passed_.fetch_add(1, std::memory_order_relaxed);
  return true;
}

void ChunkKeys::add(std::string_view sha, int64_t length) {
  auto key = keyOf(sha, length);
  if (!key) return;
  std::unique_lock lk(mu_);
  insertLocked(*key);
}

void ChunkKeys::add(const std::vector<ChunkLoc>& chunks) {
  std::unique_lock lk(mu_);
  for (auto& c : chunks) {
    if (auto key = keyOf(c.sha, c.length)) insertLocked(*key);
  }
}

Status ChunkKeys::load(Store* store, size_t pageSize) {
  // Page by page, the lock taken per page: lookups and additions go on
  // meanwhile (they pass the set until loaded_), and an addition racing a
  // page is in the set either way (inserting twice is inserting once).
  ChunkKey after;
  for (;;) {
    if (stopping_.load()) return Status(Code::kUnavailable, "loading the chunk keys was stopped");
    ASSIGN_OR_RETURN(std::vector<ChunkKey> page, store->listChunkKeys(after, pageSize));
    {
      std::unique_lock lk(mu_);
      for (auto& k : page) {
        if (auto key = keyOf(k.sha, k.length)) insertLocked(*key);
      }
    }
    if (page.size() < pageSize) break;
    after = std::move(page.back());
  }
  loaded_.store(true, std::memory_order_release);
  return Status::ok();
}

void ChunkKeys::startLoading(Store* store, double retryS) {
  loader_ = std::thread([this, store, retryS] {
    for (;;) {
      double t0 = monoSeconds();
      Status st = load(store);
      if (st.isOk()) {
        log::info("chunk keys: " + std::to_string(stats().keys) + " loaded in " +
                  std::to_string(int64_t((monoSeconds() - t0) * 1000)) + " ms");
        return;
      }
      if (stopping_.load()) return;
      log::warn("chunk keys: " + st.toString() +
                "; every chunk lookup asks the store until a retry succeeds");
      std::unique_lock lk(stopMu_);
      if (stopCv_.wait_for(lk, std::chrono::duration<double>(retryS),
                           [this] { return stopping_.load(); })) {
        return;
      }
    }
  });
}

void ChunkKeys::stop() {
  {
    std::lock_guard lk(stopMu_);
    stopping_.store(true);
  }
  stopCv_.notify_all();
}

ChunkKeys::Stats ChunkKeys::stats() const {
  Stats s;
  s.loaded = loaded_.load(std::memory_order_acquire);
  s.absent = absent_.load(std::memory_order_relaxed);
  s.passed = passed_.load(std::memory_order_relaxed);
  std::shared_lock lk(mu_);
  s.keys = int64_t(count_);
  return s;
}

}  // namespace dsec::platform
