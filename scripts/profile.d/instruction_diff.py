"""Where two callgrind profiles of agent-server differ, by function, per unit of work.

    instruction_diff.py FLAT_BASE FLAT_OTHER UNITS

FLAT_* are `callgrind_annotate --inclusive=no` outputs of the same load (the bench's tool
loop at 300 runs, 3,000 tool iterations) in memory and with another state; UNITS divides
the differences. Start-up is in both and cancels out. Prints the total difference and the
functions that account for most of it.
"""
import re
import sys

LINE = re.compile(r"^\s*([0-9,]+) \([^)]*\)\s+(.*)$")


def load(path):
    counts = {}
    with open(path) as f:
        for line in f:
            m = LINE.match(line)
            if not m or "PROGRAM TOTALS" in m.group(2):
                continue
            name = m.group(2).strip()
            counts[name] = counts.get(name, 0) + int(m.group(1).replace(",", ""))
    return counts


base, other, units = load(sys.argv[1]), load(sys.argv[2]), int(sys.argv[3])
diff = sorted(
    ((other.get(k, 0) - base.get(k, 0), k) for k in set(base) | set(other)), reverse=True
)
print(f"instructions per tool iteration more than in memory: {sum(d for d, _ in diff) / units:,.0f}")
for d, name in diff[:12]:
    print(f"{d / units:10,.0f}  {name[:110]}")
