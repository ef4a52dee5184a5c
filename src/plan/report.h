// The two forms of a plan `k3 plan` prints: a human table (default) and JSON (--json), both with
// the model sizes, the machine and where each figure came from, the rates and their sources, the
// placement table, every term of the decode and prefill arithmetic, and the other placements.
// Must not: compute a prediction (planner.h does); it formats what it is given.
#pragma once
#include <string>

#include "plan/machine.h"
#include "plan/planner.h"
#include "plan/rates.h"
#include "plan/sizes.h"

namespace k3::plan {

struct ReportInput {
  const ModelSizes& sizes;
  const Machine& machine;
  const Rates& rates;
  const PlanRequest& request;
  const PlanResult& result;
  std::string gpu_note;  // detection note of this machine's GPU (when not described by flags)
};

std::string format_text(const ReportInput& in);
std::string format_json(const ReportInput& in);  // pretty-printed, ends with a newline

}  // namespace k3::plan
