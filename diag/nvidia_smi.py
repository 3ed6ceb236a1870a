"""An nvidia-smi snapshot of a GPU node: every GPU's memory, utilisation, temperature and power, and the
processes that hold GPU memory. Taken by the node agent on a hang (beside the stacks) and by `rlslurm diag`.

    text = snapshot()          # None where nvidia-smi is absent (a CPU node): nothing to say, no error
    gpus = parse_gpus(csv)     # rows of `nvidia-smi --query-gpu=... --format=csv,noheader,nounits`

nvidia-smi's query interface (`--query-gpu`, `--query-compute-apps`, CSV without header or units) is the
stable, scriptable one; its default table is meant for eyes and changes between driver releases.
"""

from __future__ import annotations

import csv
import io
import shutil
import subprocess
from dataclasses import dataclass

GPU_FIELDS = ("index", "name", "uuid", "pci.bus_id", "memory.used", "memory.total", "utilization.gpu",
              "temperature.gpu", "power.draw")
APP_FIELDS = ("pid", "gpu_uuid", "process_name", "used_memory")


@dataclass(frozen=True)
class Gpu:
    index: int
    name: str
    uuid: str
    bus_id: str
    memory_used_mib: float | None
    memory_total_mib: float | None
    utilization_pct: float | None
    temperature_c: float | None
    power_w: float | None


@dataclass(frozen=True)
class GpuProcess:
    pid: int
    gpu_uuid: str
    name: str
    memory_mib: float | None


def _number(value: str) -> float | None:
    """nvidia-smi writes `[N/A]` or `[Not Supported]` where a GPU has no such sensor."""
    try:
        return float(value)
    except ValueError:
        return None


def _rows(text: str, width: int) -> list[list[str]]:
    rows = [[cell.strip() for cell in row] for row in csv.reader(io.StringIO(text)) if row]
    bad = [row for row in rows if len(row) != width]
    if bad:
        raise ValueError(f"nvidia-smi row with {len(bad[0])} fields, expected {width}: {bad[0]}")
    return rows


def parse_gpus(text: str) -> list[Gpu]:
    """The rows of `--query-gpu=GPU_FIELDS --format=csv,noheader,nounits`."""
    return [Gpu(int(r[0]), r[1], r[2], r[3], *(_number(v) for v in r[4:])) for r in _rows(text, len(GPU_FIELDS))]


def parse_apps(text: str) -> list[GpuProcess]:
    """The rows of `--query-compute-apps=APP_FIELDS --format=csv,noheader,nounits` (empty when none)."""
    return [GpuProcess(int(r[0]), r[1], r[2], _number(r[3])) for r in _rows(text, len(APP_FIELDS))]


def render(gpus: list[Gpu], apps: list[GpuProcess]) -> str:
    """One line per GPU, then the processes on it."""
    def num(v: float | None, unit: str) -> str:
        return "n/a" if v is None else f"{v:,.0f} {unit}"

    lines = []
    for g in gpus:
        lines.append(f"GPU {g.index} {g.name} ({g.bus_id}): memory {num(g.memory_used_mib, 'MiB')} of "
                     f"{num(g.memory_total_mib, 'MiB')}, utilisation {num(g.utilization_pct, '%')}, "
                     f"{num(g.temperature_c, 'C')}, power {num(g.power_w, 'W')}")
        lines += [f"  pid {a.pid} {a.name}: {num(a.memory_mib, 'MiB')}" for a in apps if a.gpu_uuid == g.uuid]
    return "\n".join(lines) + "\n"


def _query(binary: str, what: str, fields: tuple[str, ...], timeout_s: float) -> str:
    done = subprocess.run([binary, f"--query-{what}={','.join(fields)}", "--format=csv,noheader,nounits"],
                          capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        raise RuntimeError(f"nvidia-smi --query-{what} exit {done.returncode}: {done.stderr.strip()[:300]}")
    return done.stdout


def snapshot(timeout_s: float = 15.0) -> str | None:
    """This node's GPUs as text (render), None where nvidia-smi is absent; a failing nvidia-smi (a GPU that
    fell off the bus is a reason to look) is reported in the text, not raised."""
    binary = shutil.which("nvidia-smi")
    if binary is None:
        return None
    try:
        gpus = parse_gpus(_query(binary, "gpu", GPU_FIELDS, timeout_s))
        apps = parse_apps(_query(binary, "compute-apps", APP_FIELDS, timeout_s))
    except (OSError, RuntimeError, ValueError, subprocess.TimeoutExpired) as e:
        return f"nvidia-smi failed: {type(e).__name__}: {e}\n"
    return render(gpus, apps)
