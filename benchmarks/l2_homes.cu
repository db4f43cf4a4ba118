// Which of the L2's two partitions holds each line, seen from one SM (H100/H200).
//
//     nvcc -arch=sm_90a -O2 -o l2_homes benchmarks/l2_homes.cu && ./l2_homes [stride_bytes] [trials]
//
// Why: the small calls' single launch is bound by the fabric between the L2's partitions,
// which carries the lines homed in the far partition (docs/perf.md, "What bounds the single
// launch at T = 1024"): about half of the weight stream. If a line's home followed its address
// coarsely enough (runs of whole 4 KB weight rows) and repeated from one 2 MB page to the
// next, tiles could be handed to SMs near their weights' homes; if it is fine-grained, no
// schedule can take the far half off the fabric.
//
// How: per trial, SM A reads every line of a fresh region once (each line is then cached in
// its home partition, and in A's), then SM B times one read of each line, each address waiting
// for the value before it. Lines homed in B's partition (or copied there by A) hit near; the
// others cross the fabric and take longer. Per trial it prints the latency percentiles and
// histogram, the far share, the lengths of runs of same-class lines, and how often a line is
// of the same class as the line one 2 MB page on. A trial whose SM B shares A's partition
// sees every line near.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include <cuda_runtime.h>

#include "l2_probe.cuh"

constexpr size_t PAGE = size_t(2) << 20;  // the driver's large page
constexpr int PAGES = 4;                  // pages per trial
constexpr long long WAIT_CYCLES = 20000000000LL;  // SM B gives up waiting for A after this

__global__ void probe(const uint32_t* region, int lines, int stride_words, int sm_a, int sm_b,
                      volatile int* flag, uint32_t* latency, uint32_t* sink, uint32_t zero) {
    extern __shared__ char hold[];  // a launch-size smem request keeps one block per SM
    if (threadIdx.x != 0) return;
    const uint32_t me = sm_id();
    uint32_t acc = 0;
    if (me == uint32_t(sm_a)) {
        for (int i = 0; i < lines; ++i) acc += load_l2(region + size_t(i) * stride_words);
        __threadfence();
        *flag = 1;
    } else if (me == uint32_t(sm_b)) {
        if (!wait_flag(flag, WAIT_CYCLES)) {
            latency[0] = 0xffffffffu;  // SM A never ran: the host reports it
            return;
        }
        // Its own loop, not timed_reads: the byte offset's arithmetic would sink between the clock reads.
        uint32_t dep = 0;  // always 0 (zero is 0), but each address waits for the value before it
#pragma unroll 1
        for (int i = 0; i < lines; ++i) {
            const long long t0 = clock64();
            const uint32_t v = load_l2(region + size_t(i) * stride_words + dep);
            dep = v & zero;
            acc += v;
            const long long t1 = clock64();  // issues after the dependent AND: after the load
            latency[i] = uint32_t(t1 - t0) + dep;
        }
    }
    if (acc == 0x9e3779b9u) sink[0] = acc;
    hold[0] = 0;
}

int main(int argc, char** argv) {
    const int stride = argc > 1 ? std::atoi(argv[1]) : 256;
    const int trials = argc > 2 ? std::atoi(argv[2]) : 12;
    if (stride < 4 || stride % 4 || PAGE % stride || trials < 1) {
        std::printf("usage: %s [stride_bytes: a multiple of 4 dividing 2 MB] [trials >= 1]\n", argv[0]);
        return 2;
    }
    const size_t trial_bytes = PAGE * PAGES;
    const int lines = int(trial_bytes / stride);
    const int per_page = lines / PAGES;
    int sms = 0;
    CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    char* raw = nullptr;
    CHECK(cudaMalloc(&raw, trial_bytes * trials + PAGE));
    // Page aligned, so "one page on" is the same offset in the next 2 MB page.
    const uint32_t* region = reinterpret_cast<const uint32_t*>((uintptr_t(raw) + PAGE - 1) & ~uintptr_t(PAGE - 1));
    int* flag = nullptr;
    uint32_t* latency = nullptr;
    uint32_t* sink = nullptr;
    CHECK(cudaMalloc(&flag, sizeof(int)));
    CHECK(cudaMalloc(&latency, size_t(lines) * 4));
    CHECK(cudaMalloc(&sink, 4));
    const int smem = 200 * 1024;
    CHECK(cudaFuncSetAttribute(probe, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    std::vector<uint32_t> lat(lines);
    std::printf("stride %d B: %d lines a trial (%d pages of 2 MB, fresh each trial); SM A = 0\n", stride, lines,
                PAGES);
    for (int t = 0; t < trials; ++t) {
        const int sm_b = 1 + t * (sms - 1) / trials;
        CHECK(cudaMemset(flag, 0, sizeof(int)));
        probe<<<sms, 32, smem>>>(region + trial_bytes * t / 4, lines, stride / 4, 0, sm_b, flag, latency, sink, 0u);
        CHECK(cudaGetLastError());
        CHECK(cudaDeviceSynchronize());
        CHECK(cudaMemcpy(lat.data(), latency, size_t(lines) * 4, cudaMemcpyDeviceToHost));
        if (lat[0] == 0xffffffffu) {
            std::printf("SM B %3d: SM A never ran (was every SM given a block?)\n", sm_b);
            continue;
        }
        std::vector<uint32_t> sorted(lat);
        std::sort(sorted.begin(), sorted.end());
        const uint32_t p10 = sorted[lines / 10], p50 = sorted[lines / 2], p90 = sorted[lines * 9 / 10];
        const uint32_t cut = (p10 + p90) / 2;  // near below, far above (when there are two classes)
        int far = 0, same = 0, compared = 0, run = 1;
        std::vector<int> runs;
        for (int i = 0; i < lines; ++i) {
            const bool f = lat[i] > cut;
            far += f;
            if (i > 0) {
                if (f == (lat[i - 1] > cut)) {
                    ++run;
                } else {
                    runs.push_back(run);
                    run = 1;
                }
            }
            if (i + per_page < lines) {
                ++compared;
                same += f == (lat[i + per_page] > cut);
            }
        }
        runs.push_back(run);
        std::sort(runs.begin(), runs.end());
        std::printf("SM B %3d: p10 %u p50 %u p90 %u cycles; far %.3f; %zu runs of one class (min %d, median %d, "
                    "max %d lines); same class one page on %.3f\n",
                    sm_b, p10, p50, p90, double(far) / lines, runs.size(), runs.front(), runs[runs.size() / 2],
                    runs.back(), double(same) / compared);
        int hist[16] = {0};
        for (uint32_t v : lat) hist[std::min<uint32_t>(15, v / 50)]++;
        std::printf("  lines by latency (50-cycle bins):");
        for (int b : hist) std::printf(" %d", b);
        std::printf("\n");
        if (t == 0 || t == trials / 2) {
            std::printf("  first 128 lines (1 = far):");
            for (int i = 0; i < 128 && i < lines; ++i) std::printf("%s%d", i % 32 ? "" : " ", int(lat[i] > cut));
            std::printf("\n");
        }
    }
    return 0;
}
