"""--kernels: the GPU kernels of a generate by total device time."""
from __future__ import annotations


def kernel_table(run, top: int) -> tuple[list[dict], float]:
    """The `top` GPU kernels of run() by total device time (on CPU: torch ops by own CPU time): name,
    calls, total and mean microseconds, share; and the total over all kernels, listed or not (compare
    systems by that, not by sums over their top lists)."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    cuda = torch.cuda.is_available()
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        run()
        if cuda:
            torch.cuda.synchronize()

    def own_us(e):
        return e.self_device_time_total if cuda else e.self_cpu_time_total
    events = sorted((e for e in prof.key_averages() if own_us(e) > 0), key=own_us, reverse=True)
    total = sum(own_us(e) for e in events) or 1.0
    rows = [dict(kernel=e.key[:120], calls=e.count, total_us=round(own_us(e), 1),
                 mean_us=round(own_us(e) / max(e.count, 1), 2), share=round(own_us(e) / total, 4))
            for e in events[:top]]
    return rows, total
