// The memory's read bandwidth as a well-written reader meets it (benchmarks/machine.py's read_bandwidth): every
// thread of the OpenMP team sums its contiguous share of a buffer, read as ``streams`` runs side by side (as a
// product reads several blocks of weights at once). One thread reading one run leaves the memory short of
// requests; on a 2-core Xeon, 2 threads x 4 runs read ~29 GB/s where torch's sum of the same floats reads ~21.
// Plain C++ vector types: the compiler's widest registers (AVX-512 or AVX2) whatever -march gives.
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

typedef float v16 __attribute__((vector_size(64)));

extern "C" __attribute__((visibility("default"))) float rs_read(const char* p, int64_t bytes, int streams) {
  streams = std::clamp(streams, 1, 16);  // (the sums below hold 16)
  float total = 0;
#pragma omp parallel reduction(+ : total)
  {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    const int64_t run = bytes / nt / streams / 256 * 256;  // bytes of each run, whole 256-byte steps
    const char* share = p + run * streams * t;
    v16 acc[16] = {};
    for (int64_t i = 0; i < run; i += 256)
      for (int s = 0; s < streams; ++s) {
        v16 a, b, c, d;
        const char* at = share + s * run + i;
        std::memcpy(&a, at, 64), std::memcpy(&b, at + 64, 64), std::memcpy(&c, at + 128, 64),
            std::memcpy(&d, at + 192, 64);
        acc[s] += (a + b) + (c + d);
      }
    v16 all = {};
    for (int s = 0; s < 16; ++s) all += acc[s];
    for (int j = 0; j < 16; ++j) total += all[j];
  }
  return total;
}
