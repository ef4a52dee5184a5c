// Public version string of the engine.
#pragma once
namespace k3 {
const char* version();
}
