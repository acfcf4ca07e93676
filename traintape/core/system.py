"""System metrics: time, throughput, CPU, memory and GPU figures on every row.

A :class:`SystemSampler` reads the process and the host every ``interval`` seconds on a
daemon thread of its own (never on the training thread: a sample is a handful of
``/proc`` reads through psutil, plus the framework's own GPU memory counters and NVML
where present), and keeps the latest values. When the Recorder opens the row of a step
it copies them — a dict copy under a lock, nothing else — together with the wall-clock
time, into the row's metrics under :data:`PREFIX` (``sys/``). They are ordinary float64
metrics of the store (``metrics/sys/<name>``); :meth:`traintape.core.reader.Run.metrics`
leaves them out and :meth:`~traintape.core.reader.Run.system` returns them, so analyses
of the training signal and ``compare`` never mistake them for it.

==========================  ===========================================================
``sys/time``                Unix time (seconds) at which the row of the step was opened,
                            i.e. when its first data reached the recorder
``sys/step_time``           seconds per optimizer step since the previous row
                            (``(time - previous time) / (step - previous step)``; NaN on
                            a run's first row)
``sys/samples_per_s``       ``samples_per_step / step_time`` (only with
                            ``samples_per_step``)
``sys/cpu_percent``         process CPU time over wall time in the last sampling
                            interval, percent (above 100 with several busy threads)
``sys/rss_bytes``           resident set size of the process
``sys/mem_available_bytes`` host memory available (``MemAvailable``)
``sys/gpu_mem_allocated_bytes``, ``sys/gpu_mem_reserved_bytes``
                            memory allocated / reserved by the framework on its first
                            GPU (torch's caching allocator, or JAX's ``memory_stats``),
                            only where a GPU is in use
``sys/gpu_util_percent``    GPU utilisation from NVML (``pynvml``), only when installed
``sys/bytes_written``       bytes of data traintape handed to the store so far
                            (uncompressed), this process
==========================  ===========================================================

Values are the latest sample (at most ``interval`` seconds old) except ``time``,
``step_time`` and ``bytes_written``, which are exact. In a multi-process job they are process 0's.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, Final

PREFIX: Final[str] = "sys/"
"""Namespace of system metrics among a store's metrics."""

TIME, STEP_TIME, SAMPLES = "sys/time", "sys/step_time", "sys/samples_per_s"
CPU, RSS, AVAILABLE = "sys/cpu_percent", "sys/rss_bytes", "sys/mem_available_bytes"
GPU_ALLOC, GPU_RESERVED = "sys/gpu_mem_allocated_bytes", "sys/gpu_mem_reserved_bytes"
GPU_UTIL, WRITTEN = "sys/gpu_util_percent", "sys/bytes_written"


def is_system(name: str) -> bool:
    """Whether metric ``name`` is a system metric (``sys/...``)."""
    return name.startswith(PREFIX)


def _gpu_memory() -> tuple[float, float] | None:
    """(allocated, reserved) bytes on the framework's first GPU, or None. Only looks at
    frameworks the program already imported (never imports one)."""
    torch = sys.modules.get("torch")
    if torch is not None:
        try:
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                return float(torch.cuda.memory_allocated()), float(torch.cuda.memory_reserved())
        except Exception:
            pass
    jax = sys.modules.get("jax")
    if jax is not None:
        try:
            dev = jax.local_devices()[0]
            if dev.platform == "gpu":
                st = dev.memory_stats() or {}
                used = float(st.get("bytes_in_use", float("nan")))
                return used, float(st.get("bytes_reserved", st.get("bytes_limit", used)))
        except Exception:
            pass
    return None


def _nvml_handle() -> Any:
    """An NVML handle of GPU 0, or None (no pynvml, no driver, no GPU)."""
    try:
        import pynvml  # type: ignore[import-not-found]

        pynvml.nvmlInit()
        return pynvml.nvmlDeviceGetHandleByIndex(0)
    except Exception:
        return None


class SystemSampler:
    """Samples the process and host every ``interval`` seconds off the training thread.

    Args:
        interval: seconds between samples (> 0).
        samples_per_step: training samples per optimizer step (global batch size), for
            ``sys/samples_per_s``; None leaves that metric out.
        bytes_written: a callable returning traintape's bytes written so far (the
            Recorder passes its writer's counter).
    """

    def __init__(
        self,
        interval: float = 1.0,
        samples_per_step: int | None = None,
        bytes_written: Callable[[], int] | None = None,
    ) -> None:
        if not interval > 0:
            raise ValueError(f"system metrics interval must be > 0 seconds, got {interval}")
        if samples_per_step is not None and samples_per_step <= 0:
            raise ValueError(f"samples_per_step must be > 0, got {samples_per_step}")
        import psutil

        self.interval = float(interval)
        self.samples_per_step = samples_per_step
        self._bytes_written = bytes_written
        self._proc = psutil.Process()
        self._psutil = psutil
        self._nvml = _nvml_handle()
        self._lock = threading.Lock()
        self._latest: dict[str, float] = {}
        self._last_cpu = (time.monotonic(), self._cpu_seconds())
        self._prev: tuple[int, float] | None = None  # (step, time) of the previous row
        self._stop = threading.Event()
        self._sample()
        self._thread = threading.Thread(target=self._run, name="traintape-system", daemon=True)
        self._thread.start()

    @property
    def names(self) -> list[str]:
        """The metric names this sampler fills (fixed at construction)."""
        names = [TIME, STEP_TIME, *self._latest]
        if self.samples_per_step is not None:
            names.append(SAMPLES)
        if self._bytes_written is not None:
            names.append(WRITTEN)
        return sorted(names)

    def _cpu_seconds(self) -> float:
        t = self._proc.cpu_times()
        return float(t.user + t.system)

    def _sample(self) -> None:
        now, cpu = time.monotonic(), self._cpu_seconds()
        t0, c0 = self._last_cpu
        self._last_cpu = (now, cpu)
        values = {
            RSS: float(self._proc.memory_info().rss),
            AVAILABLE: float(self._psutil.virtual_memory().available),
        }
        if now - t0 >= 0.05:  # shorter windows say nothing (CPU time has ~10 ms ticks)
            values[CPU] = 100.0 * (cpu - c0) / (now - t0)
        else:
            values[CPU] = self._latest.get(CPU, float("nan"))
            self._last_cpu = (t0, c0)
        gpu = _gpu_memory()
        if gpu is not None:
            values[GPU_ALLOC], values[GPU_RESERVED] = gpu
        if self._nvml is not None:
            try:
                import pynvml

                values[GPU_UTIL] = float(pynvml.nvmlDeviceGetUtilizationRates(self._nvml).gpu)
            except Exception:
                pass
        with self._lock:
            self._latest = values

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            # a failing probe never reaches training: the last values stay
            with contextlib.suppress(Exception):
                self._sample()

    def row_metrics(self, step: int) -> dict[str, float]:
        """The system metrics of the row of ``step``, opened now (cheap: a dict copy)."""
        now = time.time()
        with self._lock:
            out = dict(self._latest)
        out[TIME] = now
        if self._bytes_written is not None:  # a counter: read now, not sampled
            out[WRITTEN] = float(self._bytes_written())
        prev = self._prev
        if prev is not None and step > prev[0]:
            out[STEP_TIME] = (now - prev[1]) / (step - prev[0])
        else:
            out[STEP_TIME] = float("nan")
        if self.samples_per_step is not None:
            st = out[STEP_TIME]
            out[SAMPLES] = self.samples_per_step / st if st > 0 else float("nan")
        self._prev = (step, now)
        return out

    def close(self) -> None:
        """Stop the sampling thread (idempotent)."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)
