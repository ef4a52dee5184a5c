// The `k3` command: dispatches subcommands.
#include <cstdio>
int main() { std::puts("k3"); return 0; }
