"""CPU time of `hdp.packing.calibrate.calibrate`, optionally side by side with another git revision.

    python examples/calibrate_speed.py                   # this tree only
    python examples/calibrate_speed.py --against cb29cf3 --repeats 3

The records are synthetic, drawn from the family itself: 6 record sets of 120 group records each,
on group sizes 1-8, with a per-token CP overhead of 0, 1e3 or 2e4 units. Each set is drawn from
its own seed and carries +-3% noise. With ``--against REV`` the script loads ``packing/calibrate.py``
of that revision (via ``git show``) next to this tree's. It alternates the two ``--repeats``
times and prints the least CPU time of each, with their ratio. It also checks that both fits give
the same unit time and linear coefficient to 1e-3. Everything else is imported from this tree.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType

import numpy as np

from hdp.packing import cost_model

ROOT = Path(__file__).resolve().parents[1]


def record_sets() -> list[tuple[object, list[dict]]]:
    """(base model, records) of the 6 synthetic sets."""
    import hdp.packing.calibrate as current

    out = []
    for seed in range(6):
        rng = np.random.default_rng(seed)
        base = cost_model("cpu-tiny", "cpu-gloo")
        truth = dataclasses.replace(base, cp_per_token=[0.0, 1e3, 2e4][seed % 3] * base.linear_coef / 1e3,
                                    merge_per_token=base.merge_per_token * (seed % 2))
        recs = []
        for _ in range(120):
            k = int(rng.choice([1, 2, 3, 4, 8]))
            lengths = rng.integers(16, 4096 * k, size=int(rng.integers(1, 4))).tolist()
            recs.append({"kind": "group", "lengths": lengths, "group_size": k,
                         "seconds": current.group_seconds(truth, lengths, k) * rng.uniform(0.97, 1.03)})
        out.append((base, recs))
    return out


def load_revision(rev: str) -> ModuleType:
    """``packing/calibrate.py`` of git revision ``rev`` as a module (its imports resolve to this tree)."""
    src = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:packing/calibrate.py"], check=True,
                         capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / "calibrate_at_rev.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("hdp.packing._calibrate_at_rev", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up while the class is built
    spec.loader.exec_module(mod)
    return mod


def time_fits(mod: ModuleType, sets: list) -> tuple[float, list]:
    """(CPU seconds of every fit, the fitted models)."""
    t0 = time.process_time()
    fits = [mod.calibrate(recs, base=base, warn=False).cost for base, recs in sets]
    return time.process_time() - t0, fits


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--against", metavar="REV", help="git revision to time side by side")
    ap.add_argument("--repeats", type=int, default=3, help="alternations (least time reported)")
    args = ap.parse_args()
    import hdp.packing.calibrate as current

    sets = record_sets()
    mods = {"this tree": current}
    if args.against:
        mods[args.against] = load_revision(args.against)
    best = {name: float("inf") for name in mods}
    fits = {}
    for _ in range(max(1, args.repeats)):
        for name, mod in mods.items():
            secs, fits[name] = time_fits(mod, sets)
            best[name] = min(best[name], secs)
    for name in mods:
        print(f"{name:>12}: {best[name]:.3f} s CPU for {len(sets)} fits (least of {args.repeats})")
    if args.against:
        print(f"{args.against} / this tree: {best[args.against] / best['this tree']:.2f}x")
        for a, b in zip(fits["this tree"], fits[args.against]):
            for field in ("unit_time_s", "linear_coef"):
                x, y = getattr(a, field), getattr(b, field)
                if abs(x - y) > 1e-3 * max(abs(x), abs(y)):
                    print(f"fits differ: {field} {x:.6g} vs {y:.6g}")
                    return 1
        print("fits agree (unit time and linear coefficient to 1e-3)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
