// `k3 serve`: the OpenAI-compatible HTTP server (src/server) as a subcommand; argv[0] is "serve".
#pragma once

namespace k3::cli {
int cmd_serve(int argc, char** argv);
}
