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
