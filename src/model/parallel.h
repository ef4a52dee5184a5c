// A model split over ranks (issue 23): tensor parallelism for attention and the dense trunk,
// expert parallelism for the routed experts, or both on the same ranks. Owns the plan's checks, how
// each weight is cut per rank (rank_weights: row slices, views into the bound weights, never
// copies), the rank dims, the role each rank's forward plays, and the group that runs a step on
// every rank (ranks as threads of this process over the in-process communicator, core/comm.h).
// Must not: change any sublayer's math: model/layers.cpp gathers and takes turns where a split
// needs it, and nowhere else.
//
// What each rank holds and computes (world = max(tp, ep) ranks; tp and ep are each 1 or the world):
//   - tp > 1: its KDA heads and MLA heads (contiguous, balanced: 5 heads over 2 ranks are 3 + 2),
//     its part of the dense FFN's and shared experts' intermediate, and its rows of every output
//     projection (o_proj, the down projections). The ranks gather a projection's input whole, each
//     computes its output rows with the whole dot product, and they gather the rows: every value
//     is computed by one rank exactly as one rank alone computes it. The MLA latent cache (one
//     latent per token for all heads), the router, the latent projections, the norms and the
//     embedding are whole on every rank; the routed experts too unless ep > 1.
//   - ep > 1: an ascending range of routed expert ids (balanced); each rank computes its experts'
//     outputs for the rows routed to them, the ranks gather them all, and every rank adds each row's
//     in ascending expert id, which is the one rank's order of additions.
//   - Only rank 0 computes the logits.
// So a split model's logits are bitwise those of the model on one rank, in every numerics (CPU).
// The collectives trade bandwidth for that (two all-gathers per output projection; per MoE layer an
// all-gather of every routed expert output, top_k x latent floats a row, instead of one sum); a GPU
// path over NCCL may sum partial products instead.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "model/dims.h"
#include "model/layers.h"
#include "model/weights.h"

namespace k3 {

class Communicator;
class Model;
class RemoteLink;
namespace io {
class Checkpoint;
}

struct ParallelPlan {
  int tp = 1, ep = 1;
  int world() const { return tp > ep ? tp : ep; }
  bool split() const { return world() > 1; }
  std::string str() const;  // "TP2 x EP2", "TP2", "EP2", "1 rank"
};

// [begin, end) of n items cut into `parts` contiguous parts, the first n % parts parts one larger.
struct CutRange {
  int64_t begin = 0, end = 0;
  int64_t size() const { return end - begin; }
};
CutRange balanced_part(int64_t n, int parts, int i);

// Throws a one-line k3::Error naming the first reason the plan cannot split this model (a rank left
// without heads, intermediate, rows or experts; tp and ep both above 1 but unequal; out of range).
void check_parallel_plan(const ModelDims& d, const ParallelPlan& p);

// One line saying what each rank holds (k3 prints it when it splits a model).
std::string split_description(const ModelDims& d, const ParallelPlan& p);

// How a split model runs on GPUs, for one-line refusals.
inline constexpr const char* kGpuSplitHow =
    "a model split over ranks runs on GPUs as one process per GPU (mpirun -np N k3 ... --device cuda --tp N, or "
    "--rank/--world/--master); ranks as threads of one process run on the CPU";
// --device cuda with a split plan needs processes (process_group()); CPU ranks started with --master
// are refused (no host collectives). A one-line k3::Error; nothing for one rank.
void check_split_device(const ParallelPlan& p, bool cuda);

// Rank r's dims (its head counts and intermediates), role (without the communicator) and weights
// (views into `w`: row slices and the whole replicated parts; experts of other ranks left empty).
ModelDims rank_dims(const ModelDims& d, const ParallelPlan& p, int r);
RankRole rank_role(const ModelDims& d, const ParallelPlan& p, int r);
ModelWeights rank_weights(const ModelDims& d, const ModelWeights& w, const ParallelPlan& p, int r);

// Reads in the pages of the checkpoint's mapping that the views of `w` cover (a rank's rows and
// experts), with progress(done, total bytes).
void prefault_weight_views(const io::Checkpoint& ckpt, const ModelWeights& w,
                           const std::function<void(uint64_t, uint64_t)>& progress);

// The rank models of a split model and their communicators (Model::split makes it). Ranks as
// threads: every rank model and communicator is here. Ranks as processes (Model::split_across):
// this process's rank model alone, and on rank 0 the link that drives the others (model/remote.h).
struct SplitGroup {
  ParallelPlan plan;
  std::vector<std::unique_ptr<Model>> ranks;
  std::vector<std::unique_ptr<Communicator>> comms;
  std::shared_ptr<RemoteLink> remote;  // rank 0 of ranks as processes; closed when the group goes
  SplitGroup();
  ~SplitGroup();
};

}  // namespace k3
