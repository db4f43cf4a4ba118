// What l2_homes.cu and l2_near_stream.cu both use to time single reads of L2 from a chosen SM.
#pragma once
#include <cstdint>
#include <cstdio>
#include <cstdlib>

#include <cuda_runtime.h>

// A CUDA call that must succeed: otherwise the probe says which and stops.
#define CHECK(x)                                                                       \
    do {                                                                               \
        cudaError_t e_ = (x);                                                          \
        if (e_ != cudaSuccess) {                                                       \
            std::printf("%s: %s (line %d)\n", #x, cudaGetErrorString(e_), __LINE__);   \
            std::exit(1);                                                              \
        }                                                                              \
    } while (0)

// The SM this thread runs on: how a block learns its role, since a launch cannot place blocks.
__device__ __forceinline__ uint32_t sm_id() {
    uint32_t s;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(s));
    return s;
}

// A relaxed load at GPU scope: it is never elided, and it is served by L2, not L1.
__device__ __forceinline__ uint32_t load_l2(const uint32_t* p) {
    uint32_t v;
    asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

// One timed read of each of n addresses (base + offset(i)), each waiting for the one before.
// offset is arithmetic, so nothing but the timed load sits between the clock reads.
template <class Offset>
__device__ inline uint32_t timed_reads(const char* base, Offset offset, int n, uint32_t* latency, uint32_t zero) {
    uint32_t dep = 0, acc = 0;
#pragma unroll 1
    for (int i = 0; i < n; ++i) {
        const char* p = base + offset(i);
        const long long t0 = clock64();
        const uint32_t v = load_l2(reinterpret_cast<const uint32_t*>(p) + dep);
        dep = v & zero;
        acc += v;
        const long long t1 = clock64();  // issues after the dependent AND: after the load
        latency[i] = uint32_t(t1 - t0) + dep;
    }
    return acc;
}

// Wait for another SM's flag, for at most limit cycles: false if it never came.
__device__ inline bool wait_flag(volatile int* flag, long long limit) {
    const long long start = clock64();
    while (*flag == 0)
        if (clock64() - start > limit) return false;
    return true;
}
