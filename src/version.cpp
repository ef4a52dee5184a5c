// Version string (kept in one place; printed by `k3 --version`).
#include "k3/version.h"
namespace k3 {
const char* version() { return "0.1.0"; }
}  // namespace k3
