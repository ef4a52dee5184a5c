#!/usr/bin/env python3
"""Regenerate the committed Kimi Linear fixture (tests/fixtures/kl-tiny) into a temporary directory and
compare it with the committed one (exit 1 on any difference, 77 when none is committed or when
transformers is not installed).

Checkpoint files, README.md and config.json must be byte-identical. logits.f32 may differ by float32
rounding of transformers' CPU pass on another BLAS/CPU (allowed: max |diff| <= 1e-5 and identical
argmax). reference.json must be identical except its `agreement` block, whose rel-L2 / max-abs values
must stay below 1e-5 / 1e-4 (and argmax equal), and the float digits of `tf_top2_margin` / greedy
margins (compared to 1e-4).

Usage: python tools/gen/check_kl_fixture.py [--fixtures-root tests/fixtures]
"""
import argparse
import json
import os
import sys
import tempfile


HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import check_fixtures as CF  # noqa: E402


def compare_reference(a: dict, b: dict) -> list:
    problems = []
    for k in sorted(set(a) | set(b)):
        if k not in a or k not in b:
            problems.append(f"reference.json: key {k} only in one of the two")
            continue
        if k == "agreement":
            ag = b[k]
            for name, v in ag.items():
                if name.endswith("rel_l2") and not (isinstance(v, float) and v <= 1e-5):
                    problems.append(f"reference.json: agreement.{name} = {v} (> 1e-5)")
                if name.endswith("max_abs") and not (isinstance(v, float) and v <= 1e-4):
                    problems.append(f"reference.json: agreement.{name} = {v} (> 1e-4)")
                if name.endswith("argmax_equal") and v is not True:
                    problems.append(f"reference.json: agreement.{name} = {v}")
        elif k == "tf_top2_margin":
            if len(a[k]) != len(b[k]) or max(abs(x - y) for x, y in zip(a[k], b[k])) > 1e-4:
                problems.append("reference.json: tf_top2_margin differs by more than 1e-4")
        elif k == "greedy":
            ga, gb = dict(a[k]), dict(b[k])
            if abs(ga.pop("min_top2_margin") - gb.pop("min_top2_margin")) > 1e-4:
                problems.append("reference.json: greedy.min_top2_margin differs by more than 1e-4")
            if ga != gb:
                problems.append("reference.json: greedy differs")
        elif k == "diagnostics":
            da, db = dict(a[k]), dict(b[k])
            if abs(da.pop("tf_min_top2_margin") - db.pop("tf_min_top2_margin")) > 1e-4:
                problems.append("reference.json: diagnostics.tf_min_top2_margin differs by more than 1e-4")
            if da != db:
                problems.append("reference.json: diagnostics differ")
        elif a[k] != b[k]:
            problems.append(f"reference.json: {k} differs")
    return problems


def compare(committed: str, fresh: str) -> list:
    # Kimi Linear's logits come from transformers in fp32: rounding differences up to 1e-5 are fine.
    return CF.compare(committed, fresh, f32_tol=1e-5, compare_reference=compare_reference)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--fixtures-root", default=os.path.join(os.path.dirname(os.path.dirname(HERE)), "tests", "fixtures"))
    a = ap.parse_args()
    try:
        import transformers  # noqa: F401
    except ImportError:
        print("SKIP: transformers is not installed (tools/reference/requirements-kimi-linear.txt)")
        return 77
    import make_kl_fixtures as MF
    present = [p for p in sorted(MF.COMMITTED) if os.path.isdir(os.path.join(a.fixtures_root, p))]
    if not present:
        print("SKIP: no committed Kimi Linear fixture")
        return 77
    bad = False
    with tempfile.TemporaryDirectory() as tmp:
        MF.main(["--out-root", tmp])
        for preset in present:
            problems = compare(os.path.join(a.fixtures_root, preset), os.path.join(tmp, preset))
            for p in problems:
                print(f"{preset}: {p}")
            print(f"{preset}: {'OK' if not problems else 'MISMATCH'}")
            bad |= bool(problems)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
