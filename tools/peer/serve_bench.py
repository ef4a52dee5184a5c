"""Load generator for OpenAI-compatible servers (k3 serve, llama-cpp-python's server): C concurrent
streams, each sending R streaming /v1/completions requests one after another (greedy, max_tokens M,
a different prompt per request), and the aggregate generated t/s, time to first token and
inter-token latency (p50/p99) of the run. Used by scripts/peer_serve.sh.

Tokens: the `usage.completion_tokens` of the final chunk when the server sends one
(stream_options.include_usage), else the number of chunks that carried text (llama-cpp-python streams
one chunk per token). TTFT: from sending the request to its first chunk with text. ITL: the gaps
between successive chunks with text of one request.

    python tools/peer/serve_bench.py --url http://127.0.0.1:8080 --streams 1,4,16 --requests 4 \
        --max-tokens 64 --prompts FILE --out result.json
"""
import argparse
import json
import statistics
import threading
import time

import httpx


def percentile(xs, q):
    if not xs:
        return None
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def one_request(client, url, model, prompt, max_tokens, extra):
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, **extra}
    t0 = time.perf_counter()
    first = None
    times = []
    usage_tokens = None
    text_chunks = 0
    with client.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.read()[:200]!r}")
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data.strip() == "[DONE]":
                break
            j = json.loads(data)
            if j.get("usage"):
                usage_tokens = j["usage"].get("completion_tokens")
            for ch in j.get("choices") or []:
                if ch.get("text"):
                    now = time.perf_counter()
                    if first is None:
                        first = now
                    times.append(now)
                    text_chunks += 1
    end = time.perf_counter()
    itl = [b - a for a, b in zip(times, times[1:])]
    return {"ttft": (first - t0) if first else None, "itl": itl, "tokens": usage_tokens or text_chunks,
            "start": t0, "end": end}


def run_level(url, model, prompts, streams, requests, max_tokens, extra):
    results, errors = [], []
    lock = threading.Lock()
    prompt_iter = iter(range(streams * requests))

    def worker():
        with httpx.Client() as client:
            for _ in range(requests):
                with lock:
                    i = next(prompt_iter)
                try:
                    r = one_request(client, url, model, prompts[i % len(prompts)], max_tokens, extra)
                    with lock:
                        results.append(r)
                except Exception as e:  # noqa: BLE001 (recorded, the run continues)
                    with lock:
                        errors.append(str(e))

    threads = [threading.Thread(target=worker) for _ in range(streams)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    tokens = sum(r["tokens"] for r in results)
    ttft = [r["ttft"] for r in results if r["ttft"] is not None]
    itl = [x for r in results for x in r["itl"]]
    return {
        "streams": streams, "requests": len(results), "errors": errors[:5], "error_count": len(errors),
        "wall_s": round(wall, 3), "generated_tokens": tokens,
        "aggregate_tps": round(tokens / wall, 2) if wall > 0 else None,
        "ttft_p50_ms": round(1e3 * percentile(ttft, 0.5), 2) if ttft else None,
        "ttft_p99_ms": round(1e3 * percentile(ttft, 0.99), 2) if ttft else None,
        "itl_p50_ms": round(1e3 * percentile(itl, 0.5), 3) if itl else None,
        "itl_p99_ms": round(1e3 * percentile(itl, 0.99), 3) if itl else None,
        "mean_tokens_per_request": round(statistics.mean(r["tokens"] for r in results), 1) if results else None,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", required=True)
    ap.add_argument("--model", default="k3-nano")
    ap.add_argument("--streams", default="1,4,16")
    ap.add_argument("--requests", type=int, default=4, help="requests per stream (default 4)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompts", required=True, help="one prompt per line")
    ap.add_argument("--warmup", type=int, default=2, help="requests before the timed levels")
    ap.add_argument("--extra", default="{}", help="JSON object merged into every request body")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    prompts = [p for p in open(args.prompts, encoding="utf-8").read().splitlines() if p.strip()]
    extra = json.loads(args.extra)
    with httpx.Client() as c:
        for i in range(args.warmup):
            one_request(c, args.url, args.model, prompts[-1 - i], args.max_tokens, extra)
    levels = [run_level(args.url, args.model, prompts, int(s), args.requests, args.max_tokens, extra)
              for s in args.streams.split(",")]
    json.dump({"url": args.url, "max_tokens": args.max_tokens, "requests_per_stream": args.requests,
               "levels": levels}, open(args.out, "w"), indent=2)
    for lv in levels:
        print(f"streams {lv['streams']:>3}: {lv['aggregate_tps']} t/s, TTFT p50 {lv['ttft_p50_ms']} ms "
              f"p99 {lv['ttft_p99_ms']} ms, ITL p50 {lv['itl_p50_ms']} ms p99 {lv['itl_p99_ms']} ms, "
              f"{lv['requests']} requests, {lv['error_count']} errors")


if __name__ == "__main__":
    main()
