"""Read a py-spy speedscope profile (recorded with --idle at 100 Hz, as calls 1-2 did): the main thread of its
process with the most samples (or of the process named by --process), as a timeline of the first listed pattern
each sample's stack holds, runs shorter than --min seconds left out; --imports instead sums its samples by the
modules being imported, outermost first, to the given depth, up to the first sample inside the trainer's init.

    mkdir -p /tmp/p && tar xf bench/results/2026-12-01-session31/call1/profiles.tar -C /tmp/p
    python bench/results/2026-12-01-session31/phases.py /tmp/p/1-gt.speedscope.json.gz \\
        materialize,_trace@fx_trace,expand@block_template,reshard_after_forward,transformer_block_bucketing,inductor_decomposition,boxed
    python bench/results/2026-12-01-session31/phases.py /tmp/p/0-titan.speedscope.json.gz --imports 3
    python bench/results/2026-12-01-session31/phases.py bench/results/2026-12-01-session31/call2/gt1.speedscope.json.gz \\
        _warm_up,Future.result,GraphLowering.codegen,decompose --process 1506 --min 0.2
"""
import argparse
import collections
import gzip
import json

parser = argparse.ArgumentParser()
parser.add_argument("profile")
parser.add_argument("patterns", nargs="?", default="")
parser.add_argument("--process", default="")
parser.add_argument("--min", type=float, default=0.05)
parser.add_argument("--imports", type=int, default=0)
a = parser.parse_args()
data = json.loads(gzip.decompress(open(a.profile, "rb").read()))
frames = data["shared"]["frames"]
threads = [p for p in data["profiles"] if a.process in p["name"] and ("MainThread" in p["name"] or '""' in p["name"])]
samples = max(threads, key=lambda p: len(p["samples"]))["samples"]
SECONDS = 0.01


def names(sample):
    return [f"{frames[i]['name']}@{frames[i]['file'].rsplit('/', 1)[-1]}" for i in sample]


if a.imports:
    init = next((k for k, s in enumerate(samples) if any(n.startswith(("GraphTrainer.__init__", "Trainer.__init__")) for n in names(s))),
                len(samples))
    total = collections.Counter()
    for s in samples[:init]:
        modules = [frames[i]["file"].split("site-packages/")[-1] for i in s if frames[i]["name"] == "<module>"]
        for depth, module in enumerate(modules[: a.imports]):
            total[" " * depth + module] += 1
    print(f"{init * SECONDS:.2f} s before the trainer's init")
    for module, n in total.most_common(25):
        print(f"{n * SECONDS:6.2f} {module}")
else:
    patterns = a.patterns.split(",")
    runs, t = [], 0.0
    for s in samples:
        stack = names(s)
        label = next((p for p in patterns if any(p in n for n in stack)), "other")
        if runs and runs[-1][2] == label:
            runs[-1][1] = t + SECONDS
        else:
            runs.append([t, t + SECONDS, label])
        t += SECONDS
    for start, end, label in runs:
        if end - start >= a.min and label != "other":
            print(f"{start:6.2f}-{end:6.2f} s {label}")
