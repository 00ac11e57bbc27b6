"""Timing and memory helpers for the benchmarks (CUDA events, median of repeats, peak allocation)."""
import statistics

import torch

HBM_BYTES_PER_S = 4.3e12       # measured device-to-device copy on the H200 (read + write)
BF16_FLOPS = 7.9e14            # measured dense bf16 matmul on the H200


def warm_up_gpu(matmuls=200):
    """About a second of large matmuls, so that the first timed row does not run at idle clocks."""
    a = torch.randn(4096, 4096, device="cuda")
    for _ in range(matmuls):
        a = a @ a
        a = a / a.norm()
    torch.cuda.synchronize()


def time_ms(fn, warmup=3, repeat=20):
    """Median milliseconds of `fn()` on the current CUDA stream."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def graph_ms(fn, repeat=20, calls=1):
    """GPU time of one call of fn, replayed from a CUDA graph of `calls` calls (no launch or Python overhead:
    what the kernels alone cost)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(calls):
                fn()
    torch.cuda.current_stream().wait_stream(stream)
    return time_ms(graph.replay, repeat=repeat) / calls


def peak_mb(fn):
    """Peak CUDA allocation of one call of `fn`, above what was allocated before it."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def table(rows, header):
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
    line = lambda r: " | ".join(str(v).rjust(w) for v, w in zip(r, widths))  # noqa: E731
    return "\n".join([line(header), "-+-".join("-" * w for w in widths)] + [line(r) for r in rows])


def kernel_times(fn):
    """{CUDA kernel name: self GPU time in ms} of one profiled fn() call (after a warm one)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return {event.key: event.self_device_time_total / 1e3 for event in prof.key_averages()
            if event.device_type == torch.autograd.DeviceType.CUDA}
