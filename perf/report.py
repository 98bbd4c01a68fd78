"""Print the Markdown tables of docs/performance.md from perf/results/*.json.

python perf/report.py perf/results
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _f(x, nd=1):
    return "–" if x is None else f"{x:.{nd}f}"


def _breakdown(items):
    """``--breakdown``: where the worker threads spent their time (seconds summed over threads)."""
    items = [(label, res) for label, res in items if "breakdown" in res]
    if not items:
        return
    print("| run | wall s | thread-seconds available | in head_metrics | in eigh | in assignments | other in head_metrics | waiting | ms per head: eigh / assignments / other |")
    print("|---|---|---|---|---|---|---|---|---|")
    for label, res in items:
        b = res["breakdown"]
        other = b["head_metrics_seconds"] - b["eigh_seconds"] - b["assignment_seconds"]
        wait = b["thread_seconds_available"] - b["head_metrics_seconds"]
        per_head = " / ".join(f"{1000 * t / res['heads']:.2f}" for t in (b["eigh_seconds"], b["assignment_seconds"], other))
        print(
            f"| {label} | {res['seconds']:.1f} | {b['thread_seconds_available']:.1f} | {b['head_metrics_seconds']:.1f} | "
            f"{b['eigh_seconds']:.1f} | {b['assignment_seconds']:.1f} | {other:.1f} | {wait:.1f} | {per_head} |"
        )
    print()


def stage(r):
    print(f"loadavg 1 min at start / end: {r['environment']['loadavg_1min_at_start']} / {r['environment']['loadavg_1min_at_end']}\n")
    print("| variant | method | heads | seconds | heads/s | peak RSS MB | batched speed-up | max abs diff vs batched | same dropped heads (paper) or bit-identical (corrected) |")
    print("|---|---|---|---|---|---|---|---|---|")
    argv = r.get("argv", [])
    workers = argv[argv.index("--threads") + 1] if "--threads" in argv else "2"
    for row in r["rows"]:
        b = row["batched"]
        print(f"| {row['variant']} | batched, {workers} worker thread(s) x 1 torch thread | {b['heads']} | {_f(b['seconds'])} | {_f(b['heads_per_second'])} | {_f(b['peak_rss_mb'], 0)} | – | – | – |")
        for key, p in row.items():
            if key.startswith("per_head_"):
                same = p.get("bit_identical", p.get("same_dropped_heads"))
                print(
                    f"| {row['variant']} | per-head baseline, {key[9:].replace('thr', ' torch thread(s)')} | {p['heads']} | {_f(p['seconds'])} | {_f(p['heads_per_second'])} | {_f(p['peak_rss_mb'], 0)} | {p['speedup_of_batched']:.2f}x | {p['max_abs_diff']:.1e} | {same} |"
                )
        for key, t in row.items():
            if key.startswith("table1_"):
                print(f"\n{key}: " + ", ".join(f"{k} {v:.6f}" for k, v in t.items()))
    print()
    _breakdown([(f"batched, {row['variant']}", row["batched"]) for row in r["rows"]])


def shapes(r):
    print(f"loadavg 1 min at start / end: {r['environment']['loadavg_1min_at_start']} / {r['environment']['loadavg_1min_at_end']}\n")
    print("| N | d | variant | batched heads/s (heads) | peak RSS MB | per-head 1 thr heads/s | speed-up | per-head 2 thr heads/s | speed-up | max abs diff (1 thr) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for row in r["rows"]:
        b, p1, p2 = row["batched"], row.get("per_head_1thr", {}), row.get("per_head_2thr", {})
        print(
            f"| {row['N']} | {row['d']} | {row['variant']} | {_f(b['heads_per_second'])} ({b['heads']}) | {_f(b['peak_rss_mb'], 0)} | "
            f"{_f(p1.get('heads_per_second'))} | {_f(p1.get('speedup_of_batched'), 2)}x | {_f(p2.get('heads_per_second'))} | {_f(p2.get('speedup_of_batched'), 2)}x | {p1.get('max_abs_diff', float('nan')):.1e} |"
        )
    print()


def table1(r):
    print(f"{r['total_heads']} heads in {r['total_seconds']:.1f} s on {r['device']} ({r['total_heads'] / r['total_seconds']:.1f} heads/s); loadavg {r['environment']['loadavg_1min_at_start']:.2f}\n")
    _breakdown([(row["model"], row) for row in r["rows"]])


def allocator(r):
    print(
        f"{r['activations']}, {r['threads']} worker threads, {r['chunk']} heads per chunk, paper variant; loadavg {r['environment']['loadavg_1min_at_start']:.2f} / {r['environment']['loadavg_1min_at_end']:.2f}\n"
    )
    print("| glibc setting | layers | heads | seconds | peak RSS MB |\n|---|---|---|---|---|")
    for row in r["rows"]:
        print(f"| {row['mode']} | {row['layers']} | {row['heads']} | {row['seconds']:.1f} | {row['peak_rss_mb']:.0f} |")
    print()


def chain(r):
    print(
        f"{r['tree']}: {' '.join(r['targets'])} in {r['wall_seconds']:.1f} s (cores {r['cores']}); loadavg {r['environment']['loadavg_1min_at_start']:.2f} / {r['environment']['loadavg_1min_at_end']:.2f}\n"
    )
    print("| job | seconds | max RSS MB |\n|---|---|---|")
    for name, v in r["rules"].items():
        print(f"| {name} | {v['seconds']:.1f} | {v['max_rss_mb']:.0f} |")
    jobs = sum(v["seconds"] for v in r["rules"].values())
    print(f"| Snakemake itself (wall minus the jobs) | {r['wall_seconds'] - jobs:.1f} | |")
    print()


def authors(r):
    t = r["table1"]
    print(
        f"authors' structure, {r['spec']['model']} x {r['spec']['images']} images: {r['wall_seconds']:.1f} s wall, {r['cpu_seconds']:.1f} CPU-s, {r['heads']} heads, "
        f"{r['torch_threads']} torch threads; MDC {t['MDC']:.6f} MOC {t['MOC']:.6f} LCKA {t['LCKA']:.6f} KCKA {t['KCKA']:.6f}\n"
    )


def extract(r):
    print("| tree | repeat | images | seconds | CPU-s | images/s | peak RSS MB |\n|---|---|---|---|---|---|---|")
    for row in r["rows"]:
        print(f"| {row['tree']} | {row['repeat']} | {row['images']} | {row['seconds']:.2f} | {row['cpu_seconds']:.2f} | {row['images_per_second']:.1f} | {row['peak_rss_mb']:.0f} |")
    print()


def concurrent(r):
    print("| GOMP_SPINCOUNT | processes | wall s | seconds per process | heads per process |\n|---|---|---|---|---|")
    for row in r["rows"]:
        per = row["per_process"]
        seconds = " / ".join(f"{p['seconds']:.1f}" for p in per)
        print(f"| {row['gomp_spincount']} | {row['processes']} | {row['wall_seconds']:.1f} | {seconds} | {per[0]['heads']} |")
    print()


def memory(r):
    print("| model | images | extraction s | extraction peak RSS MB | KPCA layers | KPCA s | KPCA peak RSS MB | HDF5 MB |\n|---|---|---|---|---|---|---|---|")
    for row in r["rows"]:
        print(
            f"| {row['model']} | {row['images']} | {row['extract_seconds']:.0f} | {row['extract_peak_rss_mb']:.0f} | {row['kpca_layers']} | {row['kpca_seconds']:.0f} | {row['kpca_peak_rss_mb']:.0f} | {row['h5_mb']:.0f} |"
        )
    print()


def ab(r):
    print(f"{r['variant']} variant, {r['heads']} heads x {r['repeats']} repeats, chunks of {r['chunk']}, eigh threads {r['eigh_threads']}, other tree {r['tree']}\n")
    print("| tree | head_metrics ms/head | eigh | assignments | everything else |\n|---|---|---|---|---|")
    for name, ms in r["ms_per_head"].items():
        print(f"| {name} | {ms['total']:.2f} | {ms['eigh']:.2f} | {ms['assignment']:.2f} | {ms['everything_else']:.2f} |")
    diff = max(r["max_abs_diff"].values(), default=0.0)
    print(f"\nlargest per-head difference between the trees: {diff:.1e}\n")


for path in sorted(Path(sys.argv[1]).glob("*.json")):
    r = json.loads(path.read_text())
    print(f"### {path.name}\n")
    globals()[r["command"]](r)
