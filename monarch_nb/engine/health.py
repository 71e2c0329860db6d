"""Rank health probes, read by the worker's control thread for each heartbeat.

:class:`HealthProbe` returns a small dict of plain numbers:

* always: ``cpu`` (% of one core since the last probe), ``rss`` (bytes);
* when the rank's memory cgroup (v1 or v2) has a limit below the machine's
  memory: ``mem_limit`` and ``mem_used`` (bytes, the cgroup's own count:
  a process moved into a cgroup brings no charge along, so its RSS can
  exceed it), so that a SIGKILL from the kernel's OOM killer can be named
  with how close the rank was (procs/deathcause.py). Read each
  heartbeat (a process can be moved into a cgroup at any time): three
  small reads, the files' paths cached per cgroup;
* once torch has initialised CUDA (or HIP) in this process: ``mem``,
  ``mem_peak`` (bytes allocated by torch's caching allocator, now and at its
  peak), ``mem_reserved`` and ``mem_total``. These are allocator counters:
  reading them never syncs the device and never initialises CUDA;
* when the vendor library is importable and finds this rank's GPU: ``util``
  (%), ``temp`` (°C) and ``power`` (W), through NVML (``nvidia-ml-py``, extra
  ``monarch-nb[nvidia]``) on NVIDIA or ``amdsmi`` on ROCm.

A key that is absent means "n/a" (no GPU, library not installed, query not
supported): probing never raises, and a probe that failed once is not tried
again (a broken driver must not cost every heartbeat).

Non-goals: sending (loop.py), displaying (dashboard.py, magics.py).
"""

from __future__ import annotations

import os
import sys
from typing import Any


class HealthProbe:
    def __init__(self) -> None:
        self._proc: Any = None
        self._gpu: _GpuProbe | bool | None = None  # None: not tried yet; False: none
        try:
            import psutil

            self._proc = psutil.Process()
            self._proc.cpu_percent(None)  # primes the counter
        except Exception:
            self._proc = None

    def read(self) -> dict[str, float]:
        out: dict[str, float] = {}
        proc = self._proc
        if proc is not None:
            try:
                out["cpu"] = round(proc.cpu_percent(None), 1)
                out["rss"] = proc.memory_info().rss
            except Exception:
                self._proc = None
        cgroup = _cgroup_memory()
        if cgroup is not None:
            out["mem_limit"], out["mem_used"] = cgroup
        out.update(_torch_memory())
        if self._gpu is None and "mem_total" in out:  # torch uses a GPU: find its vendor library
            self._gpu = _GpuProbe.open() or False
        if self._gpu:
            assert isinstance(self._gpu, _GpuProbe)
            out.update(self._gpu.read())
        return out


_CGROUP_ROOT = "/sys/fs/cgroup"
# /proc/self/cgroup's text -> (limit file, usage file) of its memory cgroup
_cgroup_files: dict[str, tuple[str, str] | None] = {}


def _cgroup_memory() -> tuple[int, int] | None:
    """(limit, usage) in bytes of this process's memory cgroup; None when
    it has no limit below the machine's memory (or cannot be read)."""
    try:
        with open("/proc/self/cgroup") as f:
            text = f.read()
        if text not in _cgroup_files:
            _cgroup_files[text] = _memory_files(text)
        files = _cgroup_files[text]
        if files is None:
            return None
        with open(files[0]) as f:
            raw = f.read().strip()
        if raw == "max":
            return None
        limit = int(raw)
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        if not 0 < limit < total:
            return None
        with open(files[1]) as f:
            return limit, int(f.read().strip())
    except (OSError, ValueError):
        return None


def _memory_files(cgroup: str) -> tuple[str, str] | None:
    """v1: the ``memory`` hierarchy's ``memory.limit_in_bytes`` and
    ``memory.usage_in_bytes``; v2: the unified hierarchy's ``memory.max``
    and ``memory.current``."""
    found: list[tuple[str, str]] = []
    for line in cgroup.splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            d = os.path.join(_CGROUP_ROOT, "memory", path.lstrip("/"))
            found.insert(0, (os.path.join(d, "memory.limit_in_bytes"),
                             os.path.join(d, "memory.usage_in_bytes")))
        elif controllers == "":
            for root in (_CGROUP_ROOT, os.path.join(_CGROUP_ROOT, "unified")):
                d = os.path.join(root, path.lstrip("/"))
                found.append((os.path.join(d, "memory.max"), os.path.join(d, "memory.current")))
    return next((f for f in found if os.path.exists(f[0]) and os.path.exists(f[1])), None)


def _torch_memory() -> dict[str, float]:
    torch = sys.modules.get("torch")  # never import torch (or CUDA) for a heartbeat
    if torch is None:
        return {}
    try:
        cuda = torch.cuda
        if not cuda.is_initialized():
            return {}
        total = _TOTAL.get("total")
        if total is None:
            total = _TOTAL["total"] = cuda.get_device_properties(0).total_memory
        return {"mem": cuda.memory_allocated(0), "mem_peak": cuda.max_memory_allocated(0),
                "mem_reserved": cuda.memory_reserved(0), "mem_total": total}
    except Exception:
        return {}


_TOTAL: dict[str, int] = {}


class _GpuProbe:
    """Utilisation, temperature and power of this rank's one GPU."""

    def __init__(self, read: Any) -> None:
        self._read = read
        self.failed = False

    @classmethod
    def open(cls) -> _GpuProbe | None:
        if os.environ.get("HIP_VISIBLE_DEVICES") is not None or _is_rocm():
            return cls._open_amdsmi()
        return cls._open_nvml()

    def read(self) -> dict[str, float]:
        if self.failed:
            return {}
        try:
            return dict(self._read())
        except Exception:
            self.failed = True
            return {}

    @classmethod
    def _open_nvml(cls) -> _GpuProbe | None:
        try:
            import pynvml  # nvidia-ml-py

            pynvml.nvmlInit()
            device = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip() or "0"
            if device.startswith(("GPU-", "MIG-")):
                handle = pynvml.nvmlDeviceGetHandleByUUID(device)
            else:
                handle = pynvml.nvmlDeviceGetHandleByIndex(int(device))
        except Exception:
            return None

        def read() -> dict[str, float]:
            out: dict[str, float] = {}
            for key, fn in (
                ("util", lambda: pynvml.nvmlDeviceGetUtilizationRates(handle).gpu),
                ("temp", lambda: pynvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU)),
                ("power", lambda: pynvml.nvmlDeviceGetPowerUsage(handle) / 1000.0),
            ):
                try:
                    out[key] = round(float(fn()), 1)
                except Exception:  # not supported on this board: n/a
                    pass
            return out

        return cls(read)

    @classmethod
    def _open_amdsmi(cls) -> _GpuProbe | None:
        try:
            import amdsmi

            amdsmi.amdsmi_init()
            device = os.environ.get("HIP_VISIBLE_DEVICES", "0").split(",")[0].strip() or "0"
            handle = amdsmi.amdsmi_get_processor_handles()[int(device)]
        except Exception:
            return None

        def read() -> dict[str, float]:
            out: dict[str, float] = {}
            try:
                out["util"] = float(amdsmi.amdsmi_get_gpu_activity(handle)["gfx_activity"])
            except Exception:
                pass
            try:
                out["temp"] = float(amdsmi.amdsmi_get_temp_metric(
                    handle, amdsmi.AmdSmiTemperatureType.HOTSPOT,
                    amdsmi.AmdSmiTemperatureMetric.CURRENT))
            except Exception:
                pass
            try:
                info = amdsmi.amdsmi_get_power_info(handle)
                watts = info.get("current_socket_power") or info.get("average_socket_power")
                out["power"] = float(watts)
            except Exception:
                pass
            return out

        return cls(read)


def _is_rocm() -> bool:
    torch = sys.modules.get("torch")
    return bool(torch is not None and getattr(torch.version, "hip", None))


__all__ = ["HealthProbe"]
