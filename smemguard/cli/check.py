"""``smemguard check``: the command line of :mod:`smemguard.preflight`."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable

from ..facts import gpus, untrusted
from . import check_decisions

if TYPE_CHECKING:
    from ..preflight import Progress, Report

# The preflight engine (process pools, AST tools) is imported by the functions that run ``check``
# only: every other smemguard command builds this parser too.


HELP = "report which Triton kernel configs overflow which GPUs' shared memory (no GPU needed)"

#: Seconds each import of a target may take by default: a big package's first import (torch, Triton and its
#: own dependencies) takes 10 to 60 s on a loaded CI machine; five times that still stops a hung check with a
#: line that names the module, long before a CI job's own limit kills it without one.
IMPORT_TIMEOUT = 300.0
#: The longest --timeout: beyond a day the bound means nothing (and no timer takes 1e12 s).
MAX_TIMEOUT = 86400.0
#: Threads a block (workgroup) may have on every NVIDIA and AMD GPU.
MAX_THREADS = 1024
#: A compiler process holds Triton, torch and the target: about this many MB.
WORKER_MB = 150

DESCRIPTION = """\
Finds the Triton kernels in TARGET (JIT functions, autotuners, heuristics), compiles each config for
each GPU's arch on this machine with Triton's own compiler, and compares the shared memory each
compiled kernel needs with the GPU's per-block limit: exactly the check that raises
OutOfResources on the GPU. Each config is compiled as aligned launches (16-byte aligned
pointers, sizes divisible by 16: the most shared memory) and as misaligned ones, plus the
specializations you name with --one. No GPU is needed: Triton's CUDA and HIP backends (gfx*: MI300X,
MI355X, ...) ship in its wheel, and each compile stops once Triton has allocated shared memory
(LLVM IR), before PTX and ptxas.

The check runs the target's code: it imports TARGET (with a package, each of its modules) in this
process, and again in each compiler process (--jobs), as a program using the kernels would. Check
code you would run; for code you do not trust, run the check where that code can do no harm: a
throw-away container or sandbox with no network, no credentials and nothing of value writable, e.g.
  docker run --rm --network none -v "$PWD:/src:ro" IMAGE smemguard check /src/kernels.py --gpu L4
An import that takes longer than --timeout (default 300 s; an endless loop, a wait at import) stops
the check with exit status 2 and one line naming the module. Whatever the target prints goes to
stderr: stdout holds the report alone (--json output parses).

Exit status: 0 when every kernel has a fitting config on every GPU in every specialization,
1 when some kernel has none on some GPU (it would raise OutOfResources there whatever the
autotuner picks), 2 on a usage error, a target that cannot be read or imported (or whose import
outlives --timeout), or a kernel whose every config fails to compile for another reason (each
error named). Use it to gate a deploy.

Verdicts are measured by compiling, except clear cases of matmul-like configs, which a
calibrated estimate decides (shown with ~; --exact compiles everything). Results are cached in
$SMEMGUARD_CACHE_DIR/preflight, so a second run only compiles what changed.
"""

EPILOG = """\
examples:
  smemguard check --examples --gpu L4,A100,H100
      smemguard's example kernels (a FlagGems-like 216-config matmul, vLLM's persistent fp32 matmul,
      a flash-attention forward) against three GPUs
  smemguard check my_pkg.kernels --gpu L4 --json > smem.json
      every kernel in a module, machine-readable (schema smemguard.check/1, see below)
  smemguard check kernels.py:matmul --gpu L20 --meta BLOCK_M=128,BLOCK_N=128,BLOCK_K=64,num_stages=4
      one plain @triton.jit kernel, one config
  smemguard check my_pkg.ops:moe --gpu L4 --one N --sig scale=fp32 --dtype bf16
  smemguard check my_pkg.kernels --gpu L4,L40S,MI355X --exact --json > before.json
  (after 'pip install -U triton', or in the new image:)
  smemguard check my_pkg.kernels --gpu L4,L40S,MI355X --exact --json > after.json
  smemguard check --compare before.json after.json
      a Triton upgrade's diff: per kernel, config, GPU and specialization, the bytes before and after, the
      configs that newly overflow a GPU and the kernels newly left without a fitting config; exit status 1
      when something that fit no longer does (0 otherwise, 2 when a report cannot be used): a CI gate
  smemguard check my_pkg.kernels --gpu L4,T4 --decisions l4-t4.json
      also write, for every config that overflows, the decision recovery would take on that GPU
      (fewer stages, or another config of the kernel's list, compiled to fit on a stand-in of the
      GPU); then on the serving hosts, or into an image's SMEMGUARD_CACHE_DIR:
      smemguard cache import l4-t4.json
      and a checked launch compiles the variant that fits directly, never the one that overflows

what the check needs to know (guessed, or given):
  argument types   pointers are found in the source (loaded from / stored to, or named *ptr) and
                   get --dtype; other arguments are i32. --sig NAME=TYPE,... fixes a guess
                   (TYPE: *fp16, *bf16, *fp32, i32, i64, fp32, or none for an argument every
                   launch passes as None, an optional tensor left out).
  strides of 1     the innermost stride of a contiguous tensor is 1 in every launch, which Triton
                   compiles as a constant (vectorized, pipelined loads: more shared memory). Read
                   from the source: the integer argument multiplying a tensor's last-axis offset
                   (a_ptr + rm[:, None] * sam + rk[None, :] * sak: sak) when it is also the last of
                   that tensor's strides in argument order. Where the two disagree (a tile loaded
                   transposed), every reading is checked: the argument order's stride equal to 1,
                   the tile layout's ("... by-layout"), neither ("... non-unit"); the worse counts,
                   and the report names them. --unit NAMES to say which are 1 in every launch,
                   --unit none for none.
  configs          an autotuner's own list; for a plain @triton.jit kernel, one --meta per config:
                   the kernel's constexprs, num_warps (a power of two, at most 1024 threads a block:
                   32 warps on NVIDIA, 16 on CDNA's 64-thread waves), num_stages (0 to 32: compile time
                   grows with the stages, 512 take minutes), num_ctas (1 to 16), maxnreg (1 to 255),
                   and for AMD GPUs Triton's HIP options (waves_per_eu, matrix_instr_nonkdim, kpack);
                   any other name is refused, naming the kernel's constexprs.
  constexprs       --const NAME=VALUE for those no config sets (HEAD_DIM=128).
  A module can declare the same per kernel: SMEMGUARD_PREFLIGHT = {"kernel": {"dtype": "fp32",
  "signature": {...}, "constants": {...}, "configs": [...], "ones": [["N"]], "unit": [...]}}
  (see smemguard/examples.py); options given here win.

--json: {"schema": "smemguard.check/1", "exit_status", "gpus": [{name, arch, limit, checked}],
  "kernels": [{kernel, jit, specializations: [{name, aligned, ones, unit_guess, guessed_ones}],
  unit_args, unsure_unit_args, configs: [{config, constexprs, num_warps,
  num_stages, gpus: {GPU: {fits, specializations: {SPEC: {verdict: fits|overflows|error|not_checked,
  how: measured|cached|estimated, shared, estimate: {low, high}, error}}}}}]}],
  "summary": {GPU: {checked, configs, fit, kernels_without_fit: [{kernel, specializations}]}},
  "verdicts": {measured, cached, estimated}, "compiles", "cache_hits", "seconds"}
"""


def _key_values(text: str, option: str) -> dict[str, Any]:
    from ..preflight import TargetError

    values = {}
    for part in filter(None, (piece.strip() for piece in text.split(","))):
        name, sep, raw = part.partition("=")
        if not sep or not name.strip():
            raise TargetError(f"{option} {text!r}: expected NAME=VALUE,NAME=VALUE")
        values[name.strip()] = _parse_value(raw.strip())
    return values


def _parse_value(raw: str):
    if raw in ("True", "False"):
        return raw == "True"
    for kind in (int, float):
        try:
            return kind(raw)
        except ValueError:
            pass
    return raw


def _names(text: str) -> list[str]:
    return [name.strip() for name in text.split(",") if name.strip()]


def parse_gpus(texts: Iterable[str]) -> list[gpus.Gpu]:
    from ..preflight import TargetError

    chosen = []
    for name in (name for text in texts or () for name in _names(text)):
        gpu = gpus.lookup(name)
        if gpu is None:
            raise TargetError(f"unknown GPU {name!r}; known: {', '.join(gpus.names())} (see 'smemguard gpus')")
        if gpu not in chosen:
            chosen.append(gpu)
    if not chosen:
        raise TargetError("name at least one GPU with --gpu (e.g. --gpu L4,A100,H100)")
    return chosen


def _overrides(args, gpu_list: list[gpus.Gpu]) -> dict:
    from ..kernels.estimate import ELEMENT_BYTES
    from ..preflight import TargetError

    overrides: dict[str, Any] = {}
    if args.dtype:
        if args.dtype not in ELEMENT_BYTES:  # else every config of every kernel fails to compile, each with a line
            raise TargetError(f"--dtype {untrusted.printable(args.dtype, 40)}: not an element type; accepted: "
                              f"{', '.join(ELEMENT_BYTES)}")
        overrides["dtype"] = args.dtype
    if args.sig:
        overrides["signature"] = {name: str(ty) for text in args.sig for name, ty in _key_values(text, "--sig").items()}
    if args.const:
        overrides["constants"] = {name: value for text in args.const
                                  for name, value in _key_values(text, "--const").items()}
    if args.meta:
        overrides["configs"] = [_meta(text, gpu_list) for text in args.meta]
    if args.one:
        overrides["ones"] = [_names(text) for text in args.one]
    if args.unit:
        overrides["unit"] = args.unit if args.unit in ("auto", "none") else _names(args.unit)
    return overrides


def _meta(text: str, gpu_list: list[gpus.Gpu]) -> dict:
    """One --meta config; TargetError for options no launch takes, or that would compile for minutes (before
    the target is imported). Their bounds are a decision file's (store.decision_cache): --decisions writes only
    what 'cache import' accepts."""
    from ..preflight import TargetError
    from ..store import decision_cache

    config = _key_values(text, "--meta")
    warps = config.get("num_warps", 4)
    if not decision_cache.power_of_two(warps, decision_cache.MAX_WARPS):
        raise TargetError(f"--meta {text!r}: num_warps={warps!r}: expected a power of two from 1 to "
                          f"{decision_cache.MAX_WARPS} (warps of 32 threads: a block has {MAX_THREADS} at most)")
    for gpu in gpu_list:
        if warps * gpu.warp_size > MAX_THREADS:
            raise TargetError(f"--meta {text!r}: num_warps={warps} is {warps * gpu.warp_size} threads a block on "
                              f"{gpu.name} ({gpu.warp_size} a warp), over the {MAX_THREADS} a block can have: at "
                              f"most num_warps={MAX_THREADS // gpu.warp_size} there")
    for name, least, most, why in (("num_stages", 0, decision_cache.MAX_STAGES, "; compile time grows with the stages: "
                                    "512 take minutes"), ("num_ctas", 1, 16, ""), ("maxnreg", 1, 255, "")):
        value = config.get(name, least)
        if type(value) is not int or not least <= value <= most:
            raise TargetError(f"--meta {text!r}: {name}={value!r}: expected an integer from {least} to {most}{why}")
    return config


def _refuse_unknown_meta(kernels, configs: list[dict], gpu_list: list[gpus.Gpu]) -> None:
    """TargetError for a --meta name that is neither a constexpr of a kernel checked nor an option: a launch
    refuses it, and the check would silently leave it out."""
    from ..preflight import TargetError, Variant
    from ..preflight.compiling import hip_option_names

    options = [field.name for field in dataclasses.fields(Variant) if field.name != "constexprs"]
    amd = hip_option_names() if any(gpu.backend == "hip" for gpu in gpu_list) else frozenset()
    for kernel in kernels:
        constexprs = [param.name for param in kernel.jit.params if param.is_constexpr]
        for config in configs:
            unknown = [f"{name}={value!r}" for name, value in config.items()
                       if name not in constexprs and name not in options and name not in amd]
            if unknown:
                raise TargetError(
                    f"--meta {', '.join(unknown)}: no constexpr of {kernel.name}, nor an option; its constexprs: "
                    f"{', '.join(constexprs) or 'none'}; options: {', '.join(options)}"
                    + (", and for AMD GPUs Triton's HIP options (waves_per_eu, matrix_instr_nonkdim, kpack, ...)"
                       if amd else ""))


def usable_cpus() -> int:
    """The CPUs this process may run on: a container's or taskset's share, not the host's count."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS has no affinity
        return os.cpu_count() or 1


def _jobs(asked: int | None) -> int:
    """Compiler processes: ``asked``, at most the CPUs usable (one line says so when lowered)."""
    cpus = usable_cpus()
    if asked is not None and asked > cpus:
        print(f"smemguard check: --jobs {asked} lowered to {cpus}, the CPUs this process can use: more processes "
              f"compile no faster, and each holds about {WORKER_MB} MB", file=sys.stderr, flush=True)
        return cpus
    return asked or cpus


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value <= MAX_TIMEOUT:
        raise argparse.ArgumentTypeError(f"expected seconds, more than 0 and at most {MAX_TIMEOUT:g}, not {text!r}")
    return value


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive number of processes, not {text!r}")
    return value


def add_check_command(subparsers) -> argparse.ArgumentParser:
    """Add ``check`` to an argparse subparsers object; the parsed namespace runs with :func:`run_check`."""
    parser = subparsers.add_parser("check", help=HELP, description=DESCRIPTION, epilog=EPILOG,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("targets", nargs="*", metavar="TARGET",
                        help="a module (pkg.kernels), a package (pkg: the kernels each of its modules defines), a "
                             "kernel in a module (pkg.kernels:matmul), or a file (kernels.py, kernels.py:matmul)")
    parser.add_argument("--examples", action="store_true", help="also check smemguard's example kernels")
    parser.add_argument("--gpu", action="append", metavar="GPU[,GPU...]",
                        help="GPUs to check against, by name or alias from 'smemguard gpus' (L4, A100, H100, ...); "
                             "needed unless --compare")
    parser.add_argument("--compare", nargs=2, type=Path, metavar=("OLD.json", "NEW.json"),
                        help="compare two reports of 'check --json' (made in two environments, e.g. before and after "
                             "a Triton upgrade) instead of checking: the bytes of each config before and after, and "
                             "what newly overflows (exit status 1); --json prints the comparison as JSON (schema "
                             "smemguard.compare/1). Make both with --exact: estimated verdicts hide bytes")
    parser.add_argument("--meta", action="append", metavar="NAME=VALUE,...",
                        help="one config: constexprs and num_warps/num_stages (what is accepted: 'configs' "
                             "below); repeat for more (replaces an autotuner's list)")
    parser.add_argument("--const", action="append", metavar="NAME=VALUE,...",
                        help="constexprs every config needs but none sets (HEAD_DIM=128)")
    parser.add_argument("--one", action="append", metavar="NAME[,NAME...]",
                        help="also check launches where these integer arguments equal 1 (N == 1); repeatable")
    parser.add_argument("--unit", metavar="NAMES|auto|none",
                        help="arguments that are 1 in every launch (innermost strides; default auto: read "
                             "from the source, every reading checked where it does not tell)")
    parser.add_argument("--dtype", metavar="TYPE", help="element type of pointer arguments (default fp16)")
    parser.add_argument("--sig", action="append", metavar="NAME=TYPE,...", help="argument types (scale=fp32)")
    parser.add_argument("--exact", action="store_true", help="compile every config (no estimated verdicts)")
    parser.add_argument("--jobs", type=_positive, metavar="N",
                        help=f"compiler processes, each about {WORKER_MB} MB (default and most: the CPUs this "
                             f"process can use, {usable_cpus()} here; more is lowered to that, with one line)")
    parser.add_argument("--timeout", type=_seconds, default=IMPORT_TIMEOUT, metavar="SECONDS",
                        help=f"how long each import of a target may take, here and in each compiler process "
                             f"(default {IMPORT_TIMEOUT:g}); a longer one stops the check, exit status 2, naming "
                             "the module")
    parser.add_argument("--no-cache", action="store_true", help="neither read nor write cached results")
    parser.add_argument("--decisions", type=Path, metavar="FILE",
                        help="write the decision recovery would take for every overflowing config to FILE (replaced "
                             "atomically), for 'smemguard cache import FILE'")
    parser.add_argument("--json", action="store_true", help="print the JSON document (schema smemguard.check/1)")
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    parser.set_defaults(run=_check_or_compare)
    return parser


def _check_or_compare(args) -> int:
    """``check --compare OLD NEW`` compares two reports and checks nothing; else the check."""
    if args.compare is None:
        return run_check(args)
    from ..preflight import compare

    if args.targets or args.examples or args.gpu:
        print("smemguard check: --compare takes two reports and checks nothing: leave out TARGET, --examples and "
              "--gpu (make each report with 'smemguard check TARGET --gpu ... --json > FILE')", file=sys.stderr)
        return 2
    return compare.run(*args.compare, as_json=args.json, quiet=args.quiet, say=print,
                       err=lambda line: print(line, file=sys.stderr))


def _progress_printer(every: float = 1.0) -> Callable[[Progress], None]:
    """Progress on stderr: the compile just finished, at most one line per ``every`` seconds, and the last."""
    shown_at = -math.inf

    def show(event: Progress) -> None:
        nonlocal shown_at
        if event.done < event.planned and event.elapsed - shown_at < every:
            return
        shown_at = event.elapsed
        item, result = event.item, event.item.result or {}
        outcome = f"{result['shared']} B" if result.get("shared") is not None else "compile error"
        arch = f"sm_{item.arch}" if isinstance(item.arch, int) else item.arch
        rate = event.done / event.elapsed if event.elapsed > 0 else 0.0
        left = (f", ~{_duration((event.planned - event.done) / rate)} left" if rate and event.done < event.planned
                else "")
        print(f"smemguard check: [{event.done}/{event.planned}] {arch} {item.kernel.name.rsplit(':', 1)[-1]} "
              f"{item.variant.label()} {item.spec.name}: {outcome} ({result.get('seconds', 0):.1f} s; "
              f"{event.elapsed:.0f} s elapsed, {rate:.1f} compiles/s{left})", file=sys.stderr, flush=True)

    return show


def _show_decided(event) -> None:
    """A line on stderr per overflowing config decided (each is a stand-in launch and recovery's ladder: seconds)."""
    rate = event.done / event.elapsed if event.elapsed > 0 else 0.0
    left = f", ~{_duration((event.planned - event.done) / rate)} left" if rate and event.done < event.planned else ""
    print(f"smemguard check: deciding [{event.done}/{event.planned}] {event.gpu} {event.kernel.rsplit(':', 1)[-1]} "
          f"{event.config} {event.spec}: {event.outcome} ({event.seconds:.1f} s; {event.elapsed:.0f} s elapsed{left})",
          file=sys.stderr, flush=True)


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.0f} min"


def run_check(args) -> int:
    """Run ``smemguard check`` for a parsed namespace; print the report; return the exit status."""
    from .. import preflight
    from ..preflight import format_summary, format_table
    from ..preflight.compiling import workers_end_with_this_process

    with _stdout_to_stderr(), workers_end_with_this_process():
        report = _checked(args)
    if report is None:
        return 2
    if args.json:
        print(json.dumps(report.to_json(), indent=2))
        if not args.quiet:  # the text summary says it; the document only lists them
            for kernel in (kernel for kernel in report.kernels if kernel.unsure_unit_args):
                print(f"smemguard check: {kernel.name}: {preflight.unsure_strides(kernel)}", file=sys.stderr)
    else:
        print(format_table(report))
        print()
        print(format_summary(report))
    return report.exit_status


def _checked(args) -> Report | None:
    """The check's report (running the target's code), or None once one line on stderr has said why none."""
    from .. import preflight
    from ..preflight import ResultCache, TargetError, check, discover
    from ..preflight.discovery import files_read
    from ..preflight.pins import check_pins
    from .pin import pins_in_force

    refusal = args.decisions and check_decisions.unwritable(args.decisions)
    if refusal:
        print(f"smemguard check: --decisions {refusal}; nothing checked", file=sys.stderr)
        return None
    try:
        gpu_list = parse_gpus(args.gpu)
        overrides = _overrides(args, gpu_list)
        jobs = _jobs(args.jobs)
        kernels = discover(args.targets, examples=args.examples, overrides=overrides, import_timeout=args.timeout)
        _refuse_unknown_meta(kernels, overrides.get("configs", []), gpu_list)
        if args.decisions:
            check_decisions.refuse_an_input(args.decisions, files_read(kernels))
        if not args.quiet:
            variants = sum(len(kernel.variants) for kernel in kernels)
            print(f"smemguard check: {untrusted.counted(len(kernels), 'kernel')}, "
                  f"{untrusted.counted(variants, 'config')}, GPUs "
                  f"{', '.join(f'{gpu.name} ({gpu.arch})' for gpu in gpu_list)}; compiling with {jobs} processes",
                  file=sys.stderr, flush=True)
        cache = ResultCache(None) if args.no_cache else preflight.default_cache()
        if cache.refused:  # the decision file beside the results is as untrusted: its pins are not read either
            print(f"smemguard check: not using cached results: {untrusted.printable(cache.refused)}; every config is "
                  "compiled, and only SMEMGUARD_PINS's pins are shown", file=sys.stderr, flush=True)
        report = check(kernels, gpu_list, exact=args.exact, jobs=jobs, cache=cache,
                       progress=None if args.quiet else _progress_printer(), import_timeout=args.timeout)
        in_force = pins_in_force(args.settings, "smemguard check", from_cache=not cache.refused)
        report.pinned = check_pins(report, in_force, exact=args.exact, jobs=jobs, cache=cache,
                                   import_timeout=args.timeout)
    except TargetError as error:
        print(f"smemguard check: {error}", file=sys.stderr)
        return None
    progress = None if args.quiet else _show_decided
    if args.decisions and not check_decisions.write(report, args.decisions, cache, progress):
        return None
    return report


@contextlib.contextmanager
def _stdout_to_stderr():
    """While the target's code runs (imports, compiles, decisions), what it prints goes to stderr, from Python, C
    or a subprocess; the compiler processes inherit that. Stdout is the report's alone: --json parses."""
    sys.stdout.flush()
    try:
        kept = os.dup(1)
        os.dup2(2, 1)
    except OSError:  # stdout or stderr closed: there is no stream to keep clean
        kept = None
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        for stream in (sys.stdout, sys.__stdout__):  # what the target wrote to them directly, still buffered
            with contextlib.suppress(AttributeError, OSError, ValueError):  # None, or closed by the target
                stream.flush()
        if kept is not None:
            os.dup2(kept, 1)
            os.close(kept)
