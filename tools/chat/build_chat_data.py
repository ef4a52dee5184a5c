#!/usr/bin/env python3
"""Builds the K3-nano chat fine-tune data: conversations in the K3 chat format (XTML) about the
documents of the K3-nano corpus, rendered to token ids by tools/chat/xtml.py (checked against the
engine's goldens by tools/chat/check_goldens.py), plus the held-out evaluation prompts.

    build/corpus/venv/bin/python tools/chat/build_chat_data.py          # after tools/corpus/build_corpus.sh
                                                                        # and encode_corpus.py

Inputs: the extracted documentation trees of build/corpus/pkgroot (the corpus's own sources, walked
with the corpus's include/exclude rules: tools/corpus/build_corpus.py SOURCES), build/corpus/train.u16
and valid.u16, models/k3-nano/tiktoken.model.
What it extracts: documented entries with a name and a description: Sphinx objects (Python, SciPy,
pandas, scikit-learn, SymPy, SQLAlchemy, Flask, Django, Sphinx functions/classes/methods/attributes,
LLVM/Clang/Sphinx/Python command-line options, CMake commands/variables/properties/modules),
PostgreSQL SQL commands, client applications and their options, SQLite SQL statements and C API
functions, Node.js API methods.
What it writes (OUT/device/ holds what the fine-tune reads, about 7 MB):
  OUT/device/chat_ids.u16.gz      all training conversations' token ids (little-endian uint16), concatenated
  OUT/device/chat_index.json.gz   per conversation: [offset, length, [[start, end], ...] trained spans]
  OUT/device/raw_train.u16.gz     a subset of the raw pretraining ids (replay), whole chunks of train.u16
  OUT/device/valid.u16.gz         the raw validation split (for the fine-tune's perplexity log)
  OUT/device/eval_prompts.jsonl   the held-out prompts (as in the fixtures), for a quick check in Python
  OUT/summary.json         counts; OUT/samples.txt: 40 rendered conversations ([[trained]] text);
  OUT/conversations.jsonl.gz: every training conversation as a request (messages, tools, options)
  FIXTURES/questions.jsonl, FIXTURES/tool_prompts.jsonl   the held-out prompts the C++ test runs
Training conversations: a question about an entry, a short thinking section (one or two sentences)
that closes, an answer of 1-4 sentences taken from the entry's documentation; system prompts vary
(none, plain, thinking effort low/high/max, non-thinking), some conversations are multi-turn; tool
conversations declare 2-5 tools (search_docs, read_doc, get_option, lookup_symbol, list_entries,
convert_units), the assistant calls one (sometimes two) with well-formed arguments, the tool result is
a documentation snippet, and the final answer uses it; some carry tool_choice=required.
The loss covers only the assistant turns after the last user message (their generated tokens, end
markers included). Held-out: every entry of a held-out document (the corpus's validation documents
plus 4% of the others by a hash of the document id) is kept out of training; 50 plain questions and
40 tool prompts are drawn from them. Deterministic for a given --seed.
"""
from __future__ import annotations

import argparse
import array
import gzip
import hashlib
import html
import html.parser
import json
import os
import random
import re
import sys
import time
import unicodedata

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(REPO, "tools", "tokenizer"))
sys.path.insert(0, os.path.join(REPO, "tools", "corpus"))
import build_corpus as BC  # noqa: E402  (SOURCES, rel_match, is_valid_doc)
import kimi_ref  # noqa: E402
import xtml  # noqa: E402

# ------------------------------------------------------------------------------------ a small DOM

VOID = {"br", "img", "hr", "meta", "link", "input", "wbr", "area", "base", "col", "embed", "param",
        "source", "track"}
AUTO_CLOSE_P = {"p", "div", "dl", "ul", "ol", "table", "pre", "h1", "h2", "h3", "h4", "h5", "h6", "blockquote",
                "section", "dt", "dd", "li"}


class Node:
    __slots__ = ("tag", "attrs", "children", "parent")

    def __init__(self, tag, attrs, parent):
        self.tag, self.attrs, self.children, self.parent = tag, attrs, [], parent

    def cls(self):
        return self.attrs.get("class", "").split()

    def has_class(self, *names):
        c = self.cls()
        return all(n in c for n in names)

    def elems(self):
        return [c for c in self.children if isinstance(c, Node)]

    def iter(self):
        stack = [self]
        while stack:
            n = stack.pop()
            yield n
            stack.extend(reversed(n.elems()))


class DomBuilder(html.parser.HTMLParser):
    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.root = Node("#root", {}, None)
        self.cur = self.root

    def handle_starttag(self, tag, attrs):
        if tag in AUTO_CLOSE_P and self.cur.tag == "p":
            self.cur = self.cur.parent
        n = Node(tag, {k: (v or "") for k, v in attrs}, self.cur)
        self.cur.children.append(n)
        if tag not in VOID:
            self.cur = n

    def handle_startendtag(self, tag, attrs):
        self.cur.children.append(Node(tag, {k: (v or "") for k, v in attrs}, self.cur))

    def handle_endtag(self, tag):
        n = self.cur
        while n is not None and n.tag != tag:
            n = n.parent
        if n is not None and n.parent is not None:
            self.cur = n.parent

    def handle_data(self, data):
        self.cur.children.append(data)


def parse_html(text):
    b = DomBuilder()
    b.feed(text)
    b.close()
    return b.root


SKIP_TEXT = {"script", "style"}


def text_of(node, skip_pre=True):
    out = []

    def walk(n):
        for c in n.children:
            if isinstance(c, str):
                out.append(c)
            elif c.tag in SKIP_TEXT or (skip_pre and c.tag == "pre"):
                continue
            elif c.tag == "a" and "headerlink" in c.cls():
                continue
            elif c.tag == "br":
                out.append(" ")
            else:
                walk(c)
    walk(node)
    return clean("".join(out))


def clean(s):
    s = unicodedata.normalize("NFC", s)
    s = s.replace("\u00a0", " ").replace("\u200b", "").replace("\ufeff", "").replace("¶", "")
    s = "".join(ch for ch in s if ch == "\n" or unicodedata.category(ch)[0] != "C")
    return re.sub(r"\s+", " ", s).strip()


SENT_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z`\"'(\[])")
ABBREV = ("e.g.", "i.e.", "etc.", "vs.", "cf.", "approx.", "Fig.", "No.", "resp.", "incl.")


def sentences(text):
    parts = SENT_END.split(text)
    out = []
    for p in parts:
        if out and out[-1].endswith(ABBREV):
            out[-1] += " " + p
        else:
            out.append(p)
    return [s.strip() for s in out if s.strip()]


def good_desc(paras):
    """The first one or two paragraphs -> list of sentences (None when unusable)."""
    sents = []
    for p in paras[:2]:
        if len(p) < 20:
            continue
        sents.extend(sentences(p))
        if len(sents) >= 4:
            break
    sents = [s for s in sents if 8 <= len(s) <= 400]
    if not sents or len(sents[0]) < 15:
        return None
    if not re.search(r"[A-Za-z]{3}", sents[0]):
        return None
    bad = ("See also", "Deprecated since", "New in version", "Changed in version", ">>>")
    if sents[0].startswith(bad):
        return None
    return sents


def direct_paras(dd):
    """Text of the direct <p> children of a node (not of nested definition lists)."""
    return [text_of(c) for c in dd.elems() if c.tag == "p"]


# ------------------------------------------------------------------------------------ extractors

LIB_NAME = {"python-docs": "Python", "scipy-docs": "SciPy", "pandas-docs": "pandas", "sklearn-docs": "scikit-learn",
            "sympy-docs": "SymPy", "sqlalchemy-docs": "SQLAlchemy", "flask-docs": "Flask", "django-docs": "Django",
            "sphinx-docs": "Sphinx", "llvm-docs": "LLVM", "clang-docs": "Clang", "cmake-docs": "CMake",
            "postgresql-docs": "PostgreSQL", "sqlite-docs": "SQLite", "nodejs-docs": "Node.js"}
SPHINX_KINDS = {"function": "function", "method": "method", "class": "class", "exception": "exception",
                "attribute": "attribute", "data": "data", "property": "property", "classmethod": "method",
                "staticmethod": "method", "decorator": "decorator", "option": "option", "envvar": "envvar",
                "command": "command", "variable": "variable"}


def h1_text(tree):
    for n in tree.iter():
        if n.tag == "h1":
            return text_of(n)
    return ""


def sphinx_items(src, rel, tree):
    items = []
    title = h1_text(tree)
    program = ""
    if src in ("llvm-docs", "clang-docs") and " - " in title:
        program = title.split(" - ")[0].strip()
    for dl in tree.iter():
        if dl.tag != "dl":
            continue
        c = dl.cls()
        if len(c) < 2 or c[0] not in ("py", "std", "c", "cpp", "js", "cmake", "rst"):
            continue
        kind = SPHINX_KINDS.get(c[1])
        if not kind:
            continue
        dts = [e for e in dl.elems() if e.tag == "dt"]
        dds = [e for e in dl.elems() if e.tag == "dd"]
        if not dts or not dds:
            continue
        sig = re.sub(r"\[source\]$", "", text_of(dts[0])).strip()
        ident = dts[0].attrs.get("id", "")
        desc = good_desc(direct_paras(dds[0]))
        if not desc or not sig or len(sig) > 160:
            continue
        if kind == "option":
            names = [s.strip() for s in sig.split(",")]
            opt = names[0].split(" ")[0].split("=")[0]
            if not opt.startswith("-") and not opt.startswith("/"):
                continue
            prog = program
            if not prog and ident.startswith("cmdoption-"):
                m = re.match(r"cmdoption-([a-z0-9_.]+?)-", ident)
                prog = m.group(1) if m else ""
            if not prog:
                prog = {"python-docs": "python", "sphinx-docs": "sphinx-build"}.get(src, "")
            if not prog:
                continue
            items.append(dict(kind="option", name=opt, sig=sig, program=prog, desc=desc))
        else:
            name = ident if ident and not ident.startswith(("id", "index-")) else sig.split("(")[0].strip()
            if c[0] == "c" and name.startswith("c."):
                name = name[2:]
            name = re.sub(r"^(class|exception|async|abstractmethod|classmethod|staticmethod|property|"
                          r"data|attribute|method|function)\s+", "", name)
            if not re.match(r"^[A-Za-z_][\w.]*$", name) or len(name) > 70:
                continue
            items.append(dict(kind=kind, name=name, sig=sig, desc=desc))
    return items


CMAKE_DIRS = {"command": "command", "variable": "variable", "module": "module", "policy": "policy",
              "envvar": "environment variable", "prop_tgt": "target property", "prop_dir": "directory property",
              "prop_sf": "source file property", "prop_test": "test property", "prop_gbl": "global property",
              "prop_cache": "cache entry property", "prop_inst": "installed file property",
              "generator": "generator", "manual": None}


def cmake_items(rel, tree):
    d = rel.split("/")[0]
    kind = CMAKE_DIRS.get(d)
    if not kind:
        return sphinx_items("cmake-docs", rel, tree)
    sect = None
    for n in tree.iter():
        if n.tag == "h1":
            sect = n.parent
            name = text_of(n)
            break
    if sect is None or not name or len(name) > 60:
        return []
    paras = [text_of(c) for c in sect.elems() if c.tag == "p"]
    desc = good_desc(paras)
    if not desc:
        return []
    return [dict(kind="cmake " + kind, name=name, sig=name, desc=desc)]


def postgres_items(rel, tree):
    if not (rel.startswith("sql-") or rel.startswith("app-")):
        return []
    title = purpose = ""
    desc_paras, opts = [], []
    for n in tree.iter():
        if n.tag == "div" and "refnamediv" in n.cls():
            title = text_of(next((e for e in n.iter() if e.tag == "h2"), n))
            p = next((e for e in n.elems() if e.tag == "p"), None)
            if p is not None:
                purpose = text_of(p)
        if n.tag == "div" and "refsect1" in n.cls():
            h = next((e for e in n.elems() if e.tag == "h2"), None)
            ht = text_of(h) if h is not None else ""
            if ht == "Description" and not desc_paras:
                desc_paras = [text_of(e) for e in n.elems() if e.tag == "p"]
            if ht == "Options":
                for dl in n.iter():
                    if dl.tag != "dl":
                        continue
                    kids = dl.elems()
                    for i, e in enumerate(kids):
                        if e.tag == "dt" and i + 1 < len(kids) and kids[i + 1].tag == "dd":
                            terms = [text_of(t) for t in e.iter() if t.tag == "code" and "option" in t.cls()]
                            d = good_desc(direct_paras(kids[i + 1]))
                            if terms and d:
                                long = [t for t in terms if t.startswith("--")]
                                opt = (long or terms)[0].split("=")[0].split(" ")[0]
                                opts.append((opt, ", ".join(terms), d))
    if not title:
        return []
    desc = good_desc(desc_paras)
    items = []
    if desc:
        kind = "SQL command" if rel.startswith("sql-") else "program"
        summary = purpose.split("—", 1)[1].strip() if "—" in purpose else ""
        items.append(dict(kind="pg " + kind, name=title, sig=title, desc=desc, summary=summary))
    if rel.startswith("app-"):
        for opt, sig, d in opts:
            if opt.startswith("-"):
                items.append(dict(kind="option", name=opt, sig=sig, program=title, desc=d))
    return items


def sqlite_items(rel, tree):
    items = []
    if rel.startswith("lang_"):
        title = ""
        for n in tree.iter():
            if n.tag == "title":
                title = text_of(n)
                break
        paras, in_desc = [], False
        for n in tree.iter():
            if n.tag == "h1":
                in_desc = text_of(n).endswith("Description") or text_of(n).endswith("Overview")
            elif n.tag == "p" and in_desc and len(paras) < 2:
                paras.append(text_of(n))
        desc = good_desc(paras)
        if title and desc and len(title) < 60:
            items.append(dict(kind="sqlite statement", name=title, sig=title, desc=desc))
    elif rel.startswith("c3ref/"):
        h2s = [n for n in tree.iter() if n.tag == "h2"]
        if len(h2s) < 2:
            return []
        title = text_of(h2s[1])
        pre = next((n for n in tree.iter() if n.tag == "pre"), None)
        fns = re.findall(r"\b(sqlite3_[a-z0-9_]+)\s*\(", text_of(pre, skip_pre=False)) if pre is not None else []
        paras = [text_of(n) for n in tree.iter() if n.tag == "p"][:2]
        desc = good_desc(paras)
        if fns and desc and title:
            items.append(dict(kind="sqlite C function", name=fns[0], sig=fns[0] + "()", desc=desc, summary=title))
    return items


def nodejs_items(rel, tree):
    items = []
    mod = rel[:-5]
    for n in tree.iter():
        if n.tag not in ("h3", "h4"):
            continue
        t = text_of(n)
        t = re.sub(r"#$", "", t).strip()
        m = re.match(r"^([A-Za-z_$][\w$]*(?:\.[A-Za-z_$][\w$]*)+)\(", t)
        if not m:
            continue
        par = n.parent.elems()
        i = par.index(n)
        paras = []
        for e in par[i + 1:]:
            if e.tag in ("h2", "h3", "h4"):
                break
            if e.tag == "p":
                paras.append(text_of(e))
        desc = good_desc(paras)
        if desc:
            items.append(dict(kind="method", name=m.group(1), sig=t, desc=desc, module=mod))
    return items


EXTRACT_SOURCES = ("python-docs", "postgresql-docs", "django-docs", "sqlite-docs", "llvm-docs", "clang-docs",
                   "nodejs-docs", "sphinx-docs", "sqlalchemy-docs", "flask-docs", "cmake-docs", "sklearn-docs",
                   "pandas-docs", "scipy-docs", "sympy-docs")


def walk_source(src, root):
    base = os.path.join(root, src["package"], src["base"])
    exclude = [re.compile(x) for x in src["exclude"]]
    files = []
    for dp, dn, fn in os.walk(base):
        dn.sort()
        for f in fn:
            rel = os.path.relpath(os.path.join(dp, f), base).replace(os.sep, "/")
            if BC.rel_match(rel, src["include"]) and not any(x.search(rel) for x in exclude):
                files.append(rel)
    return base, sorted(files)


def extract_items(pkgroot, log):
    items = []
    for src in BC.SOURCES:
        name = src["name"]
        if name not in EXTRACT_SOURCES:
            continue
        base, files = walk_source(src, pkgroot)
        n0 = len(items)
        for rel in files:
            if not rel.endswith(".html"):
                continue
            raw = open(os.path.join(base, rel), "rb").read().decode("utf-8", errors="replace")
            if name == "postgresql-docs":
                if not (rel.startswith("sql-") or rel.startswith("app-")):
                    continue
                got = postgres_items(rel, parse_html(raw))
            elif name == "sqlite-docs":
                if not (rel.startswith("lang_") or rel.startswith("c3ref/")):
                    continue
                got = sqlite_items(rel, parse_html(raw))
            elif name == "nodejs-docs":
                got = nodejs_items(rel, parse_html(raw))
            elif name == "cmake-docs":
                got = cmake_items(rel, parse_html(raw))
            else:
                if '<dl class="' not in raw:
                    continue
                got = sphinx_items(name, rel, parse_html(raw))
            for it in got:
                it["src"] = name
                it["doc"] = name + "/" + rel
                it["lib"] = LIB_NAME.get(name, name)
                items.append(it)
        log(f"  {name:18s} {len(items) - n0:6d} entries from {len(files)} files")
    # one entry per (source, kind, name, program): the first (sorted path order)
    seen, out = set(), []
    for it in items:
        k = (it["src"], it["kind"], it["name"], it.get("program", ""))
        if k not in seen:
            seen.add(k)
            out.append(it)
    return out


# ------------------------------------------------------------------------------------ conversations

SYSTEM_PROMPTS = [
    "You are a helpful assistant.",
    "You are K3-nano, a small assistant that answers questions about software documentation.",
    "You answer questions about programming libraries and tools. Be concise.",
    "Answer briefly and accurately.",
    "You are a documentation assistant. Keep answers short.",
    "You are a helpful assistant for developers.",
]

KIND_WORD = {"function": "function", "method": "method", "class": "class", "exception": "exception",
             "attribute": "attribute", "data": "value", "property": "property", "decorator": "decorator",
             "envvar": "environment variable", "command": "command", "variable": "variable"}


def kind_word(it):
    k = it["kind"]
    if k.startswith("cmake "):
        return "CMake " + k[6:]
    if k.startswith("pg "):
        return k[3:]
    if k == "sqlite statement":
        return "SQL statement"
    if k == "sqlite C function":
        return "C function"
    return KIND_WORD.get(k, k)


def short_name(name):
    return name.rsplit(".", 1)[-1]


def question(it, r):
    k, n, lib = it["kind"], it["name"], it["lib"]
    kw = kind_word(it)
    if k == "option":
        p = it["program"]
        return r.choice([
            f"What does the {n} option of {p} do?",
            f"In {p}, what is the {n} option for?",
            f"What is `{p} {n}` used for?",
            f"Explain the {n} flag of {p}.",
            f"How does {n} change what {p} does?",
            f"what does {p} {n} do",
        ])
    if k in ("function", "method"):
        return r.choice([
            f"What does {n}() do?",
            f"What is {n} used for in {lib}?",
            f"Explain the {lib} {kw} {n}.",
            f"How does `{n}` work?",
            f"Can you tell me what {short_name(n)}() does in {lib}?",
            f"What does the {kw} {n} return?",
            f"what is {n} for",
            f"Describe {n}.",
        ])
    if k in ("class", "exception"):
        return r.choice([
            f"What is the {n} {kw} in {lib}?",
            f"What is {n}?",
            f"Explain the {kw} {n}.",
            f"What is {short_name(n)} used for in {lib}?",
            f"Tell me about {n}.",
        ])
    if k.startswith("cmake "):
        return r.choice([
            f"What does the {kw} {n} do?",
            f"What is {n} in CMake?",
            f"Explain the {kw} {n}.",
            f"How is {n} used in CMake?",
            f"what is {n} for in cmake",
        ])
    if k.startswith("pg "):
        return r.choice([
            f"What does {n} do in PostgreSQL?",
            f"Explain the PostgreSQL {kw} {n}.",
            f"What is {n} used for?",
            f"In PostgreSQL, what does {n} do?",
        ])
    if k == "sqlite statement":
        return r.choice([
            f"What does {n} do in SQLite?",
            f"Explain the SQLite {n} statement.",
            f"How does SQLite handle {n}?",
        ])
    if k == "sqlite C function":
        return r.choice([
            f"What does {n}() do in the SQLite C API?",
            f"Explain the SQLite C function {n}.",
            f"What is {n} for?",
        ])
    return r.choice([
        f"What is {n} in {lib}?",
        f"What does the {lib} {kw} {n} mean?",
        f"Explain {n}.",
        f"Tell me about {n} in {lib}.",
    ])


def subject(it):
    k, n = it["kind"], it["name"]
    if k == "option":
        return f"the {n} option of {it['program']}"
    if k in ("function", "method", "class", "exception", "attribute", "data", "property", "decorator"):
        return f"the {it['lib']} {kind_word(it)} {n}"
    return f"the {kind_word(it)} {n}"


def thinking(it, r, effort):
    s = subject(it)
    first = r.choice([
        f"The user asks about {s}.",
        f"This is a question about {s}.",
        f"The question is about {s}.",
        f"They want to know what {s} does.",
        f"I need to explain {s}.",
    ])
    second = r.choice([
        "Its documentation answers this, so I will summarize it.",
        "I will answer from its documentation in a few sentences.",
        "A short summary of the documentation is enough.",
        "I'll give the documented behaviour briefly.",
        "I remember its documentation; I will summarize it.",
    ])
    if effort == "low":
        return first
    if effort in ("high", "max") or r.random() < 0.5:
        return first + " " + second
    return first


def answer(it, r, max_sents=None):
    sents = it["desc"][: max_sents or r.choice([1, 2, 2, 3, 3, 4])]
    body = " ".join(sents)
    while len(body) > 600 and len(sents) > 1:
        sents = sents[:-1]
        body = " ".join(sents)
    k = it["kind"]
    style = r.random()
    if style < 0.45:
        return body
    if k == "option":
        return r.choice([f"The {it['name']} option of {it['program']}: {body}",
                         f"`{it['sig']}`: {body}", f"In {it['program']}, {it['name']}: {body}"])
    if style < 0.7:
        return f"`{it['sig']}`: {body}"
    if style < 0.85:
        return f"From the {it['lib']} documentation of {it['name']}: {body}"
    return f"{it['name']}: {body}"


TOOLS = {
    "search_docs": dict(
        description="Search the documentation and return the best matching snippets.",
        parameters={"type": "object", "properties": {
            "query": {"type": "string", "description": "what to search for"},
            "max_results": {"type": "integer", "description": "how many snippets to return"},
            "source": {"type": "string", "description": "limit the search to one documentation set"}},
            "required": ["query"]}),
    "read_doc": dict(
        description="Read the documentation of a command, function, statement or option.",
        parameters={"type": "object", "properties": {
            "name": {"type": "string", "description": "the documented name"},
            "section": {"type": "string", "enum": ["summary", "description", "options", "examples"]}},
            "required": ["name"]}),
    "get_option": dict(
        description="Describe one command-line option of a program.",
        parameters={"type": "object", "properties": {
            "program": {"type": "string"}, "option": {"type": "string"}},
            "required": ["program", "option"]}),
    "lookup_symbol": dict(
        description="Look up a function, class, method or variable by name.",
        parameters={"type": "object", "properties": {
            "symbol": {"type": "string"}, "library": {"type": "string"},
            "exact": {"type": "boolean", "description": "only exact name matches"}},
            "required": ["symbol"]}),
    "list_entries": dict(
        description="List the documented entries of a module, chapter or program.",
        parameters={"type": "object", "properties": {
            "module": {"type": "string"}, "limit": {"type": "integer"},
            "include_private": {"type": "boolean"}},
            "required": ["module"]}),
    "convert_units": dict(
        description="Convert a value between units of length, mass or data size.",
        parameters={"type": "object", "properties": {
            "value": {"type": "number"}, "from_unit": {"type": "string"}, "to_unit": {"type": "string"}},
            "required": ["value", "from_unit", "to_unit"]}),
}


def tool_decl(name):
    t = TOOLS[name]
    return {"type": "function", "function": {"name": name, "description": t["description"],
                                             "parameters": t["parameters"]}}


def applicable_tools(it):
    if it["kind"] == "option":
        return ["get_option", "search_docs", "read_doc"]
    if it["kind"] in ("function", "method", "class", "exception", "attribute", "data", "property", "decorator",
                      "sqlite C function"):
        return ["lookup_symbol", "search_docs", "read_doc"]
    return ["read_doc", "search_docs"]


def make_call(tool, it, r):
    n = it["name"]
    if tool == "search_docs":
        q = f"{it['program']} {n}" if it["kind"] == "option" else r.choice([n, f"{it['lib']} {n}", n])
        args = {"query": q}
        if r.random() < 0.35:
            args["max_results"] = r.choice([1, 3, 5])
        if r.random() < 0.2:
            args["source"] = it["lib"]
        return args
    if tool == "read_doc":
        args = {"name": f"{it['program']} {n}" if it["kind"] == "option" else n}
        if r.random() < 0.5:
            args["section"] = r.choice(["summary", "description"])
        return args
    if tool == "get_option":
        return {"program": it["program"], "option": n}
    if tool == "lookup_symbol":
        args = {"symbol": n}
        if r.random() < 0.5:
            args["library"] = it["lib"]
        if r.random() < 0.4:
            args["exact"] = r.random() < 0.7
        return args
    raise ValueError(tool)


def tool_result(tool, it, r):
    desc = " ".join(it["desc"][:4])
    if tool == "search_docs" and r.random() < 0.5:
        hits = [{"title": it["name"] if it["kind"] != "option" else f"{it['program']} {it['name']}",
                 "source": it["lib"], "snippet": desc}]
        return json.dumps(hits, ensure_ascii=False)
    head = it["sig"] if it["kind"] != "option" else f"{it['program']} {it['sig']}"
    return f"{head}\n{desc}"


def system_config(r, allow_nonthinking=True):
    """-> (system text or '', reasoning_effort, thinking)"""
    x = r.random()
    sys_text = r.choice(SYSTEM_PROMPTS) if r.random() < 0.4 else ""
    if x < 0.35:
        return sys_text, "", True
    if x < 0.5:
        return sys_text, "low", True
    if x < 0.65:
        return sys_text, "high", True
    if x < 0.78:
        return sys_text, "max", True
    if not allow_nonthinking:
        return sys_text, "", True
    if x < 0.9:
        return sys_text, "none", False
    return sys_text, r.choice(["", "high"]), False


def qa_turn(it, r, effort, think_on):
    q = question(it, r)
    a = answer(it, r)
    msg = {"role": "assistant", "content": a}
    if think_on:
        msg["reasoning_content"] = thinking(it, r, effort)
    return [{"role": "user", "content": q}, msg]


SMALLTALK = [
    ("Hi", "Hello! Ask me about a command, a function or an option from the documentation I know."),
    ("Hello!", "Hello! What would you like to know?"),
    ("Thanks!", "You're welcome."),
    ("Thank you, that helps.", "Glad it helped. Ask if you have another question."),
    ("Who are you?", "I am K3-nano, a small language model trained on software documentation. I can answer short "
                     "questions about commands, functions and options."),
    ("What can you do?", "I can answer short questions about the documentation of Python, PostgreSQL, SQLite, "
                         "CMake, LLVM and other tools, and I can call tools when they are available."),
    ("Are you a large model?", "No. I am K3-nano, a small model with about 48 million parameters, so my answers "
                               "are short and can be wrong."),
    ("Can you help me?", "Yes. Tell me which command, function or option you want to know about."),
]


def smalltalk_conv(r, sys_text, effort, think_on):
    q, a = r.choice(SMALLTALK)
    msgs = [{"role": "system", "content": sys_text}] if sys_text else []
    m = {"role": "assistant", "content": a}
    if think_on:
        m["reasoning_content"] = r.choice(["This is small talk; a short friendly reply is enough.",
                                           "A greeting or a general question. I will answer briefly.",
                                           "No documentation is needed here."])
    msgs += [{"role": "user", "content": q}, m]
    return dict(messages=msgs, reasoning_effort=effort, thinking=think_on, tools=[], tool_choice_required=False)


def plain_conv(pick, r):
    sys_text, effort, think_on = system_config(r)
    msgs = [{"role": "system", "content": sys_text}] if sys_text else []
    n_turns = 1 if r.random() < 0.8 else r.choice([2, 2, 3])
    for t in range(n_turns):
        msgs += qa_turn(pick(), r, effort, think_on)
    return dict(messages=msgs, reasoning_effort=effort, thinking=think_on, tools=[], tool_choice_required=False)


def declared_tools(it, r, must):
    names = {must}
    pool = [t for t in TOOLS if t != must]
    r.shuffle(pool)
    names.update(pool[:r.choice([1, 1, 2, 3, 4])])
    order = sorted(names)
    r.shuffle(order)
    return order


def tool_call_turn(it, r, tool, think_on, effort, call_id, extra=None):
    args = make_call(tool, it, r)
    calls = [{"id": call_id, "type": "function", "function": {"name": tool, "arguments": args}}]
    if extra:
        calls.append(extra)
    m = {"role": "assistant", "content": "", "tool_calls": calls}
    target = subject(it)
    if think_on:
        m["reasoning_content"] = r.choice([
            f"The user asks about {target}. I should look it up with {tool}.",
            f"I will call {tool} to get the documentation of {it['name']}.",
            f"Let me check the documentation of {target} first.",
            f"{tool} can find {it['name']}; I will call it.",
        ]) if effort != "low" else f"I will call {tool}."
    else:
        m["content"] = r.choice(["Let me look that up.", "I'll check the documentation.",
                                 f"I'll look up {it['name']}.", "Checking the documentation."])
    return m


def tool_conv(pick, r, final_answer=True):
    """Tools declared; the user asks; the assistant calls a tool; (the result; the final answer)."""
    it = pick()
    sys_text, effort, think_on = system_config(r)
    required = r.random() < 0.3
    tool = r.choice(applicable_tools(it))
    names = declared_tools(it, r, tool)
    msgs = [{"role": "system", "content": sys_text}] if sys_text else []
    if r.random() < 0.12:  # an earlier plain exchange
        msgs += qa_turn(pick(), r, effort, think_on)
    msgs.append({"role": "user", "content": question(it, r)})
    call = tool_call_turn(it, r, tool, think_on, effort, "call_1")
    results = [(tool, "call_1", tool_result(tool, it, r))]
    if r.random() < 0.12:  # a second, parallel call about another entry of the same kind
        other = pick()
        t2 = r.choice([t for t in applicable_tools(other)])
        if t2 not in names:
            names.append(t2)
        a2 = make_call(t2, other, r)
        call["tool_calls"].append({"id": "call_2", "type": "function", "function": {"name": t2, "arguments": a2}})
        results.append((t2, "call_2", tool_result(t2, other, r)))
        msgs[-1]["content"] = msgs[-1]["content"].rstrip("?.") + f", and also about {other['name']}?"
    msgs.append(call)
    if final_answer:
        order = results[:]
        if len(order) > 1 and r.random() < 0.5:
            order.reverse()
        for t, cid, res in order:
            msgs.append({"role": "tool", "tool_call_id": cid, "content": res})
        fin = {"role": "assistant", "content": answer(it, r)}
        if len(results) > 1:
            fin["content"] += " " + answer(dict(other), r, max_sents=1)
        if think_on:
            fin["reasoning_content"] = r.choice([
                "The tool result has the documentation; I will summarize it.",
                f"The result describes {it['name']}. I can answer now.",
                "I have the snippet I need.",
            ])
        msgs.append(fin)
    return dict(messages=msgs, reasoning_effort=effort, thinking=think_on,
                tools=[tool_decl(t) for t in names], tool_choice_required=required)


UNITS = [("km", "m", 1000), ("m", "cm", 100), ("kg", "g", 1000), ("GiB", "MiB", 1024), ("MiB", "KiB", 1024),
         ("in", "cm", 2.54), ("ft", "m", 0.3048), ("lb", "kg", 0.45359237)]


def units_conv(pick, r):
    sys_text, effort, think_on = system_config(r)
    a, b, f = r.choice(UNITS)
    v = r.choice([1, 2, 3, 5, 8, 10, 12, 16, 20, 25, 64, 100, 250])
    res = v * f
    res_s = (f"{res:.4f}".rstrip("0").rstrip(".")) if isinstance(res, float) else str(res)
    q = r.choice([f"Convert {v} {a} to {b}.", f"How many {b} are in {v} {a}?", f"What is {v} {a} in {b}?"])
    names = declared_tools(None, r, "convert_units")
    msgs = [{"role": "system", "content": sys_text}] if sys_text else []
    call = {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function", "function": {
        "name": "convert_units", "arguments": {"value": v, "from_unit": a, "to_unit": b}}}]}
    if think_on:
        call["reasoning_content"] = "A unit conversion; convert_units does it."
    else:
        call["content"] = "Let me convert that."
    fin = {"role": "assistant", "content": f"{v} {a} is {res_s} {b}."}
    if think_on:
        fin["reasoning_content"] = "The tool returned the converted value."
    msgs += [{"role": "user", "content": q}, call, {"role": "tool", "tool_call_id": "call_1", "content": res_s + " " + b},
             fin]
    return dict(messages=msgs, reasoning_effort=effort, thinking=think_on,
                tools=[tool_decl(t) for t in names], tool_choice_required=r.random() < 0.3)


def tools_but_plain_conv(pick, r):
    """Tools declared but not needed (small talk): answer directly."""
    c = smalltalk_conv(r, *system_config(r))
    names = declared_tools(None, r, r.choice(list(TOOLS)))
    c["tools"] = [tool_decl(t) for t in names]
    return c


# ------------------------------------------------------------------------------------ main


def render_conv(enc, c):
    return xtml.render_ids_with_mask(enc, c["messages"], tools=c["tools"], reasoning_effort=c["reasoning_effort"],
                                     thinking=c["thinking"], tool_choice_required=c["tool_choice_required"])


def prompt_record(enc, c, kind, it):
    segs = xtml.render(c["messages"], tools=c["tools"], reasoning_effort=c["reasoning_effort"],
                       thinking=c["thinking"], tool_choice_required=c["tool_choice_required"])
    rec = {"id": None, "kind": kind, "source_doc": it["doc"], "entry": it["name"],
           "system": next((m["content"] for m in c["messages"] if m["role"] == "system"), ""),
           "reasoning_effort": c["reasoning_effort"], "thinking": c["thinking"],
           "tool_choice_required": c["tool_choice_required"], "tools": c["tools"],
           "user": c["messages"][-1]["content"],
           "reference_answer": " ".join(it["desc"][:2]),
           "prompt_ids": xtml.segments_ids(enc, segs)}
    return rec


def held_out_doc(doc):
    if BC.is_valid_doc(doc):
        return True
    h = int.from_bytes(hashlib.sha256(("k3-nano-chat/" + doc).encode("utf-8")).digest()[:8], "big")
    return h % 100 < 4


class CachedEnc:
    """tiktoken encoding with a cache for the repeated ordinary-text segments (headers, templates)."""

    def __init__(self, enc):
        self.enc = enc
        self._special_tokens = enc._special_tokens
        self.cache = {}

    def encode_ordinary(self, s):
        v = self.cache.get(s)
        if v is None:
            v = self.enc.encode_ordinary(s)
            if len(s) < 200:
                self.cache[s] = v
        return v


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", default=os.path.join(REPO, "build", "corpus"))
    ap.add_argument("--vocab", default=os.path.join(REPO, "models", "k3-nano"))
    ap.add_argument("--out", default=os.path.join(REPO, ".chatdata"))
    ap.add_argument("--fixtures", default=os.path.join(REPO, "tests", "fixtures", "k3-nano-chat"))
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--conversations", type=int, default=36000)
    ap.add_argument("--raw-tokens", type=int, default=2_600_000, help="raw pretraining ids kept for replay")
    ap.add_argument("--n-questions", type=int, default=50)
    ap.add_argument("--n-tool-prompts", type=int, default=40)
    a = ap.parse_args()
    t0 = time.time()

    def log(*x):
        print(*x, flush=True)

    enc = CachedEnc(kimi_ref.make_encoding(a.vocab))
    log("extracting entries from", os.path.join(a.corpus, "pkgroot"))
    items = extract_items(os.path.join(a.corpus, "pkgroot"), log)
    train_items = [it for it in items if not held_out_doc(it["doc"])]
    test_items = [it for it in items if held_out_doc(it["doc"])]
    train_docs = {it["doc"] for it in train_items}
    test_docs = {it["doc"] for it in test_items}
    assert not (train_docs & test_docs)
    log(f"{len(items)} entries: {len(train_items)} for training ({len(train_docs)} documents), "
        f"{len(test_items)} held out ({len(test_docs)} documents)")

    r = random.Random(a.seed)
    # balance: entries are drawn by source, with weights ~ (entries of the source)^0.6
    by_src = {}
    for it in train_items:
        by_src.setdefault(it["src"], []).append(it)
    groups = [by_src[s] for s in sorted(by_src)]
    weights = [len(g) ** 0.6 for g in groups]

    def pick():
        return r.choice(r.choices(groups, weights=weights)[0])

    convs = []
    kinds = {"plain": 0, "tool_call_only": 0, "tool_full": 0, "units": 0, "smalltalk": 0, "tools_smalltalk": 0}
    for i in range(a.conversations):
        x = r.random()
        if x < 0.56:
            c, k = plain_conv(pick, r), "plain"
        elif x < 0.70:
            c, k = tool_conv(pick, r, final_answer=False), "tool_call_only"
        elif x < 0.93:
            c, k = tool_conv(pick, r, final_answer=True), "tool_full"
        elif x < 0.955:
            c, k = units_conv(pick, r), "units"
        elif x < 0.985:
            c, k = smalltalk_conv(r, *system_config(r)), "smalltalk"
        else:
            c, k = tools_but_plain_conv(pick, r), "tools_smalltalk"
        kinds[k] += 1
        convs.append(c)
    log(f"{len(convs)} training conversations: {kinds}")

    dev = os.path.join(a.out, "device")  # what the fine-tune needs (carried to the GPU machine)
    os.makedirs(dev, exist_ok=True)
    ids_all = array.array("H")
    index = []
    n_train_tok = 0
    for c in convs:
        ids, mask = render_conv(enc, c)
        spans, s = [], None
        for j, mk in enumerate(mask + [0]):
            if mk and s is None:
                s = j
            elif not mk and s is not None:
                spans.append([s, j])
                s = None
        if not spans:
            raise SystemExit(f"a conversation without trained tokens: {c}")
        index.append([len(ids_all), len(ids), spans])
        ids_all.extend(ids)
        n_train_tok += sum(e - s for s, e in spans)
    if sys.byteorder != "little":
        ids_all.byteswap()
    with gzip.open(os.path.join(dev, "chat_ids.u16.gz"), "wb", compresslevel=9) as f:
        f.write(ids_all.tobytes())
    with gzip.open(os.path.join(dev, "chat_index.json.gz"), "wt", compresslevel=9) as f:
        json.dump(index, f, separators=(",", ":"))
    lens = sorted(x[1] for x in index)
    log(f"chat tokens {len(ids_all):,} (trained {n_train_tok:,}); conversation length median {lens[len(lens) // 2]}, "
        f"p99 {lens[int(len(lens) * 0.99)]}, max {lens[-1]}")

    # raw replay subset: whole chunks of train.u16 at evenly spaced offsets; and the validation split
    raw = array.array("H")
    with open(os.path.join(a.corpus, "train.u16"), "rb") as f:
        raw.frombytes(f.read())
    chunk = 65536
    n_chunks = max(1, a.raw_tokens // chunk)
    starts = [int(i * (len(raw) - chunk) / max(1, n_chunks - 1)) for i in range(n_chunks)]
    sub = array.array("H")
    for s in starts:
        sub.extend(raw[s:s + chunk])
    with gzip.open(os.path.join(dev, "raw_train.u16.gz"), "wb", compresslevel=9) as f:
        f.write(sub.tobytes())
    with open(os.path.join(a.corpus, "valid.u16"), "rb") as f, \
            gzip.open(os.path.join(dev, "valid.u16.gz"), "wb", compresslevel=9) as g:
        g.write(f.read())
    log(f"raw replay subset {len(sub):,} tokens ({n_chunks} chunks of {chunk}) of {len(raw):,}")

    # held-out prompts: entries of held-out documents, at most 2 per document, spread over sources
    rt = random.Random(a.seed + 1)
    test_by_src = {}
    for it in test_items:
        test_by_src.setdefault(it["src"], []).append(it)
    picks, used_per_doc = [], {}
    srcs = sorted(test_by_src)
    for lst in test_by_src.values():
        rt.shuffle(lst)
    need = a.n_questions + a.n_tool_prompts
    pos = {s: 0 for s in srcs}
    while len(picks) < need and any(pos[s] < len(test_by_src[s]) for s in srcs):
        for s in srcs:
            while pos[s] < len(test_by_src[s]):
                it = test_by_src[s][pos[s]]
                pos[s] += 1
                if used_per_doc.get(it["doc"], 0) < 2:
                    used_per_doc[it["doc"]] = used_per_doc.get(it["doc"], 0) + 1
                    picks.append(it)
                    break
            if len(picks) >= need:
                break
    rt.shuffle(picks)
    q_items, t_items = picks[:a.n_questions], picks[a.n_questions:need]
    questions, tool_prompts = [], []
    for i, it in enumerate(q_items):
        sys_text, effort, think_on = system_config(rt)
        if i < 40:  # 40 thinking prompts (10 of them with the default options of `k3 chat`), 10 non-thinking
            think_on = True
            effort = "" if i < 10 else effort if effort != "none" else "high"
            if i < 10:
                sys_text = ""
        else:
            think_on, effort = False, rt.choice(["none", ""])
        c = dict(messages=([{"role": "system", "content": sys_text}] if sys_text else []) +
                 [{"role": "user", "content": question(it, rt)}],
                 reasoning_effort=effort, thinking=think_on, tools=[], tool_choice_required=False)
        rec = prompt_record(enc, c, "question", it)
        rec["id"] = f"q{i + 1:02d}"
        questions.append(rec)
    for i, it in enumerate(t_items):
        sys_text, effort, think_on = system_config(rt, allow_nonthinking=i % 5 != 4)
        if i % 5 == 4:
            think_on, effort = False, "none"
        tool = rt.choice(applicable_tools(it))
        names = declared_tools(it, rt, tool)
        c = dict(messages=([{"role": "system", "content": sys_text}] if sys_text else []) +
                 [{"role": "user", "content": question(it, rt)}],
                 reasoning_effort=effort, thinking=think_on, tools=[tool_decl(t) for t in names],
                 tool_choice_required=i % 3 == 0)
        rec = prompt_record(enc, c, "tool", it)
        rec["id"] = f"t{i + 1:02d}"
        tool_prompts.append(rec)
    os.makedirs(a.fixtures, exist_ok=True)
    for name, recs in (("questions.jsonl", questions), ("tool_prompts.jsonl", tool_prompts)):
        with open(os.path.join(a.fixtures, name), "w", encoding="utf-8") as f:
            for rec in recs:
                f.write(json.dumps(rec, ensure_ascii=False) + "\n")
    with open(os.path.join(dev, "eval_prompts.jsonl"), "w", encoding="utf-8") as f:
        for rec in questions + tool_prompts:
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")
    # a few rendered training conversations, for review
    with open(os.path.join(a.out, "samples.txt"), "w", encoding="utf-8") as f:
        for c in convs[:40]:
            segs = xtml.render(c["messages"], tools=c["tools"], reasoning_effort=c["reasoning_effort"],
                               thinking=c["thinking"], tool_choice_required=c["tool_choice_required"],
                               add_generation_prompt=False)
            f.write("".join(("[[" + s.text + "]]" if s.gen else s.text) if not s.special else s.text
                            for s in segs) + "\n\n")
    summary = dict(seed=a.seed, entries=len(items), train_entries=len(train_items), heldout_entries=len(test_items),
                   train_documents=len(train_docs), heldout_documents=len(test_docs), conversations=len(convs),
                   kinds=kinds, chat_tokens=len(ids_all), trained_tokens=n_train_tok, raw_replay_tokens=len(sub),
                   questions=len(questions), tool_prompts=len(tool_prompts),
                   entries_by_source={s: sum(1 for it in items if it["src"] == s) for s in sorted(by_src)},
                   seconds=time.time() - t0)
    with open(os.path.join(a.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    log(json.dumps(summary))
    # the training conversations as JSON (requests), for checks against the engine's renderer
    with gzip.open(os.path.join(a.out, "conversations.jsonl.gz"), "wt", encoding="utf-8") as f:
        for c in convs:
            f.write(json.dumps(c, ensure_ascii=False) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
