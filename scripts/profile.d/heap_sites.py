"""Sums heaptrack's peak memory by allocation site, per run in flight: scripts/profile heap.

Reads `heaptrack_print --print-flamegraph FILE --flamegraph-cost-type peak` (one line per
stack, root first, then its bytes at the peak) and charges each stack to its first frame,
from the allocation up, that is ours or a library's rather than a container's or the
allocator's (`Vec` growth is charged to whoever grew the `Vec`). What one-time
initialisation (`OnceLock`, the tokenizer's tables) holds is shown apart, not per run.
"""

import collections
import re
import sys

# Frames that only move memory around for someone else.
GENERIC = re.compile(
    r"^(<)?(alloc|core|std|hashbrown|slab|bytes|serde_json|serde_core|serde|indexmap|"
    r"smallvec|__|0x|malloc|_dl|<&mut serde)"
)
ONCE = re.compile(r"once_lock::OnceLock|sync::once::Once::|4once5futex")


def clean(frame):
    frame = frame.split(" (")[0]
    frame = re.sub(r"::h[0-9a-f]{16}$", "", frame)
    for old, new in [("$LT$", "<"), ("$GT$", ">"), ("$u20$", " "), ("$C$", ","), ("..", "::"),
                     ("$u7b$$u7b$closure$u7d$$u7d$", "{closure}"), ("$RF$", "&")]:
        frame = frame.replace(old, new)
    return frame.lstrip("_")


def main(stacks, runs, top=25):
    by_site = collections.Counter()
    once = total = 0
    with open(stacks) as lines:
        for line in lines:
            stack, _, cost = line.rstrip("\n").rpartition(" ")
            cost = int(cost) if cost.isdigit() else 0
            if cost <= 0:
                continue
            total += cost
            frames = [clean(f) for f in stack.split(";") if f]
            if any(ONCE.search(f) for f in frames):
                once += cost
                continue
            site = next((f for f in reversed(frames) if not GENERIC.match(f)), frames[-1])
            by_site[site[:110]] += cost
    per_run = (total - once) / runs
    print(f"peak heap {total / 1e6:.1f} MB; once per process (tokenizer tables, OnceLocks) "
          f"{once / 1e6:.1f} MB; the rest per run in flight: {per_run / 1000:.1f} KB")
    for site, cost in by_site.most_common(top):
        print(f"{cost / runs:8.0f} B/run  {site}")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
