"""The Recorder's options, validated at construction (a Pydantic model, like the schema).

Each option is range-checked before anything is claimed or written: a value that would
abort the interpreter (``flush_every_steps=10**9`` sizes every row chunk), cost
gigabytes (``10**6``), make the queue unbounded (``max_pending=0``) or never fire
(``flush_every_seconds=nan``) is refused with a ``ValueError`` naming the option.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

MAX_FLUSH_EVERY_STEPS = 1 << 16
"""Rows per commit (and per row chunk of a new store) at most: a row chunk of the stats
arrays holds ``flush_every_steps x tensors x stats`` float64."""
MAX_PENDING = 1 << 20
"""Queue bound at most (items)."""

Seconds = Annotated[float, Field(gt=0, allow_inf_nan=False)]


class RecorderOptions(BaseModel):
    """Validated options of :class:`traintape.Recorder` (see its docstring)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    flush_every_steps: Annotated[int, Field(strict=True, ge=1, le=MAX_FLUSH_EVERY_STEPS)] = 64
    flush_every_seconds: Seconds = 5.0
    max_pending: Annotated[int, Field(strict=True, ge=1, le=MAX_PENDING)] = 1024
    max_pending_bytes: Annotated[int, Field(strict=True, ge=1)] = 1 << 30
    compression: Literal["none", "zstd", "blosc"] = "none"
    claim_stale_after: Seconds = 30.0
    write_timeout: Seconds = 120.0
    system_metrics: bool | Seconds = True
    samples_per_step: Annotated[int, Field(strict=True, ge=1)] | None = None

    @classmethod
    def check(cls, **values: object) -> RecorderOptions:
        """The options, or ``ValueError`` naming each option at fault and why."""
        import numbers

        plain = {  # numpy integers are ints; bools are not
            k: int(v) if isinstance(v, numbers.Integral) and not isinstance(v, bool) else v
            for k, v in values.items()
        }
        try:
            return cls.model_validate(plain)
        except ValidationError as e:
            why = "; ".join(
                f"{'.'.join(str(p) for p in err['loc'][:1])}={err.get('input')!r}: {err['msg']}"
                for err in e.errors()
            )
            raise ValueError(f"invalid Recorder option: {why}") from None
