"""Every decision ``smemguard check --decisions`` writes, launched as checked: compiled directly, or not?

Answered (CPU harness, Triton 3.9.0, torch 2.13.0 CPU, 2026-12-02; raw: benchmarks/results/2026-12-02-cpu-session-8/
decisions_round_trip.md): yes. ``check --examples --gpu T4,MI300X,L4 --decisions`` wrote 147 decisions; of the first 6
per kernel and GPU (33 launches), every launch with the imported file compiled one variant and raised nothing, without
it 2 to 4 compiles and an incident each; the same variant in 27 of 33 (the 6 others: T4 config switches to another
fitting config, where recovery races candidates on the stand-in's arbitrary timings and the check keeps the first
that fits). ``tests/test_preflight_decisions.py`` keeps the claim tested.

    python benchmarks/experiments/decisions_round_trip.py --gpu L4,T4,MI300X [--examples] [TARGET ...] [--json OUT]

The CPU harness (``smemguard.testing.fake_gpu``; AMD needs ld.lld, see README's ROCm section). The check
runs on the targets (default: smemguard's examples), its decisions are imported into a fresh cache, and
then every overflowing (kernel, config, specialization, GPU) that got an entry is launched as the check
compiled it (its stand-in arguments, the config put in force through the kernel's own autotuner, as one
tuned on a bigger GPU would be), twice, each in a fresh stand-in session: with the imported cache, and with
an empty one (recovery deciding as it would on a host without the file). Printed last, a row per launch:
what ran with and without the file, the variants compiled, the incidents. The claim checked (Triton 3.5 and
later): with the file, no incident, one compile, the variant recovery chooses without it.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from triton import knobs

import smemguard
from smemguard.cli import commands
from smemguard.store import decision_cache
from smemguard.facts import gpus
from smemguard.kernels import introspect, tuners
from smemguard import preflight
from smemguard.preflight import decide
from smemguard.facts.settings import Settings
from smemguard.testing import fake_gpu


def launch_as_checked(kernel, variant, spec, gpu) -> None:
    """``kernel`` launched through its own layers as the check compiled ``variant`` in ``spec`` for ``gpu``."""
    args, kwargs, config = decide.stand_in_launch(kernel, variant, spec, gpu)
    tuner = next((layer for layer in introspect.chain(kernel.launched) if tuners.tuner_for(layer)), None)
    if tuner is not None:
        tuner.cache.clear()
        tuner.cache[tuners.tuning_key(tuner, args, kwargs)] = config
    kernel.launched[decide.stand_in_grid](*args, **kwargs)


def one_launch(kernel, variant, spec, gpu, cache_dir: Path, scratch: Path) -> dict:
    log = scratch / "incidents.jsonl"
    log.unlink(missing_ok=True)
    compiled = []
    knobs.runtime.jit_cache_hook = lambda **kw: compiled.append(
        (kw["compile"]["num_stages"], kw["compile"]["num_warps"])) and False
    smemguard.install(Settings(mode="on", cache_dir=cache_dir, log_path=log))
    try:
        with fake_gpu(gpu.name, cache_dir=str(scratch / "triton")) as device:
            launch_as_checked(kernel, variant, spec, gpu)
        ran = device.launches[-1]
        incidents = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
        return {"ran": [ran.num_stages, ran.num_warps, ran.shared], "compiled": compiled,
                "incidents": [(record["action"], record["remembered"]) for record in incidents]}
    except Exception as error:
        return {"error": f"{type(error).__name__}: {error}"[:300]}
    finally:
        smemguard.uninstall()
        knobs.runtime.jit_cache_hook = None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("targets", nargs="*", metavar="TARGET", help="as for 'smemguard check' (default: --examples)")
    parser.add_argument("--examples", action="store_true", help="smemguard's example kernels (the default)")
    parser.add_argument("--gpu", default="L4,T4,MI300X", help="GPUs from 'smemguard gpus' (default: L4,T4,MI300X)")
    parser.add_argument("--json", type=Path, help="also write every row here")
    parser.add_argument("--each", type=int, default=0, metavar="N",
                        help="only the first N overflowing launches of each kernel on each GPU (default: all)")
    parser.add_argument("--decisions", type=Path, help="a file 'smemguard check --decisions' wrote for these targets "
                                                       "and GPUs (default: run that check now)")
    args = parser.parse_args(argv)
    scratch = Path(tempfile.mkdtemp(prefix="smemguard-round-trip-"))
    file = args.decisions or scratch / "decisions.json"
    targets = [*args.targets, *(["--examples"] if args.examples or not args.targets else [])]
    if args.decisions is None:
        status = commands.main(["check", *targets, "--gpu", args.gpu, "--decisions", str(file), "--quiet"])
        if status not in (0, 1):
            return status
    imported, empty = scratch / "imported", scratch / "empty"
    assert commands.main(["cache", "import", str(file), "--dir", str(imported)]) == 0
    empty.mkdir(mode=0o700)
    stored = {key for table in decision_cache.KINDS for key in json.loads(file.read_text())[table]}
    kernels = preflight.discover(args.targets, examples=args.examples or not args.targets)
    report = preflight.check(kernels, [gpus.lookup(name) for name in args.gpu.split(",")], jobs=1,
                             cache=preflight.default_cache())
    rows = []
    for gpu in report.checked_gpus():
        for k, kernel in enumerate(report.kernels):
            taken = 0
            for v, variant in enumerate(kernel.variants):
                for spec in kernel.specializations:
                    if report.verdict(k, v, spec.name, gpu.name).verdict != preflight.OVERFLOWS:
                        continue
                    if args.each and taken == args.each:
                        break
                    taken += 1
                    row = {"gpu": gpu.name, "kernel": kernel.name, "config": variant.label(), "spec": spec.name,
                           "with": one_launch(kernel, variant, spec, gpu, imported, scratch),
                           "without": one_launch(kernel, variant, spec, gpu, empty, scratch)}
                    rows.append(row)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    print(f"{len(stored)} entries; {len(rows)} overflowing launches")
    print("| GPU | kernel | config | spec | ran with / without (stages, warps, B) | compiled with / without | "
          "incidents with / without |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for row in rows:
        with_, without = row["with"], row["without"]
        print(f"| {row['gpu']} | {row['kernel'].split(':')[-1]} | {row['config']} | {row['spec']} | "
              f"{with_.get('ran', with_.get('error'))} / {without.get('ran', without.get('error'))} | "
              f"{with_.get('compiled')} / {without.get('compiled')} | {with_.get('incidents')} / "
              f"{without.get('incidents')} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
