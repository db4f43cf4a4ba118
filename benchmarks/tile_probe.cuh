// What the probes that run a swapped gate/up or down tile's TMA loads and wgmma share (l2_multicast.cu,
// dsmem_rows.cu): bounded mbarrier waits, the cluster barrier, TMA loads, the wgmma descriptor and the
// m64n160k16 MMA, a fill of small bf16 values, and the host's timed launches (ProbeLaunches). Needs sm_90a
// (compute_90a).
#pragma once
#include <vector>

#include "l2_probe.cuh"

constexpr long long WAIT_CYCLES = 4000000000LL;  // a wait gives up after this (about 2 s)

// A wait on this CTA's barrier, acquiring at cluster scope (the arrivals may come from the cluster's
// other CTAs); false once it gave up.
__device__ bool wait_parity(uint64_t* bar, uint32_t parity) {
    const long long start = clock64();
    while (true) {
        uint32_t ok;
        asm volatile(
            "{ .reg .pred p; mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], %2;"
            " selp.u32 %0, 1, 0, p; }"
            : "=r"(ok) : "r"(smem_u32(bar)), "r"(parity) : "memory");
        if (ok) return true;
        if (clock64() - start > WAIT_CYCLES) return false;
    }
}

__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}

// A shared-memory matrix descriptor for wgmma: K-major rows of 128 B under the 128 B swizzle, 8-row
// groups 1 KB apart (what a TMA box of 64 bf16 columns with CU_TENSOR_MAP_SWIZZLE_128B writes). A
// K step of 16 columns inside the 128 B row adds 32 B to the start address.
__device__ __forceinline__ uint64_t sw128_desc(uint32_t addr) {
    return uint64_t((addr & 0x3FFFF) >> 4) | (uint64_t(1) << 16) | (uint64_t(1024 >> 4) << 32) | (uint64_t(1) << 62);
}

__device__ __forceinline__ void tma_load(const CUtensorMap* map, uint32_t dst, uint64_t* bar, int col, int row) {
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
                 " [%0], [%1, {%2, %3}], [%4];"
                 ::"r"(dst), "l"(map), "r"(col), "r"(row), "r"(smem_u32(bar)) : "memory");
}

// L2's evict-first policy (CUTLASS's encoding), which the kernel's swapped tiles put on their weight
// loads: each weight byte is read once, and the token rows keep their lines.
constexpr uint64_t EVICT_FIRST = 0x12F0000000000000ull;

// A weight box, evict-first.
__device__ __forceinline__ void tma_load_once(const CUtensorMap* map, uint32_t dst, uint64_t* bar, int col, int row) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint"
        " [%0], [%1, {%2, %3}], [%4], %5;"
        ::"r"(dst), "l"(map), "r"(col), "r"(row), "r"(smem_u32(bar)), "l"(EVICT_FIRST) : "memory");
}

// One m64n160k16 bf16 wgmma: d (80 fp32 a thread) += A(desc_a) * B(desc_b)^T, or = when !accumulate.
__device__ __forceinline__ void wgmma_m64n160k16(float (&d)[80], uint64_t desc_a, uint64_t desc_b, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %82, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n160k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
        "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79"
        "}, %80, %81, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
          "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
          "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79])
        : "l"(desc_a), "l"(desc_b), "r"(accumulate));
}

// Small bf16 values (exponent 2^-4 .. 2^-1, either sign), so the MMAs run on ordinary numbers.
__global__ void fill(uint16_t* w, size_t n) {
    for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
        const uint32_t h = mix32(uint32_t(i));
        w[i] = uint16_t(((h >> 31) << 15) | ((123 + (h >> 28 & 3)) << 7) | (h & 0x7f));
    }
}

// The words a probe kernel reports through and the host's timed launches of it: failed (a wait gave up),
// done (the CTAs that finished), sink (results no one reads, so the compiler keeps their work) and timing
// (words_per_cta 64-bit words a CTA, read back into tim after each timed launch).
struct ProbeLaunches {
    int *failed, *done;
    float* sink;
    long long* timing;
    int words_per_cta;
    std::vector<long long> tim;
    cudaEvent_t e0, e1;

    ProbeLaunches(int max_ctas, int words) : words_per_cta(words), tim(size_t(max_ctas) * words) {
        CHECK(cudaMalloc(&failed, 4));
        CHECK(cudaMalloc(&done, 4));
        CHECK(cudaMalloc(&sink, 4));
        CHECK(cudaMalloc(&timing, tim.size() * 8));
        CHECK(cudaMemset(failed, 0, 4));
        CHECK(cudaEventCreate(&e0));
        CHECK(cudaEventCreate(&e1));
    }

    // rounds + 3 launches of launch() on grid CTAs, the first three untimed; after each timed one,
    // timed(ms) with the CTAs' timing words in tim. False, with a line saying so, where a launch's CTAs
    // did not all finish or one of its waits gave up.
    template <class Launch, class Timed>
    bool run(const char* name, int cluster, int grid, int rounds, Launch launch, Timed timed) {
        for (int it = 0; it < rounds + 3; ++it) {
            CHECK(cudaMemset(done, 0, 4));
            CHECK(cudaEventRecord(e0));
            launch();
            const Launched l = finish_launch(e0, e1, done, failed);
            if (l.done != grid || l.gave_up) {
                std::printf("%s, cluster %d: %d of %d CTAs finished%s\n", name, cluster, l.done, grid,
                            l.gave_up ? ", a wait gave up" : "");
                return false;
            }
            if (it < 3) continue;
            CHECK(cudaMemcpy(tim.data(), timing, size_t(grid) * words_per_cta * 8, cudaMemcpyDeviceToHost));
            timed(l.ms);
        }
        return true;
    }
};
