"""Sums `perf report --sort dso,sym` lines by where the samples fall: scripts/profile cpu."""

import re
import sys

# First match wins: kernel symbols by subsystem, then user space by crate.
CATEGORIES = [
    ("kernel: scheduler, futex, epoll (threads waking and sleeping)",
     r"\[k\] (finish_task_switch|__schedule|schedule|futex|do_epoll|ep_|_raw_spin|try_to_wake|"
     r"select_task|enqueue|dequeue|update_curr|psi_|pick_next|__switch_to|sched_|wake_up|"
     r"__wake|autoremove|default_wake|ttwu|available_idle|set_next|put_prev|update_load|"
     r"reweight|check_preempt|resched|hrtimer|ktime)"),
    ("kernel: TCP over loopback, syscalls, other", r"\[k\]"),
    ("HTTP/2 (h2), hyper, tonic, http, bytes, tower", r" h2::|hyper|tonic|\bhttp::|bytes::|tower|axum"),
    ("allocator (mimalloc) and memcpy", r"\b_?mi_|__mem(move|cpy|set)|memcmp"),
    ("tokio's scheduler", r"tokio::|tokio_util"),
    ("serde_json", r"serde_json|serde_core|itoa|ryu"),
    ("agentrt's own code, jsonschema", r"agentrt|sse_stream|jsonschema|referencing|regex"),
    ("protobuf (prost), tracing", r"prost|tracing"),
    ("libc, std, hashing and the rest", r"."),
]


def summarize(report, processes):
    """Shares by category, per process: `processes` maps a thread id to its process."""
    shares = {name: {c: 0.0 for c, _ in CATEGORIES} for name in set(processes.values())}
    with open(report) as lines:
        for line in lines:
            match = re.match(r"\s*([\d.]+)%\s+(\d+):\S+\s+(\S+)\s+(.*)", line)
            if not match or match.group(2) not in processes:
                continue
            share = float(match.group(1))
            where = match.group(3) + " " + match.group(4)
            for category, pattern in CATEGORIES:
                if re.search(pattern, where):
                    shares[processes[match.group(2)]][category] += share
                    break
    return shares


def main():
    report, *named = sys.argv[1:]
    processes, names = {}, []
    for argument in named:
        name, tids = argument.split("=", 1)
        names.append(name)
        with open(tids) as listing:
            processes.update({tid.strip(): name for tid in listing if tid.strip()})
    shares = summarize(report, processes)
    print("| samples in | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    for category, _ in CATEGORIES:
        cells = []
        for name in names:
            total = sum(shares[name].values()) or 1.0
            cells.append(f"{shares[name][category] * 100 / total:.0f}%")
        print(f"| {category} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
