#!/usr/bin/env python3
# Builds the K3-nano training corpus: plain English text converted from permissively licensed
# documentation (and two public-domain dictionaries) shipped in pinned Debian 12 packages.
#
#   tools/corpus/build_corpus.sh            (the one command; it fetches the .debs, then runs this)
#   python3 tools/corpus/build_corpus.py --debs build/corpus/debs --out build/corpus
#
# Input: the .deb files named in SOURCES (exact versions), extracted with `dpkg-deb -x`.
# Output: build/corpus/train.txt, build/corpus/valid.txt (UTF-8, documents separated by DOC_SEP),
# models/k3-nano/corpus-manifest.json (per source) and docs/data/k3-nano-corpus.json (totals).
# Deterministic: files are visited in sorted order, the hold-out is chosen by a hash of the document
# path, and nothing depends on time, locale or hash seeds. Standard library only.
import argparse
import fnmatch
import gzip
import hashlib
import html
import html.parser
import json
import os
import re
import subprocess
import sys
import unicodedata
import zlib

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Documents are joined with two blank lines; inside a document blank-line runs are collapsed to one,
# so "\n\n\n" occurs exactly at document boundaries.
DOC_SEP = "\n\n\n"
VALID_PERCENT = 1.5       # share of documents held out for validation (by hash of the document path)
MIN_DOC_CHARS = 300       # shorter documents (after cleaning) are dropped
MIN_PROSE_SHARE = 0.5     # at least this share of a document's characters must be in prose lines
DEDUP_MIN_CHARS = 80      # paragraphs this long or longer are kept only at their first occurrence

# Selectors: "tag", ".class", "#id", "[attr=value]", or combinations such as "div.body".
COMMON_SKIP = [
    "script", "style", "nav", "form", "svg", "noscript", "button", "select", "textarea", "pre", "head",
    "[role=navigation]", "[role=search]", ".headerlink", ".highlight", ".sphinxsidebar", ".related",
    ".footer", ".toctree-wrapper", ".viewcode-link", ".navheader", ".navfooter", ".breadcrumb",
    ".breadcrumbs", ".copybutton", "[aria-hidden=true]",
]

SPHINX_EXCLUDE = [r"(^|/)genindex", r"(^|/)py-modindex", r"(^|/)search\.html$", r"(^|/)_static/",
                  r"(^|/)_sources/", r"(^|/)_images/", r"(^|/)_modules/", r"(^|/)_downloads/",
                  r"(^|/)objects\.inv", r"(^|/)license\.html$", r"(^|/)copyright\.html$"]

# Each source: one Debian package at one version. `license_check` must match in the package's
# copyright file (or `license_file`), which is how the license below was verified.
SOURCES = [
    dict(name="python-docs", package="python3.11-doc", version="3.11.2-6+deb12u9",
         license="PSF-2.0",
         license_note="Python documentation: 'This page is licensed under the Python Software Foundation "
                      "License Version 2' (stated on every page; copyright.html, license.html)",
         license_file="usr/share/doc/python3.11/html/copyright.html",
         license_check=r"licensed under the Python Software Foundation License Version 2",
         base="usr/share/doc/python3.11/html", include=["**.html"],
         exclude=SPHINX_EXCLUDE + [r"^contents\.html$", r"^about\.html$", r"^bugs\.html$",
                                   r"^download\.html$", r"^whatsnew/changelog\.html$", r"^index\.html$"],
         root=["[role=main]"], skip=[]),
    dict(name="postgresql-docs", package="postgresql-doc-15", version="15.20-0+deb12u1",
         license="PostgreSQL",
         license_note="PostgreSQL documentation, under the PostgreSQL License (BSD/MIT-like)",
         license_file="usr/share/doc/postgresql-doc-15/html/legalnotice.html",
         license_check=r"Permission to use, copy, modify, and\s+distribute this software and\s+its documentation",
         base="usr/share/doc/postgresql-doc-15/html", include=["*.html"],
         exclude=[r"^bookindex\.html$", r"^legalnotice\.html$", r"^index\.html$",
                  r"^appendix-obsolete", r"^biblio\.html$"],
         root=[], skip=[".toc", ".navheader", ".navfooter", ".list-of-tables", ".list-of-examples",
                        ".list-of-figures"]),
    dict(name="django-docs", package="python-django-doc", version="3:3.2.25-0+deb12u7",
         license="BSD-3-Clause",
         license_note="Django documentation, BSD-3-Clause (debian/copyright 'Files: *')",
         license_check=r"Files: \*\nCopyright:[^\n]*\n(?:[^\n]+\n)*?License: BSD-3-Clause",
         base="usr/share/doc/python-django-doc/html", include=["**.html"],
         exclude=SPHINX_EXCLUDE + [r"^contents\.html$", r"^index\.html$", r"(^|/)index\.html$"],
         root=["#bd"], skip=["#sidebar", ".nav", "#global-nav", "#hd", "#ft"]),
    dict(name="sqlite-docs", package="sqlite3-doc", version="3.40.1-2+deb12u2",
         license="public-domain",
         license_note="SQLite and its documentation are in the public domain (debian/copyright 'Files: *')",
         license_check=r"Files: \*\nCopyright:[^\n]*\nLicense: public-domain",
         base="usr/share/doc/sqlite3", include=["*.html", "c3ref/*.html", "session/*.html"],
         exclude=[r"^releaselog/", r"^syntax/", r"^(index|docs|sitemap|keyword_index|changes|chronology|"
                  r"copyright|doclist|news|capi3ref|toc|famous|prosupport|support|download|"
                  r"mostdeployed|thanks|crew|consortium|purchase|privatebranch|hp1)\.html$",
                  r"^c3ref/(funclist|constlist|objlist)\.html$"],
         root=[], skip=[".nosearch", ".menu", ".fancy_toc", "#toc_sub", ".fancy_title", ".imgcontainer"],
         drop_line=r"^[a-z][a-z0-9-]*:$"),  # the captions of the (skipped) syntax diagrams
    dict(name="rust-books", package="rust-doc", version="1.63.0+dfsg1-2",
         license="MIT OR Apache-2.0",
         license_note="The Rust books (The Book, Reference, Nomicon, Rust by Example, Edition Guide, "
                      "Embedded Book, rustc/rustdoc/unstable books): MIT OR Apache-2.0",
         license_check=r"src/doc/\*\n(?:[^\n]+\n)*?License: MIT or Apache-2\.0",
         base="usr/share/doc/rust-doc/html",
         include=["book/**.html", "reference/**.html", "nomicon/**.html", "rust-by-example/**.html",
                  "edition-guide/**.html", "embedded-book/**.html", "rustc/**.html", "rustdoc/**.html",
                  "unstable-book/**.html"],
         exclude=[r"(^|/)print\.html$", r"(^|/)toc\.html$", r"(^|/)404\.html$", r"(^|/)index\.html$",
                  r"^book/title-page\.html$", r"(^|/)SUMMARY\.html$", r"^unstable-book/(library|language)-features/"],
         root=["main"], skip=[]),
    dict(name="llvm-docs", package="llvm-15-doc", version="1:15.0.6-4",
         license="Apache-2.0 WITH LLVM-exception",
         license_note="LLVM documentation, Apache-2.0 with LLVM exceptions (debian/copyright 'Files: *')",
         license_check=r"Files: \*\nCopyright:[^\n]*\nLicense: APACHE-2-LLVM-EXCEPTIONS",
         base="usr/share/doc/llvm-15-doc/html", include=["**.html"],
         exclude=SPHINX_EXCLUDE + [r"^ReleaseNotes\.html$", r"^index\.html$", r"^Reference\.html$",
                                   r"^GettingStartedTutorials\.html$", r"^UserGuides\.html$",
                                   r"^CommandGuide/index\.html$", r"^tutorial/index\.html$"],
         root=["[role=main]", ".body"], skip=[]),
    dict(name="clang-docs", package="clang-15-doc", version="1:15.0.6-4",
         license="Apache-2.0 WITH LLVM-exception",
         license_note="Clang documentation, Apache-2.0 with LLVM exceptions (debian/copyright 'Files: *')",
         license_check=r"Files: \*\nCopyright:[^\n]*\nLicense: APACHE-2-LLVM-EXCEPTIONS",
         base="usr/share/doc/clang-15/html", include=["**.html"],
         exclude=SPHINX_EXCLUDE + [r"^ReleaseNotes\.html$", r"^index\.html$", r"^AttributeReference\.html$",
                                   r"^DiagnosticsReference\.html$", r"^ClangCommandLineReference\.html$"],
         root=["[role=main]", ".body"], skip=[]),
    dict(name="nodejs-docs", package="nodejs-doc", version="18.20.4+dfsg-1~deb12u3",
         license="MIT",
         license_note="Node.js API documentation, MIT (Expat) like Node.js itself",
         license_check=r"Files: \*\s*\nCopyright:[^\n]*\n(?:[^\n]+\n)*?License: Expat",
         base="usr/share/doc/nodejs/api", include=["*.html"],
         exclude=[r"^all\.html$", r"^index\.html$", r"^documentation\.html$", r"^deprecations\.html$"],
         root=["#apicontent"], skip=[".api_metadata", ".toc", "#gtoc", ".picker", ".srclink",
                                     ".mark", ".changelog"]),
    dict(name="sphinx-docs", package="sphinx-doc", version="5.3.0-4",
         license="BSD-2-Clause",
         license_note="Sphinx documentation, BSD-2-Clause (debian/copyright 'Files: *')",
         license_check=r"Files: \*\s*\nCopyright:[^\n]*\n(?:[^\n]+\n)*?License: BSD-2-clause",
         base="usr/share/doc/sphinx-doc/html", include=["**.html"],
         exclude=SPHINX_EXCLUDE + [r"^changes\.html$", r"^index\.html$", r"^contents\.html$",
                                   r"^examples\.html$", r"^authors\.html$"],
         root=["[role=main]", ".body"], skip=[]),
    dict(name="sqlalchemy-docs", package="python-sqlalchemy-doc", version="1.4.46+ds1-1",
         license="MIT",
         license_note="SQLAlchemy documentation, MIT (Expat) (debian/copyright 'Files: *')",
         license_check=r"Files: \*\s*\nCopyright:[^\n]*\n(?:[^\n]+\n)*?License: Expat",
         base="usr/share/doc/python-sqlalchemy-doc/html", include=["**.html"],
         exclude=SPHINX_EXCLUDE + [r"^changelog/", r"^index\.html$", r"^contents\.html$", r"^copyright\.html$"],
         root=["#docs-body"], skip=["#docs-bottom-navigation", ".docs-navigation-links"]),
    dict(name="flask-docs", package="python-flask-doc", version="2.2.2-3",
         license="BSD-3-Clause",
         license_note="Flask documentation, BSD-3-Clause (debian/copyright 'Files: *')",
         license_check=r"Files: \*\s*\nCopyright:[^\n]*\n(?:[^\n]+\n)*?License: BSD-3-clause",
         base="usr/share/doc/python-flask-doc/html", include=["**.html"],
         exclude=SPHINX_EXCLUDE + [r"^changes\.html$", r"^index\.html$", r"^license\.html$"],
         root=["[role=main]", ".body"], skip=[]),
    dict(name="cmake-docs", package="cmake-doc", version="3.25.1-1",
         license="BSD-3-Clause",
         license_note="CMake documentation, BSD-3-Clause (debian/copyright 'Files: *')",
         license_check=r"Files: \*\s*\nCopyright:[^\n]*\n(?:[^\n]+\n)*?License: BSD-3-clause",
         license_deb=("cmake-data", "3.25.1-1"), license_file="usr/share/doc/cmake-data/copyright",
         base="usr/share/doc/cmake-data/html", include=["**.html"],
         exclude=SPHINX_EXCLUDE + [r"^index\.html$", r"^release/"],
         root=["[role=main]", ".body"], skip=[]),
    dict(name="apache-httpd-docs", package="apache2-doc", version="2.4.71-1~deb12u1",
         license="Apache-2.0",
         license_note="Apache HTTP Server manual (English pages only), Apache-2.0",
         license_check=r"Files: \*\s*\nCopyright:[^\n]*\n(?:[^\n]+\n)*?License: Apache-2\.0",
         base="usr/share/doc/apache2-doc/manual/en", include=["**.html"],
         exclude=[r"(^|/)index\.html$", r"^sitemap\.html$", r"^mod/quickreference\.html$",
                  r"^mod/directives\.html$", r"^glossary\.html$", r"^license\.html$"],
         root=["#page-content"], skip=["#quickview", ".toplang", ".bottomlang", "#footer", "#page-header",
                                       "#path", ".example", "#comments_section",
                                       ".directive"]),
    dict(name="erlang-docs", package="erlang-doc", version="1:25.2.3+dfsg-1+deb12u4",
         license="Apache-2.0",
         license_note="Erlang/OTP documentation, Apache-2.0 (debian/copyright 'Files: *')",
         license_check=r"Files: \*\s*\nCopyright:[^\n]*\n(?:[^\n]+\n)*?License: Apache-2\.0",
         base="usr/share/doc/erlang-doc", include=["**.html"],
         exclude=[r"(^|/)index\.html$", r"(^|/)notes\.html$", r"(^|/)release_notes\.html$",
                  r"(^|/)users_guide\.html$", r"(^|/)(man_index|applications|nyi)\.html$",
                  r"(^|/)part\.html$", r"(^|/)ref_man\.html$", r"(^|/)internal_doc/",
                  r"(^|/)pdf/", r"(^|/)js/"],
         root=["#content"], skip=[".example", ".title-anchors", ".footer", ".topbar", ".leftnav-tube",
                                  ".bold_code", ".since"]),
    dict(name="golang-spec", package="golang-1.19-doc", version="1.19.8-2",
         license="BSD-3-Clause",
         license_note="The Go specification, memory model and assembler guide, under the Go license "
                      "(BSD-3-Clause; debian/copyright 'Files: *')",
         license_check=r"Files: \*\nCopyright:[^\n]*\nLicense: Go",
         base="usr/share/doc/golang-1.19-doc/html", include=["go_spec.html", "go_mem.html", "asm.html"],
         exclude=[], root=[], skip=["#nav", ".toc", "#manual-nav"]),
    dict(name="sklearn-docs", package="python-sklearn-doc", version="1.2.1+dfsg-1",
         license="BSD-3-Clause",
         license_note="scikit-learn documentation, BSD-3-Clause (debian/copyright 'Files: *')",
         license_check=r"Files: \*\s*\nCopyright:[^\n]*\n(?:[^\n]+\n)*?License: BSD-3-Clause",
         base="usr/share/doc/python-sklearn-doc/html", include=["**.html"],
         exclude=SPHINX_EXCLUDE + [r"^whats_new", r"^index\.html$", r"^contents\.html$", r"^authors",
                                   r"_team", r"^about\.html$", r"^related_projects\.html$",
                                   r"^presentations\.html$", r"^min_dependency", r"^install\.html$",
                                   r"(^|/)sg_execution_times\.html$", r"^documentation\.html$"],
         root=["[role=main]", ".body"], skip=[".sphx-glr-script-out", ".sphx-glr-download",
                                               ".sphx-glr-thumbcontainer", ".sphx-glr-timing"]),
    dict(name="pandas-docs", package="python-pandas-doc", version="1.5.3+dfsg-2",
         license="BSD-3-Clause",
         license_note="pandas documentation, BSD-3-Clause (debian/copyright 'Files: *': BSD-3; the few "
                      "CC-BY-SA Stack Overflow snippets of upstream are patched out of the Debian package)",
         license_check=r"Files: \*\s*\nCopyright:[^\n]*\nLicense: BSD-3\n",
         base="usr/share/doc/python-pandas-doc/html", include=["**.html"],
         exclude=SPHINX_EXCLUDE + [r"^whatsnew", r"(^|/)index\.html$", r"^api\.html$", r"^release\.html$",
                                   r"^ecosystem\.html$"],
         root=["[role=main]", ".body"], skip=[".bd-toc", ".output_area", ".prev-next-area"]),
    dict(name="scipy-docs", package="python-scipy-doc", version="1.10.1-2",
         license="BSD-3-Clause",
         license_note="SciPy documentation, BSD-3-Clause (debian/copyright 'Files: *')",
         license_check=r"Files: \*\s*\nCopyright:[^\n]*\n(?:[^\n]+\n)*?License: BSD-3-clause",
         base="usr/share/doc/python-scipy-doc/html", include=["**.html"],
         exclude=SPHINX_EXCLUDE + [r"^release", r"(^|/)index\.html$"],
         root=["[role=main]", ".body"], skip=[".bd-toc", ".prev-next-area"]),
    dict(name="sympy-docs", package="python-sympy-doc", version="1.11.1-1",
         license="BSD-3-Clause",
         license_note="SymPy documentation, BSD-3-Clause (debian/copyright 'Files: *'; GPL-2+ covers "
                      "only debian/*, the packaging)",
         license_check=r"Files: \*\s*\nCopyright:[^\n]*\nLicense: BSD-3-clause",
         base="usr/share/doc/python-sympy-doc/html", include=["**.html"],
         exclude=SPHINX_EXCLUDE + [r"(^|/)index\.html$"],
         root=["[role=main]", ".body"], skip=[".bd-toc", ".prev-next-area"]),
    dict(name="jargon-file", package="dict-jargon", version="4.4.7-3.1", kind="dictd",
         license="public-domain",
         license_note="The Jargon File 4.4.7: 'This document (the Jargon File) is in the public domain'",
         license_check=r"Files: \*\nCopyright:[^\n]*\nLicense: public-domain",
         base="usr/share/dictd", dict_name="jargon"),
    dict(name="devils-dictionary", package="dict-devil", version="1.0-13.1", kind="dictd",
         license="public-domain",
         license_note="Ambrose Bierce, The Devil's Dictionary (1911): 'A Public Domain Text, Copyright Expired'",
         license_check=r"The Devil's Dictionary is in the public domain",
         base="usr/share/dictd", dict_name="devil"),
]

BLOCK_HARD = {"p", "div", "section", "article", "main", "aside", "h1", "h2", "h3", "h4", "h5", "h6",
              "ul", "ol", "dl", "table", "blockquote", "pre", "figure", "figcaption", "hr", "center",
              "header", "footer", "caption", "details", "summary", "address", "body"}
BLOCK_SOFT = {"li", "dt", "dd", "tr", "br"}
VOID = {"br", "img", "hr", "meta", "link", "input", "wbr", "area", "base", "col", "embed", "param",
        "source", "track"}


def parse_selector(sel):
    m = re.fullmatch(r"([a-z0-9]*)((?:[.#][\w-]+)*)(?:\[([\w-]+)=([^\]]+)\])?", sel.strip())
    if not m:
        raise ValueError("bad selector " + sel)
    tag, rest, attr, val = m.groups()
    classes = re.findall(r"\.([\w-]+)", rest)
    ids = re.findall(r"#([\w-]+)", rest)
    return (tag or None, classes, ids[0] if ids else None, attr, val)


def sel_matches(sel, tag, attrs):
    stag, classes, sid, attr, val = sel
    if stag and stag != tag:
        return False
    if classes:
        have = set((attrs.get("class") or "").split())
        if not all(c in have for c in classes):
            return False
    if sid and attrs.get("id") != sid:
        return False
    if attr and (attrs.get(attr) or "") != val:
        return False
    return True


class Extractor(html.parser.HTMLParser):
    """HTML -> paragraphs of plain text. Skipped elements (navigation, code blocks, ...) are tracked by
    tag name and nesting depth of that tag, which tolerates the unclosed <p>/<li> of older HTML.
    Table rows become one line with " | " between cells: the paragraph breaks inside a cell are flattened
    to spaces unless the cell holds a nested table or is long (a layout table)."""

    def __init__(self, root, skip):
        super().__init__(convert_charrefs=True)
        self.root = [parse_selector(s) for s in root]
        self.skip = [parse_selector(s) for s in COMMON_SKIP + skip]
        self.in_root = 0 if self.root else 1
        self.root_stack = []    # [tag, depth] of the open root element
        self.skip_stack = []    # [tag, depth] of the open skipped element
        self.out = []
        self.cells = []         # [start index in out, table depth] of open cells
        self.row_cells = [0]    # cells seen in the current row, per table depth
        self.list_prefix = False

    def brk(self, hard):
        self.out.append("\x00" if hard else "\x01")

    def close_cells(self, depth):
        while self.cells and self.cells[-1][1] >= depth:
            start, _ = self.cells.pop()
            seg = self.out[start:]
            if "\x03" not in seg and sum(len(x) for x in seg) < 1500:
                self.out[start:] = [" " if x in ("\x00", "\x01") else x for x in seg]

    def handle_starttag(self, tag, attrs):
        a = {k: (v or "") for k, v in attrs}
        if self.skip_stack:
            if tag == self.skip_stack[-1][0] and tag not in VOID:
                self.skip_stack[-1][1] += 1
            return
        if self.root_stack and tag == self.root_stack[-1][0] and tag not in VOID:
            self.root_stack[-1][1] += 1
        if not self.in_root and not self.root_stack and any(sel_matches(s, tag, a) for s in self.root):
            if tag not in VOID:
                self.root_stack.append([tag, 1])
                self.in_root = 1
            return
        if any(sel_matches(s, tag, a) for s in self.skip):
            if tag not in VOID:
                self.skip_stack.append([tag, 1])
            return
        if not self.in_root:
            return
        depth = len(self.row_cells) - 1
        if tag == "table":
            self.out.append("\x03")
            self.row_cells.append(0)
        elif tag == "tr":
            self.close_cells(depth)
            self.row_cells[-1] = 0
        elif tag in ("td", "th"):
            self.close_cells(depth)
            if self.row_cells[-1]:
                self.out.append(" | ")
            self.row_cells[-1] += 1
            self.cells.append([len(self.out), depth])
            return
        if tag in BLOCK_HARD:
            self.brk(True)
        elif tag in BLOCK_SOFT:
            self.brk(False)
        if tag == "li":
            self.list_prefix = True
        elif "classifier" in a.get("class", "").split():
            self.out.append(" : ")  # numpydoc "name : type"

    def handle_endtag(self, tag):
        if self.skip_stack:
            if tag == self.skip_stack[-1][0]:
                self.skip_stack[-1][1] -= 1
                if self.skip_stack[-1][1] == 0:
                    self.skip_stack.pop()
            return
        if self.root_stack and tag == self.root_stack[-1][0]:
            self.root_stack[-1][1] -= 1
            if self.root_stack[-1][1] == 0:
                self.root_stack.pop()
                self.in_root = 0
                self.brk(True)
                return
        if not self.in_root:
            return
        depth = len(self.row_cells) - 1
        if tag in ("td", "th"):
            self.close_cells(depth)
            return
        if tag == "tr":
            self.close_cells(depth)
        elif tag == "table" and depth > 0:
            self.close_cells(depth)
            self.row_cells.pop()
        if tag in BLOCK_HARD:
            self.brk(True)
        elif tag in BLOCK_SOFT:
            self.brk(False)

    def handle_data(self, data):
        if self.skip_stack or not self.in_root:
            return
        if self.list_prefix and data.strip():
            self.out.append("- ")
            self.list_prefix = False
        self.out.append(data)

    def text(self):
        self.close_cells(0)
        raw = "".join(x for x in self.out if x != "\x03")
        paras = []
        for para in raw.split("\x00"):
            lines = []
            for line in para.split("\x01"):
                line = re.sub(r"\s+", " ", line).strip()
                line = re.sub(r"^(\| )+|( \|)+$", "", line).strip()
                if line and line not in ("-", "|") and not BOILERPLATE_LINE.match(line):
                    lines.append(line)
            if lines:
                paras.append("\n".join(lines))
        return paras


# whole lines dropped wherever they occur (page furniture that survives the selectors)
BOILERPLATE_LINE = re.compile(
    r"^(©|Copyright ©|\(c\) Copyright|Show this page source|Click here to download the full example code|"
    r"Gallery generated by Sphinx-Gallery|Download (Python|Jupyter) source code|Total running time of the script|"
    r"Previous topic$|Next topic$|This Page$|Quick search$|Table of Contents$|Navigation$|"
    r"Last updated on |Created using Sphinx)")


def normalize_para(p):
    p = unicodedata.normalize("NFC", p)
    p = p.replace("\u00a0", " ").replace("\u200b", "").replace("\ufeff", "").replace("\u00b6", "")
    p = "".join(ch for ch in p if ch in "\n\t" or unicodedata.category(ch)[0] != "C")
    p = re.sub(r"[ \t]+", " ", p)
    p = "\n".join(line.strip() for line in p.split("\n"))
    p = re.sub(r"\n{2,}", "\n", p).strip()
    return p


PROSE_WORD = re.compile(r"[A-Za-z][a-z']*[a-z]|[aAI]")


def is_prose_line(line):
    words = line.split()
    if len(words) < 6:
        return False
    alpha = sum(1 for w in words if PROSE_WORD.fullmatch(w.strip(".,;:!?()\"'“”‘’")))
    return alpha >= 0.6 * len(words)


def prose_share(paras):
    total = sum(len(p) for p in paras) or 1
    prose = sum(len(line) for p in paras for line in p.split("\n") if is_prose_line(line))
    return prose / total


def rel_match(rel, patterns):
    return any(fnmatch.fnmatchcase(rel, pat.replace("**", "*")) for pat in patterns)


def html_documents(src, root_dir):
    base = os.path.join(root_dir, src["base"])
    exclude = [re.compile(x) for x in src["exclude"]]
    files = []
    for dp, dn, fn in os.walk(base):
        dn.sort()
        for f in fn:
            rel = os.path.relpath(os.path.join(dp, f), base).replace(os.sep, "/")
            if rel_match(rel, src["include"]) and not any(x.search(rel) for x in exclude):
                files.append(rel)
    for rel in sorted(files):
        with open(os.path.join(base, rel), "rb") as f:
            data = f.read()
        if rel.endswith(".gz"):
            data = gzip.decompress(data)
        text = data.decode("utf-8", errors="replace")
        ex = Extractor(src["root"], src["skip"])
        ex.feed(text)
        ex.close()
        yield rel, ex.text()


def dictd_documents(src, root_dir):
    """dictd databases: entries from the .index (word, base64 offset, base64 length); one document
    per initial letter, entries in index order, the 00-database-* header entries dropped."""
    base = os.path.join(root_dir, src["base"])
    data = zlib.decompress(open(os.path.join(base, src["dict_name"] + ".dict.dz"), "rb").read(), 31)
    b64 = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"

    def num(s):
        n = 0
        for ch in s:
            n = n * 64 + b64.index(ch)
        return n

    groups, seen = {}, set()
    for line in open(os.path.join(base, src["dict_name"] + ".index"), encoding="utf-8"):
        word, off, ln = line.rstrip("\n").split("\t")[:3]
        if word.startswith("00-database") or word.startswith("00database"):
            continue
        key = (num(off), num(ln))
        if key in seen:
            continue
        seen.add(key)
        entry = data[key[0]:key[0] + key[1]].decode("utf-8", errors="replace")
        letter = word[:1].upper() if word[:1].isalpha() else "0"
        groups.setdefault(letter, []).append((key[0], entry))
    for letter in sorted(groups):
        paras = []
        for _, entry in sorted(groups[letter]):
            # re-flow the indented entry text: keep blank-line paragraph breaks, join wrapped lines
            for block in re.split(r"\n\s*\n", entry.strip("\n")):
                lines = [ln.strip() for ln in block.split("\n") if ln.strip()]
                if lines:
                    paras.append(" ".join(lines))
        yield src["dict_name"] + "-" + letter, paras


def is_valid_doc(doc_id):
    h = int.from_bytes(hashlib.sha256(doc_id.encode("utf-8")).digest()[:8], "big")
    return (h % 10000) < VALID_PERCENT * 100


def deb_path(debs, src):
    name = f"{src['package']}_{src['version'].replace(':', '%3a')}_all.deb"  # apt-get download's naming
    p = os.path.join(debs, name)
    if not os.path.exists(p):
        raise SystemExit(f"missing {p}: run tools/corpus/build_corpus.sh (it downloads the pinned .debs)")
    return p


def sha256_file(p):
    h = hashlib.sha256()
    with open(p, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--debs", default=os.path.join(REPO, "build/corpus/debs"))
    ap.add_argument("--out", default=os.path.join(REPO, "build/corpus"))
    ap.add_argument("--manifest", default=os.path.join(REPO, "models/k3-nano/corpus-manifest.json"))
    ap.add_argument("--totals", default=os.path.join(REPO, "docs/data/k3-nano-corpus.json"))
    ap.add_argument("--only", help="comma-separated source names (for inspection; writes no manifest)")
    ap.add_argument("--dump", help="write each kept document to this directory (inspection)")
    args = ap.parse_args()

    roots = os.path.join(args.out, "pkgroot")
    os.makedirs(roots, exist_ok=True)
    only = set(args.only.split(",")) if args.only else None
    seen_paras = set()
    train_parts, valid_parts = [], []
    manifest = []
    for src in SOURCES:
        if only and src["name"] not in only:
            continue
        deb = deb_path(args.debs, src)
        root_dir = os.path.join(roots, src["package"])
        stamp = os.path.join(root_dir, ".deb.sha256")
        deb_sha = sha256_file(deb)
        if not (os.path.exists(stamp) and open(stamp).read() == deb_sha):
            subprocess.run(["rm", "-rf", root_dir], check=True)
            os.makedirs(root_dir)
            subprocess.run(["dpkg-deb", "-x", deb, root_dir], check=True)
            open(stamp, "w").write(deb_sha)
        # the license: checked against the package's own copyright statement
        lic_file = src.get("license_file") or f"usr/share/doc/{src['package']}/copyright"
        if "license_deb" in src:  # the doc package's /usr/share/doc dir is a symlink to this package's
            lp, lv = src["license_deb"]
            lic_deb = deb_path(args.debs, dict(package=lp, version=lv))
            lic_text = subprocess.run(["dpkg-deb", "--fsys-tarfile", lic_deb], check=True, capture_output=True).stdout
            import io
            import tarfile
            with tarfile.open(fileobj=io.BytesIO(lic_text)) as tf:
                lic_text = tf.extractfile("./" + lic_file).read().decode("utf-8", errors="replace")
            lic_file = f"{os.path.basename(lic_deb)}:{lic_file}"
        else:
            lic_text = open(os.path.join(root_dir, lic_file), encoding="utf-8", errors="replace").read()
        if not re.search(src["license_check"], lic_text):
            raise SystemExit(f"{src['name']}: license check /{src['license_check']}/ failed in {lic_file}")
        docs = dictd_documents(src, root_dir) if src.get("kind") == "dictd" else html_documents(src, root_dir)
        st = dict(files_seen=0, docs=0, dropped_short=0, dropped_code=0, train_bytes=0, valid_bytes=0,
                  train_docs=0, valid_docs=0)
        h_text = hashlib.sha256()
        drop_line = re.compile(src["drop_line"]) if src.get("drop_line") else None
        for rel, paras in docs:
            st["files_seen"] += 1
            kept = []
            for p in paras:
                p = normalize_para(p)
                if drop_line:
                    p = "\n".join(ln for ln in p.split("\n") if not drop_line.match(ln))
                if not p:
                    continue
                if len(p) >= DEDUP_MIN_CHARS:
                    k = hashlib.sha1(p.encode("utf-8")).digest()
                    if k in seen_paras:
                        continue
                    seen_paras.add(k)
                kept.append(p)
            text = "\n\n".join(kept)
            if len(text) < MIN_DOC_CHARS:
                st["dropped_short"] += 1
                continue
            if prose_share(kept) < MIN_PROSE_SHARE:
                st["dropped_code"] += 1
                continue
            doc_id = src["name"] + "/" + rel
            valid = is_valid_doc(doc_id)
            b = text.encode("utf-8")
            h_text.update(doc_id.encode("utf-8") + b"\0" + b + b"\0")
            (valid_parts if valid else train_parts).append(text)
            st["valid_docs" if valid else "train_docs"] += 1
            st["valid_bytes" if valid else "train_bytes"] += len(b)
            st["docs"] += 1
            if args.dump:
                dp = os.path.join(args.dump, doc_id + ".txt")
                os.makedirs(os.path.dirname(dp), exist_ok=True)
                open(dp, "w", encoding="utf-8").write(text + "\n")
        entry = dict(name=src["name"], package=src["package"], version=src["version"], license=src["license"],
                     license_note=src["license_note"], license_verified_in=lic_file,
                     deb=os.path.basename(deb), deb_sha256=deb_sha, files_considered=st["files_seen"],
                     documents=st["docs"], dropped_short=st["dropped_short"], dropped_code_heavy=st["dropped_code"],
                     train_documents=st["train_docs"], valid_documents=st["valid_docs"],
                     train_bytes=st["train_bytes"], valid_bytes=st["valid_bytes"],
                     bytes=st["train_bytes"] + st["valid_bytes"], text_sha256=h_text.hexdigest())
        manifest.append(entry)
        print(f"{src['name']:20s} files {st['files_seen']:6d} docs {st['docs']:6d} short {st['dropped_short']:5d} "
              f"code {st['dropped_code']:5d} MB {entry['bytes'] / 1e6:7.2f}", flush=True)

    train = DOC_SEP.join(train_parts) + "\n"
    valid = DOC_SEP.join(valid_parts) + "\n"
    os.makedirs(args.out, exist_ok=True)
    paths = {}
    for name, t in (("train.txt", train), ("valid.txt", valid)):
        p = os.path.join(args.out, name)
        with open(p, "w", encoding="utf-8", newline="\n") as f:
            f.write(t)
        paths[name] = p
    tb, vb = len(train.encode("utf-8")), len(valid.encode("utf-8"))
    print(f"train {tb / 1e6:.2f} MB ({len(train_parts)} docs), valid {vb / 1e6:.2f} MB ({len(valid_parts)} docs)")
    if only:
        return
    totals = dict(
        description="K3-nano training corpus (tools/corpus/build_corpus.sh); per-source details in "
                    "models/k3-nano/corpus-manifest.json",
        command="tools/corpus/build_corpus.sh",
        sources=len(manifest),
        documents=len(train_parts) + len(valid_parts),
        train_documents=len(train_parts), valid_documents=len(valid_parts),
        train_bytes=tb, valid_bytes=vb, total_bytes=tb + vb,
        train_chars=len(train), valid_chars=len(valid),
        train_sha256=hashlib.sha256(train.encode("utf-8")).hexdigest(),
        valid_sha256=hashlib.sha256(valid.encode("utf-8")).hexdigest(),
        document_separator=DOC_SEP,
        valid_rule=f"sha256(source/path) first 8 bytes big-endian mod 10000 < {int(VALID_PERCENT * 100)}",
        licenses=sorted({m["license"] for m in manifest}),
    )
    man = dict(
        description="Sources of the K3-nano corpus: pinned Debian 12 packages, each verified against its "
                    "own copyright statement. bytes = UTF-8 bytes of the cleaned text kept from the source "
                    "(train + valid, without separators); text_sha256 = sha256 over (doc id NUL text NUL)*.",
        command="tools/corpus/build_corpus.sh",
        settings=dict(document_separator=DOC_SEP, valid_percent=VALID_PERCENT, min_doc_chars=MIN_DOC_CHARS,
                      min_prose_share=MIN_PROSE_SHARE, dedup_min_chars=DEDUP_MIN_CHARS),
        sources=manifest,
        totals={k: totals[k] for k in ("documents", "train_bytes", "valid_bytes", "total_bytes",
                                       "train_sha256", "valid_sha256")},
    )
    for p, obj in ((args.manifest, man), (args.totals, totals)):
        os.makedirs(os.path.dirname(p), exist_ok=True)
        with open(p, "w", encoding="utf-8") as f:
            json.dump(obj, f, indent=1, ensure_ascii=False)
            f.write("\n")
    print("wrote", args.manifest, args.totals)


if __name__ == "__main__":
    sys.exit(main())
