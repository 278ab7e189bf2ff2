"""The `opweave` command."""
from __future__ import annotations

import argparse
import sys


def _explain(args) -> int:
    from . import models
    from .explain import explain
    from .frontends.torch_export import compile as compile_model

    bench = models.build(args.model, small=args.small)
    report = explain(bench.module.eval(), bench.inputs, name=args.model,
                     graph_breaks=not args.no_graph_breaks)
    print(report)
    if args.ir:
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for graph in compile_model(bench.module, bench.inputs, name=args.model).graphs:
                print()
                print(graph, end="")
    return 0


def _demo(args) -> int:
    from . import models
    from .demo import TOLERANCE, run

    rows = run(args.models or models.BENCHMARK_SET, small=args.small, runs=args.runs)
    return 0 if all(r["max_abs_diff"] <= TOLERANCE for r in rows) else 1


def main(argv=None) -> int:
    from . import models

    parser = argparse.ArgumentParser(prog="opweave", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("explain", help="coverage and IR summary of a benchmark model")
    p.add_argument("model", choices=sorted(models.BUILDERS))
    p.add_argument("--small", action="store_true", help="the small test variant")
    p.add_argument("--ir", action="store_true", help="also print the IR")
    p.add_argument("--no-graph-breaks", action="store_true",
                   help="skip the torch.compile graph-break count (faster)")
    p.set_defaults(func=_explain)
    p = sub.add_parser("demo", help="compile the benchmark models, compare with eager")
    p.add_argument("models", nargs="*", choices=sorted(models.BUILDERS) + [[]], default=None)
    p.add_argument("--small", action="store_true")
    p.add_argument("--runs", type=int, default=10)
    p.set_defaults(func=_demo)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
