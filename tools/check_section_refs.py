#!/usr/bin/env python3
"""Checks that every section citation in the repository resolves in docs/architecture.md.

Scans the text files under src/, tests/, bench/, tools/ and docs/ for references written with a
section sign followed by a number (one, two or three levels, and ranges such as "3.3-3.8" whose
two ends are both checked). A number must be a numbered heading of docs/architecture.md. Trap
citations ("6.4 trap N", "6.4 traps N, M", or the three-level form "6.4.N" after the section
sign) must name an item of the numbered list under the 6.4 heading.

A citation written right after another document's file name ("performance-anchors.md" followed
by the section sign) refers to that document, not to this page; it is counted and skipped.

Usage: python3 tools/check_section_refs.py [-v]   (run from anywhere; exit 1 lists what fails)
Standard library only.
"""
import os
import re
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGE = os.path.join("docs", "architecture.md")
ROOTS = ("src", "tests", "bench", "tools", "docs")
TRAP_SECTION = "6.4"
OWN_DOCS = {"architecture.md", "k3-architecture.md"}

NUM = r"\d+(?:\.\d+)*"
REF = re.compile(r"§\s*(" + NUM + r")(?:\s*[-–]\s*§?\s*(" + NUM + r"))?")
TRAPS_AFTER = re.compile(r"\s+traps?\s+(\d+(?:\s*(?:,|and|-|–)\s*\d+)*)")
OTHER_DOC = re.compile(r"([\w./-]+\.md)[`'\")\]]*\s*\(?\s*$")
HEADING = re.compile(r"^#{1,6}\s+(" + NUM + r")\.?(?:\s|$)")
LIST_ITEM = re.compile(r"^(\d+)\.\s")


def page_sections(path):
    """Numbered headings of the page and the trap numbers listed under the 6.4 heading."""
    sections, traps = set(), set()
    current, in_code = None, False
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.lstrip().startswith("```"):
                in_code = not in_code
                continue
            if in_code:
                continue
            if line.startswith("#"):
                m = HEADING.match(line)
                current = m.group(1) if m else None
                if m:
                    sections.add(m.group(1))
                continue
            if current == TRAP_SECTION:
                m = LIST_ITEM.match(line)
                if m:
                    traps.add(int(m.group(1)))
    return sections, traps


def text_files():
    for root in ROOTS:
        top = os.path.join(REPO, root)
        for dirpath, dirnames, filenames in os.walk(top):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and d != "__pycache__")
            for name in sorted(filenames):
                path = os.path.join(dirpath, name)
                try:
                    with open(path, "rb") as f:
                        data = f.read()
                except OSError:
                    continue
                if b"\0" in data[:8192] or "§".encode() not in data:
                    continue
                try:
                    yield os.path.relpath(path, REPO), data.decode("utf-8")
                except UnicodeDecodeError:
                    continue


def trap_numbers(spec):
    """"1, 3 and 5-7" -> [1, 3, 5, 6, 7]."""
    out = []
    for part in re.split(r"\s*(?:,|and)\s*", spec.strip()):
        if not part:
            continue
        ends = re.split(r"\s*[-–]\s*", part)
        lo, hi = int(ends[0]), int(ends[-1])
        out.extend(range(lo, hi + 1) if hi >= lo else [lo, hi])
    return out


def main(argv):
    verbose = "-v" in argv
    page = os.path.join(REPO, PAGE)
    if not os.path.exists(page):
        print(f"check_section_refs: {PAGE} not found", file=sys.stderr)
        return 2
    sections, traps = page_sections(page)
    refs, skipped, bad = 0, [], []

    for rel, text in text_files():
        for lineno, line in enumerate(text.splitlines(), 1):
            for m in REF.finditer(line):
                where = f"{rel}:{lineno}"
                doc = OTHER_DOC.search(line[: m.start()])
                if doc and os.path.basename(doc.group(1)) not in OWN_DOCS:
                    skipped.append(f"{where}: {m.group(0)} (cites {doc.group(1)})")
                    continue
                refs += 1
                checks = []  # (kind, value)
                for num in filter(None, (m.group(1), m.group(2))):
                    parts = num.split(".")
                    if len(parts) == 3 and ".".join(parts[:2]) == TRAP_SECTION:
                        checks.append(("trap", int(parts[2])))
                    else:
                        checks.append(("section", num))
                if m.group(1) == TRAP_SECTION and not m.group(2):
                    t = TRAPS_AFTER.match(line, m.end())
                    if t:
                        checks.extend(("trap", n) for n in trap_numbers(t.group(1)))
                for kind, value in checks:
                    if kind == "section" and value not in sections:
                        bad.append(f"{where}: §{value}: no heading {value} in {PAGE}")
                    elif kind == "trap" and value not in traps:
                        bad.append(f"{where}: §{TRAP_SECTION} trap {value}: not in the §{TRAP_SECTION} list of {PAGE}")
                if verbose:
                    print(f"{where}: {m.group(0)} -> " + ", ".join(f"{k} {v}" for k, v in checks))

    for s in skipped if verbose else []:
        print(f"skipped {s}")
    for b in bad:
        print(b)
    print(f"check_section_refs: {refs} references checked against {PAGE} "
          f"({len(sections)} headings, {len(traps)} traps), {len(skipped)} citing other documents skipped, "
          f"{len(bad)} unresolved")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
