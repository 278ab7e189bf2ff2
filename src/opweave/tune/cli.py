"""`opweave tune show|stats|export|import`: look into and share the tuning database."""
from __future__ import annotations

import sys

from . import DEFAULT, TuningDBError, open_db
from .target import describe, target_id


def add_parsers(sub, default_path: str | None) -> None:
    """`default_path`: the database of the user's options (the top-level CLI reads them)."""
    p = sub.add_parser("tune", help="the tuning database: show, stats, export, import")
    p.add_argument("--db", default=None,
                   help="database path (default: $OPWEAVE_TUNING_DB or the cache directory's)")
    actions = p.add_subparsers(dest="action", required=True)
    show = actions.add_parser("show", help="the records measured on this machine")
    show.add_argument("--all", action="store_true", help="records of every target")
    actions.add_parser("stats", help="records per target and kind")
    export = actions.add_parser("export", help="write every record as JSON lines")
    export.add_argument("file")
    imported = actions.add_parser("import", help="add the records of an export")
    imported.add_argument("file")
    p.set_defaults(func=run, default_db=default_path)


def _path(args) -> str:
    return args.db or args.default_db or DEFAULT


def run(args) -> int:
    db = open_db(_path(args))
    here = target_id(describe())
    if args.action == "show":
        records = db.records(None if args.all else here)
        for r in records:
            samples = ", ".join(f"{k} {min(v) * 1e6:.1f} us" for k, v in sorted(r.samples.items()) if v)
            print(f"{r.kind:<13} {r.config.get('form', r.config)!s:<16} {r.seconds * 1e6:10.1f} us  "
                  f"[{samples}]  {r.workload_text[:120]}" + ("" if r.target == here else f"  @{r.target}"))
        print(f"{len(records)} record(s) in {db.path}")
    elif args.action == "stats":
        targets = db.targets()
        for target, kinds in sorted(db.stats().items()):
            mark = " (this machine)" if target == here else ""
            print(f"target {target}{mark}: {targets.get(target, {})}")
            for kind, n in sorted(kinds.items()):
                print(f"  {kind}: {n}")
    elif args.action == "export":
        print(f"exported {db.export(args.file)} record(s) to {args.file}")
    else:
        try:
            print(f"imported {db.import_(args.file)} record(s) into {db.path}")
        except (OSError, TuningDBError) as err:
            print(f"opweave tune import: {err}", file=sys.stderr)
            return 2
    return 0
