#include "edge/id_range_pool.h"

#include <gtest/gtest.h>

#include <set>
#include <string>
#include <vector>

namespace dsec::edge {
namespace {

constexpr uint32_t kW = 65536;
constexpr uint32_t kFirst = kDefaultUsernsFirst;  // 524288 = 8 * 65536

// A window of exactly `n` slots from kFirst.
uint32_t lastFor(uint32_t n) { return kFirst + n * kW - 1; }
IdRange slot(uint32_t k) { return {kFirst + k * kW, kW}; }

IdRangePool pool(uint32_t n, std::vector<IdRange> excluded = {}, uint32_t width = kW) {
  auto p = IdRangePool::make(kFirst, kFirst + n * width - 1, width, std::move(excluded));
  EXPECT_TRUE(p.isOk()) << p.status().toString();
  return std::move(p).value();
}

bool has(const std::string& s, const std::string& part) { return s.find(part) != s.npos; }

void expectBad(const Result<IdRangePool>& p, const std::string& field, const std::string& part) {
  ASSERT_FALSE(p.isOk());
  EXPECT_EQ(p.status().code(), Code::kInvalidArgument);
  EXPECT_EQ(p.status().field(), field);
  EXPECT_TRUE(has(p.status().message(), part)) << p.status().message();
}

TEST(IdRangePool, MapAndInverseLines) {
  EXPECT_EQ(mapLine({600000, 65536}), "0 600000 65536\n");
  EXPECT_EQ(inverseLine({600000, 65536}), "600000 0 65536\n");
  EXPECT_EQ(mapLine({}), "");
  EXPECT_EQ(inverseLine({}), "");
  EXPECT_TRUE(IdRange{}.empty());
  EXPECT_FALSE(IdRange({1, 1}).empty());
}

TEST(IdRangePool, BadWidthNamesTheField) {
  for (uint32_t w : {0u, 100000u, 65535u, 65536u * 3 + 1}) {
    expectBad(IdRangePool::make(kFirst, lastFor(100), w, {}), "userns-width", "multiple of 65536");
  }
}

TEST(IdRangePool, BadWindowNamesTheField) {
  expectBad(IdRangePool::make(0, lastFor(4), kW, {}), "userns-window", "host id 0");
  expectBad(IdRangePool::make(kFirst, 0xffffffffu, kW, {}), "userns-window", "4294967295");
  expectBad(IdRangePool::make(kFirst, kFirst - 1, kW, {}), "userns-window", "before it starts");
  // One id short of a slot: no exclusion is to blame, so none is named.
  auto narrow = IdRangePool::make(kFirst, kFirst + kW - 2, kW, {});
  expectBad(narrow, "userns-window", "no range of 65536 ids fits in 524288-589822");
  EXPECT_FALSE(has(narrow.status().message(), "subuid"));
  // Two slots, each met by an exclusion.
  expectBad(IdRangePool::make(kFirst, lastFor(2), kW, {{kFirst + 5, 1}, {kFirst + kW, 1}}),
            "userns-window",
            "no range of 65536 ids fits in 524288-655359 outside /etc/subuid and /etc/subgid");
}

TEST(IdRangePool, DefaultWindowHolds28664Ranges) {
  auto p = IdRangePool::make(kDefaultUsernsFirst, kDefaultUsernsLast, kDefaultUsernsWidth, {});
  ASSERT_TRUE(p.isOk()) << p.status().toString();
  EXPECT_EQ(p->capacity(), 28664u);
  EXPECT_EQ(p->inUse(), 0u);
  EXPECT_EQ(p->width(), 65536u);
  EXPECT_EQ(p->first(), 524288u);
  EXPECT_EQ(p->last(), 0x6fffffffu);
  // The largest window the rules allow: still fewer than 65536 slots.
  auto wide = IdRangePool::make(1, 0xfffffffeu, kW, {});
  ASSERT_TRUE(wide.isOk()) << wide.status().toString();
  EXPECT_EQ(wide->capacity(), 65535u);
}

TEST(IdRangePool, ExclusionsRemoveTheSlotsTheyMeet) {
  auto withSubuid = [](std::vector<IdRange> ex) {
    auto p = IdRangePool::make(kDefaultUsernsFirst, kDefaultUsernsLast, kW, std::move(ex));
    EXPECT_TRUE(p.isOk()) << p.status().toString();
    return p.isOk() ? p->capacity() : 0;
  };
  // 600000-665535 straddles slots 1 (589824-655359) and 2 (655360-720895).
  EXPECT_EQ(withSubuid({{600000, 65536}}), 28664u - 2);
  // Exactly slot 1: one slot. Debian's first user (100000:65536) is below
  // the window, so costs nothing; nor does an empty entry.
  EXPECT_EQ(withSubuid({slot(1)}), 28664u - 1);
  EXPECT_EQ(withSubuid({{100000, 65536}, {700000000, 0}}), 28664u);
  // Overlapping and repeated entries (subuid and subgid list the same).
  EXPECT_EQ(withSubuid({{600000, 65536}, {600000, 65536}, {650000, 10}}), 28664u - 2);
  // An entry running to the top of the id space cuts the window's tail.
  EXPECT_EQ(withSubuid({{kDefaultUsernsLast - 10, 0xffffffffu}}), 28664u - 1);
}

TEST(IdRangePool, AllocatesDisjointAlignedSlotsClearOfExclusionsLowestFirst) {
  std::vector<IdRange> ex = {{kFirst + 3 * kW + 100, 5}, {kFirst + 7 * kW - 1, 2}};
  IdRangePool p = pool(10, ex);
  ASSERT_EQ(p.capacity(), 7u);  // slots 3, 6 and 7 are excluded
  std::vector<uint32_t> bases;
  for (size_t i = 0; i < p.capacity(); ++i) {
    auto r = p.allocate();
    ASSERT_TRUE(r.isOk()) << r.status().toString();
    EXPECT_EQ(r->length, kW);
    EXPECT_EQ((r->base - kFirst) % kW, 0u);
    EXPECT_LE(uint64_t(r->base) + r->length - 1, p.last());
    for (IdRange e : ex) {
      EXPECT_TRUE(e.base + e.length <= r->base || r->base + r->length <= e.base)
          << r->base << " meets " << e.base;
    }
    bases.push_back(r->base);
  }
  std::vector<uint32_t> want;
  for (uint32_t k : {0, 1, 2, 4, 5, 8, 9}) want.push_back(slot(k).base);
  EXPECT_EQ(bases, want);
  EXPECT_EQ(p.inUse(), 7u);
}

TEST(IdRangePool, ExhaustionSaysHowMany) {
  IdRangePool p = pool(3);
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(p.allocate().isOk());
  auto r = p.allocate();
  ASSERT_FALSE(r.isOk());
  EXPECT_EQ(r.status().code(), Code::kResourceExhausted);
  EXPECT_EQ(r.status().message(), "all 3 user id ranges (65536 ids in 524288-720895) are in use");
  EXPECT_EQ(p.inUse(), 3u);
  // A release makes room again.
  ASSERT_TRUE(p.release(slot(1)).isOk());
  auto again = p.allocate();
  ASSERT_TRUE(again.isOk());
  EXPECT_EQ(*again, slot(1));
}

TEST(IdRangePool, ReleasedRangesComeBackAfterTheFreshOnesOldestFirst) {
  IdRangePool p = pool(4);
  ASSERT_EQ(*p.allocate(), slot(0));
  ASSERT_EQ(*p.allocate(), slot(1));
  ASSERT_TRUE(p.release(slot(1)).isOk());
  ASSERT_TRUE(p.release(slot(0)).isOk());
  EXPECT_EQ(p.inUse(), 0u);
  EXPECT_EQ(*p.allocate(), slot(2));
  EXPECT_EQ(*p.allocate(), slot(3));
  EXPECT_EQ(*p.allocate(), slot(1));  // released first
  EXPECT_EQ(*p.allocate(), slot(0));
  EXPECT_FALSE(p.allocate().isOk());
}

TEST(IdRangePool, ReleasingWhatIsNotInUseIsNotFound) {
  IdRangePool p = pool(4);
  EXPECT_EQ(p.release(slot(2)).code(), Code::kNotFound);  // never handed out
  IdRange r = *p.allocate();
  ASSERT_TRUE(p.release(r).isOk());
  EXPECT_EQ(p.release(r).code(), Code::kNotFound);  // double release
  EXPECT_EQ(p.release({}).code(), Code::kNotFound);
  EXPECT_EQ(p.release({kFirst + 10, kW}).code(), Code::kNotFound);  // misaligned, unknown
  EXPECT_EQ(p.release({100000, kW}).code(), Code::kNotFound);       // foreign, unknown
  EXPECT_EQ(p.inUse(), 0u);
  // The failed releases queued nothing: the next slots are still fresh ones.
  EXPECT_EQ(*p.allocate(), slot(1));
  EXPECT_EQ(*p.allocate(), slot(2));
}

TEST(IdRangePool, ReservedSlotIsNeverAllocated) {
  IdRangePool p = pool(3);
  ASSERT_TRUE(p.reserve(slot(1)).isOk());
  EXPECT_EQ(p.inUse(), 1u);
  EXPECT_EQ(p.reserve(slot(1)).code(), Code::kAlreadyExists);
  EXPECT_EQ(*p.allocate(), slot(0));
  EXPECT_EQ(p.reserve(slot(0)).code(), Code::kAlreadyExists);  // allocated
  EXPECT_EQ(*p.allocate(), slot(2));
  EXPECT_EQ(p.allocate().status().code(), Code::kResourceExhausted);
  // Released, the adopted sandbox's range is an ordinary free slot.
  ASSERT_TRUE(p.release(slot(1)).isOk());
  EXPECT_EQ(*p.allocate(), slot(1));
}

TEST(IdRangePool, ReservingAQueuedSlotTakesItOffTheQueue) {
  IdRangePool p = pool(3);
  ASSERT_EQ(*p.allocate(), slot(0));
  ASSERT_TRUE(p.release(slot(0)).isOk());
  ASSERT_TRUE(p.reserve(slot(0)).isOk());
  EXPECT_EQ(*p.allocate(), slot(1));
  EXPECT_EQ(*p.allocate(), slot(2));
  // Slot 0 is not handed out a second time from the queue.
  EXPECT_EQ(p.allocate().status().code(), Code::kResourceExhausted);
  EXPECT_EQ(p.inUse(), 3u);
  // The same for queued slots a misaligned range meets: 0 and 1 here.
  ASSERT_TRUE(p.release(slot(2)).isOk());
  ASSERT_TRUE(p.release(slot(1)).isOk());
  ASSERT_TRUE(p.release(slot(0)).isOk());
  ASSERT_TRUE(p.reserve({kFirst + kW / 2, kW}).isOk());
  EXPECT_EQ(p.inUse(), 2u);
  EXPECT_EQ(*p.allocate(), slot(2));
  EXPECT_EQ(p.allocate().status().code(), Code::kResourceExhausted);
}

TEST(IdRangePool, MisalignedReservationMarksEverySlotItMeets) {
  IdRangePool p = pool(4);
  IdRange old = {kFirst + kW / 2, kW};  // half in slot 0, half in slot 1
  ASSERT_TRUE(p.reserve(old).isOk());
  EXPECT_EQ(p.inUse(), 2u);
  EXPECT_EQ(p.reserve(slot(0)).code(), Code::kAlreadyExists);
  EXPECT_EQ(p.reserve({kFirst + kW, 10}).code(), Code::kAlreadyExists);
  EXPECT_EQ(p.release(slot(1)).code(), Code::kNotFound);  // not handed out in that shape
  EXPECT_EQ(*p.allocate(), slot(2));
  EXPECT_EQ(p.reserve({kFirst + 2 * kW + 5, kW}).code(), Code::kAlreadyExists);  // meets slot 2
  EXPECT_EQ(*p.allocate(), slot(3));
  EXPECT_FALSE(p.allocate().isOk());
  ASSERT_TRUE(p.release(old).isOk());
  EXPECT_EQ(p.inUse(), 2u);
  EXPECT_EQ(*p.allocate(), slot(0));
  EXPECT_EQ(*p.allocate(), slot(1));
  EXPECT_EQ(p.release(old).code(), Code::kNotFound);
}

// After --userns-width grows from 65536 to 131072, two old sandboxes' ranges
// fall into one new slot. Their ids are disjoint, so both are adopted.
TEST(IdRangePool, DisjointOldRangesMayShareASlot) {
  IdRangePool p = pool(2, {}, 2 * kW);
  IdRange a = slot(0), b = slot(1);  // old 65536-wide slots: new slot 0
  ASSERT_TRUE(p.reserve(a).isOk());
  ASSERT_TRUE(p.reserve(b).isOk());
  EXPECT_EQ(p.inUse(), 1u);
  EXPECT_EQ(p.reserve({a.base + 100, 10}).code(), Code::kAlreadyExists);
  EXPECT_EQ(p.reserve(b).code(), Code::kAlreadyExists);
  EXPECT_EQ(*p.allocate(), (IdRange{kFirst + 2 * kW, 2 * kW}));
  EXPECT_FALSE(p.allocate().isOk());
  // The slot stays in use until the last range in it goes.
  ASSERT_TRUE(p.release(a).isOk());
  EXPECT_EQ(p.inUse(), 2u);
  EXPECT_FALSE(p.allocate().isOk());
  ASSERT_TRUE(p.release(b).isOk());
  EXPECT_EQ(p.inUse(), 1u);
  EXPECT_EQ(*p.allocate(), (IdRange{kFirst, 2 * kW}));
}

TEST(IdRangePool, InvalidReservationsAreRejectedAndMarkNothing) {
  IdRange sub = {kFirst + 2 * kW + 7, 3};
  IdRangePool p = pool(4, {sub, {100000, kW}});
  auto bad = [&](IdRange r) { return p.reserve(r).code() == Code::kInvalidArgument; };
  EXPECT_TRUE(bad({}));
  EXPECT_TRUE(bad({0, kW}));                 // host root
  EXPECT_TRUE(bad({0xffff0000u, 0x10000}));  // holds (uid_t)-1
  EXPECT_TRUE(bad({0xffffffffu, 1}));
  EXPECT_TRUE(bad(slot(2)));                     // the slot the exclusion removed
  EXPECT_TRUE(bad({kFirst + kW + 1, kW + 10}));  // misaligned, reaches into sub
  EXPECT_EQ(p.inUse(), 0u);
  EXPECT_EQ(*p.allocate(), slot(0));
  EXPECT_EQ(*p.allocate(), slot(1));
  // Up to 2^32-2, just below (uid_t)-1, is fine: outside the window, so foreign.
  EXPECT_TRUE(p.reserve({0xffff0000u, 0xffff}).isOk());
  // A foreign range delegated to a user (an older edge's 100000/65536 on
  // Debian) is kept too: it is never handed out here.
  EXPECT_TRUE(p.reserve({100000, kW}).isOk());
  EXPECT_EQ(p.inUse(), 2u);
}

TEST(IdRangePool, ForeignRangesAreSharedAndNotCounted) {
  IdRangePool p = pool(2);
  IdRange legacy = {100000, 65536};  // the node-wide range of edges before issue 31
  ASSERT_TRUE(p.reserve(legacy).isOk());
  ASSERT_TRUE(p.reserve(legacy).isOk());
  ASSERT_TRUE(p.reserve({lastFor(2) + 1, kW}).isOk());  // above the window
  EXPECT_EQ(p.inUse(), 0u);
  EXPECT_EQ(*p.allocate(), slot(0));
  ASSERT_TRUE(p.release(legacy).isOk());
  ASSERT_TRUE(p.release(legacy).isOk());
  EXPECT_EQ(p.release(legacy).code(), Code::kNotFound);  // one release too many
  ASSERT_TRUE(p.release({lastFor(2) + 1, kW}).isOk());
  EXPECT_EQ(p.inUse(), 1u);
}

TEST(IdRangePool, DefaultConstructedPoolIsEmpty) {
  IdRangePool p;
  EXPECT_EQ(p.capacity(), 0u);
  EXPECT_EQ(p.allocate().status().code(), Code::kResourceExhausted);
  EXPECT_TRUE(p.reserve({100000, kW}).isOk());
  EXPECT_TRUE(p.release({100000, kW}).isOk());
}

TEST(IdRangePool, ParsesSubordinateIds) {
  std::string text =
      "# delegated by useradd\n"
      "\n"
      "alice:100000:65536\n"
      "1001:165536:65536\r\n"  // a numeric user; CRLF
      "  bob : 231072 : 10 \n"
      "carol:300000\n"       // two fields
      "dave:1:2:3\n"         // four fields
      ":400000:65536\n"      // no user
      "erin:4x0000:65536\n"  // not a number
      "frank:500000:-1\n"
      "gina:600000:0\n"       // nothing delegated
      "hank:4294967296:10\n"  // no such host id
      "ivan:99999999999999999999999:1\n"
      "jo:4294901760:131072\n"  // runs past 2^32-1: cut there
      "kim:0:99999999999\n"     // everything: all that fits
      "last:700000:5";          // no final newline
  std::vector<IdRange> want = {{100000, 65536},      {165536, 65536},  {231072, 10},
                               {4294901760u, 65536}, {0, 0xffffffffu}, {700000, 5}};
  EXPECT_EQ(parseSubordinateIds(text), want);
  EXPECT_TRUE(parseSubordinateIds("").empty());
  EXPECT_TRUE(parseSubordinateIds("# only a comment").empty());
}

}  // namespace
}  // namespace dsec::edge
