"""`opweave tune MODEL | show | stats | export FILE | import FILE | ranker | machine`: tune
a model, look into and share the tuning database, train the learned ranker of library
forms, and measure the roofline's parameters."""
from __future__ import annotations

import sys

from ..tune import DEFAULT, TuningDBError, open_db
from ..tune.target import describe, target_id

ACTIONS = ("show", "stats", "export", "import", "ranker", "machine")


def add_parsers(sub, default_path: str | None) -> None:
    """`default_path`: the database of the user's options (the top-level CLI reads them)."""
    p = sub.add_parser(
        "tune", help="tune a model's configuration; show, stats, export, import the database; "
                     "train the ranker; measure the machine",
        description="opweave tune MODEL [--small] [--trials N | --budget SECONDS]: search the "
                    "model's whole-graph configurations and record the best per graph. "
                    "opweave tune show [--all] | stats | export FILE | import FILE: the database. "
                    "opweave tune ranker [--top-k K]: train the learned ranker of library "
                    "forms on the database, report its held-out scores and store it. "
                    "opweave tune machine [--threads N]: measure this machine's roofline "
                    "(GEMM peak, DRAM and cache bandwidth, per-op cost) for the cost model.")
    p.add_argument("what", metavar="MODEL|" + "|".join(ACTIONS))
    p.add_argument("file", nargs="?", help="the JSON-lines file of export and import")
    p.add_argument("--db", default=None,
                   help="database path (default: $OPWEAVE_TUNING_DB or the cache directory's)")
    p.add_argument("--all", action="store_true", help="show: records of every target")
    p.add_argument("--small", action="store_true", help="MODEL: its small variant")
    p.add_argument("--trials", type=int, default=None,
                   help="MODEL: at most this many measured trials (default: every configuration)")
    p.add_argument("--budget", type=float, default=None,
                   help="MODEL: seconds after which no new trial starts")
    p.add_argument("--threads", type=int, default=None,
                   help="MODEL, machine: threads to tune for (default: torch's, i.e. all cores)")
    p.add_argument("--rounds", type=int, default=10, help="MODEL: timed calls per trial")
    p.add_argument("--dynamo", action="store_true",
                   help="MODEL: tune the graphs torch.compile(backend=\"opweave\") makes "
                        "(they differ from opweave.compile's)")
    p.add_argument("--ray", nargs="?", const="", default=None, metavar="ADDRESS",
                   help="MODEL: run trials as Ray tasks, on the cluster at ADDRESS or on a "
                        "local one started for the run (needs the ray extra)")
    p.add_argument("--workers", type=int, default=None,
                   help="MODEL --ray: trials at once (default: cores // threads)")
    p.add_argument("--top-k", type=int, default=None,
                   help="ranker: forms to measure per call (default: the fewest whose "
                        "held-out total time stays within 2%% of the best forms')")
    p.add_argument("--folds", type=int, default=5, help="ranker: cross-validation folds")
    p.set_defaults(func=run, default_db=default_path)


def _path(args) -> str:
    return args.db or args.default_db or DEFAULT


def run(args) -> int:
    if args.what in ("export", "import") and not args.file:
        print(f"opweave tune {args.what}: give the file", file=sys.stderr)
        return 2
    if args.what not in ACTIONS:
        return _tune(args)
    db = open_db(_path(args))
    here = target_id(describe())
    if args.what == "show":
        records = db.records(None if args.all else here)
        for r in records:
            samples = ", ".join(f"{k} {min(v) * 1e6:.1f} us" for k, v in sorted(r.samples.items()) if v)
            config = (r.config.get("form") or r.config.get("config") or r.config.get("scores")
                      or r.config.get("machine") or r.config)
            print(f"{r.kind:<13} {config!s:<16} {r.seconds * 1e6:10.1f} us  "
                  f"[{samples[:200]}]  {r.workload_text[:120]}" + ("" if r.target == here else f"  @{r.target}"))
        print(f"{len(records)} record(s) in {db.path}")
    elif args.what == "stats":
        targets = db.targets()
        for target, kinds in sorted(db.stats().items()):
            mark = " (this machine)" if target == here else ""
            print(f"target {target}{mark}: {targets.get(target, {})}")
            for kind, n in sorted(kinds.items()):
                print(f"  {kind}: {n}")
    elif args.what == "ranker":
        return _ranker(db, args)
    elif args.what == "machine":
        return _machine(db, args)
    elif args.what == "export":
        print(f"exported {db.export(args.file)} record(s) to {args.file}")
    else:
        try:
            print(f"imported {db.import_(args.file)} record(s) into {db.path}")
        except (OSError, TuningDBError) as err:
            print(f"opweave tune import: {err}", file=sys.stderr)
            return 2
    return 0


def _machine(db, args) -> int:
    import time

    from ..cost.machine import measure
    from ..tune import roofline

    start = time.perf_counter()
    machine, about = measure(args.threads)
    roofline.store(db, machine, about, time.perf_counter() - start)
    caches = ", ".join(f"{k} {v // 1024} KiB" for k, v in sorted(about["caches"].items()))
    print(f"this machine with {about['threads']} thread(s) (caches: {caches or 'not reported'}):")
    print(f"  fp32 GEMM peak      {machine.flops / 1e9:8.1f} GFLOP/s")
    print(f"  DRAM bandwidth      {machine.bandwidth / 1e9:8.1f} GB/s (copy, read + write)")
    print(f"  cache bandwidth     {machine.cache_bandwidth / 1e9:8.1f} GB/s "
          f"(up to {machine.cache_bytes / 1024:.0f} KiB)")
    print(f"  cost of one op      {machine.launch * 1e6:8.2f} us")
    print(f"stored in {db.path}: compiles with this database cost graphs with these")
    return 0


def _ranker(db, args) -> int:
    from ..tune import ranking

    try:
        scores, top_k = ranking.train(db, folds=args.folds, top_k=args.top_k)
    except ValueError as err:
        print(f"opweave tune ranker: {err}", file=sys.stderr)
        return 2
    print(f"held-out ranking of {scores['records']} records ({scores['examples']} measured "
          f"forms, {args.folds} folds over workloads):")
    print(f"  top-1 hit {scores['top1']:.1%} (always the usual winner: {scores['baseline_top1']:.1%}),"
          f" top-2 hit {scores['top2']:.1%}, mean Kendall tau {scores['kendall_tau']:.2f}")
    for k in (1, 2):
        print(f"  measuring the top {k}: {scores[f'time_saved_top{k}']:.0%} of measuring time "
              f"saved; chosen forms {scores[f'slowdown_top{k}']:.3f}x the best (geomean), "
              f"{scores[f'latency_top{k}']:.3f}x in total time")
    print(f"  always the usual winner: {scores['baseline_slowdown']:.3f}x the best (geomean), "
          f"{scores['baseline_latency']:.3f}x in total time")
    if top_k is None:
        print("no ranker stored: no top k keeps the total time within 2% of the best forms; "
              "every form is still measured")
        return 0
    print(f"stored for this machine in {db.path}: compiles measure the top {top_k} form(s)")
    return 0


def _tune(args) -> int:
    from ..models import BUILDERS
    from .search import WorkerFailed, tune_model

    if args.what not in BUILDERS:
        print(f"opweave tune: {args.what!r} is neither {', '.join(ACTIONS)} nor a model; "
              f"models: {', '.join(BUILDERS)}", file=sys.stderr)
        return 2
    import torch

    from .runners import LocalRunner, RayRunner

    db = open_db(_path(args))
    threads = args.threads or torch.get_num_threads()
    try:
        runner = (RayRunner(args.ray or None, args.workers, threads) if args.ray is not None
                  else LocalRunner())
    except RuntimeError as err:
        print(f"opweave tune {args.what}: {err}", file=sys.stderr)
        return 2
    print(f"tuning {args.what}{' (small)' if args.small else ''} into {db.path}", flush=True)
    try:
        result = tune_model(args.what, db, small=args.small, trials=args.trials,
                            budget=args.budget, threads=threads, rounds=args.rounds,
                            runner=runner, dynamo=args.dynamo, progress=lambda line: print("  " + line, flush=True))
    except (WorkerFailed, ValueError) as err:
        print(f"opweave tune {args.what}: {err}", file=sys.stderr)
        return 1
    finally:
        runner.close()
    print(result.summary())
    return 0
