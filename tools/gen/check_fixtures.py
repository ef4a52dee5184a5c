#!/usr/bin/env python3
"""Regenerate the committed tiny fixtures into a temporary directory and compare them with
tests/fixtures/<preset>/ (optional CI step; exit 1 on any difference, 77 when none is committed).

All files must be byte-identical, except logits.f32, which may differ by float32 rounding of the
float64 reference on another BLAS/CPU (allowed: max |diff| <= 1e-6 and identical argmax).

Usage: python tools/gen/check_fixtures.py [--fixtures-root tests/fixtures]
"""
import argparse
import filecmp
import json
import os
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import make_fixtures as MF  # noqa: E402


def compare(committed: str, fresh: str, f32_tol: float = 1e-6, compare_reference=None) -> list:
    """Problems between a committed fixture directory and a regenerated one: files present on one
    side only, differing files; a .f32 logits file may differ by float32 rounding only (max |diff|
    <= f32_tol with identical argmax); reference.json goes to compare_reference(a, b) -> problems
    when given (else it must be byte-identical)."""
    problems = []
    names_c = set(os.listdir(committed))
    names_f = set(os.listdir(fresh))
    for n in sorted(names_c ^ names_f):
        problems.append(f"{n}: present only in {'committed' if n in names_c else 'regenerated'} fixture")
    for n in sorted(names_c & names_f):
        a, b = os.path.join(committed, n), os.path.join(fresh, n)
        if filecmp.cmp(a, b, shallow=False):
            continue
        if n == "reference.json" and compare_reference is not None:
            with open(a) as fa, open(b) as fb:
                problems += compare_reference(json.load(fa), json.load(fb))
            continue
        if n.endswith(".f32"):
            x = np.fromfile(a, dtype="<f4")
            y = np.fromfile(b, dtype="<f4")
            if x.shape == y.shape:
                d = float(np.abs(x.astype(np.float64) - y).max())
                with open(os.path.join(fresh, "reference.json")) as f:
                    shape = json.load(f)["logits_shape"]
                same_argmax = bool((x.reshape(shape).argmax(-1) == y.reshape(shape).argmax(-1)).all())
                if d <= f32_tol and same_argmax:
                    print(f"  note: {n} differs by float32 rounding only (max {d:.2e})")
                    continue
                problems.append(f"{n}: max |diff| {d:.3e}, argmax identical: {same_argmax}")
                continue
        problems.append(f"{n}: differs")
    return problems


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--fixtures-root", default=os.path.join(MF.REPO, "tests", "fixtures"))
    a = ap.parse_args()
    present = [p for p in sorted(MF.COMMITTED) if os.path.isdir(os.path.join(a.fixtures_root, p))]
    if not present:
        print("SKIP: no committed tiny fixtures")
        return 77
    bad = False
    with tempfile.TemporaryDirectory() as tmp:
        for preset in present:
            fresh = os.path.join(tmp, preset)
            MF.main(["--out-root", tmp, "--preset", preset])
            problems = compare(os.path.join(a.fixtures_root, preset), fresh)
            for p in problems:
                print(f"{preset}: {p}")
            print(f"{preset}: {'OK (identical)' if not problems else 'MISMATCH'}")
            bad |= bool(problems)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
