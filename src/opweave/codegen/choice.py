"""Measured choices among an anchor group's forms (codegen/library.py makes the forms):
recorded in the tuning database for this machine, or measured by interleaved runs and
recorded; memoized per process, shared by a size class for graphs compiled for many
sizes, and measured again under `rechecking`."""
from __future__ import annotations

import re
import time
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Callable

import torch

from .. import tune
from ..ir.graph import Value
from . import precision as prec

_CHOICES: dict[tuple, tuple[str, float]] = {}  # signature -> (fastest candidate, seconds)
_CLASS_CHOICES: dict[tuple, tuple[str, float]] = {}  # size class -> (candidate, s per FLOP)


KIND = "library-form"  # the tuning database's name for this decision
# The same decision for a size class (`size_class`); its times are seconds per FLOP.
CLASS_KIND = "library-form-by-size-class"
_BY_SIZE_CLASS: ContextVar[bool] = ContextVar("opweave_library_by_size_class", default=False)


@contextmanager
def by_size_class():
    """Within it, a signature never measured takes the form measured for its size class,
    and its time scaled by its FLOPs: a graph compiled for many sizes (specializing.py)
    measures each anchor once per class, not once per size (BERT-base spent 4-6 s of each
    new size's compile measuring)."""
    token = _BY_SIZE_CLASS.set(True)
    try:
        yield
    finally:
        _BY_SIZE_CLASS.reset(token)


# Within `rechecking`, recorded forms are measured again and each keeps its fastest sample
# of every run (noise only adds time, so a record measured under load is corrected).
_RECHECK: ContextVar[bool] = ContextVar("opweave_library_recheck", default=False)


@contextmanager
def rechecking(on: bool = True):
    token = _RECHECK.set(on)
    try:
        yield
    finally:
        _RECHECK.reset(token)


def is_rechecking() -> bool:
    """Whether recorded choices are being measured again (`rechecking`): attention's form
    follows it too."""
    return _RECHECK.get()


def _rounded(match: re.Match) -> str:
    dims = [int(d) for d in match.group(1).split(",") if d]
    return "[" + ",".join(str(d if d <= 2 else 1 << (d - 1).bit_length()) for d in dims) + "]"


def size_class(key: tuple) -> tuple:
    """A signature with every size rounded up to a power of two (1 and 2 kept): the
    shapes between two powers of two share one measured choice."""
    op, attrs, types, *rest = key
    return (op, attrs, tuple(re.sub(r"\[([0-9,]*)\]", _rounded, t) for t in types), *rest)


def _memo_key(key: tuple) -> tuple:
    return key, torch.get_num_threads()


def _by_class(key: tuple, candidates, work: float) -> tuple[str, float] | None:
    """The form recorded for `key`'s size class and its time scaled to `work` FLOPs."""
    if not (_BY_SIZE_CLASS.get() and work > 0):
        return None
    memo = _memo_key(size_class(key))
    recalled = _CLASS_CHOICES.get(memo) or tune.recall(CLASS_KIND, memo[0], candidates)
    if recalled is None or recalled[0] not in candidates:
        return None
    _CLASS_CHOICES[memo] = recalled
    return recalled[0], recalled[1] * work


def measured(key: tuple, work: float = 0.0) -> float | None:
    """Seconds of the fastest form measured for this signature (in this process, or
    recorded in the tuning database for this machine), if any; within `by_size_class`,
    its class's scaled to `work` FLOPs where the signature itself was never measured."""
    if _memo_key(key) in _CHOICES:
        return _CHOICES[_memo_key(key)][1]
    if _RECHECK.get():
        return None  # measured again by `choose`
    recalled = tune.recall(KIND, key, _ANY) or _by_class(key, _ANY, work)
    return recalled[1] if recalled else None


def choose(key: tuple, candidates: dict[str, Callable], inputs: list[Value],
           rounds: int = 7, work: float = 0.0) -> tuple[str, float]:
    """The faster candidate at these shapes and its best time: recorded in the tuning
    database for this machine, or measured by interleaved runs on random inputs and
    recorded (memoized per key for the process too). With a learned ranker stored for
    this machine (`opweave tune ranker`), only the forms it ranks first are measured.
    Within `by_size_class`, a choice of the signature's size class serves, and a new
    measurement is recorded for the class too (`work`: the anchor's FLOPs).
    The minimum, not the median: on a shared machine noise only adds time, and medians of
    7 runs picked an unfused convolution + ReLU over the fused one in a third of ResNet's
    groups. Within `rechecking`, a recorded choice is measured again and decided on the
    record's samples and the new ones together."""
    memo = _memo_key(key)
    if memo in _CHOICES and _CHOICES[memo][0] in candidates:
        return _CHOICES[memo]
    recheck = _RECHECK.get()
    recalled = None if recheck else \
        tune.recall(KIND, key, candidates) or _by_class(key, candidates, work)
    if recalled is None:
        # convolutions keep activations channels-last between them, so measure them that way
        args = [_example(v, channels_last=key[0] == "conv") for v in inputs]
        shortlist = tune.shortlist(KIND, key, candidates, tune.active())
        leaving = ("leaves", "bf16") in key
        if leaving:
            shortlist = leaving_bf16(shortlist)
        if ("reads", "bf16") in key:
            shortlist = handed_bf16(shortlist, residual=("residual", "bf16") in key)
        samples = measure(shortlist, args, rounds)
        if recheck:  # with every earlier sample of today's forms
            earlier = tune.recorded_samples(KIND, key)
            samples = {form: earlier.get(form, []) + times for form, times in samples.items()}
        best = _preferring_int8(samples) if ("precision", "int8") in key else \
            _preferring_bf16(samples, handed=("reads", "bf16") in key, leaving=leaving) \
            if ("precision", "bf16") in key else \
            _preferring_direct(samples)
        tune.remember(KIND, key, best, samples)
        recalled = best, min(samples[best])
        if _BY_SIZE_CLASS.get() and work > 0:
            per_flop = {name: [t / work for t in times] for name, times in samples.items()}
            tune.remember(CLASS_KIND, size_class(key), best, per_flop)
            _CLASS_CHOICES[_memo_key(size_class(key))] = best, min(per_flop[best])
    _CHOICES[memo] = recalled
    return recalled


# a group's direct oneDNN form is kept unless another measured more than this much faster
DIRECT_MARGIN = 0.03


def _preferring_direct(samples: dict[str, list[float]], direct: str = "onednn-direct") -> str:
    """The fastest form by its minimum time, except that the direct form is taken unless
    it is more than DIRECT_MARGIN slower. Measured here, each form is called from Python,
    and the direct form's call (ctypes, its output allocated in Python) costs more there
    than torch's op does; in a native plan it is one raw call with no descriptor built,
    where torch's builds oneDNN's primitive descriptor at every call. ResNet-50 on a Zen 4,
    2 threads, interleaved in one process: 39.46 ms with torch's forms, 38.43 with each
    convolution's form chosen by its minimum alone, 37.68 with the direct form everywhere."""
    fastest = {name: min(times) for name, times in samples.items()}
    best = min(fastest, key=fastest.get)
    if direct in fastest and fastest[direct] <= fastest[best] * (1 + DIRECT_MARGIN):
        return direct
    return best


# where bf16 was asked for and a group's operand may come to it in bf16, its bf16 form is
# kept unless a float32 form measured more than this much faster
BF16_MARGIN = 0.10


def _preferring_bf16(samples: dict[str, list[float]], handed: bool = False,
                     leaving: bool = False) -> str:
    """The bf16 forms' pick (as `_preferring_direct`), unless a float32 form measured
    faster (the float32 forms' pick, as `_preferring_direct`): that one is only more
    accurate. `handed`: the group's operand may come to it in bf16
    (`precision.may_arrive_in_bf16`, and each form was measured on it as it would read it:
    `handed_bf16`); then the float32 form must be more than BF16_MARGIN faster. Measured
    here, a bf16 form widens its result, which between bf16 steps it does not, so it runs
    faster there than it measured, and a float32 form there makes its readers round its
    result. A group reading a float32 operand
    (a graph input) rounds it at every call, as measured. Small products and products
    bound by their operand's bytes run faster in float32: GCN's [2708, 1433] x [1433, 16]
    product on its input features, 673-677 us on oneDNN's direct float32 form against
    693-763 in bf16 on a Zen 4, warm; in the bench's calls, with the features coming from
    memory, its bf16 model ran 2.48 ms against float32's 2.27. `leaving`: the group's
    result may leave in bf16 too, and each form was measured so (`leaving_bf16`): the
    margin's two reasons are in the measurement, so there is none."""
    low = {name: times for name, times in samples.items() if name.endswith(prec.LOW_SUFFIX)}
    full = {name: times for name, times in samples.items() if name not in low}
    low_direct = "onednn-direct" + prec.LOW_SUFFIX
    if not low or not full:
        return _preferring_direct(samples, direct=low_direct if low else "onednn-direct")
    low_best = _preferring_direct(low, direct=low_direct)
    full_best = _preferring_direct(full)
    margin = BF16_MARGIN if handed and not leaving else 0.0
    if min(full[full_best]) * (1 + margin) < min(low[low_best]):
        return full_best
    return low_best


# where static int8 was asked for, a group's int8 form is kept unless it measured more
# than this much slower than its fastest float32 form
INT8_MARGIN = 0.10


def _preferring_int8(samples: dict[str, list[float]]) -> str:
    """The fastest form by its minimum time, except that the fastest int8 form is taken
    unless it is more than INT8_MARGIN slower than it: int8 was asked for, a shared
    machine's noise is about that large, and a group kept in float32 costs more than its
    own time shows (its neighbours then pass float32, not codes, to it and through it: one
    float32 convolution at a ResNet stage's entry kept the whole stage's sums in float32).
    Among the int8 forms, "onednn-int8-direct" is taken unless another is more than
    DIRECT_MARGIN faster, for the reason `_preferring_direct` gives."""
    fastest = {name: min(times) for name, times in samples.items()}
    best = min(fastest, key=fastest.get)
    quantized = [name for name in fastest if name.startswith("onednn-int8")]
    if not quantized:
        return best
    fastest_int8 = min(quantized, key=fastest.get)
    direct = "onednn-int8-direct"
    # as `_preferring_direct`: its native call costs less than it measured from Python
    preferred = direct if direct in fastest and \
        fastest[direct] <= fastest[fastest_int8] * (1 + DIRECT_MARGIN) else fastest_int8
    # (each margin on its own: the two together never keep an int8 form further behind
    # float32 than INT8_MARGIN)
    for name in (preferred, fastest_int8):
        if fastest[name] <= fastest[best] * (1 + INT8_MARGIN):
            return name
    return best


def handed_bf16(candidates: dict[str, Callable], residual: bool = False) -> dict[str, Callable]:
    """The forms of a group whose operand comes to it in bf16 (`precision.
    may_arrive_in_bf16`), each measured on the operand as it would read it there: the bf16
    forms on the rounded operand as it is, the float32 forms widening it first. Measured
    on a float32 operand, a bf16 form rounds it at every call, which between bf16 steps
    it does not: MobileNetV2's depthwise 3x3 over [1, 96, 113, 113] measured 162 us in
    bf16 against 95 in float32 that way, and runs in 68 against 88 (+ the widening) on a
    bf16 operand (oneDNN's direct forms, 2-core Zen 4). `residual`: the residual operand
    (the second) comes in bf16 too, and is read the same way: measured on a float32 one,
    ResNet-50's first stage's bf16 convolutions rounded their [1, 256, 56, 56] residual at
    every call and lost to the float32 form, which then widened the whole stage (AMX)."""
    handed = 2 if residual else 1

    def reading(name: str, fn: Callable) -> Callable:
        low = name.endswith(prec.LOW_SUFFIX)

        def call(*args):
            if low:
                return fn(*args)
            return fn(*[prec.widen(a) for a in args[:handed]], *args[handed:])
        call.measured_args = lambda args: [*map(prec.narrow, args[:handed]), *args[handed:]]
        return call
    return {name: reading(name, fn) for name, fn in candidates.items()}


def leaving_bf16(candidates: dict[str, Callable]) -> dict[str, Callable]:
    """The forms of a group whose result may leave in bf16 (`precision.may_leave_in_bf16`),
    each measured with its result as its readers take it: a bf16 form's left in bf16
    (`handed_on`), a float32 form's rounded, as its readers round it. Measured with the bf16
    result widened, a bf16 form paid a conversion the model does not make, and a float32
    form none of those it makes its readers do: MobileNetV2's 1x1 convolution 16->96 over
    112x112 with ReLU6 measured 382 us in float32 against 502 in bf16, so five of its
    convolutions ran in float32 between bf16 ones; measured so, they are bf16 and the
    model takes 0.89x the time (2-core Xeon with AMX, one process, the two compiles
    called alternately)."""
    def leaving(fn: Callable) -> Callable:
        handed_on = getattr(fn, "handed_on", None)
        low = handed_on() if handed_on is not None else None
        if low is not None:
            return low

        def call(*args):
            return [prec.narrow(y) for y in fn(*args)]
        if hasattr(fn, "measured_args"):
            call.measured_args = fn.measured_args
        return call
    return {name: leaving(fn) for name, fn in candidates.items()}


class _Anything:
    """Accepts every candidate name (to read a recorded time without the candidates)."""

    def __contains__(self, name) -> bool:
        return True


_ANY = _Anything()


def measure(candidates: dict[str, Callable], args, rounds: int = 7) -> dict[str, list[float]]:
    """Seconds of each of `rounds` interleaved runs per candidate on `args`, after two
    warm-up rounds."""
    samples: dict[str, list[float]] = {name: [] for name in candidates}
    # a form may be measured on its operands as they reach it (int8 codes: Int8Group)
    own_args = {name: fn.measured_args(args) if hasattr(fn, "measured_args") else args
                for name, fn in candidates.items()}
    for r in range(rounds + 2):
        for name, fn in candidates.items():
            t = time.perf_counter()
            fn(*own_args[name])
            if r >= 2:
                samples[name].append(time.perf_counter() - t)
    return samples


def fastest(candidates: dict[str, Callable], args, rounds: int = 7) -> tuple[str, float]:
    """The candidate with the smallest minimum time over `rounds` interleaved runs on
    `args`, and that time."""
    samples = measure(candidates, args, rounds)
    name = min(samples, key=lambda n: min(samples[n]))
    return name, min(samples[name])


def _example(v: Value, channels_last: bool) -> torch.Tensor:
    t = v.type
    if not t.dtype.is_floating_point:
        return torch.zeros(t.shape, dtype=t.dtype)
    x = torch.randn(t.shape, dtype=t.dtype)
    return x.contiguous(memory_format=torch.channels_last) if channels_last and x.dim() == 4 else x
