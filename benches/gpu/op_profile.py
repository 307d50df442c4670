"""Per-op time from a regflow timeline (`bench_gpu_gpt2 --trace PATH`): sums each op type's
slices (the part of an actor's name before ':') over the pieces given, and prints the
ops that took most, in ms per piece, with their share of the total. (Not named
profile.py: that would shadow the standard library module torch imports.)

    python3 benches/gpu/op_profile.py TRACE.json [--pieces 1,2] [--top 25]

On `cuda` a traced kernel runs alone, so a slice is that kernel's own time plus a launch
and a stream wait (runtime/src/device/cuda.rs).
"""

import argparse
import collections
import json


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("trace")
    parser.add_argument("--pieces", default="", help="comma-separated pieces (steps) to count; all when empty")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    with open(args.trace) as f:
        events = json.load(f)["traceEvents"]
    wanted = {int(p) for p in args.pieces.split(",") if p}
    time, count, pieces = collections.Counter(), collections.Counter(), set()
    for e in events:
        if e.get("ph") != "X":
            continue
        piece = e.get("args", {}).get("piece", 0)
        if wanted and piece not in wanted:
            continue
        pieces.add(piece)
        op = e["name"].split(":")[0]
        time[op] += e["dur"]
        count[op] += 1
    if not pieces:
        raise SystemExit(f"{args.trace}: no slices for pieces {sorted(wanted)}")
    n = len(pieces)
    total = sum(time.values())
    print(f"{total / n / 1e3:.1f} ms of slices per piece over {n} piece(s) {sorted(pieces)}")
    for op, us in time.most_common(args.top):
        print(f"{us / n / 1e3:9.2f} ms {100 * us / total:5.1f} %  {count[op] // n:5d}x  {op}")


if __name__ == "__main__":
    main()
