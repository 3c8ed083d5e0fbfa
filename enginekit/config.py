"""Build configuration: precision, per-input shape profiles and everything else a build depends on."""

from __future__ import annotations

import dataclasses
import difflib
import enum
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from enginekit.errors import BuildError

Shape = tuple[int, ...]


class Precision(str, enum.Enum):
    """Numerical precision an engine computes in."""

    FP32 = "fp32"
    FP16 = "fp16"
    BF16 = "bf16"
    INT8 = "int8"

    def __str__(self) -> str:
        return self.value


#: Verification rules (docs/verification.md). ``scaled``: per output,
#: ``max|engine - ref| <= atol + rtol * max|ref|`` and cosine similarity >= the floor;
#: ``elementwise``: every element ``|engine - ref| <= atol + rtol * |ref|`` (the numpy rule).
RULES = ("scaled", "elementwise")

#: Default (atol, rtol) of the ``elementwise`` rule per precision.
DEFAULT_TOLERANCE: dict[Precision, tuple[float, float]] = {
    Precision.FP32: (1e-4, 1e-3),
    Precision.FP16: (1e-2, 1e-2),
    Precision.BF16: (5e-2, 5e-2),
    Precision.INT8: (1e-1, 1e-1),
}

#: Default (atol, rtol) of the ``scaled`` rule per precision: rtol is relative to the output's
#: scale max|ref|; atol is a floor for outputs that are all (near) zero. Why these numbers:
#: docs/verification.md.
SCALED_TOLERANCE: dict[Precision, tuple[float, float]] = {
    Precision.FP32: (1e-6, 1e-4),
    Precision.FP16: (1e-4, 2e-2),
    Precision.BF16: (1e-3, 6e-2),
    Precision.INT8: (1e-2, 2e-1),
}

#: Default cosine-similarity floor of the ``scaled`` rule per precision.
MIN_COSINE: dict[Precision, float] = {
    Precision.FP32: 0.9999,
    Precision.FP16: 0.999,
    Precision.BF16: 0.99,
    Precision.INT8: 0.95,
}


def check_rule(rule: str) -> str:
    """The rule name, checked.

    Raises:
        BuildError: not one of :data:`RULES` (with the closest name).
    """
    if rule not in RULES:
        close = difflib.get_close_matches(str(rule), RULES, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise BuildError(f"verification rule {rule!r} is not one of {', '.join(RULES)}{hint}")
    return rule


@dataclasses.dataclass(frozen=True)
class Tolerance:
    """How verification judges each output against the reference.

    Attributes:
        rule: ``scaled`` (error relative to the output's scale, plus cosine similarity) or
            ``elementwise`` (``|engine - ref| <= atol + rtol * |ref|`` for every element).
        atol: absolute floor.
        rtol: relative tolerance: to ``max|ref|`` (scaled) or to each ``|ref|`` (elementwise).
        min_cosine: cosine-similarity floor for float outputs (None: not gated).
    """

    rule: str = "scaled"
    atol: float = SCALED_TOLERANCE[Precision.FP32][0]
    rtol: float = SCALED_TOLERANCE[Precision.FP32][1]
    min_cosine: float | None = MIN_COSINE[Precision.FP32]

    def __post_init__(self) -> None:
        check_rule(self.rule)
        for name in ("atol", "rtol"):
            if not getattr(self, name) >= 0:
                raise BuildError(f"{name}={getattr(self, name)}: expected a number >= 0")
        c = self.min_cosine
        if c is not None and not -1.0 <= c <= 1.0:
            raise BuildError(f"min_cosine={c}: expected a number in [-1, 1], e.g. 0.9999")

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def default_tolerance(
    precision: Precision | str,
    rule: str = "scaled",
    atol: float | None = None,
    rtol: float | None = None,
    min_cosine: float | None = None,
) -> Tolerance:
    """The rule's defaults for the precision, with any of atol, rtol, min_cosine overridden."""
    precision = Precision(precision)
    table = SCALED_TOLERANCE if check_rule(rule) == "scaled" else DEFAULT_TOLERANCE
    d_atol, d_rtol = table[precision]
    d_cos = MIN_COSINE[precision] if rule == "scaled" else None
    return Tolerance(
        rule,
        d_atol if atol is None else atol,
        d_rtol if rtol is None else rtol,
        d_cos if min_cosine is None else min_cosine,
    )


@dataclasses.dataclass(frozen=True)
class ShapeProfile:
    """The range of shapes one input accepts: every dim of ``min`` <= ``opt`` <= ``max``."""

    min: Shape
    opt: Shape
    max: Shape

    def __post_init__(self) -> None:
        for label in ("min", "opt", "max"):
            object.__setattr__(self, label, tuple(int(d) for d in getattr(self, label)))
        if not len(self.min) == len(self.opt) == len(self.max):
            raise BuildError(
                f"shape profile {self.min}, {self.opt}, {self.max}: min, opt and max must have "
                "the same rank"
            )
        for axis, (lo, mid, hi) in enumerate(zip(self.min, self.opt, self.max)):
            if lo < 0 or not lo <= mid <= hi:
                raise BuildError(
                    f"shape profile {self.min}, {self.opt}, {self.max}: dim {axis} needs "
                    f"0 <= min <= opt <= max, got {lo}, {mid}, {hi}"
                )

    @classmethod
    def fixed(cls, shape: Sequence[int]) -> ShapeProfile:
        """A profile accepting exactly one shape."""
        return cls(tuple(shape), tuple(shape), tuple(shape))

    def contains(self, shape: Sequence[int]) -> bool:
        """Whether ``shape`` lies inside this profile."""
        return len(shape) == len(self.min) and all(
            lo <= d <= hi for d, lo, hi in zip(shape, self.min, self.max)
        )

    def to_json(self) -> list[list[int]]:
        return [list(self.min), list(self.opt), list(self.max)]


#: One optimization profile: input name -> the shapes it accepts.
Profile = Mapping[str, ShapeProfile]

ShapesArg = Mapping[str, Any] | Sequence[Mapping[str, Any]] | str | Sequence[str] | None


def _as_profile(name: str, value: Any) -> ShapeProfile:
    try:
        return _as_profile_unnamed(name, value)
    except BuildError as exc:
        if f"input {name!r}" in str(exc):
            raise
        raise BuildError(f"shapes for input {name!r}: {exc}") from None


def _as_profile_unnamed(name: str, value: Any) -> ShapeProfile:
    if isinstance(value, ShapeProfile):
        return value
    if isinstance(value, str):
        return _parse_profile_text(name, value)
    seq = list(value)
    if seq and all(isinstance(d, (int,)) and not isinstance(d, bool) for d in seq):
        return ShapeProfile.fixed(seq)
    if len(seq) == 3 and all(isinstance(s, (list, tuple)) for s in seq):
        return ShapeProfile(tuple(seq[0]), tuple(seq[1]), tuple(seq[2]))
    raise BuildError(
        f"shapes for input {name!r}: expected one shape like (8, 16) or three shapes "
        f"[min, opt, max], got {value!r}"
    )


_DIMS = re.compile(r"^\d+(x\d+)*$")


def _parse_shape_text(name: str, text: str) -> Shape:
    text = text.strip()
    if text == "" or text == "scalar":
        return ()
    if not _DIMS.match(text):
        raise BuildError(
            f"shapes for input {name!r}: {text!r} is not a shape; write dims joined by 'x', "
            "e.g. 8x3x224x224"
        )
    return tuple(int(d) for d in text.split("x"))


def _parse_profile_text(name: str, text: str) -> ShapeProfile:
    parts = text.split(",")
    if len(parts) == 1:
        return ShapeProfile.fixed(_parse_shape_text(name, parts[0]))
    if len(parts) == 3:
        lo, mid, hi = (_parse_shape_text(name, p) for p in parts)
        try:
            return ShapeProfile(lo, mid, hi)
        except BuildError as exc:
            raise BuildError(f"shapes for input {name!r}: {exc}") from None
    raise BuildError(
        f"shapes for input {name!r}: {text!r} must be one shape (AxB) or min,opt,max (AxB,CxD,ExF)"
    )


def parse_shapes(args: str | Iterable[str]) -> tuple[dict[str, ShapeProfile], ...]:
    """Parse trtexec-style ``name:AxB`` / ``name:min,opt,max`` specs into profiles.

    Specs may be separated by spaces or given as several strings. Naming an input a second
    time starts a new optimization profile (as TensorRT takes several).
    """
    items = args.split() if isinstance(args, str) else [p for a in args for p in a.split()]
    profiles: list[dict[str, ShapeProfile]] = []
    for item in items:
        name, sep, rest = item.rpartition(":")
        if not sep or not name:
            raise BuildError(
                f"--shapes {item!r}: expected name:AxB or name:min,opt,max (e.g. x:1x16,8x16,64x16)"
            )
        profile = _parse_profile_text(name, rest)
        for p in profiles:
            if name not in p:
                p[name] = profile
                break
        else:
            profiles.append({name: profile})
    return tuple(profiles)


def normalize_shapes(shapes: ShapesArg) -> tuple[dict[str, ShapeProfile], ...]:
    """Turn any accepted form of ``shapes=`` into a tuple of profiles.

    Accepted: ``{"x": [(1, 16), (8, 16), (64, 16)]}``, ``{"x": (8, 16)}``, ``{"x": "1x16,8x16,64x16"}``,
    a list of such dicts (one per optimization profile), or trtexec-style text.
    """
    if shapes is None:
        return ()
    if isinstance(shapes, str):
        return parse_shapes(shapes)
    if isinstance(shapes, Mapping):
        return ({str(k): _as_profile(str(k), v) for k, v in shapes.items()},)
    seq: list[Any] = list(shapes)
    if all(isinstance(s, str) for s in seq):
        return parse_shapes(seq)
    if all(isinstance(s, Mapping) for s in seq):
        return tuple({str(k): _as_profile(str(k), v) for k, v in s.items()} for s in seq)
    raise BuildError(f"shapes: expected a dict of input name -> shapes, got {shapes!r}")


@dataclasses.dataclass(frozen=True)
class BuildConfig:
    """Everything a build depends on besides the model itself.

    Args:
        backend: registered backend name (``enginekit backends`` lists them).
        profiles: optimization profiles; each maps input name -> ShapeProfile. Empty means
            the model's own shapes, with symbolic dims unrestricted where the backend allows.
        precision: fp32, fp16, bf16 or int8.
        device: ``cpu``, ``cuda`` or ``cuda:N``.
        verify: run the built engine against the ONNX Runtime CPU reference at build time.
        atol, rtol: verification tolerance; None takes the precision's default for ``rule``.
        rule: verification rule: ``scaled`` (default) or ``elementwise`` (docs/verification.md).
        min_cosine: cosine-similarity floor of the scaled rule; None takes the precision's.
        seed: seed of the random verification inputs.
        options: backend-specific options (each backend documents and validates its own).
        simplify: simplify the graph before the backend builds it (enginekit.passes.simplify).
        outputs: build only the subgraph computing these tensors (empty: the model's outputs).
        verify_example: the first batch verification will feed (from ``verify_data``), set by
            :func:`enginekit.build`: a backend that compiles programs specialized to input
            values (XLA, TVM) compiles the one verification runs. Not part of the config's
            identity (neither compared nor serialized).
    """

    backend: str = "onnxruntime"
    profiles: tuple[dict[str, ShapeProfile], ...] = ()
    precision: Precision = Precision.FP32
    device: str = "cpu"
    verify: bool = True
    atol: float | None = None
    rtol: float | None = None
    seed: int = 0
    rule: str = "scaled"
    min_cosine: float | None = None
    options: dict[str, Any] = dataclasses.field(default_factory=dict)
    simplify: bool = True
    outputs: tuple[str, ...] = ()
    verify_example: Mapping[str, Any] | None = dataclasses.field(
        default=None, compare=False, repr=False
    )

    def __post_init__(self) -> None:
        object.__setattr__(self, "outputs", tuple(self.outputs))
        try:
            object.__setattr__(self, "precision", Precision(self.precision))
        except ValueError:
            raise BuildError(
                f"precision {self.precision!r} is not one of "
                f"{', '.join(p.value for p in Precision)}"
            ) from None
        check_rule(self.rule)
        if not (self.device == "cpu" or re.fullmatch(r"cuda(:\d+)?", self.device)):
            raise BuildError(f"device {self.device!r}: expected 'cpu', 'cuda' or 'cuda:N'")

    @property
    def tolerance(self) -> tuple[float, float]:
        """(atol, rtol) used by build-time verification, under :attr:`rule`."""
        t = self.verification
        return (t.atol, t.rtol)

    @property
    def verification(self) -> Tolerance:
        """The whole verification tolerance: rule, atol, rtol, cosine floor."""
        return default_tolerance(self.precision, self.rule, self.atol, self.rtol, self.min_cosine)

    def to_json(self) -> dict[str, Any]:
        """A JSON-safe dict that :meth:`from_json` turns back into an equal config."""
        return {
            "backend": self.backend,
            "profiles": [{k: v.to_json() for k, v in p.items()} for p in self.profiles],
            "precision": self.precision.value,
            "device": self.device,
            "verify": self.verify,
            "atol": self.atol,
            "rtol": self.rtol,
            "seed": self.seed,
            "rule": self.rule,
            "min_cosine": self.min_cosine,
            "options": dict(self.options),
            "simplify": self.simplify,
            "outputs": list(self.outputs),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> BuildConfig:
        """Inverse of :meth:`to_json`."""
        fields = dict(data)
        fields["profiles"] = tuple(
            {k: ShapeProfile(*(tuple(s) for s in v)) for k, v in p.items()}
            for p in fields.get("profiles", ())
        )
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in fields.items() if k in known})
