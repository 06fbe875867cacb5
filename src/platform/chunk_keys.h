// ChunkKeys: the keys of the chunk table (Store::putChunks) in memory, so
// that a converter's lookup of a chunk no layer stored (most of them: every
// file of a new image) costs no store query. On PostgreSQL each
// Store::findChunk is a network round trip, and a layer of 80,000 small files
// asks 80,000 times.
//
// What it holds: for each (sha, length) a 64-bit key, the first 8 bytes of
// the sha256 with the length folded in. A key is a prefix, not the chunk:
// mayContain() false means certainly unknown (no query needed), true means
// "ask the store", which stays the truth (lookupChunkAndHold).
//
// Why a set that lags the store is still correct (it only ever errs towards
// "ask the store", except for chunks it was never told of):
//  - Loaded once, then added to by this process's putChunks only. Chunks
//    another replica stores on a shared store later are not in it: a
//    conversion here misses them and stores them again. A lost dedup chance,
//    never a wrong answer (a miss is always a safe answer: the converter
//    stores the bytes itself). They are in the set from the next start.
//  - Never removed from: deleteChunksOf / deleteBlob (gc) leave their keys
//    behind, so a lookup of a collected chunk passes the set and the store
//    answers nullopt. Stale keys cost one query each, never a wrong hit.
//  - Until the load is done, everything passes (as if there were no set).
//
// Memory: an open-addressing table of uint64_t (linear probing), grown to
// twice its size at 70% full: 8 bytes a slot, 35% to 70% full, so 11.4 to 23
// bytes a chunk (10 million chunks: at most ~230 MB; a std::unordered_set
// would take ~40 bytes a chunk). An unknown chunk whose key matches a known
// one (odds about N in 2^64 for N keys) only costs the query it would have
// cost without the set.
//
// Thread-safe: mu_ (a shared_mutex) guards the table: lookups share it,
// additions take it alone. Counters are atomics.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <string_view>
#include <thread>
#include <vector>

#include "common/status.h"
#include "platform/store.h"

namespace dsec::platform {

class ChunkKeys {
 public:
  // Keys read from the store per listChunkKeys call: ~1 MB of rows a page,
  // and the SQLite store's lock held for one page at a time.
  static constexpr size_t kLoadPage = 10000;

  ChunkKeys();
  // Stops a load under way (startLoading) and waits for its thread.
  ~ChunkKeys();
  ChunkKeys(const ChunkKeys&) = delete;
  ChunkKeys& operator=(const ChunkKeys&) = delete;

  // The key of a chunk; nullopt when `sha` does not begin with 16 lower-case
  // hex digits (no such chunk can be stored: checkChunks refuses it).
  static std::optional<uint64_t> keyOf(std::string_view sha, int64_t length);

  // False only when the chunk is certainly not in the store (but see the
  // header comment: certainly not as far as this process knows). True before
  // the load has finished, and for a sha keyOf cannot read. Counts the
  // answer (stats()).
  bool mayContain(std::string_view sha, int64_t length);
  // Records chunks just stored (after Store::putChunks succeeded). Malformed
  // shas are skipped. Before or during a load alike.
  void add(std::string_view sha, int64_t length);
  void add(const std::vector<ChunkLoc>& chunks);

  // Reads every key of `store` (listChunkKeys, `pageSize` at a time) into
  // the set, on the calling thread, then lets mayContain answer false. A
  // store error is returned as is and leaves the set unloaded (everything
  // passes). kUnavailable when stop() was called meanwhile. Called again
  // (after a failure), it starts over; the keys read so far stay.
  Status load(Store* store, size_t pageSize = kLoadPage);
  // load() on a thread of its own, returning at once; a failed load is
  // logged and tried again every `retryS` seconds until it succeeds or the
  // set is destroyed. `store` must outlive this.
  void startLoading(Store* store, double retryS = 10);
  // Ends a load under way (it returns kUnavailable) and its retries.
  void stop();

  struct Stats {
    bool loaded = false;
    int64_t keys = 0;    // distinct keys held
    int64_t absent = 0;  // lookups answered "not stored" with no store query
    int64_t passed = 0;  // lookups that had to ask the store
  };
  Stats stats() const;

 private:
  // Inserts into table_ (mu_ held exclusively); grows it at 70% full.
  void insertLocked(uint64_t key);
  bool containsLocked(uint64_t key) const;

  mutable std::shared_mutex mu_;
  // Open addressing, linear probing; 0 is an empty slot (a key of 0 is
  // stored as 1: one more harmless collision). Size a power of two.
  std::vector<uint64_t> table_;  // guarded by mu_
  size_t count_ = 0;             // guarded by mu_
  std::atomic<bool> loaded_{false};
  std::atomic<int64_t> absent_{0};
  std::atomic<int64_t> passed_{0};

  std::mutex stopMu_;  // guards stopping_ for stopCv_
  std::condition_variable stopCv_;
  std::atomic<bool> stopping_{false};
  std::thread loader_;
};

}  // namespace dsec::platform
