"""`gossip bench gpu`: device tensors through host memory, next to the physical bounds.

(a) device <-> host bandwidth, 1-512 MB: pageable ``.cpu()`` / ``.to(device)`` vs a pinned
    buffer allocated once vs pinned on a side stream, against the PCIe link read from the
    device (generation x width);
(b) a device -> socket -> device exchange between 2 processes, pipelined piece by piece, vs
    max(D2H, socket, H2D) and their sum (gpu_ranks.py);
(c) top-k of 25M floats at 1% on the device plus the payload copy vs host top-k after ``.cpu()``;
(d) ring-allreduce and dpsgd of CUDA tensors, 4 peers sharing the GPU, vs torch.distributed
    gloo all_reduce of the same CUDA tensors in the same run (gpu_ranks.py).
Every function takes the device, so the whole benchmark also runs on ``cpu`` (tests do, at
tiny sizes); the command refuses to run without CUDA.
"""

from __future__ import annotations

import shutil
import subprocess

import torch

from gossip.bench import gpu_ranks
from gossip.bench.gpu_ranks import timed
from gossip.bench.harness import format_table
from gossip.device import CudaCopier, copier_for
from gossip.errors import GossipError

MB = 1 << 20
#: GT/s per lane of each PCIe generation, and the line code's efficiency.
_PCIE_GTS = {1: 2.5, 2: 5.0, 3: 8.0, 4: 16.0, 5: 32.0, 6: 64.0}


def require_cuda() -> torch.device:
    """The CUDA device, or a GossipError saying in one line that there is none."""
    if not torch.cuda.is_available():
        raise GossipError("gossip bench gpu needs a CUDA device: torch.cuda.is_available() "
                          "is False here, nothing measured")
    return torch.device("cuda", torch.cuda.current_device())


def pcie_link(device: torch.device) -> tuple[str, float | None]:
    """The link as read from the device ("Gen5 x16") and its bound in GB/s per direction."""
    if device.type != "cuda" or shutil.which("nvidia-smi") is None:
        return "unknown (no nvidia-smi)", None
    query = "pcie.link.gen.current,pcie.link.width.current,pcie.link.gen.max,pcie.link.width.max"
    try:
        line = subprocess.run(["nvidia-smi", f"--id={device.index or 0}",
                               f"--query-gpu={query}", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=20,
                              check=True).stdout.strip().splitlines()[0]
        gen, width, gen_max, width_max = (int(v) for v in line.split(","))
    except (subprocess.SubprocessError, ValueError, IndexError, OSError) as exc:
        return f"unknown ({exc})", None
    # An idle GPU may report a lower current generation (power saving): use the maximum.
    code = 0.8 if gen_max <= 2 else 128 / 130
    bound = _PCIE_GTS.get(gen_max, 0.0) * width_max * code / 8
    return f"Gen{gen_max} x{width_max} (now Gen{gen} x{width})", bound or None


def bandwidth(device: torch.device, sizes_mb: list[int], *, reps: int = 5,
              echo=print) -> list[dict]:
    """(a) D2H and H2D GB/s per size: pageable, pinned buffer, pinned on a side stream."""
    link, bound = pcie_link(device)
    echo(f"(a) device <-> host copies; link {link}, bound "
         f"{f'{bound:.1f} GB/s' if bound else 'unknown'} per direction")
    copier, rows = copier_for(device), []
    pin = device.type == "cuda"
    for size in sizes_mb:
        numel = size * MB // 4
        x = torch.randn(numel, device=device)
        host = torch.empty(numel, pin_memory=pin)
        gbs = {
            "D2H pageable": timed(lambda: x.cpu(), device, reps),
            "D2H pinned": timed(lambda: host.copy_(x), device, reps),
            "D2H pinned side stream": timed(lambda: _side(copier, host, x), device, reps),
            "H2D pageable": timed(lambda: host.to(device, copy=True), device, reps),
            "H2D pinned side stream": timed(lambda: _side(copier, x, host), device, reps),
        }
        row = {"MB": size}
        for name, seconds in gbs.items():
            row[name] = size * MB / seconds / 1e9
        if bound:
            row["best / bound"] = max(v for k, v in row.items() if k != "MB") / bound
        rows.append(row)
    echo(format_table(rows, list(rows[0])))
    return rows


def _side(copier, dst, src):
    copier.after_device_work()
    copier.start(dst, src).synchronize()


def device_topk(device: torch.device, numel: int, density: float, *, reps: int = 5,
                echo=print) -> dict[str, float]:
    """(c) top-k where the tensor lives, payload copied out, vs ``.cpu()`` then host top-k."""
    from gossip.compress import create

    topk = create("topk", density=density)
    x = torch.randn(numel, device=device)
    on_device = timed(lambda: topk.compress(x, key="bench"), device, reps)
    on_host = timed(lambda: topk.compress(x.cpu(), key="bench"), device, reps)
    payload = topk.compress(x, key="bench")
    result = {"device top-k + copy ms": on_device * 1e3, "cpu() + host top-k ms": on_host * 1e3,
              "speed-up": on_host / on_device, "payload MB": payload.nbytes / MB}
    echo(f"(c) top-k of {numel} float32 at density {density}, payload "
         f"{payload.nbytes / MB:.2f} MB of {numel * 4 / MB:.0f} MB (target: speed-up >= 10)")
    echo(format_table([result], list(result)))
    return result


def run(*, sizes_mb: list[int], numel: int, density: float, peers: int, reps: int,
        exchange_mb: int, echo=print, device: torch.device | None = None) -> dict:
    """Every part in turn; ``device`` defaults to the CUDA one (GossipError without)."""
    device = device or require_cuda()
    if device.type == "cuda":
        echo(f"device: {torch.cuda.get_device_name(device)}")
        assert isinstance(copier_for(device), CudaCopier)
    results = {"bandwidth": bandwidth(device, sizes_mb, reps=reps, echo=echo)}
    results["exchange"] = gpu_ranks.exchange(device, exchange_mb * MB // 4, reps=reps,
                                             echo=echo)
    results["topk"] = device_topk(device, numel, density, reps=reps, echo=echo)
    results["allreduce"] = gpu_ranks.allreduce(device, peers, numel, reps=reps, echo=echo,
                                               bound=pcie_link(device)[1])
    return results
