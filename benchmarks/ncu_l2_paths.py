"""Which L2 counters see the kernels' loads? Dense forward (N=16K, d=128, H=16), ours and Flex,
under Nsight Compute with every L2-sector source-unit counter this GPU offers, to explain why
``lts__t_sectors_srcunit_tex_op_read`` shows fewer bytes than the tiles the kernels load.

    PYTHONPATH=. python benchmarks/ncu_l2_paths.py [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
WANTED = re.compile(r"^(lts__t_sectors_srcunit_\w+|lts__t_sectors_op_read|lts__t_sectors|l1tex__m_xbar2l1tex_read_bytes"
                    r"|lts__t_sectors_srcnode_gpc\w*|dram__bytes_read|gpu__time_duration)$")


def available(ncu: str) -> list[str]:
    out = subprocess.run([ncu, "--query-metrics", "--chip", "gh100"], capture_output=True, text=True).stdout
    names = {line.split()[0] for line in out.splitlines() if line.strip() and not line.startswith("-")}
    return sorted(n + ".sum" for n in names if WANTED.match(n))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ncu", default=shutil.which("ncu") or "/usr/local/cuda/bin/ncu")
    ap.add_argument("--patterns", nargs="+", default=["dense", "sliding_window_1024"])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    metrics = available(args.ncu)
    print("metrics:", metrics, flush=True)
    res = {}
    for p in args.patterns:
        for impl in ("ours", "flex"):
            cmd = [args.ncu, "--clock-control", "none", "--cache-control", "all", "--profile-from-start", "off",
                   "--target-processes", "all", "--csv", "--page", "raw", "--metrics", ",".join(metrics),
                   sys.executable, os.path.join(HERE, "ncu_compare.py"), "worker", "--pattern", p, "--impl", impl]
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=500)
            with open(os.path.join(args.out, f"l2_{p}_{impl}.csv"), "w") as f:
                f.write(r.stdout + "\n" + r.stderr[-3000:])
            lines = r.stdout.splitlines()
            try:
                start = next(i for i, line in enumerate(lines) if line.startswith('"ID"'))
            except StopIteration:
                print(p, impl, "no output", r.stderr[-500:], flush=True)
                continue
            import csv
            import io
            rows = list(csv.reader(io.StringIO("\n".join(lines[start:]))))
            head, body = rows[0], rows[2:]
            for row in body:
                rec = dict(zip(head, row))
                name = rec.get("Kernel Name", "")[:40]
                vals = {m: rec.get(m, "") for m in metrics}
                res.setdefault(f"{p}/{impl}", []).append(dict(kernel=name, **vals))
                print(f"{p} {impl} {name}: " + ", ".join(f"{m.replace('.sum', '')}={v}" for m, v in vals.items() if v),
                      flush=True)
    with open(os.path.join(args.out, "ncu_l2_paths.json"), "w") as f:
        json.dump(dict(metrics=metrics, results=res), f, indent=1)


if __name__ == "__main__":
    main()
