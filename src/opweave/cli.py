"""The `opweave` command."""
from __future__ import annotations

import argparse
import sys

# options.PRECISIONS, spelled out so parsing the command line imports no compiler
# (tests/test_cli.py checks that the two agree)
COMPILE_PRECISIONS = ("fp32", "bf16", "bf16x3", "int8", "int8-dynamic")


def _explain(args) -> int:
    from . import models
    from .explanation import explain
    from .frontends.torch_export import compile as compile_model

    bench = models.build(args.model, small=args.small)
    if args.train or args.memory_budget is not None:
        if args.precision not in (None, "fp32"):
            print("--precision applies to inference; training steps compute in float32",
                  file=sys.stderr)
            return 2
        from .models.base import disable_dropout

        budget = args.memory_budget
        budget = None if budget is None else (int(budget) if budget > 1 else budget)
        print(explain(disable_dropout(bench.loss_module).train(), (*bench.inputs, bench.targets),
                      name=args.model, graph_breaks=False, rewrite=args.rewrite, train=True,
                      memory_budget=budget))
        return 0
    report = explain(bench.module.eval(), bench.inputs, name=args.model,
                     graph_breaks=not args.no_graph_breaks, rewrite=args.rewrite,
                     precision=args.precision, schedule=args.schedule)
    print(report)
    if args.ir:
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for graph in compile_model(bench.module, bench.inputs, name=args.model,
                                       rewrite=args.rewrite).graphs:
                print()
                print(graph, end="")
    if args.html:
        import warnings

        from .profiling import profile

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            compiled = compile_model(bench.module.eval(), bench.inputs, name=args.model,
                                     rewrite=args.rewrite)
        print(f"wrote {profile(compiled, bench.inputs, runs=3, name=args.model).write_html(args.html)}")
    return 0


def _rules(args) -> int:
    """List the rewrite rules; with --check, test each numerically (and with --prove, by z3)."""
    from .passes.rewrite.rule import RULESETS, all_rules

    rules = all_rules()
    print(f"{len(rules)} rules in {len(RULESETS)} sets")
    for name, (priority, doc) in RULESETS.items():
        members = [r.name for r in rules if r.ruleset == name]
        print(f"  {name} (phase {priority}, {len(members)}): {doc}")
        if args.verbose:
            print("    " + ", ".join(members))
    failed = 0
    if args.check:
        from .passes.rewrite.soundness import check_rule

        for rule in rules:
            for problem in check_rule(rule):
                failed += 1
                print(f"UNSOUND {problem}")
        print(f"numerical check: {len(rules) - failed} of {len(rules)} rules pass on their examples")
    if args.prove:
        from collections import Counter

        from .tools.rule_proofs import prove_all

        outcomes = prove_all(rules)
        kinds = Counter(o.split(":")[0].split(" (")[0] for o in outcomes.values())
        print("z3 (float32 elementwise rules, index rules): " + ", ".join(f"{k} {n}" for k, n in kinds.items()))
        for name, outcome in outcomes.items():
            if outcome.startswith("counterexample") or args.verbose:
                print(f"  {name}: {outcome}")
    if args.generate:
        from .tools.rule_generation import generate

        print(generate())
    return 1 if failed else 0


def _rewrite_report(args) -> int:
    from .tools.rewrite_report import compare, markdown

    from . import models

    names = args.models or list(models.BENCHMARK_SET)
    print(markdown(compare(names, small=args.small, engines=args.engines,
                           backtrack_seconds=args.backtrack_seconds)))
    return 0


def _fusion_report(args) -> int:
    from . import models
    from .tools.fusion_report import compare

    print(compare(args.models or list(models.BENCHMARK_SET), small=args.small))
    return 0


def _demo(args) -> int:
    from . import models
    from .demo import TOLERANCE, run

    rows = run(args.models or models.BENCHMARK_SET, small=args.small, runs=args.runs)
    return 0 if all(r["max_abs_diff"] <= TOLERANCE for r in rows) else 1


def _bench(args) -> int:
    from pathlib import Path

    from tqdm import tqdm

    from .bench import harness, report

    for given, flag in ((args.pause, "--pause"), (args.caller != "main", "--caller")):
        if given and (args.device == "cuda" or args.overhead or args.horizontal
                      or args.schedules or args.memory or args.accuracy or args.dynamic):
            print(f"{flag} applies to the CPU bench of latencies or training steps only (not "
                  "to --device cuda, --overhead, --horizontal, --schedules, --memory, "
                  "--accuracy or --dynamic)", file=sys.stderr)
            return 2
    if args.device == "cuda":
        return _gpu_bench(args)
    if args.overhead:
        return _overhead(args)
    if args.horizontal:
        return _horizontal(args)
    if args.schedules:
        return _schedules(args)
    if args.memory:
        return _memory_curve(args)
    if args.accuracy:
        return _accuracy(args)
    if args.dynamic:
        return _dynamic(args)
    if args.precision != "fp32" and args.mode == "train":
        print(f"--precision {args.precision} compares inference backends; training steps "
              "compute in float32", file=sys.stderr)
        return 2
    backends = args.backends or (harness.TRAIN_BACKENDS if args.mode == "train"
                                 else harness.PRECISION_BACKENDS.get(args.precision)
                                 or harness.DEFAULT_BACKENDS)
    config = harness.BenchConfig(models=bench_models(args), backends=backends, mode=args.mode,
                                 batch=args.batch, runs=args.runs, warmup=args.warmup,
                                 calls=1 if args.calls is None else args.calls,
                                 pause_ms=args.pause, caller=args.caller,
                                 threads=args.threads, small=args.small,
                                 log_dir=str(Path(args.out) / "logs"))
    total = len(config.models) * harness.steps_per_model(config)
    with tqdm(total=total, disable=args.no_progress or None, leave=False,
              unit="step", dynamic_ncols=True) as progress:
        result = harness.run(config, progress)
    print(report.terminal(result))
    paths = report.write_all(result, Path(args.out))
    print("\nwrote " + ", ".join(str(p) for p in paths.values()))
    failures = [m.model for m in result.models if not _opweave_sound(m, config)]
    if failures:
        print(f"opweave failed or differs from eager on: {', '.join(failures)}")
    return 1 if failures else 0


def _gpu_bench(args) -> int:
    from pathlib import Path

    import torch

    from . import models
    from .bench import gpu

    if not torch.cuda.is_available():
        print("--device cuda needs a CUDA GPU and a CUDA build of torch", file=sys.stderr)
        return 2
    backends = list(gpu.TRAIN_BACKENDS if args.mode == "train" else gpu.INFER_BACKENDS)
    if args.max_autotune:
        backends.insert(2, "inductor-max-autotune")
    results = gpu.run(args.models or list(models.BENCHMARK_SET), backends, args.mode,
                      args.precision, args.runs, 20 if args.calls is None else args.calls,
                      Path(args.out))
    failed = [r.model for r in results for e in r.entries
              if e.backend.startswith("opweave") and e.ms is None]
    return 1 if failed else 0


def _dynamic(args) -> int:
    import torch

    from .bench import cpu, dynamic

    torch.set_num_threads(args.threads)
    sizes = [(b, s) for b in args.batches for s in args.seqs]
    model = (args.models or ["bert-base"])[0]
    print(f"{model}{' (small)' if args.small else ''}; {cpu.line(cpu.describe(args.threads))}")
    print(dynamic.header())
    results = dynamic.measure(sizes, model_name=model, runs=args.runs, warmup=args.warmup,
                              small=args.small)
    worst = max(max(r.max_abs_diff.values()) for r in results)
    print(f"largest difference from eager: {worst:.1e}")
    return 0 if worst < 1e-3 else 1


def _accuracy(args) -> int:
    import torch

    from . import models
    from .bench import accuracy, cpu

    torch.set_num_threads(args.threads)
    print(cpu.line(cpu.describe(args.threads)))
    print(accuracy.table(accuracy.measure_models(args.models or models.BENCHMARK_SET,
                                                 small=args.small)))
    return 0


def _overhead(args) -> int:
    import torch

    from .bench import cpu, overhead

    torch.set_num_threads(args.threads)
    print(cpu.line(cpu.describe(args.threads)))
    print(overhead.table(overhead.measure()))
    return 0


def _horizontal(args) -> int:
    import torch

    from .bench import cpu, horizontal

    torch.set_num_threads(args.threads)
    print(cpu.line(cpu.describe(args.threads)))
    rows = []
    for name in args.models or ["xmlcnn", "zoo-resnet18"]:
        rows += horizontal.measure(name, args.sizes, small=args.small, steps=args.runs,
                                   warmup=args.warmup)
    print(horizontal.table(rows))
    return 0


def _schedules(args) -> int:
    import torch

    from .bench import cpu, stages

    torch.set_num_threads(args.threads)
    print(cpu.line(cpu.describe(args.threads)))
    rows, worst = [], 0.0
    for name in args.models or stages.MODELS:
        row = stages.measure(name, small=args.small, rounds=args.runs, warmup=args.warmup)
        worst = max(worst, *row.max_diff.values())
        print(row.markdown(), flush=True)
        rows.append(row)
    print()
    print(stages.table(rows))
    print(f"largest difference from the sequential plan: {worst:.1e}")
    return 0 if worst < 1e-3 else 1


def _memory_curve(args) -> int:
    import torch

    from .bench import cpu, memory_curve

    torch.set_num_threads(args.threads)
    print(cpu.line(cpu.describe(args.threads)))
    rows = []
    for name in args.models or ["bert-base", "vit-b16"]:
        rows += memory_curve.measure(name, args.batch, args.fractions, runs=args.runs,
                                     warmup=min(args.warmup, 1), small=args.small,
                                     threads=args.threads)
        print(memory_curve.table(rows), flush=True)
    return 0


def _fuzz(args) -> int:
    import warnings

    from .fuzz import check
    from .fuzz.runner import FuzzConfig, fuzz, report

    if args.blocks is not None:
        return _fuzz_blocks(args)
    paths = tuple(p.strip() for p in args.paths.split(",") if p.strip())
    unknown = set(paths) - set(check.PATHS)
    if unknown or not paths:
        print(f"opweave fuzz: unknown path(s) {sorted(unknown)}; known: {', '.join(check.PATHS)}",
              file=sys.stderr)
        return 2
    if args.graphs < 0 or args.max_nodes < 1:
        print("opweave fuzz: --graphs must be >= 0 and --max-nodes >= 1", file=sys.stderr)
        return 2
    config = FuzzConfig(graphs=args.graphs, seed=args.seed, max_nodes=args.max_nodes,
                        paths=paths, out=args.out, time_budget=args.time_budget,
                        minimize=not args.no_minimize)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # per-graph warnings are the fuzzer's to judge
        summary = fuzz(config, log=lambda line: print(line, flush=True))
    print(report(summary, config))
    return 1 if summary.failed else 0


def _fuzz_blocks(args) -> int:
    """`opweave fuzz --blocks N`: N random networks of model blocks in --precision."""
    import warnings

    from .fuzz import blocks

    if args.blocks < 0:
        print("opweave fuzz: --blocks must be >= 0", file=sys.stderr)
        return 2
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a fallback's warning is not a wrong result
        failed = blocks.run(range(args.seed, args.seed + args.blocks), args.precision,
                            args.random_forms, log=lambda line: print(line, flush=True))
    print(f"{args.blocks - failed} of {args.blocks} networks in {args.precision} matched "
          f"float64 within {blocks.TOLERANCES[args.precision]:g} (relative L2)"
          + (", library forms drawn at random" if args.random_forms else ""))
    return 1 if failed else 0


def _profile(args) -> int:
    import os
    import warnings

    import torch

    from . import models
    from .profiling import profile

    torch.set_num_threads(args.threads)
    if args.model in models.BUILDERS:
        from .frontends.torch_export import compile as compile_model

        bench = models.build(args.model, small=args.small)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # what ran in eager is in the profile's rows
            compiled = compile_model(bench.module.eval(), bench.inputs, name=args.model,
                                     precision=args.precision)
        inputs = list(bench.inputs)
    elif os.path.isfile(args.model):
        from .onnx.cli import load_inputs, parse_dims
        from .onnx.model import from_onnx

        compiled = from_onnx(args.model, precision=args.precision)
        arrays = load_inputs(compiled, args.input, parse_dims(args.dim), args.seed,
                             random_missing=True)
        inputs = [torch.from_numpy(arrays[n]) for n in compiled.input_names]
    else:
        print(f"opweave profile: {args.model!r} is neither a benchmark model nor a file; "
              f"models: {', '.join(sorted(models.BUILDERS))}", file=sys.stderr)
        return 2
    prof = profile(compiled, inputs, runs=args.runs, warmup=args.warmup, name=args.model,
                   measure_machine=True)
    print(prof.table(args.top))
    for path, write in ((args.trace, prof.write_trace), (args.html, prof.write_html)):
        if path:
            print(f"wrote {write(path)}")
    return 0


def _add_profile_parser(sub) -> None:
    import os

    p = sub.add_parser("profile", help="where a compiled model's time goes: per kernel, IR "
                                       "node, source line and module; trace and HTML report")
    p.add_argument("model", help="a benchmark model's name, or an .onnx file (random inputs "
                                 "of its declared shapes unless -i gives them)")
    p.add_argument("--small", action="store_true", help="the small variant of a benchmark model")
    p.add_argument("--runs", type=int, default=10, help="profiled calls (default 10)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--top", type=int, default=15, help="rows per table")
    p.add_argument("--precision", choices=COMPILE_PRECISIONS, default=None,
                   help="profile the model compiled in this precision (default: fp32, or "
                        "$OPWEAVE_PRECISION; int8 calibrates on the example inputs, an ONNX "
                        "file on its first call)")
    p.add_argument("--trace", metavar="PATH", help="write a Chrome/Perfetto trace (JSON)")
    p.add_argument("--html", metavar="PATH", help="write the self-contained HTML report")
    p.add_argument("--input", "-i", action="append", metavar="[NAME=]FILE",
                   help="ONNX: inputs as in `opweave run`")
    p.add_argument("--dim", action="append", metavar="NAME=SIZE",
                   help="ONNX: size of a symbolic dimension")
    p.add_argument("--seed", type=int, default=0, help="ONNX: seed of the random inputs")
    p.set_defaults(func=_profile)


def bench_models(args) -> list[str]:
    """`--models` (default: the benchmark set unless `--zoo`), then the zoo with `--zoo`."""
    from . import models

    names = list(args.models or ([] if args.zoo else models.BENCHMARK_SET))
    if args.zoo:
        names += [n for n in models.ZOO_SET if n not in names]
    return names


def _opweave_sound(model, config) -> bool:
    from .bench.harness import TOLERANCE

    entry = model.backends.get("opweave")
    if entry is None:
        return True
    return entry.ok and entry.accurate(TOLERANCE[config.mode])


def main(argv=None) -> int:
    from . import models

    parser = argparse.ArgumentParser(prog="opweave", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("explain", help="coverage and IR summary of a benchmark model")
    p.add_argument("model", choices=sorted(models.BUILDERS))
    p.add_argument("--small", action="store_true", help="the small test variant")
    p.add_argument("--ir", action="store_true", help="also print the IR")
    p.add_argument("--html", metavar="PATH", help="also write the HTML report of `opweave "
                   "profile` (graphs before and after rewriting, fusion groups, why a node "
                   "runs alone; timed over 3 calls)")
    p.add_argument("--no-graph-breaks", action="store_true",
                   help="skip the torch.compile graph-break count (faster)")
    p.add_argument("--rewrite", choices=("eqsat", "greedy", "backtrack", "off"), default=None,
                   help="the rewrite engine (default: eqsat, or $OPWEAVE_REWRITE)")
    p.add_argument("--train", action="store_true",
                   help="the training step (loss and gradients), with its peak memory")
    p.add_argument("--memory-budget", type=float, default=None, metavar="B",
                   help="the training step under a memory budget: a fraction of the "
                        "unconstrained peak (0 < B <= 1) or bytes (B > 1); implies --train")
    p.add_argument("--precision", choices=COMPILE_PRECISIONS, default=None,
                   help="inference in this precision (default: fp32, or $OPWEAVE_PRECISION); "
                        "bf16 and int8 say how many steps run in it, on which units (int8 "
                        "calibrates on the example inputs)")
    p.add_argument("--schedule", choices=("sequential", "ios", "critical-path"), default=None,
                   help="run independent steps in concurrent stages and show them: which ran "
                        "together, on how many threads, estimated against measured")
    p.set_defaults(func=_explain)
    p = sub.add_parser("rules", help="the rewrite rules: list, check, prove, generate")
    p.add_argument("--check", action="store_true", help="run every rule on its examples")
    p.add_argument("--prove", action="store_true", help="prove what z3 can decide")
    p.add_argument("--generate", action="store_true", help="TASO-style rule generation")
    p.add_argument("-v", "--verbose", action="store_true")
    p.set_defaults(func=_rules)
    p = sub.add_parser("rewrite-report", help="rewrite engines compared on benchmark models")
    p.add_argument("models", nargs="*", choices=sorted(models.BUILDERS) + [[]], default=None,
                   help="default: the five benchmark models")
    p.add_argument("--engines", nargs="+", choices=("eqsat", "greedy", "backtrack", "off"),
                   default=["eqsat", "greedy", "backtrack"])
    p.add_argument("--backtrack-seconds", type=float, default=10.0)
    p.add_argument("--small", action="store_true")
    p.set_defaults(func=_rewrite_report)
    p = sub.add_parser("fusion-report", help="ILP and greedy fusion partitioners compared")
    p.add_argument("models", nargs="*", choices=sorted(models.BUILDERS) + [[]], default=None,
                   help="default: the five benchmark models")
    p.add_argument("--small", action="store_true")
    p.set_defaults(func=_fusion_report)
    p = sub.add_parser("demo", help="compile the benchmark models, compare with eager")
    p.add_argument("models", nargs="*", choices=sorted(models.BUILDERS) + [[]], default=None)
    p.add_argument("--small", action="store_true")
    p.add_argument("--runs", type=int, default=10)
    p.set_defaults(func=_demo)
    _add_bench_parser(sub, models)
    _add_fuzz_parser(sub)
    _add_profile_parser(sub)
    from .onnx.cli import add_parsers
    from .options import Options
    from .autotune.cli import add_parsers as add_tune_parsers

    add_parsers(sub)
    add_tune_parsers(sub, Options.from_env().tuning_db)
    args = parser.parse_args(argv)
    try:
        if args.command in ("run", "conformance", "profile"):
            from .onnx.cli import main_guard

            return main_guard(args.func, args)
        return args.func(args)
    except KeyboardInterrupt:
        return 130


def _add_fuzz_parser(sub) -> None:
    p = sub.add_parser("fuzz", help="differential fuzzing: random graphs through every path "
                                    "against eager")
    p.add_argument("--graphs", type=int, default=100, help="graphs to check (default 100)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-nodes", type=int, default=8, help="ops per graph, at most")
    p.add_argument("--paths", default="compile,dynamo,onnx,train",
                   help="comma-separated: compile, dynamo, onnx, train")
    p.add_argument("--out", default="opweave-fuzz-failures",
                   help="directory for the minimised reproducers")
    p.add_argument("--time-budget", type=float, default=None,
                   help="seconds; no new graph starts after it")
    p.add_argument("--no-minimize", action="store_true", help="write failures unminimised")
    p.add_argument("--blocks", type=int, default=None, metavar="N",
                   help="instead of op graphs: N random networks of model blocks (convolutions, "
                        "bottlenecks, attention, MLPs) compiled in --precision, against "
                        "float64 (fuzz/blocks.py); seeds from --seed")
    p.add_argument("--precision", choices=COMPILE_PRECISIONS, default="bf16",
                   help="--blocks: the precision to compile in (default bf16)")
    p.add_argument("--random-forms", action="store_true",
                   help="--blocks: draw each library form at random instead of measuring")
    p.set_defaults(func=_fuzz)


def _milliseconds(text: str) -> float:
    """An argparse type: a finite number of milliseconds, 0 or more."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be 0 or more milliseconds, got {text}")
    return value


def _at_least_one(text: str) -> int:
    """An argparse type: a whole number of at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _add_bench_parser(sub, models) -> None:
    import os

    from .bench.backends import BACKENDS
    from .bench.worker import CALLERS

    p = sub.add_parser("bench", help="measure opweave against eager, Inductor, ONNX Runtime, TVM, "
                                          "OpenVINO")
    p.add_argument("--models", nargs="+", choices=sorted(models.BUILDERS), default=None,
                   help="default: the five benchmark models")
    p.add_argument("--zoo", action="store_true",
                   help="add every zoo model (zoo-*, standard sizes; see models/zoo.py)")
    p.add_argument("--backends", nargs="+", choices=BACKENDS, default=None,
                   help="default: all (inference) or eager, inductor, opweave (training); "
                        "eager is always measured as the reference")
    p.add_argument("--mode", choices=("infer", "train"), default="infer")
    p.add_argument("--precision", choices=("fp32", "bf16", "bf16x3", "int8"), default="fp32",
                   help="bf16: opweave, Inductor (autocast, freezing) and OpenVINO in bf16 "
                        "beside their fp32 forms, held to bf16's tolerance; bf16x3: opweave's "
                        "products from three bf16 parts, held to float32's; int8: opweave and "
                        "ONNX Runtime statically quantized, calibrated on the benchmark's "
                        "inputs, held to int8's (default backends change accordingly)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--runs", type=int, default=10, help="timed rounds (one sample per backend)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                   help="threads for every backend (default: all cores)")
    p.add_argument("--small", action="store_true", help="small model variants (quick check)")
    p.add_argument("--out", default="bench-results", help="directory for JSON, markdown, PNG")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--overhead", action="store_true",
                   help="only measure the runtime's cost per call and per step (Python "
                        "steps, native plan, eager), no models")
    p.add_argument("--horizontal", action="store_true",
                   help="only HFTA: training throughput of N instances fused, one after "
                        "another, and in N processes (default models: xmlcnn, zoo-resnet18)")
    p.add_argument("--schedules", action="store_true",
                   help="only inter-operator schedules: opweave's steps one after another, "
                        "in critical-path stages and in IOS stages, from the same measured "
                        "costs (default models: Inception-v3, SqueezeNet, RandWire, "
                        "GoogLeNet, XML-CNN, BERT-base); --threads above the cores "
                        "oversubscribes")
    p.add_argument("--sizes", nargs="+", type=int, default=[2, 4, 8],
                   help="--horizontal: the numbers of instances")
    p.add_argument("--memory", action="store_true",
                   help="only training memory: step time and peak memory of opweave at "
                        "each --fractions budget, eager, per-block checkpointing and "
                        "Inductor (default models: bert-base at seq 512, vit-b16)")
    p.add_argument("--accuracy", action="store_true",
                   help="only accuracy: eager fp32 and opweave in fp32, bf16, bf16x3 and int8 "
                        "against a float64 reference (max abs and relative L2 of the outputs)")
    p.add_argument("--dynamic", action="store_true",
                   help="only dynamic shapes: one model (default bert-base) at each --batches "
                        "x --seqs size, opweave compiled once with dynamic=True against a "
                        "static compile per size, eager and Inductor dynamic=True")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cuda: the models on the GPU, in one process: eager, Inductor, ONNX "
                        "Runtime's CUDA provider (if installed), opweave and opweave-dynamo "
                        "(--mode, --precision, --runs, --models, --out apply; bench/gpu.py)")
    p.add_argument("--max-autotune", action="store_true",
                   help="--device cuda: add Inductor's max-autotune (minutes per model)")
    p.add_argument("--calls", type=_at_least_one, default=None,
                   help="calls per run of the latency bench: 1 (default), one call after "
                        "the other backends ran; N, N calls back to back, the sample their "
                        "mean without the first (docs/architecture.md); --device cuda: the "
                        "sample is the mean of N calls (default 20)")
    p.add_argument("--pause", type=_milliseconds, default=0.0, metavar="MS",
                   help="the latency bench: sleep MS milliseconds before each timed call, "
                        "so that each meets idle threads and vCPUs as a model served now "
                        "and then does (default 0; docs/runtime.md)")
    p.add_argument("--caller", choices=CALLERS, default="main",
                   help="the latency bench: which thread makes the timed calls: main "
                        "(default), the one that built and compiled the model; thread, one "
                        "other thread, as a server's handler (docs/runtime.md)")
    p.add_argument("--seqs", nargs="+", type=int, default=[8, 16, 32, 64, 128, 256, 384, 512])
    p.add_argument("--batches", nargs="+", type=int, default=[1, 2, 4, 8])
    p.add_argument("--fractions", nargs="+", type=float, default=[1.0, 0.7, 0.5, 0.35],
                   help="--memory: budgets as fractions of opweave's unconstrained peak")
    p.set_defaults(func=_bench)


if __name__ == "__main__":
    sys.exit(main())
