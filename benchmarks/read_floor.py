"""The read floor of a benchmark row: the time a plain streaming read of the row's bytes takes under
the same L2 flush and the same event timing. A decode kernel reads those bytes and more (page
tables, through a gather), so it cannot beat this time: `floor ÷ time` says how much of a row is left
to win, and a goal below the floor cannot be met by any kernel under that method.
"""

from __future__ import annotations

SOURCE = r"""
extern "C" __global__ void read_all(const uint4* __restrict__ src, long long n, unsigned* __restrict__ sink) {
  const long long step = (long long)gridDim.x * blockDim.x;
  long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  unsigned acc = 0;
  for (; i + 3 * step < n; i += 4 * step) {  // four loads in flight per thread: 128 KB per SM
    const uint4 a = __ldcs(src + i), b = __ldcs(src + i + step);
    const uint4 c = __ldcs(src + i + 2 * step), d = __ldcs(src + i + 3 * step);
    acc ^= a.x ^ a.y ^ a.z ^ a.w ^ b.x ^ b.y ^ b.z ^ b.w ^ c.x ^ c.y ^ c.z ^ c.w ^ d.x ^ d.y ^ d.z ^ d.w;
  }
  for (; i < n; i += step) {
    const uint4 a = __ldcs(src + i);
    acc ^= a.x ^ a.y ^ a.z ^ a.w;
  }
  if (acc == 0x9e3779b9u) *sink = acc;  // a use of every load, practically never taken
}
"""

THREADS, BLOCKS_PER_SM = 512, 4


class ReadFloor:
    """Streams a buffer once on torch's current stream (one CuPy wrapper of that stream, built once:
    a wrapper per call would cost ~20 µs of host time)."""

    def __init__(self, torch):
        import cupy

        self.torch = torch
        self.kernel = cupy.RawKernel(SOURCE, "read_all")
        self.stream = cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)
        self.sink = torch.zeros(1, dtype=torch.int32, device="cuda")
        self.grid = torch.cuda.get_device_properties(0).multi_processor_count * BLOCKS_PER_SM

    def reader(self, nbytes: int):
        """A call that reads nbytes of random data (a buffer it keeps), and the buffer's size."""
        import numpy as np

        words = -(-nbytes // 16)
        buffer = self.torch.empty(16 * words, dtype=self.torch.uint8, device="cuda").random_()
        args = (np.uint64(buffer.data_ptr()), np.int64(words), np.uint64(self.sink.data_ptr()))

        def read():
            self.kernel((self.grid,), (THREADS,), args, stream=self.stream)
        read.buffer = buffer
        return read

    def us(self, timer, nbytes: int, flush: bool = True) -> float:
        """Median µs of reading nbytes (with timer's L2 flush before each call unless flush is False)."""
        read = self.reader(nbytes)
        try:
            return timer.median_us(read, flush=flush)
        finally:
            del read.buffer
