#!/usr/bin/env python3
"""Print a pass/fail table from a gtest JSON report plus extra rows ("PASS|name" arguments).

Usage: python3 tools/gtest_table.py REPORT.json [STATUS|name ...]   (exit 1 if anything failed)
Used by scripts/cuda_test.sh and scripts/measure_cuda_perf.sh on the GPU machine.
"""
import json
import sys


def main(argv):
    rows = []
    if argv[1] != "-":
        try:
            with open(argv[1]) as f:
                doc = json.load(f)
            for suite in doc.get("testsuites", []):
                for t in suite.get("testsuite", []):
                    name = suite["name"] + "." + t["name"]
                    if t.get("failures"):
                        status = "FAIL"
                    elif t.get("result") == "SKIPPED" or t.get("status") == "NOTRUN":
                        status = "SKIP"
                    else:
                        status = "PASS"
                    rows.append((status, name))
        except (OSError, ValueError) as e:  # the test binary crashed before writing its report
            rows.append(("FAIL", "test binary (no JSON report: %s)" % e))
    for r in argv[2:]:
        status, name = r.split("|", 1)
        rows.append((status, name))
    width = max(len(n) for _, n in rows)
    print("| %-*s | result |" % (width, "test"))
    print("|%s|--------|" % ("-" * (width + 2)))
    for status, name in rows:
        print("| %-*s | %-6s |" % (width, name, status))
    counts = {s: sum(1 for x, _ in rows if x == s) for s in ("PASS", "FAIL", "SKIP")}
    print("\n%d passed, %d failed, %d skipped" % (counts["PASS"], counts["FAIL"], counts["SKIP"]))
    return 1 if counts["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
