#!/usr/bin/env python3
"""An independent Python renderer of the Kimi K3 chat format (XTML), written from
/work/shared/spec/chat-format.md (not from src/chat). tools/chat/check_goldens.py checks it against
every reviewed golden conversation in tests/fixtures/chat/ (text and token ids), so conversations it
renders are what the engine renders; tests/cli/test_k3_nano_chat.cpp checks it again on every
held-out prompt of tests/fixtures/k3-nano-chat/.

Only the four markers <|open|>, <|close|>, <|sep|>, <|end_of_msg|> are special ids; everything else
(tag names, attributes, user/tool/assistant text) is ordinary text, tokenized with special tokens
disallowed, each text segment on its own (a marker always ends a BPE piece).

    import xtml
    segs = xtml.render(messages, tools=..., reasoning_effort="high", thinking=True)
    ids = xtml.segments_ids(enc, segs)            # enc: tools/tokenizer/kimi_ref.make_encoding(DIR)
    ids, mask = xtml.render_ids_with_mask(enc, messages, ...)   # mask: 1 on the assistant's generated
                                                                # tokens of the trained turns
Where the spec is silent the reviewed goldens decide (see check_goldens.py): tool results are put in
the call order of the preceding assistant turn; call arguments keep their key order; the
tool-declaration JSON is key-sorted at every depth and compact; no BOS.
"""
from __future__ import annotations

import json
from typing import Any, Dict, List, Optional, Sequence, Tuple

OPEN, CLOSE, SEP, EOM = "<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"
MARKERS = (OPEN, CLOSE, SEP, EOM)
EFFORTS = ("low", "medium", "high", "max")
TOOLS_HEADER = "# Tools\nHere are the available tools, described in JSONSchema.\n```json\n"
TOOLS_FOOTER = "\n```"
TOOL_CHOICE_TEXT = "The system is invoked with `tool_choice=required`. You MUST call tools."


class Seg:
    """One rendered piece: a marker (special) or ordinary text. owner: index of the message it belongs
    to (-1: preamble / generation prompt). gen: part of what the model generates in an assistant
    turn (after that turn's generation-prompt prefix)."""
    __slots__ = ("special", "text", "owner", "gen")

    def __init__(self, special: bool, text: str, owner: int = -1, gen: bool = False):
        self.special, self.text, self.owner, self.gen = special, text, owner, gen

    def __repr__(self):
        return f"Seg({self.special}, {self.text!r}, {self.owner}, {self.gen})"


def escape_attr(v: str) -> str:
    return v.replace("&", "&amp;").replace('"', "&quot;")


def sorted_compact_json(v: Any) -> str:
    return json.dumps(v, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def compact_json(v: Any) -> str:
    """Compact, keys in the given order (tool-call argument values)."""
    return json.dumps(v, separators=(",", ":"), ensure_ascii=False)


def json_type(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, (int, float)):
        return "number"
    if isinstance(v, str):
        return "string"
    if isinstance(v, list):
        return "array"
    if isinstance(v, dict):
        return "object"
    raise TypeError(f"not a JSON value: {type(v).__name__}")


def content_text(c: Any) -> str:
    """A message's content: a string, or a list of {"type": "text", "text": ...} parts (joined)."""
    if c is None:
        return ""
    if isinstance(c, str):
        return c
    if isinstance(c, list):
        out = []
        for p in c:
            if isinstance(p, str):
                out.append(p)
            elif isinstance(p, dict) and p.get("type", "text") == "text":
                out.append(p.get("text", ""))
            else:
                raise ValueError(f"unsupported content part {p!r}")
        return "".join(out)
    raise ValueError(f"unsupported content {c!r}")


def call_arguments(call: Dict[str, Any]) -> Any:
    fn = call.get("function", call)
    a = fn.get("arguments", {})
    if isinstance(a, str):
        a = json.loads(a) if a.strip() else {}
    return a


class _Out:
    def __init__(self):
        self.segs: List[Seg] = []
        self.owner = -1
        self.gen = False

    def m(self, marker: str):
        self.segs.append(Seg(True, marker, self.owner, self.gen))

    def t(self, text: str):
        if text:
            self.segs.append(Seg(False, text, self.owner, self.gen))

    def open(self, header: str):
        self.m(OPEN)
        self.t(header)
        self.m(SEP)

    def close(self, tag: str):
        self.m(CLOSE)
        self.t(tag)
        self.m(SEP)

    def end_message(self):
        self.close("message")
        self.m(EOM)

    def message(self, header: str, body: str):
        self.open(header)
        self.t(body)
        self.end_message()


def resolve_options(request: Dict[str, Any]) -> Dict[str, Any]:
    """OpenAI-style request fields -> render() keyword arguments."""
    effort = request.get("reasoning_effort") or ""
    thinking = True
    kw = request.get("chat_template_kwargs") or {}
    for d in (kw, request):
        for k in ("enable_thinking", "thinking"):
            if k in d and d[k] is False:
                thinking = False
    if effort == "none":
        thinking = False
    return dict(tools=request.get("tools") or [], reasoning_effort=effort, thinking=thinking,
                tool_choice_required=request.get("tool_choice") == "required")


def render(messages: Sequence[Dict[str, Any]], tools: Optional[Sequence[Dict[str, Any]]] = None,
           reasoning_effort: str = "", thinking: bool = True, tool_choice_required: bool = False,
           add_generation_prompt: bool = True) -> List[Seg]:
    if reasoning_effort and reasoning_effort not in EFFORTS + ("none",):
        raise ValueError(f"unknown reasoning effort {reasoning_effort!r}")
    if reasoning_effort == "none":
        thinking = False
    o = _Out()
    # preamble: effort, tool declarations, tool choice
    if reasoning_effort and reasoning_effort != "none":
        o.message('message role="system" type="thinking-effort"', "thinking_effort=" + reasoning_effort)
    if tools:
        o.message('message role="system" type="tool-declare"',
                  TOOLS_HEADER + sorted_compact_json(list(tools)) + TOOLS_FOOTER)
    if tool_choice_required:
        o.message('message role="system" type="tool-choice"', TOOL_CHOICE_TEXT)
    gen_open = "think" if thinking else "response"
    # tool_call_id -> (name, index) of the most recent assistant turn's calls
    call_of: Dict[str, Tuple[str, int]] = {}
    i = 0
    n = len(messages)
    while i < n:
        msg = messages[i]
        role = msg.get("role")
        o.owner = i
        if role in ("system", "user"):
            o.message(f'message role="{role}"', content_text(msg.get("content")))
            i += 1
        elif role == "assistant":
            reasoning = msg.get("reasoning_content") or msg.get("reasoning") or ""
            content = content_text(msg.get("content"))
            calls = msg.get("tool_calls") or []
            o.open('message role="assistant"')
            # what follows the generation prompt's `<|open|>message role="assistant"<|sep|>` prefix
            first_gen = len(o.segs)
            if reasoning:
                o.open("think")
                o.t(reasoning)
                o.close("think")
            if content or not calls:  # (an assistant turn with neither still has an empty response)
                o.open("response")
                o.t(content)
                o.close("response")
            call_of = {}
            if calls:
                o.open("tools")
                for k, c in enumerate(calls, 1):
                    fn = c.get("function", c)
                    name = fn["name"]
                    if c.get("id"):
                        call_of[c["id"]] = (name, k)
                    args = call_arguments(c)
                    o.open(f'call tool="{escape_attr(name)}" index="{k}"')
                    if isinstance(args, dict):
                        for key, val in args.items():
                            ty = json_type(val)
                            o.open(f'argument key="{escape_attr(key)}" type="{ty}"')
                            o.t(val if ty == "string" else compact_json(val))
                            o.close("argument")
                    else:
                        o.open(f'json type="{json_type(args)}"')
                        o.t(compact_json(args))
                        o.close("json")
                    o.close("call")
                o.close("tools")
            o.end_message()
            # mark the generated part: everything after `<|open|>message role="assistant"<|sep|>`
            # plus the opener of the section the generation prompt opens (think / response), which
            # is part of the prompt, not generated
            gen_start = first_gen
            segs = o.segs
            if (gen_start + 2 < len(segs) and segs[gen_start].special and segs[gen_start].text == OPEN
                    and segs[gen_start + 1].text == gen_open and segs[gen_start + 2].text == SEP):
                gen_start += 3
            for s in segs[gen_start:]:
                s.gen = True
            i += 1
        elif role == "tool":
            # a run of tool results: rendered in the call order of the assistant turn before them
            run = []
            while i < n and messages[i].get("role") == "tool":
                run.append((i, messages[i]))
                i += 1
            resolved = []
            for j, tm in run:
                cid = tm.get("tool_call_id", "")
                if cid in call_of:
                    name, idx = call_of[cid]
                elif tm.get("name"):
                    name, idx = tm["name"], len(resolved) + 1
                else:
                    raise ValueError(f"tool message {j} answers no known call ({cid!r})")
                resolved.append((idx, j, name, content_text(tm.get("content"))))
            for idx, j, name, text in sorted(resolved, key=lambda r: (r[0], r[1])):
                o.owner = j
                o.message(f'message role="tool" tool="{escape_attr(name)}" index="{idx}"', text)
        else:
            raise ValueError(f"unknown role {role!r}")
    o.owner = -1
    o.gen = False
    if add_generation_prompt:
        o.open('message role="assistant"')
        o.open(gen_open)
    return o.segs


def segments_text(segs: Sequence[Seg]) -> str:
    return "".join(s.text for s in segs)


def review_text(segs: Sequence[Seg]) -> str:
    """The goldens' review form: "<|" inside ordinary text is written "<\\|"."""
    return "".join(s.text if s.special else s.text.replace("<|", "<\\|") for s in segs)


def special_ids(enc) -> Dict[str, int]:
    return {m: enc._special_tokens[m] for m in MARKERS}


def encode_plain(enc, text: str) -> List[int]:
    """Ordinary text with special tokens disallowed (marker names stay text), by the oracle's rules."""
    import kimi_ref  # tools/tokenizer (put on sys.path by the caller)
    return kimi_ref.encode_text(enc, text)


def segments_ids(enc, segs: Sequence[Seg]) -> List[int]:
    sp = special_ids(enc)
    ids: List[int] = []
    for s in segs:
        ids.extend([sp[s.text]] if s.special else encode_plain(enc, s.text))
    return ids


def segments_ids_mask(enc, segs: Sequence[Seg], train_from_message: int = 0) -> Tuple[List[int], List[int]]:
    """ids and a 0/1 mask: 1 on generated assistant tokens of messages with index >= train_from_message."""
    sp = special_ids(enc)
    ids: List[int] = []
    mask: List[int] = []
    for s in segs:
        part = [sp[s.text]] if s.special else encode_plain(enc, s.text)
        ids.extend(part)
        mask.extend([1 if (s.gen and s.owner >= train_from_message) else 0] * len(part))
    return ids, mask


def last_user_index(messages: Sequence[Dict[str, Any]]) -> int:
    last = -1
    for i, m in enumerate(messages):
        if m.get("role") == "user":
            last = i
    return last


def render_ids_with_mask(enc, messages, **kw) -> Tuple[List[int], List[int]]:
    """A whole conversation (no generation prompt) -> ids and the loss mask of its final assistant
    turn(s): the assistant turns after the last user message (a tool-call turn and the answer that
    uses the tool results both count)."""
    segs = render(messages, add_generation_prompt=False, **kw)
    return segments_ids_mask(enc, segs, last_user_index(messages) + 1)
