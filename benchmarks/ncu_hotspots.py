"""Where a kernel's instructions go, from Nsight Compute's per-instruction source counters: per kernel, the
executed-instruction mix by opcode and the hottest straight-line runs of SASS (consecutive instructions executed
the same number of times: a loop body or a branch arm), each with its opcode mix and its memory / tensor-core
instructions, so that a run can be matched to the source loop it comes from.

On the GPU machine (the fused attention's table kernels, one forward+backward):

    ncu -k regex:"(fwd|dq|dkv)_onehot" --launch-count 3 --section SourceCounters -o rep \\
        python3 benchmarks/profile_fused_forward.py --once --rel-pos --window 12 --heads 4x32
    ncu -i rep.ncu-rep --page source --csv --print-source sass > src.csv
    python3 benchmarks/ncu_hotspots.py src.csv [--top 16]

(`NCU_KERNELS=<regex> bash benchmarks/device_run.sh` runs these three after its tests and benchmarks.)
The CSV holds one "Kernel Name" line per kernel, then a header line ("Address", "Source", ... "Instructions
Executed", ...) and one line per SASS instruction.
"""
import argparse
import collections
import csv
import re

MARKERS = ("HMMA", "LDSM", "LDS", "STS", "LD.", "ST.", "LDG", "STG", "SHFL", "BAR", "MUFU", "RED", "ATOM")


def read_kernels(path):
    """[(kernel name, [instruction dict])], in file order, a kernel's repeated sections dropped."""
    kernels, header, seen = [], None, set()
    with open(path, newline="") as f:
        for row in csv.reader(f):
            if not row:
                continue
            if row[0] == "Kernel Name":
                match = re.search(r"::(\w+)<([^>]*)>", row[1])
                name = f"{match.group(1)}<{match.group(2)}>" if match else row[1]
                kernels.append([name, []])
            elif row[0] == "Address":
                header = row
            elif kernels and header and len(row) == len(header):
                kernels[-1][1].append(dict(zip(header, row)))
    unique = []
    for name, instrs in kernels:
        if name not in seen:
            seen.add(name)
            unique.append((name, instrs))
    return unique


def count(value):
    try:
        return float(value.replace(",", ""))
    except (AttributeError, ValueError):
        return 0.0


def opcode(source):
    words = [w for w in source.split() if not w.startswith("@")]
    return words[0].split(".")[0] if words else ""


def runs(instrs):
    """(executed instructions, first, end) of each straight-line run of equal execution counts."""
    out, start = [], 0
    for n in range(1, len(instrs) + 1):
        if n == len(instrs) or count(instrs[n]["Instructions Executed"]) != count(instrs[start]["Instructions Executed"]):
            out.append((count(instrs[start]["Instructions Executed"]) * (n - start), start, n))
            start = n
    return sorted(out, reverse=True)


def report(name, instrs, top):
    total = sum(count(i["Instructions Executed"]) for i in instrs) or 1.0
    mix = collections.Counter()
    for i in instrs:
        mix[opcode(i["Source"])] += count(i["Instructions Executed"])
    lines = [f"== {name}: {len(instrs)} SASS instructions, {total:.3g} warp instructions executed",
             "   mix: " + ", ".join(f"{op} {n / total:.0%}" for op, n in mix.most_common(12))]
    for executed, first, end in runs(instrs)[:top]:
        ops = collections.Counter(opcode(instrs[x]["Source"]) for x in range(first, end))
        marks = [instrs[x]["Source"].strip() for x in range(first, end)
                 if any(m in instrs[x]["Source"] for m in MARKERS)][:3]
        lines.append(f"   {executed / total:5.1%}  [{first}, {end}) x{count(instrs[first]['Instructions Executed']):.0f}"
                     f"  {dict(ops.most_common(4))}  {marks}")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("csv", help="ncu --page source --csv --print-source sass output")
    ap.add_argument("--top", type=int, default=16, help="hottest runs listed per kernel")
    args = ap.parse_args(argv)
    for name, instrs in read_kernels(args.csv):
        print(report(name, instrs, args.top))


if __name__ == "__main__":
    main()
