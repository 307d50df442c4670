"""Per-op time from a regflow timeline (`bench_gpu_gpt2 --trace PATH`): sums each op type's
slices (the part of an actor's name before ':') over the pieces given, and prints the
ops that took most, in ms per piece, with their share of the total. (Not named
profile.py: that would shadow the standard library module torch imports.)

    python3 benches/gpu/op_profile.py TRACE.json [--pieces 1,2] [--top 25]

On `cuda` (runtime/src/device/cuda.rs) a trace has, beside each stream's host row (the
launches), a `gpu` row of when the GPU ran each kernel, timed by CUDA events while the
stream runs as untraced. Then the per-op sums are of those device slices (ops that ran
on the host, with no device slice, are listed apart), and per piece the script prints
the span from its first kernel's start to its last kernel's end, the time some stream of
the GPU was busy (the union of the device slices), each row's busy time, and the gaps:
an overlap of streams shows as busy time summed over rows above the union. With
`REGFLOW_CUDA_TRACE=serial` (each kernel alone, waited for) or on other devices there
are only host slices, and those are summed.
"""

import argparse
import collections
import json


def union_length(intervals):
    """Total length covered by (start, end) intervals."""
    total, reach = 0.0, None
    for start, end in sorted(intervals):
        if reach is None or start > reach:
            total += end - start
            reach = end
        elif end > reach:
            total += end - reach
            reach = end
    return total


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("trace")
    parser.add_argument("--pieces", default="", help="comma-separated pieces (steps) to count; all when empty")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    with open(args.trace) as f:
        events = json.load(f)["traceEvents"]
    rows = {e["tid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "thread_name"}
    wanted = {int(p) for p in args.pieces.split(",") if p}
    slices = [e for e in events if e.get("ph") == "X"]
    slices = [e for e in slices if not wanted or e.get("args", {}).get("piece", 0) in wanted]
    gpu = [e for e in slices if e.get("cat") == "gpu"]
    on_gpu = {(e["name"], e["args"].get("piece", 0)) for e in gpu}
    # Host slices of kernels the GPU also ran are launches; the others ran on the host.
    host = [e for e in slices if e.get("cat") != "gpu" and (e["name"], e.get("args", {}).get("piece", 0)) not in on_gpu]
    pieces = sorted({e.get("args", {}).get("piece", 0) for e in slices})
    if not pieces:
        raise SystemExit(f"{args.trace}: no slices for pieces {sorted(wanted)}")
    n = len(pieces)

    def table(title, chosen):
        time, count = collections.Counter(), collections.Counter()
        for e in chosen:
            op = e["name"].split(":")[0]
            time[op] += e["dur"]
            count[op] += 1
        total = sum(time.values())
        print(f"{total / n / 1e3:.1f} ms of {title} per piece over {n} piece(s) {pieces}")
        for op, us in time.most_common(args.top):
            print(f"{us / n / 1e3:9.2f} ms {100 * us / max(total, 1e-9):5.1f} %  {count[op] // n:5d}x  {op}")

    if not gpu:
        table("slices", host)
        return
    table("kernels on the GPU", gpu)
    if host:
        table("host-run kernels (no device slice)", host)
    print("per piece: span (first kernel start to last kernel end), GPU busy (union of all rows), per row busy")
    for piece in pieces:
        mine = [(e["ts"], e["ts"] + e["dur"], e["tid"]) for e in gpu if e["args"].get("piece", 0) == piece]
        if not mine:
            continue
        span = max(end for _, end, _ in mine) - min(start for start, _, _ in mine)
        busy = union_length([(s, e) for s, e, _ in mine])
        per_row = collections.defaultdict(list)
        for s, e, tid in mine:
            per_row[tid].append((s, e))
        row_text = ", ".join(
            f"{rows.get(tid, tid)} {union_length(iv) / 1e3:.2f}" for tid, iv in sorted(per_row.items())
        )
        print(f"  piece {piece}: span {span / 1e3:.2f} ms, busy {busy / 1e3:.2f} ms ({100 * busy / max(span, 1e-9):.1f} %); {row_text}")


if __name__ == "__main__":
    main()
