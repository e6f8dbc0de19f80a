"""A profile: what a model costs on one kind of device, as the simulator and the planner read it.

``pdserve profile`` measures one on this machine; one built from published figures plans a
fleet elsewhere (a GPU profile taken on other hardware plans GPUs). JSON, reusable. Parts:

- Step cost per parallel degree (torch threads on a CPU, tensor-parallel GPUs). One forward
  pass of a continuous batch costs, in milliseconds,

      base + decode * decodes + prefill * prompt tokens
           + decode_ctx * (sum of the decodes' contexts)
           + prefill_attn * (sum over prompt chunks of chunk * (start + chunk / 2))

  the weights are read once per step, every token pays its matmuls, and attention reads each
  token's context (the terms of DistServe's and Vidur's latency models).
- KV handoff per transport: a fixed cost plus a cost per MiB.
- Serving overheads the engine alone does not show: the router and gRPC hops before the first
  token (and the extra of the disaggregated path), a per-step and per-sequence cost of
  streaming outputs, and how often the router refreshes its view of the workers.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path

log = logging.getLogger(__name__)
PROFILE_VERSION = 1
PARALLEL_KINDS = ("threads", "tensor_parallel")


@dataclass(frozen=True, slots=True)
class StepShape:
    """What a step runs, in the terms the cost model prices."""

    decodes: int = 0
    decode_context: int = 0  # sum over the decodes of the tokens each attends to
    prefill_tokens: int = 0
    prefill_pairs: float = 0.0  # sum over prompt chunks of chunk * (start + chunk / 2)

    @classmethod
    def of(cls, decode_contexts: list[int], chunks: list[tuple[int, int]]) -> "StepShape":
        """``chunks``: (start, num_tokens) of each prompt chunk."""
        return cls(
            len(decode_contexts),
            sum(decode_contexts),
            sum(n for _, n in chunks),
            sum(n * (start + n / 2) for start, n in chunks),
        )

    @property
    def empty(self) -> bool:
        return not self.decodes and not self.prefill_tokens

    def features(self) -> tuple[float, float, float, float, float]:
        """The multipliers of StepCost's terms, in field order."""
        return (
            0.0 if self.empty else 1.0,
            float(self.decodes),
            float(self.prefill_tokens),
            float(self.decode_context),
            float(self.prefill_pairs),
        )


@dataclass(frozen=True, slots=True)
class StepCost:
    """Milliseconds of one forward pass (see the module doc)."""

    base_ms: float
    decode_ms: float  # per decoding sequence
    prefill_ms: float  # per prompt token
    decode_ctx_ms: float  # per context token a decode attends to
    prefill_attn_ms: float  # per (prompt token, context token) pair

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"step cost {f.name}: must be a finite number, got {value!r}")
        if self.base_ms < 0:
            raise ValueError(f"step cost base_ms: must be >= 0, got {self.base_ms}")
        # A term may weigh a little below zero (figures fitted by hand); the smallest steps still take time.
        if self.prefill_alone_ms(1) <= 0 or self.decode_step_ms(1, 1) <= 0:
            raise ValueError("step cost: a one-token prefill and a one-sequence decode step must each take > 0 ms")

    def coefficients(self) -> tuple[float, ...]:
        return tuple(getattr(self, f.name) for f in fields(self))

    def ms(self, shape: StepShape) -> float:
        return max(0.0, sum(c * x for c, x in zip(self.coefficients(), shape.features())))

    def prefill_alone_ms(self, tokens: int, start: int = 0) -> float:
        """One prompt (or its uncached part, from ``start``) in a step of its own."""
        return self.ms(StepShape.of([], [(start, tokens)]))

    def decode_step_ms(self, batch: int, context: int) -> float:
        """A step of ``batch`` decodes whose contexts are ``context`` tokens each."""
        return self.ms(StepShape.of([context] * batch, []))

    def max_prefill_tokens(self, decodes: int, decode_context: int, budget_ms: float) -> int:
        """The most prompt tokens (one chunk from the start of its prompt) that a step with
        these decodes can add and still take at most ``budget_ms``; 0 if none fits."""
        spare = budget_ms - self.ms(StepShape(decodes, decode_context))
        if decodes == 0:
            spare -= self.base_ms  # a step of the chunk alone still pays the base
        if spare <= 0:
            return 0
        a, b = self.prefill_attn_ms / 2, self.prefill_ms  # chunk n costs a n^2 + b n
        if a <= 0:
            return int(spare / b) if b > 0 else 1 << 30
        return int((-b + math.sqrt(b * b + 4 * a * spare)) / (2 * a))


@dataclass(frozen=True, slots=True)
class TransferCost:
    """One KV handoff: ``fixed_ms + ms_per_mib * MiB``."""

    fixed_ms: float
    ms_per_mib: float

    def __post_init__(self) -> None:
        if not (
            math.isfinite(self.fixed_ms)
            and math.isfinite(self.ms_per_mib)
            and self.fixed_ms >= 0
            and self.ms_per_mib >= 0
        ):
            raise ValueError(f"transfer cost must be finite and >= 0, got {self.fixed_ms}, {self.ms_per_mib}")

    def ms(self, nbytes: int) -> float:
        return self.fixed_ms + self.ms_per_mib * nbytes / 2**20


@dataclass(frozen=True, slots=True)
class Overheads:
    """What serving adds to the engine's own steps (milliseconds, seconds where named)."""

    first_token_ms: float = 0.0  # client -> router -> worker and the first token back (every request)
    handoff_ms: float = 0.0  # the disaggregated path's extra: reservation, second RPC, acknowledgement
    step_ms: float = 0.0  # per engine step of a serving worker, beyond the forward pass
    seq_ms: float = 0.0  # per sequence per step (its token streamed out)
    stats_interval_s: float = 1.0  # the router's view of worker load is this old at most

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"overheads.{f.name}: must be a finite number >= 0, got {value!r}")
        if self.stats_interval_s <= 0:
            raise ValueError("overheads.stats_interval_s: must be > 0")


@dataclass(frozen=True)
class Profile:
    model: str
    device: str  # what ran it: "cpu (2 cores, AMD EPYC ...)", "NVIDIA A100-SXM4-80GB"
    parallel: str  # what a degree counts: threads or tensor_parallel
    steps: dict[int, StepCost]  # by degree
    kv_bytes_per_token: int  # all layers, K and V
    transfers: dict[str, TransferCost]
    transport: str  # the transport a stack of this kind negotiates
    overheads: Overheads = field(default_factory=Overheads)
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"  # the KV format kv_bytes_per_token and the transfer times are of
    cores: int | None = None  # devices every worker of a stack shares (a CPU's cores); None: one per degree
    kv_cache_tokens: dict[int, int] = field(default_factory=dict)  # KV capacity of one instance, by degree
    max_model_len: int = 8192
    source: str = ""  # how it was made: the command, or the publications its figures come from
    created: str = ""
    fit_error: dict[int, float] = field(default_factory=dict)  # median relative error of the fit, by degree
    samples: tuple[dict, ...] = ()  # the raw measurements
    version: int = PROFILE_VERSION

    def __post_init__(self) -> None:
        if self.parallel not in PARALLEL_KINDS:
            raise ValueError(f"profile.parallel: must be one of {', '.join(PARALLEL_KINDS)}, got {self.parallel!r}")
        if not self.steps:
            raise ValueError("profile.steps: needs the step cost of at least one degree")
        if any(not isinstance(d, int) or d < 1 for d in self.steps):
            raise ValueError(f"profile.steps: degrees must be integers >= 1, got {sorted(self.steps)}")
        if not isinstance(self.transport, str) or self.transport not in self.transfers:
            raise ValueError(f"profile.transport: {self.transport!r} has no entry in profile.transfers")
        for name in ("kv_bytes_per_token", "cores", "max_model_len"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value >= 2**40):
                raise ValueError(f"profile.{name}: must be an integer below 2**40, got {value!r}")
        if any(tokens < 1 for tokens in self.kv_cache_tokens.values()):
            raise ValueError(f"profile.kv_cache_tokens: must be >= 1 per degree, got {self.kv_cache_tokens}")
        if self.kv_bytes_per_token < 1:
            raise ValueError(f"profile.kv_bytes_per_token: must be >= 1, got {self.kv_bytes_per_token}")
        if self.cores is not None and self.cores < 1:
            raise ValueError(f"profile.cores: must be >= 1, got {self.cores}")
        if self.max_model_len < 2:
            raise ValueError(f"profile.max_model_len: must be >= 2, got {self.max_model_len}")
        for degree, cost in self.steps.items():  # a term below zero must not make long steps free
            if (
                cost.decode_ms + cost.decode_ctx_ms * self.max_model_len <= 0
                or cost.prefill_alone_ms(self.max_model_len) <= 0
            ):
                raise ValueError(
                    f"profile.steps.{degree}: a sequence at the longest context ({self.max_model_len} tokens) "
                    "would cost nothing (a term weighs too far below zero)"
                )

    # -- queries --------------------------------------------------------------------------------
    @property
    def degrees(self) -> tuple[int, ...]:
        return tuple(sorted(self.steps))

    def step_cost(self, degree: int) -> StepCost:
        """The cost at ``degree``, else at the nearest measured degree below it (more threads
        than measured run at least as fast), else the smallest measured one."""
        if degree in self.steps:
            return self.steps[degree]
        below = [d for d in self.degrees if d < degree]
        return self.steps[below[-1] if below else self.degrees[0]]

    def kv_tokens(self, degree: int) -> int | None:
        if degree in self.kv_cache_tokens:
            return self.kv_cache_tokens[degree]
        if not self.kv_cache_tokens:
            return None
        nearest = min(self.kv_cache_tokens, key=lambda d: abs(d - degree))
        return self.kv_cache_tokens[nearest] * degree // nearest

    def warn_if_other_model(self, model_dir: str, path: str) -> None:
        """Serving one model with another model's profile sizes chunks and replicas wrongly: say so."""
        served = Path(model_dir).name
        if self.model != served:
            log.warning(
                "profile %s measured %s on %s; this worker serves %s: its step costs do not describe it "
                "(make one with: pdserve profile --output FILE)",
                path,
                self.model,
                self.device,
                served,
            )

    def check_fits(self, specs) -> None:
        """ValueError when the workload (RequestSpecs) holds requests the profiled model cannot
        take: a simulation would count them as SLO misses, and advise looser SLOs."""
        too_long = [s for s in specs if s.prompt_len + s.max_tokens > self.max_model_len]
        if too_long:
            worst = max(too_long, key=lambda s: s.prompt_len + s.max_tokens)
            raise ValueError(
                f"--input-len/--output-len: {len(too_long)} of {len(specs)} requests exceed the profile's "
                f"max_model_len {self.max_model_len} (the longest: {worst.prompt_len} prompt + "
                f"{worst.max_tokens} output tokens)"
            )

    def transfer_ms(self, num_tokens: int, transport: str | None = None) -> float:
        return self.transfers[transport or self.transport].ms(num_tokens * self.kv_bytes_per_token)

    # -- JSON -----------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        out = asdict(self)
        for key in ("steps", "kv_cache_tokens", "fit_error"):
            out[key] = {str(k): v for k, v in out[key].items()}
        out["samples"] = list(self.samples)
        return out

    @classmethod
    def from_dict(cls, data: dict) -> "Profile":
        """Raises ValueError naming the field that is missing or wrong."""
        if not isinstance(data, dict):
            raise ValueError("profile: expected a JSON object")
        if data.get("version") != PROFILE_VERSION:
            raise ValueError(
                f"profile.version: this pdserve reads version {PROFILE_VERSION}, got {data.get('version')!r}"
            )
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"profile: unknown keys {', '.join(unknown)}")
        try:
            values = dict(data)
            values["steps"] = {_degree(k, "steps"): StepCost(**v) for k, v in data["steps"].items()}
            values["transfers"] = {str(k): TransferCost(**v) for k, v in data["transfers"].items()}
            values["overheads"] = Overheads(**data.get("overheads", {}))
            values["kv_cache_tokens"] = {
                _degree(k, "kv_cache_tokens"): _number(int, v, "kv_cache_tokens")
                for k, v in data.get("kv_cache_tokens", {}).items()
            }
            values["fit_error"] = {
                _degree(k, "fit_error"): _number(float, v, "fit_error") for k, v in data.get("fit_error", {}).items()
            }
            values["samples"] = tuple(data.get("samples", ()))
        except KeyError as e:
            raise ValueError(f"profile.{e.args[0]}: missing") from None
        except (TypeError, AttributeError) as e:
            raise ValueError(f"profile: malformed entry ({e})") from None
        missing = [
            f.name
            for f in fields(cls)
            if f.name not in values and f.default is MISSING and f.default_factory is MISSING
        ]
        if missing:
            raise ValueError(f"profile.{missing[0]}: missing")
        return cls(**values)

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=1))
        return path

    @classmethod
    def load(cls, path: str | Path) -> "Profile":
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"profile {path}: no such file (make one with: pdserve profile --output {path})")
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"profile {path}: not valid JSON ({e.msg} at line {e.lineno})") from None
        try:
            return cls.from_dict(data)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None


def _degree(key, where: str) -> int:
    try:
        degree = int(key)
    except (TypeError, ValueError):
        raise ValueError(f"profile.{where}: keys are degrees (integers), got {key!r}") from None
    if degree < 1:
        raise ValueError(f"profile.{where}: degrees must be >= 1, got {degree}")
    return degree


def _number(kind: type, value, where: str):
    try:
        return kind(value)
    except (TypeError, ValueError, OverflowError):
        raise ValueError(f"profile.{where}: values must be numbers, got {value!r}") from None
