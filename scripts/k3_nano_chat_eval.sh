#!/usr/bin/env bash
# Writes docs/data/k3-nano-chat-eval.json: the chat acceptance figures of the bundled K3-nano (issue 17
# part 3) and its raw-text perplexity before and after the chat fine-tune.
#  - chat: runs the GoogleTest tests/cli/test_k3_nano_chat.cpp (greedy replies, at most 256 tokens,
#    fast numerics, through the runtime chat path ChatSession and the engine's output parser) on the 50
#    held-out questions and the held-out tool prompts of tests/fixtures/k3-nano-chat/, with
#    K3_NANO_CHAT_JSON set so it writes its counts and every reply;
#  - perplexity: `k3 eval --ctx 512 --stride 512 --numerics exact` on build/corpus/valid.txt (the
#    protocol of scripts/k3_nano_eval.sh; needs models/k3-nano/CORPUS.md steps 1-3), compared with the
#    pre-fine-tune model's figure (docs/data/k3-nano-eval.json at commit 461ee07: 23.518041);
#  - the fine-tune's own record: docs/data/k3-nano-chat-train-log.jsonl.
# Usage: scripts/k3_nano_chat_eval.sh [BUILD_DIR]   (default build; configured with K3_BUILD_TESTS=ON)
# ENGINE_JSON=FILE reuses a `k3 eval --json` result already made (the exact eval takes ~20 min on 2 cores).
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
cmake -S . -B "$build" -DK3_BUILD_TESTS=ON >/dev/null
cmake --build "$build" -j"$(nproc)" --target k3cli test_k3_nano_chat >/dev/null
chat_json=$(mktemp)
trap 'rm -f "$chat_json"' EXIT
# The test's assertions decide the exit status after the JSON is written: keep going to record a failure too.
K3_NANO_CHAT_JSON=$chat_json "$build/tests/cli/test_k3_nano_chat" --gtest_filter='K3NanoChat.*' | grep -E '^(questions|tool prompts):|^\[  (PASSED|FAILED)' || true
engine=${ENGINE_JSON:-$build/k3-nano-eval-engine.json}
if [[ -z ${ENGINE_JSON:-} ]]; then
  "$build/bin/k3" eval -m models/k3-nano -f build/corpus/valid.txt --ctx 512 --stride 512 --numerics exact --json "$engine"
fi
python3 - "$chat_json" "$engine" <<'PY'
import datetime, hashlib, json, subprocess, sys
chat, e = (json.load(open(p)) for p in sys.argv[1:3])
before = {"perplexity": 23.518041456385944, "nll_sum": 639372.2028222234, "tokens_scored": 202476,
          "source": "docs/data/k3-nano-eval.json at commit 461ee07 (the model before the chat fine-tune, "
                    "same protocol, engine, numerics exact)"}
assert e["tokens_scored"] == before["tokens_scored"] and e["ctx"] == 512 and e["stride"] == 512
log = [json.loads(l) for l in open("docs/data/k3-nano-chat-train-log.jsonl")]
start = next(r for r in log if r.get("event") == "start")
done = next(r for r in log if r.get("event") == "done")
cpu = subprocess.run("lscpu | sed -n 's/^Model name: *//p' | head -1", shell=True, capture_output=True, text=True).stdout.strip()
shards = {f"model-0000{i}-of-00003.safetensors": hashlib.sha256(open(f"models/k3-nano/model-0000{i}-of-00003.safetensors", "rb").read()).hexdigest()
          for i in (1, 2, 3)}
q, t = chat["questions"], chat["tool_prompts"]
out = {
    "command": "bash scripts/k3_nano_chat_eval.sh",
    "date": datetime.date.today().isoformat(),
    "machine": f"{cpu}, 2 cores (dev machine)",
    "model": {"dir": "models/k3-nano", "sha256": shards,
              "made_by": "tools/train/finetune_chat.py (fine-tune, then --merge-from ... --alpha 0.7: "
                         "base + 0.7 x (fine-tuned - base)); models/k3-nano/README.md 'Chat fine-tune'"},
    "chat": {
        "how": "tests/cli/test_k3_nano_chat.cpp: ChatSession (runtime chat path), greedy (temperature 0), at most "
               f"{chat['max_tokens_per_reply']} tokens per reply, numerics fast; prompts of documents held out of "
               "the fine-tune (tests/fixtures/k3-nano-chat/)",
        "questions": q,
        "closed_thinking": chat["closed_thinking"],
        "closed_thinking_and_answered": chat["closed_thinking_and_answered"],
        "answered_fraction": chat["closed_thinking_and_answered"] / q,
        "ended_message_within_limit": chat["ended_message"],
        "tool_prompts": t,
        "well_formed_tool_calls": chat["well_formed_tool_calls"],
        "well_formed_fraction": chat["well_formed_tool_calls"] / t,
        "well_formed_tool_calls_strict": chat["well_formed_tool_calls_strict"],
        "criteria": {"answered_fraction": ">= 0.90 (closed thinking, or a non-thinking prompt, and a non-empty answer)",
                     "well_formed_fraction": ">= 0.80 (a closed call of a declared tool, JSON-object arguments with "
                                             "the schema's required keys; strict also checks names, types and enums)"},
        "generated_tokens": chat["generated_tokens"],
        "seconds": chat["seconds"],
    },
    "perplexity": {
        "protocol": "k3 eval -f build/corpus/valid.txt --ctx 512 --stride 512 --numerics exact (202,476 tokens scored)",
        "before": before,
        "after": {"perplexity": e["perplexity"], "nll_sum": e["nll_sum"], "tokens_scored": e["tokens_scored"]},
        "ratio": e["perplexity"] / before["perplexity"],
        "criterion": "moves by at most 10%",
    },
    "fine_tune": {
        "log": "docs/data/k3-nano-chat-train-log.jsonl",
        "device": start["device"] + " (one NVIDIA H200), torch " + start["torch"],
        "steps": done["steps"], "tokens": done["tokens"], "train_seconds": done["train_seconds"],
        "conversations": start["conversations"], "trained_chat_tokens": start["trained_chat_tokens"],
        "raw_replay_tokens": start["raw_tokens"], "args": start["args"],
    },
    "replies": chat["replies"],
}
json.dump(out, open("docs/data/k3-nano-chat-eval.json", "w"), indent=1, ensure_ascii=False)
open("docs/data/k3-nano-chat-eval.json", "a").write("\n")
print(json.dumps({k: out[k] for k in ("chat", "perplexity")}, indent=1))
PY
