// A model split over ranks in other processes (model/remote.h, issue 23's one process per rank):
// rank 0 drives, the others follow its control messages. Here the "processes" are threads over the
// in-process communicator, each with its own loaded model and its own Model::split_across, exactly
// as `mpirun -np N k3 ...` runs them over MPI (tests/cli/test_mpi_launch.sh runs the real launch).
// Gate: bitwise the one-rank model (teacher-forced logits, prefill then decode, greedy, a batch of
// staggered sequences, sessions' mark/rollback/fork), and bitwise the same split with ranks as
// threads where a split's values differ from one rank's by design (fill_random's per-rank heads).
// Then the failures: a rank started with another plan or model, a process count that does not
// match, a step that fails on a follower; none hangs, each is one line.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "common/batch_run.h"
#include "common/model_run.h"
#include "common/split_cases.h"
#include "core/comm.h"
#include "core/error.h"
#include "io/safetensors.h"
#include "model/model.h"
#include "model/remote.h"

namespace fs = std::filesystem;

namespace {

using k3test::prompt_ids;
using k3test::same_bits;
using Case = k3test::SplitCase;
const auto& dir_of = k3test::split_model_dir;
const auto& opts = k3test::numerics_opts;

// Ranks as "processes": rank 0's model here, every other rank's model loaded and split on a thread
// of its own that follows rank 0 until rank 0's model is destroyed.
class RemoteSplit {
 public:
  // follower_plan / follower_dir: what ranks > 0 are started with (the same as rank 0's unless a
  // test starts them differently).
  RemoteSplit(const std::string& dir, k3::ParallelPlan plan, k3::ParallelPlan follower_plan = {0, 0},
              std::string follower_dir = "")
      : comms_(k3::make_local_group(plan.world())), errors_(size_t(plan.world())) {
    if (follower_plan.tp == 0) follower_plan = plan;
    if (follower_dir.empty()) follower_dir = dir;
    for (int r = 1; r < plan.world(); ++r)
      threads_.emplace_back([this, r, follower_dir, follower_plan] {
        try {
          auto m = k3::Model::load(follower_dir);
          EXPECT_FALSE(m->split_across(follower_plan, *comms_[size_t(r)])) << "rank " << r << " drove";
        } catch (const std::exception& e) {
          errors_[size_t(r)] = e.what();
        }
      });
    model_ = k3::Model::load(dir);
    EXPECT_TRUE(model_->split_across(plan, *comms_[0]));
  }
  ~RemoteSplit() { finish(); }
  // Closes the group (rank 0's model goes) and waits for the followers; their errors, "" if none.
  std::vector<std::string> finish() {
    model_.reset();
    for (auto& t : threads_) t.join();
    threads_.clear();
    return errors_;
  }
  k3::Model& operator*() const { return *model_; }
  k3::Model* operator->() const { return model_.get(); }

 private:
  std::vector<std::unique_ptr<k3::Communicator>> comms_;
  std::vector<std::string> errors_;
  std::vector<std::thread> threads_;
  std::unique_ptr<k3::Model> model_;
};

class RemoteRanks : public ::testing::TestWithParam<Case> {};

TEST_P(RemoteRanks, LogitsDecodeAndGreedyAreTheOneRankModels) {
  const Case c = GetParam();
  auto one = k3::Model::load(dir_of(c.model));
  RemoteSplit split(dir_of(c.model), {c.tp, c.ep});
  EXPECT_EQ(split->parallel().tp, c.tp);
  EXPECT_EQ(split->parallel().ep, c.ep);
  const auto ids = prompt_ids(int32_t(one->dims().vocab), 13, 5u + uint32_t(c.tp * 10 + c.ep));
  std::vector<k3::ops::Numerics> numerics{k3::ops::Numerics::Fast};
  if (c.model != "k3-nano") numerics.push_back(k3::ops::Numerics::Exact);
  for (auto n : numerics) {
    SCOPED_TRACE(k3::ops::numerics_name(n));
    const auto o = opts(n);
    EXPECT_TRUE(same_bits(k3test::full_pass(*split, ids, o), k3test::full_pass(*one, ids, o))) << "teacher-forced";
    EXPECT_TRUE(same_bits(k3test::incremental(*split, ids, 5, o), k3test::incremental(*one, ids, 5, o)))
        << "prefill 5 then decode";
    EXPECT_EQ(k3test::greedy(*split, ids, 8, o), k3test::greedy(*one, ids, 8, o));
  }
  for (const std::string& e : split.finish()) EXPECT_EQ(e, "");
}

TEST_P(RemoteRanks, BatchedSequencesAndSessionsAreTheOneRankModels) {
  const Case c = GetParam();
  auto one = k3::Model::load(dir_of(c.model));
  RemoteSplit split(dir_of(c.model), {c.tp, c.ep});
  {
    const auto seqs = k3test::mixed_sequences(5, int32_t(one->dims().vocab), 3u);
    auto p1 = one->new_pool();
    auto p2 = split->new_pool();  // a second pool besides the sessions' (the followers hold both)
    const auto want = k3test::run_batched(*one, seqs, opts(k3::ops::Numerics::Fast), *p1);
    const auto got = k3test::run_batched(*split, seqs, opts(k3::ops::Numerics::Fast), *p2);
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < got.size(); ++i) EXPECT_TRUE(same_bits(got[i], want[i])) << "sequence " << i;
  }
  // Sessions: a mark and a rollback, a fork that continues differently (the followers keep their own
  // parts of the mark and share their own cache pages), a slot freed and taken again by a fork.
  const auto ids = prompt_ids(int32_t(one->dims().vocab), 20, 99u);
  const size_t V = size_t(one->dims().vocab);
  const auto o = opts(k3::ops::Numerics::Fast);
  const auto run = [&](const k3::Model& m) {
    std::vector<float> out, l(V);
    k3::Session s(m);
    m.forward(s, ids.data(), 8, false, l.data(), o);
    const auto mark = s.mark();
    m.forward(s, ids.data() + 8, 6, false, l.data(), o);
    out.insert(out.end(), l.begin(), l.end());
    {
      k3::Session gone(s);  // a fork dropped at once: its slot is free again on every rank
    }
    k3::Session fork(s);
    s.rollback(mark);
    EXPECT_EQ(s.position(), 8);
    m.forward(s, ids.data() + 14, 6, false, l.data(), o);
    out.insert(out.end(), l.begin(), l.end());
    m.forward(fork, ids.data() + 2, 3, false, l.data(), o);
    out.insert(out.end(), l.begin(), l.end());
    s.rollback(mark);  // the same mark twice
    m.forward(s, ids.data() + 3, 2, false, l.data(), o);
    out.insert(out.end(), l.begin(), l.end());
    s.reset();
    m.forward(s, ids.data() + 5, 4, false, l.data(), o);
    out.insert(out.end(), l.begin(), l.end());
    return out;
  };
  EXPECT_TRUE(same_bits(run(*split), run(*one)));
  for (const std::string& e : split.finish()) EXPECT_EQ(e, "");
}

INSTANTIATE_TEST_SUITE_P(Models, RemoteRanks,
                         ::testing::Values(Case{"tiny", 2, 1}, Case{"tiny", 1, 2}, Case{"tiny", 2, 2},
                                           Case{"tiny", 3, 3}, Case{"kl-tiny", 2, 2}, Case{"k3-nano", 2, 2}),
                         k3test::split_case_name);

// Bench depths (StatePool::fill_random: each rank fills its own heads) and positions set without a
// forward: the same as the split with ranks as threads, bitwise.
TEST(RemoteRanksState, FilledContextsAreTheThreadSplits) {
  const std::string dir = dir_of("tiny");
  auto threads = k3::Model::load(dir);
  threads->split({2, 2});
  RemoteSplit procs(dir, {2, 2});
  const auto ids = prompt_ids(int32_t(threads->dims().vocab), 4, 17u);
  const auto after_fill = [&](const k3::Model& m) {
    auto pool = m.new_pool();
    const int32_t a = pool->alloc(), b = pool->alloc();
    pool->fill_random(a, 70, 1234);
    pool->set_position(b, 3);  // contents undefined: only its position is used below
    pool->free(b);
    std::vector<float> l(size_t(m.dims().vocab));
    const k3::SeqStep s{a, ids.data(), int64_t(ids.size()), false};
    m.step(*pool, std::span(&s, 1), opts(k3::ops::Numerics::Fast), l.data());
    EXPECT_EQ(pool->position(a), 74);
    return l;
  };
  EXPECT_TRUE(same_bits(after_fill(*procs), after_fill(*threads)));
  for (const std::string& e : procs.finish()) EXPECT_EQ(e, "");
}

// Loading reads in one rank's part on every process: rank 0 its rows and experts (fewer bytes than
// the checkpoint), and it tells the followers to read theirs (their loop takes the message).
TEST(RemoteRanksState, EachRankReadsInItsOwnPart) {
  auto one = k3::Model::load(dir_of("k3-nano"));
  EXPECT_FALSE(one->prefault_process_rank({}));  // not one rank of a split over processes
  RemoteSplit split(dir_of("k3-nano"), {2, 2});
  uint64_t total = 0;
  EXPECT_TRUE(split->prefault_process_rank([&](uint64_t, uint64_t t) { total = t; }));
  const uint64_t all = split->checkpoint().total_tensor_bytes();
  EXPECT_GT(total, all / 3);
  EXPECT_LT(total, all * 4 / 5);
  const auto ids = prompt_ids(int32_t(one->dims().vocab), 6, 5u);
  EXPECT_TRUE(same_bits(k3test::full_pass(*split, ids, opts(k3::ops::Numerics::Fast)),
                        k3test::full_pass(*one, ids, opts(k3::ops::Numerics::Fast))));
  for (const std::string& e : split.finish()) EXPECT_EQ(e, "");
}

bool one_line_with(const std::string& msg, const std::string& part) {
  return msg.find(part) != std::string::npos && msg.find('\n') == std::string::npos;
}

// A follower started with another plan or another model: it refuses at the first message, the
// group is aborted, and rank 0's first step fails in one line naming why (no hang); later steps
// refuse too.
TEST(RemoteRanksErrors, MismatchedRanksFailInOneLine) {
  const int32_t id = 3;
  std::vector<float> l(4096);
  {
    RemoteSplit split(dir_of("tiny"), {2, 1}, {1, 2});
    auto pool = split->new_pool();
    const k3::SeqStep s{pool->alloc(), &id, 1, false};
    try {
      split->step(*pool, std::span(&s, 1), {}, l.data());
      ADD_FAILURE() << "a step ran with a rank started with another plan";
    } catch (const k3::Error& e) {
      EXPECT_TRUE(one_line_with(e.what(), "rank 1 was started with --tp 1 --ep 2, rank 0 with --tp 2 --ep 1"))
          << e.what();
    }
    try {
      split->step(*pool, std::span(&s, 1), {}, l.data());
      ADD_FAILURE() << "a step ran after the group failed";
    } catch (const k3::Error& e) {
      EXPECT_TRUE(one_line_with(e.what(), "stopped after an earlier failure")) << e.what();
    }
    pool.reset();
    const auto errors = split.finish();
    EXPECT_TRUE(one_line_with(errors[1], "rank 0 with --tp 2 --ep 1")) << errors[1];
  }
  {
    RemoteSplit split(dir_of("tiny"), {2, 1}, {2, 1}, dir_of("tiny-flat"));
    auto pool = split->new_pool();
    const k3::SeqStep s{pool->alloc(), &id, 1, false};
    try {
      split->step(*pool, std::span(&s, 1), {}, l.data());
      ADD_FAILURE() << "a step ran with a rank of another model";
    } catch (const k3::Error& e) {
      EXPECT_TRUE(one_line_with(e.what(), "loaded a different model than rank 0")) << e.what();
    }
  }
}

// The number of processes must be the plan's ranks; a plan of one rank under several processes is
// refused too (every process would run the whole job).
TEST(RemoteRanksErrors, ProcessCountMustMatchThePlan) {
  auto group = k3::make_local_group(2);
  auto m = k3::Model::load(dir_of("tiny"));
  try {
    m->split_across({3, 1}, *group[0]);
    ADD_FAILURE() << "3 ranks over 2 processes";
  } catch (const k3::Error& e) {
    EXPECT_TRUE(one_line_with(e.what(), "k3 runs as 2 processes (local), but --tp 3 --ep 1 ask for 3 ranks"))
        << e.what();
  }
  try {
    m->split_across({1, 1}, *group[0]);
    ADD_FAILURE() << "one rank over 2 processes";
  } catch (const k3::Error& e) {
    EXPECT_TRUE(one_line_with(e.what(), "the model is not split (give --tp or --ep")) << e.what();
  }
  EXPECT_FALSE(m->parallel().split());
}

// A follower that gives up after joining (as one that runs out of memory does: it aborts the
// group): rank 0's next step throws the follower's reason instead of waiting for it.
TEST(RemoteRanksErrors, AFollowerThatGivesUpEndsRankZerosStep) {
  auto group = k3::make_local_group(2);
  std::string follower_error;
  std::thread follower([&] {
    try {
      auto m = k3::Model::load(dir_of("tiny"));
      // Joins the group, then gives up before following.
      std::vector<uint8_t> hello;
      group[1]->broadcast_bytes(hello, 0);
      group[1]->abort("rank 1 ran out of memory (simulated)");
    } catch (const std::exception& e) {
      follower_error = e.what();
    }
  });
  auto m = k3::Model::load(dir_of("tiny"));
  ASSERT_TRUE(m->split_across({2, 1}, *group[0]));
  follower.join();
  EXPECT_EQ(follower_error, "");
  auto pool = m->new_pool();
  const int32_t id = 3;
  const k3::SeqStep s{pool->alloc(), &id, 1, false};
  std::vector<float> l(size_t(m->dims().vocab));
  try {
    m->step(*pool, std::span(&s, 1), {}, l.data());
    ADD_FAILURE() << "a step ran without its follower";
  } catch (const k3::Error& e) {
    EXPECT_TRUE(one_line_with(e.what(), "rank 1 ran out of memory (simulated)")) << e.what();
  }
}

}  // namespace

namespace {
// Moving a split model over processes to GPUs: options the split does not take are refused before
// the followers hear of it (they then close normally); where the move itself fails (here: no usable
// GPU, or no CUDA backend in this build) rank 0 fails in one line and every follower ends, no hang.
TEST(RemoteRanksErrors, GpuMovesThatCannotBeMadeEndEveryRank) {
  {
    RemoteSplit split(dir_of("tiny"), {2, 2});
    k3::GpuOptions o;
    o.experts_on_cpu = true;
    try {
      split->use_gpu(o);
      ADD_FAILURE() << "--cpu-experts went to the GPU split";
    } catch (const k3::Error& e) {
      EXPECT_TRUE(one_line_with(e.what(), "--cpu-experts with --tp/--ep is not supported")) << e.what();
    }
    for (const std::string& e : split.finish()) EXPECT_EQ(e, "");  // the followers closed normally
  }
  for (const k3::ParallelPlan plan : {k3::ParallelPlan{2, 1}, k3::ParallelPlan{2, 2}}) {
    SCOPED_TRACE(plan.str());
    RemoteSplit split(dir_of("tiny"), plan);
    std::string why;
    try {
      split->use_gpu();
    } catch (const k3::Error& e) {
      why = e.what();
    }
    if (why.empty()) GTEST_SKIP() << "this machine has a usable GPU: the move succeeded (tests/cuda covers it)";
    EXPECT_EQ(why.find('\n'), std::string::npos) << why;
    const auto errors = split.finish();
    EXPECT_NE(errors[1], "") << "the follower did not fail";
  }
}
}  // namespace
