#!/usr/bin/env bash
# The CPU test suite on another machine (the GPU machine's host CPU has AVX-512 BF16/VNNI, which
# this 2-core VM and CI may lack; issue 24): the release build of this tree's tests, run by ctest
# there, with the machine's CPU flags and the commit in the record.
#   bash scripts/cpu_test_on_device.sh            here: builds build-cpu (CPU-only, tests on) and packs
#                                                 build-cpu-stage/cpu-tests.tar.xz (stripped test
#                                                 binaries, ctest files, k3 and the libedit libraries
#                                                 it links, the commit);
#   bash scripts/cpu_test_on_device.sh --on-device   there: unpacks it where ctest expects it (the build
#                                                 paths are absolute: /work/main is linked to the
#                                                 checkout), runs ctest, writes $OUT/cpu-ctest.txt and
#                                                 $OUT/cpu-ctest.json (summary, CPU, flags, commit).
#   bash scripts/cpu_test_on_device.sh --here     on this machine when it has AVX-512 BF16/VNNI itself:
#                                                 builds build-cpu, runs ctest, writes
#                                                 docs/data/cpu-ctest-avx512.json (and the log beside it
#                                                 in build-cpu-stage/out).
# With the `device` tool: run(command="bash scripts/cpu_test_on_device.sh --on-device",
#                             carry=["build-cpu-stage/cpu-tests.tar.xz"])
# The third-party fixtures (../shared) do not travel (size); their tests skip there with a message.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
stage=build-cpu-stage

build_cpu() {
  cmake -S . -B build-cpu -DCMAKE_BUILD_TYPE=Release -DK3_CUDA=OFF -DK3_BUILD_TESTS=ON -DK3_WERROR=ON >/dev/null
  cmake --build build-cpu -j"$(nproc)"
}

# ctest in build-cpu, then the record: $1 = where the log and the JSON go, $2 = what the machine is.
run_and_record() {
  local out=$1 where=$2
  mkdir -p "$out"
  local flags cpu commit start rc wall
  flags=$(grep -m1 '^flags' /proc/cpuinfo | tr ' ' '\n' | grep -E '^(avx2|fma|f16c|avx512(f|bw|vl|dq|_bf16|_vnni|vnni))$' | sort | tr '\n' ' ')
  cpu=$(grep -m1 'model name' /proc/cpuinfo | sed 's/.*: //')
  commit=$(tr '\n' ' ' <build-cpu/COMMIT)
  echo "CPU: $cpu, $(nproc) cores; flags: $flags; commit: $commit"
  start=$(date +%s)
  (cd "$root/build-cpu" && ctest -j"$(nproc)" --timeout 600 --output-on-failure) >"$out/cpu-ctest.txt" 2>&1
  rc=$?
  wall=$(( $(date +%s) - start ))
  tail -n 25 "$out/cpu-ctest.txt"
  python3 - "$out" "$rc" "$wall" "$cpu" "$flags" "$(nproc)" "$commit" "$where" "$3" <<'PY'
import json, re, sys
out, rc, wall, cpu, flags, cores, commit, where, command = sys.argv[1:]
log = open(f"{out}/cpu-ctest.txt", errors="replace").read()
m = re.search(r"(\d+)% tests passed, (\d+) tests failed out of (\d+)", log)
status = lambda s: re.findall(r"Test +#\d+: (\S+) .*\*\*\*" + s, log)
doc = {
    "command": command, "machine": f"{cpu}, {cores} cores ({where})", "cpu_flags": flags.split(),
    "commit": commit.strip(), "ctest_exit": int(rc), "wall_s": int(wall),
    "total": int(m.group(3)) if m else None,
    "failed": int(m.group(2)) if m else None,  # ctest counts tests that could not run as failed
    "failed_tests": status("Failed"), "not_run_tests": status("Not Run") + status("Exception") + status("Timeout"),
    "skipped_tests": status("Skipped"),
    "avx512_tests_skipped": [t for t in status("Skipped") if "avx512" in t.lower()],
}
json.dump(doc, open(f"{out}/cpu-ctest.json", "w"), indent=2)
print(json.dumps({k: v for k, v in doc.items() if k != "skipped_tests"}), f"skipped: {len(doc['skipped_tests'])}")
PY
  return $rc
}

if [[ "${1:-}" == "--here" ]]; then
  for f in avx512bw avx512_bf16 avx512_vnni; do
    grep -qw "$f" /proc/cpuinfo || { echo "cpu_test_on_device.sh --here: this CPU has no $f; run the suite on the GPU machine's host"; exit 2; }
  done
  build_cpu || exit 2
  git rev-parse HEAD >build-cpu/COMMIT
  git status --porcelain --untracked-files=no | grep -q . && echo "dirty" >>build-cpu/COMMIT
  rc=0
  run_and_record "$stage/out" "this machine" "bash scripts/cpu_test_on_device.sh --here" || rc=$?
  cp "$stage/out/cpu-ctest.json" docs/data/cpu-ctest-avx512.json
  echo "wrote docs/data/cpu-ctest-avx512.json"
  exit $rc
fi

if [[ "${1:-}" != "--on-device" ]]; then
  set -e
  [[ $root == /work/main ]] || { echo "cpu_test_on_device.sh: the packed paths assume the checkout is /work/main" >&2; exit 2; }
  build_cpu
  rm -rf "$stage" /tmp/k3-cpu-pack && mkdir -p "$stage" /tmp/k3-cpu-pack/build-cpu/lib
  (cd build-cpu && find . -path ./Testing -prune -o -path '*/CMakeFiles' -prune -o -type f \
     \( -name CTestTestfile.cmake -o -name '*_tests.cmake' -o -name '*_include.cmake' -o -path './bin/*' \
        -o \( -perm -u+x \( -name 'test_*' -o -name 'k3_*' \) \) \) -print) >/tmp/k3-cpu-pack.list
  (cd build-cpu && tar -cf - -T /tmp/k3-cpu-pack.list) | tar -x -C /tmp/k3-cpu-pack/build-cpu
  find /tmp/k3-cpu-pack/build-cpu -type f -perm -u+x -exec strip {} + 2>/dev/null || true
  ldd build-cpu/bin/k3 | awk '/libedit|libbsd|libmd\.|libtinfo|libcpp-httplib|libbrotli/ {print $3}' | xargs -r -I{} cp -L {} /tmp/k3-cpu-pack/build-cpu/lib/
  git rev-parse HEAD >/tmp/k3-cpu-pack/build-cpu/COMMIT
  git status --porcelain --untracked-files=no | grep -q . && echo "dirty" >>/tmp/k3-cpu-pack/build-cpu/COMMIT
  tar -C /tmp/k3-cpu-pack -cf - build-cpu | xz -6 -T"$(nproc)" >"$stage/cpu-tests.tar.xz"
  rm -rf /tmp/k3-cpu-pack
  du -sh "$stage/cpu-tests.tar.xz"
  echo "packed; on the GPU machine: bash scripts/cpu_test_on_device.sh --on-device (carry $stage/cpu-tests.tar.xz)"
  exit 0
fi

# ---------------------------------------------------------------- there
out=${OUT:-$stage/out}
mkdir -p "$out"
[[ -f $stage/cpu-tests.tar.xz ]] || { echo "no $stage/cpu-tests.tar.xz (run the first half here)"; exit 2; }
rm -rf build-cpu && xz -dc "$stage/cpu-tests.tar.xz" | tar -x -f - || exit 2
if [[ $root != /work/main ]]; then mkdir -p /work && ln -sfn "$root" /work/main; fi
export LD_LIBRARY_PATH=$root/build-cpu/lib:${LD_LIBRARY_PATH:-}
rc=0
run_and_record "$out" "the GPU machine's host" "bash scripts/cpu_test_on_device.sh (here), then run(command='bash scripts/cpu_test_on_device.sh --on-device', carry=['build-cpu-stage/cpu-tests.tar.xz'])" || rc=$?
exit $rc
