#!/usr/bin/env python3
"""table.py: prints compare.sh's results as a Markdown table, a row per cell and round.

Reads OUT/r<round>-<dtype>-{kvb.json,pp.json,tg.json,bb.jsonl} (compare.sh writes them).
Columns: tok/s of each engine (best of the 2 repetitions of kvbridge and of
llama-bench's decode; llama.cpp's prefill and llama-batched-bench run once), kvbridge ÷ llama.cpp, the read bandwidth
kvbridge probed beside the cell (mean over its repetitions), and each engine's ratio:
- kvbridge: its own probed ratio (bench engine's summary line; prefill: ÷ its compute peak).
- llama.cpp, batch 1: (GGUF tensor bytes + KV bytes of the mean context) × tok/s ÷ the
  probed bandwidth, KV bytes a token = layers · 2 · kv_heads · head_dim · the KV type's size.
- llama.cpp, batch 8 and 32: tok/s ÷ kvbridge's step bound for the cell (weights, KV and
  compute at the probed bandwidth and the measured peaks; kvbridge's weight bytes).
- llama.cpp, prefill: kvbridge's FLOPs a prompt token × tok/s ÷ the peak kvbridge divides by.
Needs python3 only. Usage: table.py OUT
"""
import glob
import json
import os
import re
import sys

LAYERS, KV_HEADS, HEAD_DIM = 28, 8, 128
KV_SIZE = {"f16": 2, "bf16": 2, "f32": 4}


def mean(xs):
    return sum(xs) / len(xs)


def load(out, r, dt):
    p = os.path.join(out, f"r{r}-{dt}-")
    with open(p + "kvb.json") as f:
        kvb = json.load(f)["runs"][0]
    with open(p + "pp.json") as f:
        pp = json.load(f)
    with open(p + "tg.json") as f:
        tg = json.load(f)
    with open(p + "bb.jsonl") as f:
        bb = [json.loads(line) for line in f if line.startswith("{")]
    return kvb, pp, tg, bb


def rows(kvb, pp, tg, bb):
    """Yields (cell, kvbridge tok/s, llama.cpp tok/s, probe GB/s, kvb ratio, llama ratio)."""
    n_prompt = 1024
    peak = kvb["prefill_gflops"] / kvb["prefill_peak_ratio"]
    flops_tok = kvb["prefill_flops"] / n_prompt
    lp = max(pp[0]["samples_ts"])
    yield ("prefill 1024", kvb["prefill_tokens_per_s"], lp, None,
           kvb["prefill_peak_ratio"], flops_tok * lp / 1e9 / peak)

    by_depth = {t["n_depth"]: t for t in tg}
    b1 = next(b for b in kvb["batched"] if b["batch"] == 1)
    cells = [("b1 after 1024", 1024, kvb["decode_tokens_per_s"], kvb["decode_reps"],
              kvb["decode_probed_ratio"]),
             ("b1 ctx 128", 128, b1["tokens_per_s"], b1["reps"], b1["probed_ratio"])]
    for name, depth, kts, reps, kratio in cells:
        t = by_depth[depth]
        lts = max(t["samples_ts"])
        gbps = mean([x["read_gbps"] for x in reps])
        kv_tok = LAYERS * 2 * KV_HEADS * HEAD_DIM * KV_SIZE[t["type_k"]]
        nbytes = t["model_size"] + kv_tok * (depth + t["n_gen"] / 2)
        yield name, kts, lts, gbps, kratio, nbytes * lts / (gbps * 1e9)

    speed = {x["pl"]: x["speed_tg"] for x in bb}
    for b in kvb["batched"]:
        if b["batch"] == 1 or b["batch"] not in speed:
            continue
        bound = mean([x["tokens_per_s"] / x["ratio"] for x in b["reps"]])
        gbps = mean([x["read_gbps"] for x in b["reps"]])
        lts = speed[b["batch"]]
        yield f"b{b['batch']} ctx 128", b["tokens_per_s"], lts, gbps, b["probed_ratio"], lts / bound


def main():
    out = sys.argv[1]
    found = {}
    for p in glob.glob(os.path.join(out, "r*-*-kvb.json")):
        m = re.match(r"r(\d+)-(\w+)-kvb\.json", os.path.basename(p))
        found.setdefault(m.group(2), []).append(int(m.group(1)))
    for dt in ("bfloat16", "int8", "float32"):
        if dt not in found:
            continue
        print(f"\n{dt}\n")
        print("| cell | round | kvbridge tok/s | llama.cpp tok/s | kvbridge ÷ llama.cpp "
              "| probe GB/s | kvbridge ratio | llama.cpp ratio |")
        print("|---|---|---|---|---|---|---|---|")
        table = {}
        for r in sorted(found[dt]):
            try:
                for row in rows(*load(out, r, dt)):
                    table.setdefault(row[0], []).append((r,) + row[1:])
            except (OSError, StopIteration, KeyError, IndexError, ValueError) as e:
                print(f"| round {r}: incomplete ({e!r}) |")
        for cell, rs in table.items():
            for r, kts, lts, gbps, kr, lr in rs:
                g = "–" if gbps is None else f"{gbps:.1f}"
                print(f"| {cell} | {r} | {kts:.1f} | {lts:.1f} | {kts / lts:.2f} | {g} "
                      f"| {kr:.2f} | {lr:.2f} |")


if __name__ == "__main__":
    main()
