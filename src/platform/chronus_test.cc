#include "platform/chronus.h"

#include <gtest/gtest.h>

#include <atomic>
#include <filesystem>
#include <future>
#include <thread>

#include "common/util.h"
#include "platform/store_test_util.h"

namespace dsec::platform {
namespace {

using json = nlohmann::json;

// On both stores: Chronus relies on putStep's kAlreadyExists.
class ChronusTest : public ::testing::TestWithParam<StoreKind> {
 protected:
  void SetUp() override {
    DSEC_MAKE_TEST_STORE_ENV(env_, GetParam());
    auto s = env_->open();
    ASSERT_TRUE(s.isOk()) << s.status().toString();
    store_ = std::move(*s);
    chronus_ = std::make_unique<Chronus>(store_.get());
  }
  void TearDown() override {
    chronus_.reset();
    store_.reset();
    env_.reset();
  }
  std::unique_ptr<TestStoreEnv> env_;
  std::unique_ptr<Store> store_;
  std::unique_ptr<Chronus> chronus_;
};
DSEC_INSTANTIATE_FOR_BOTH_STORES(ChronusTest);

TEST_P(ChronusTest, RunsOnceReplaysAndRefusesAnotherRequest) {
  int runs = 0;
  auto run = [&]() -> Result<StepOutcome> {
    ++runs;
    return StepOutcome{200, "application/json", "{\"n\":" + std::to_string(runs) + "}"};
  };
  StepKey key{"t1", 0};
  json req = {{"cmd", "echo x >> f"}};
  auto a = chronus_->once(key, "exec", "sb-1", req, run);
  ASSERT_TRUE(a.isOk());
  EXPECT_FALSE(a->replayed);
  auto b = chronus_->once(key, "exec", "sb-2", req, run);
  ASSERT_TRUE(b.isOk());
  EXPECT_TRUE(b->replayed);
  EXPECT_EQ(b->body, a->body);
  EXPECT_EQ(runs, 1);
  auto c = chronus_->once(key, "exec", "sb-1", json{{"cmd", "other"}}, run);
  ASSERT_FALSE(c.isOk());
  EXPECT_EQ(c.status().code(), Code::kConflict);
  EXPECT_EQ(c.status().field(), "step");
  EXPECT_NE(c.status().message().find(a->digest), std::string::npos);
  // Another kind with the same body is another request.
  EXPECT_FALSE(chronus_->once(key, "read", "sb-1", req, run).isOk());
  EXPECT_EQ(runs, 1);
}

TEST_P(ChronusTest, FailuresAreNotStepsAndTheLogIsDurable) {
  StepKey key{"t2", 3};
  auto fail = []() -> Result<StepOutcome> { return notFound("no such file"); };
  EXPECT_EQ(chronus_->once(key, "read", "sb", json{{"path", "/x"}}, fail).status().code(),
            Code::kNotFound);
  auto ok = []() -> Result<StepOutcome> {
    return StepOutcome{200, "application/octet-stream", "hi"};
  };
  ASSERT_TRUE(chronus_->once(key, "read", "sb", json{{"path", "/x"}}, ok).isOk());
  // A new Chronus on the same store (a restarted platform) replays it.
  Chronus again(store_.get());
  auto r = again.once(key, "read", "sb", json{{"path", "/x"}}, fail);
  ASSERT_TRUE(r.isOk());
  EXPECT_TRUE(r->replayed);
  EXPECT_EQ(r->body, "hi");
  auto steps = store_->loadTrajectory("t2");
  ASSERT_TRUE(steps.isOk());
  ASSERT_EQ(steps->size(), 1u);
  EXPECT_EQ((*steps)[0].kind, "read");
}

TEST_P(ChronusTest, ARepeatInFlightWaitsForTheFirst) {
  std::atomic<int> runs{0};
  auto slow = [&]() -> Result<StepOutcome> {
    ++runs;
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    return StepOutcome{200, "application/json", "{}"};
  };
  StepKey key{"t3", 1};
  std::vector<std::thread> threads;
  std::atomic<int> replayed{0};
  for (int i = 0; i < 4; ++i) {
    threads.emplace_back([&] {
      auto r = chronus_->once(key, "exec", "sb", json{{"cmd", "sleep"}}, slow);
      ASSERT_TRUE(r.isOk());
      if (r->replayed) ++replayed;
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(runs.load(), 1);
  EXPECT_EQ(replayed.load(), 3);
}

TEST_P(ChronusTest, KeysAreChecked) {
  json t = "ok-1", s = 2, bad = "bad id", neg = -1, str = "2";
  EXPECT_FALSE(Chronus::parseKey(nullptr, nullptr)->has_value());
  EXPECT_EQ(Chronus::parseKey(&t, &s)->value().step, 2);
  EXPECT_EQ(Chronus::parseKey(&t, nullptr).status().field(), "step");
  EXPECT_EQ(Chronus::parseKey(nullptr, &s).status().field(), "trajectory_id");
  EXPECT_EQ(Chronus::parseKey(&bad, &s).status().field(), "trajectory_id");
  EXPECT_EQ(Chronus::parseKey(&t, &neg).status().field(), "step");
  EXPECT_EQ(Chronus::parseKey(&t, &str).status().field(), "step");
}

// A write's kept bytes are named in the step, whatever sandbox it ran in:
// the digest covers only the kind and the request.
TEST_P(ChronusTest, KeepsContentAndIgnoresTheSandbox) {
  auto run = [&]() -> Result<StepOutcome> {
    StepOutcome o{200, "application/json", "{}"};
    o.content = "sha256:bytes";
    return o;
  };
  json req = {{"path", "/f"}, {"sha256", "ab"}};
  auto first = chronus_->once({"t", 0}, "write", "sb-a", req, run);
  ASSERT_TRUE(first.isOk());
  EXPECT_EQ(store_->getStep("t", 0)->content, "sha256:bytes");
  auto again = chronus_->once({"t", 0}, "write", "sb-b", req, run);
  ASSERT_TRUE(again.isOk()) << again.status().toString();
  EXPECT_TRUE(again->replayed);
  EXPECT_EQ(again->digest, first->digest);
}

// A step in flight holds no thread: its work finishes later on another
// thread; a repeat meanwhile is queued (no thread waits) and gets the stored
// result once the first is stored; another request under the key is refused
// at once.
TEST_P(ChronusTest, AsyncStepsHoldNoThreadAndRepeatsWaitAsCallbacks) {
  StepKey key{"async", 3};
  json req = {{"cmd", "sleep 60"}};
  Chronus::StepDone finishFirst;
  std::promise<Result<StepOutcome>> first, repeat;
  chronus_->onceAsync(
      key, "exec", "sb-1", req, [&](Chronus::StepDone f) { finishFirst = std::move(f); },
      [&](Result<StepOutcome> o) { first.set_value(std::move(o)); });
  ASSERT_TRUE(finishFirst);  // the work started on this thread and returned
  int repeatRuns = 0;
  chronus_->onceAsync(
      key, "exec", "sb-1", req, [&](Chronus::StepDone) { ++repeatRuns; },
      [&](Result<StepOutcome> o) { repeat.set_value(std::move(o)); });
  std::promise<Status> other;
  chronus_->onceAsync(
      key, "exec", "sb-1", json{{"cmd", "other"}}, [](Chronus::StepDone) {},
      [&](Result<StepOutcome> o) { other.set_value(o.status()); });
  EXPECT_EQ(other.get_future().get().code(), Code::kConflict);
  // Finished from another thread (as an agent's exit frame would).
  std::thread([&] { finishFirst(StepOutcome{200, "application/json", "{\"n\":1}"}); }).join();
  auto a = first.get_future().get();
  ASSERT_TRUE(a.isOk()) << a.status().toString();
  EXPECT_FALSE(a->replayed);
  auto b = repeat.get_future().get();
  ASSERT_TRUE(b.isOk()) << b.status().toString();
  EXPECT_TRUE(b->replayed);
  EXPECT_EQ(b->body, "{\"n\":1}");
  EXPECT_EQ(repeatRuns, 0);
}

// A first attempt that fails is not a step: the repeat that waited for it
// runs the work itself.
TEST_P(ChronusTest, ARepeatRunsWhenTheStepItWaitedForFailed) {
  StepKey key{"async", 4};
  json req = {{"cmd", "true"}};
  Chronus::StepDone finishFirst;
  std::promise<Result<StepOutcome>> first, repeat;
  chronus_->onceAsync(
      key, "exec", "sb-1", req, [&](Chronus::StepDone f) { finishFirst = std::move(f); },
      [&](Result<StepOutcome> o) { first.set_value(std::move(o)); });
  chronus_->onceAsync(
      key, "exec", "sb-1", req,
      [&](Chronus::StepDone f) { f(StepOutcome{200, "application/json", "{\"n\":2}"}); },
      [&](Result<StepOutcome> o) { repeat.set_value(std::move(o)); });
  finishFirst(Status(Code::kUnavailable, "the sandbox went away"));
  EXPECT_EQ(first.get_future().get().status().code(), Code::kUnavailable);
  auto b = repeat.get_future().get();
  ASSERT_TRUE(b.isOk()) << b.status().toString();
  EXPECT_FALSE(b->replayed);
  EXPECT_EQ(b->body, "{\"n\":2}");
}

}  // namespace
}  // namespace dsec::platform
