"""`opweave run` and `opweave conformance`: the ONNX commands of the CLI."""
from __future__ import annotations

import os
import sys

import numpy as np

from ..files import atomic_write
from .errors import OnnxError


def parse_dims(items) -> dict[str, int]:
    dims = {}
    for item in items or []:
        name, _, value = item.partition("=")
        if not name or not value.lstrip("-").isdigit() or int(value) < 0:
            raise OnnxError(f"--dim {item!r}: expected NAME=SIZE with a non-negative size")
        dims[name] = int(value)
    return dims


def load_inputs(model, files, dims: dict[str, int], seed: int,
                random_missing: bool = False) -> dict[str, np.ndarray]:
    """Inputs from .npz (by name) / .npy (NAME=file.npy, or in input order) files. An
    input no file gives is an error, unless `random_missing` asks for random data of the
    declared shapes: a typo in an .npz must not silently run the model on noise."""
    arrays: dict[str, np.ndarray] = {}
    positional = iter(model.input_names)
    for item in files or []:
        name, sep, path = item.partition("=")
        if not sep:
            name, path = None, item
        if not os.path.isfile(path):
            raise OnnxError(f"input file {path!r} does not exist")
        try:
            loaded = np.load(path, allow_pickle=False)
        except Exception as error:
            raise OnnxError(f"cannot read input file {path!r}: {error}") from None
        if isinstance(loaded, np.lib.npyio.NpzFile):
            unknown = set(loaded.files) - set(model.input_names)
            if unknown:
                raise OnnxError(f"{path}: no model input named {', '.join(sorted(unknown))}; "
                                f"inputs: {', '.join(model.input_names)}")
            arrays.update({k: loaded[k] for k in loaded.files})
        else:
            name = name or next(positional, None)
            if name not in model.input_names:
                raise OnnxError(f"{path}: no model input named {name!r}; inputs: "
                                f"{', '.join(model.input_names)}")
            arrays[name] = loaded
    missing = [n for n in model.input_names if n not in arrays]
    if missing and not random_missing:
        raise OnnxError(f"no input file gives model input(s) {', '.join(missing)}; pass them "
                        f"with -i (an .npz with arrays named like the inputs, or NAME=file.npy), "
                        f"or --random-missing for random data of the declared shapes")
    if missing:
        symbols = {**model.bind({n: np.shape(a) for n, a in arrays.items()}), **dims}
        rng = np.random.default_rng(seed)
        for name, ttype in model.input_types(symbols, names=missing).items():
            arrays[name] = _random(rng, ttype)
    return arrays


def _random(rng, ttype) -> np.ndarray:
    """Standard normal floats; integers in {0, 1} (valid indices for any non-empty dim)."""
    import torch

    from .arrays import to_numpy

    if ttype.dtype == torch.bool:
        return rng.random(ttype.shape) < 0.5
    if ttype.dtype.is_floating_point:
        values = torch.from_numpy(rng.standard_normal(ttype.shape).astype(np.float32))
    else:
        values = torch.from_numpy(rng.integers(0, 2, size=ttype.shape))
    return to_numpy(values.to(ttype.dtype))


def run_command(args) -> int:
    from .model import from_onnx

    model = from_onnx(args.model)
    inputs = load_inputs(model, args.input, parse_dims(args.dim), args.seed,
                         args.random_missing)
    outputs = model(**inputs)
    named = dict(zip(model.output_names, outputs))
    if args.output:
        atomic_write(args.output, lambda tmp: _savez(tmp, named))
        print(f"wrote {len(named)} output(s) to {args.output}")
    for name, array in named.items():
        flat = np.asarray(array, dtype=np.float64).reshape(-1) if array.size else np.zeros(0)
        preview = np.array2string(flat[:6], precision=4, separator=", ")
        print(f"{name}: {array.dtype}{list(array.shape)} {preview}{' ...' if flat.size > 6 else ''}")
    return 0


def _savez(path, arrays: dict) -> None:
    """An .npz (a zip of .npy files) at exactly `path`; np.savez would append ".npz" to
    other names, and its `file` parameter would clash with an output named "file"."""
    import zipfile

    with zipfile.ZipFile(path, "w") as archive:
        for name, array in arrays.items():
            with archive.open(f"{name}.npy", "w") as member:
                np.lib.format.write_array(member, np.asanyarray(array), allow_pickle=False)


def conformance_command(args) -> int:
    from . import conformance

    report = conformance.run(set(args.ops) if args.ops else None)
    print(report.text(verbose=args.verbose))
    return 1 if report.count(conformance.FAILED) else 0


def add_parsers(sub) -> None:
    p = sub.add_parser("run", help="run an ONNX model through opweave")
    p.add_argument("model", help="the .onnx file")
    p.add_argument("--input", "-i", action="append", metavar="[NAME=]FILE",
                   help=".npz with arrays named like the inputs, or .npy for one input "
                        "(NAME=file.npy, or in input order); repeatable. An input no file "
                        "gives is an error unless --random-missing")
    p.add_argument("--random-missing", action="store_true",
                   help="fill inputs no file gives with random data of the declared shapes "
                        "(seeded by --seed)")
    p.add_argument("--dim", action="append", metavar="NAME=SIZE",
                   help="size of a symbolic dimension, for random inputs")
    p.add_argument("--output", "-o", help="save the outputs to this .npz")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=run_command)
    p = sub.add_parser("conformance", help="the ONNX backend node tests through opweave")
    p.add_argument("--ops", nargs="+", help="only these ONNX operators")
    p.add_argument("--verbose", action="store_true", help="list every op of the suite")
    p.set_defaults(func=conformance_command)


def main_guard(func, args) -> int:
    """Run a command; an OnnxError is one clear line on stderr, not a traceback."""
    try:
        return func(args)
    except OnnxError as error:
        print(f"opweave: error: {error}", file=sys.stderr)
        return 2
