// What the L2 probes share (l2_homes.cu, l2_near_stream.cu, l2_multicast.cu): timing single reads of L2
// from a chosen SM, a hash to fill buffers with, shared-memory addresses.
#pragma once
#include <cstdint>
#include <cstdio>
#include <cstdlib>

#include <cuda.h>
#include <cuda_runtime.h>
#include <cudaTypedefs.h>

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

// The GPU's nanosecond clock (globaltimer): with clock64 over the same span, an SM's clock rate.
__device__ __forceinline__ unsigned long long global_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
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

// A word's value: a hash of its index (a multiple of the index would make a position-weighted
// checksum a multiple of a large power of two, the same whatever landed where).
__device__ __forceinline__ uint32_t mix32(uint32_t x) {
    x ^= x >> 16;
    x *= 0x7feb352du;
    x ^= x >> 15;
    x *= 0x846ca68bu;
    return x ^ (x >> 16);
}

// The shared-memory address of p, as PTX's .shared instructions take it.
__device__ __forceinline__ uint32_t smem_u32(const void* p) { return uint32_t(__cvta_generic_to_shared(p)); }

// A 2D TMA map over rows of 16-bit values (cols a row, row_bytes apart) whose box is 64 columns x
// box_rows rows under the 128 B swizzle, as the GEMMs' loads of weights and token rows; false,
// with a message, where the driver has no encoder or refuses the map.
inline bool rows_map(CUtensorMap* map, void* base, uint64_t cols, uint64_t rows, uint64_t row_bytes, uint32_t box_rows) {
    static PFN_cuTensorMapEncodeTiled_v12000 encode = nullptr;
    if (!encode) {
        cudaDriverEntryPointQueryResult q;
        CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", reinterpret_cast<void**>(&encode), 12000,
                                               cudaEnableDefault, &q));
        if (!encode || q != cudaDriverEntryPointSuccess) {
            encode = nullptr;
            std::printf("cuTensorMapEncodeTiled not found\n");
            return false;
        }
    }
    const cuuint64_t dims[2] = {cols, rows};
    const cuuint64_t strides[1] = {row_bytes};
    const cuuint32_t box[2] = {64, box_rows}, estr[2] = {1, 1};
    const CUresult r = encode(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, base, dims, strides, box, estr,
                              CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                              CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r != CUDA_SUCCESS) std::printf("cuTensorMapEncodeTiled failed (%d)\n", int(r));
    return r == CUDA_SUCCESS;
}

// What a launch timed between two events left: its time, how many blocks counted themselves done,
// and whether one of its waits gave up (device words the kernel writes; failed may be null: a
// kernel without bounded waits).
struct Launched {
    float ms;
    int done;
    bool gave_up;
};

inline Launched finish_launch(cudaEvent_t e0, cudaEvent_t e1, const int* done, const int* failed) {
    CHECK(cudaEventRecord(e1));
    CHECK(cudaEventSynchronize(e1));
    CHECK(cudaGetLastError());
    Launched l{0.f, 0, false};
    int f = 0;
    CHECK(cudaMemcpy(&l.done, done, 4, cudaMemcpyDeviceToHost));
    if (failed) CHECK(cudaMemcpy(&f, failed, 4, cudaMemcpyDeviceToHost));
    l.gave_up = f != 0;
    CHECK(cudaEventElapsedTime(&l.ms, e0, e1));
    return l;
}
