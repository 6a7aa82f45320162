"""Summarizes py-spy's raw output (`py-spy record --format raw`: one `frame;frame;... count`
line per stack) as the busy share of each function, inclusive and self, leaving out the
samples where the event loop waits in select and the executor threads wait for work.

    python -m benchmarks.spy_summary api.txt [--top 40]
"""

from __future__ import annotations

import argparse
import re
from collections import Counter
from pathlib import Path

IDLE = (".select (selectors", "_worker (concurrent", ".wait (threading", "._recv (multiprocess")
PREFIXES = re.compile(r"\(/\S*?/(?:site-packages|lib/python3\.\d+)/|\(\S*?/(?=pypto_serving/)")


def summarize(path: Path) -> tuple[int, Counter, Counter]:
    inclusive: Counter = Counter()
    own: Counter = Counter()
    busy = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = [PREFIXES.sub("(", f) for f in stack.split(";")]
        if any(w in frames[-1] for w in IDLE):
            continue
        n = int(count)
        busy += n
        for frame in dict.fromkeys(frames):  # a recursive frame counts once
            inclusive[frame] += n
        own[frames[-1]] += n
    return busy, inclusive, own


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("raw", type=Path)
    p.add_argument("--top", type=int, default=40)
    args = p.parse_args(argv)
    busy, inclusive, own = summarize(args.raw)
    print(f"busy samples: {busy}")
    for title, counts in (("inclusive", inclusive), ("self", own)):
        print(f"-- {title}")
        for frame, n in counts.most_common(args.top):
            print(f"{n / max(busy, 1):6.1%}  {frame[:140]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
