// Would reading only near-homed lines stream faster? (H100/H200: the L2's two partitions.)
//
//     nvcc -arch=sm_90a -O2 -o l2_near_stream benchmarks/l2_near_stream.cu && ./l2_near_stream [MiB]
//
// Why: the small calls' single launch is bound by the fabric between the L2's partitions
// (docs/perf.md, "What bounds the single launch at T = 1024"). l2_homes.cu showed that a line's
// home follows its address in runs of 4-8 KB and that a 2 MB page repeats the pattern of another
// or its complement. So a tile scheduler could in principle hand each SM the weight rows homed
// in its own partition, if it had a map. This program builds that map the slow way and asks the
// question that decides whether it is worth having: do SMs that read only lines homed near them
// move more bytes a second than SMs that read their share of every line?
//
// Phases:
//   1. SMs by partition: SM 0 reads a fresh region per SM; each other SM then times one read of
//      each line of its own region. An SM of SM 0's partition sees every line near; one of the
//      other partition sees about half far (each region is read by one SM only, so no SM's copy
//      of a line serves another).
//   2. Granules by home: per 8 MB chunk of the buffer, SM 0 reads the first and last line of every
//      4 KB granule, then the SMs of the other partition time them. Near means homed in their
//      partition. It prints how often a granule's two lines disagree (is 4 KB the grain?) and how
//      each 2 MB page's pattern compares with the first page's (the same, its complement, other).
//   3. Streams: one block per SM reads a list of granules (16 B a thread, 4 granules in flight a
//      block-iteration, 4 iterations unrolled). The lists: "mixed" (granule g to SM g mod SMs),
//      "near" (the granules homed in an SM's partition, dealt over that partition's SMs) and "far"
//      (homed in the other one). Each with reuse 1 (every granule read once: HBM's rate) and
//      reuse 2 (each SM also reads a partner's granules, as the launch re-reads x and h rows:
//      the second read is an L2 hit). Median of 11 timed launches; bytes into the SMs a second.
//   4. The GEMM's loads: units of 128 weight rows (a row one granule) read by TMA into a ring of
//      shared-memory stages, a K block of 64 columns a stage, as a gate/up tile loads its weights:
//      contiguous rows in one box a stage (today's load), the same rows in one box a row (what a
//      gather costs), and units of near-homed rows in one box a row (what a home-aware tile would
//      do); one-row boxes issued by one thread and by a whole warp (whether one thread's issue
//      rate or the TMA unit bounds them). A checksum of what lands says whether one-row boxes
//      under the 128 B swizzle land as the rows of one box do.
//   5. Phase 3's streams again with the MMAs' power beside them: a burner block on
//      every SM (8 warps of back-to-back bf16 mma.sync on random operands, no memory traffic)
//      runs through the timed launches, as the single launch's MMAs run beside its loads. Phase 3
//      ran at the uncapped clock, where the fabric between the partitions carries about 2.5
//      TB/s; the launch at T = 1024 runs at the 700 W cap, about 1.6 GHz. If the fabric's rate
//      follows the clock, near-only reads gain more here than in phase 3, and the far-only
//      stream (the fabric's own rate) slows with the clock. First a burner that only sleeps
//      between polls (what a resident block costs the stream by itself), then the MMAs. Every
//      stream prints the SMs' median clock over the launch (clock64 against globaltimer).
#include <algorithm>
#include <chrono>
#include <initializer_list>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <tuple>
#include <vector>

#include <cuda.h>
#include <cuda_runtime.h>
#include <cudaTypedefs.h>

#include "l2_probe.cuh"

constexpr int GRAIN = 4096;                      // bytes a granule: l2_homes' shortest run of one class
constexpr int LINE = 128;                        // bytes an L2 line
constexpr int PROBE_GRAINS = 32;                 // granules of each SM's region in phase 1
constexpr int CHUNK_GRAINS = 2048;               // granules a phase-2 launch maps (8 MB: well inside L2)
constexpr uint32_t FAR_CYCLES = 400;             // l2_homes: near lines take 250-350 cycles, far 430-550
constexpr long long WAIT_CYCLES = 4000000000LL;  // a waiting SM gives up after this (about 2 s)
constexpr int SMEM = 200 * 1024;                 // a launch-size smem request keeps one block per SM

// Phase 1. region: sms * PROBE_GRAINS granules; latency: [sms][PROBE_GRAINS]; seen[s] = 1 when SM s ran.
__global__ void map_sms(const char* region, volatile int* flag, uint32_t* latency, int* seen, uint32_t* sink,
                        uint32_t zero) {
    extern __shared__ char hold[];
    const uint32_t me = sm_id();
    uint32_t acc = 0;
    if (me == 0) {
        for (int i = threadIdx.x; i < int(gridDim.x) * PROBE_GRAINS; i += blockDim.x)
            acc += load_l2(reinterpret_cast<const uint32_t*>(region + size_t(i) * GRAIN));
        __syncthreads();
        if (threadIdx.x == 0) {
            __threadfence();
            *flag = 1;
            seen[0] = 1;
        }
    } else if (threadIdx.x == 0 && me < gridDim.x) {
        if (atomicExch(seen + me, 1) == 0) {  // the first block on this SM probes
            if (!wait_flag(flag, WAIT_CYCLES)) {
                latency[me * PROBE_GRAINS] = 0xffffffffu;
                return;
            }
            const size_t first = size_t(me) * PROBE_GRAINS;
            acc += timed_reads(region, [&](int i) { return (first + i) * GRAIN; }, PROBE_GRAINS,
                               latency + me * PROBE_GRAINS, zero);
        }
    }
    if (acc == 0x9e3779b9u) sink[0] = acc;
    hold[0] = 0;
}

// Phase 2, one chunk. SM 0 reads the first and last line of each granule; the SMs of the other
// partition (rank[s] >= 0 among nb of them) time them. latency: [grains][2].
__global__ void map_grains(const char* chunk, int grains, const int* rank, int nb, volatile int* flag,
                           uint32_t* latency, uint32_t* sink, uint32_t zero) {
    extern __shared__ char hold[];
    const uint32_t me = sm_id();
    uint32_t acc = 0;
    if (me == 0) {
        for (int i = threadIdx.x; i < grains * 2; i += blockDim.x)
            acc += load_l2(reinterpret_cast<const uint32_t*>(chunk + size_t(i / 2) * GRAIN + (i % 2) * (GRAIN - LINE)));
        __syncthreads();
        if (threadIdx.x == 0) {
            __threadfence();
            *flag = 1;
        }
    } else if (threadIdx.x == 0 && me < gridDim.x && rank[me] >= 0) {
        if (!wait_flag(flag, WAIT_CYCLES)) return;  // the host sees latency 0 and reports it
        const int r = rank[me];
        const int n = min(64, 2 * ((grains - r + nb - 1) / nb));  // first and last line of each
        uint32_t lat[64];
        acc += timed_reads(chunk, [&](int i) { return size_t(r + (i / 2) * nb) * GRAIN + (i % 2) * (GRAIN - LINE); },
                           n, lat, zero);
        for (int i = 0, g = r; i < n; i += 2, g += nb) {
            latency[2 * g] = lat[i];
            latency[2 * g + 1] = lat[i + 1];
        }
    }
    if (acc == 0x9e3779b9u) sink[0] = acc;
    hold[0] = 0;
}

// Phase 3. SM s reads granules list[off[s] .. off[s + 1]); done counts the SMs that ran; clk[2 s],
// clk[2 s + 1]: the SM clocks and nanoseconds its block took (its clock rate over the launch). At most
// 48 registers a thread, so that phase 5's burner block (256 threads of 56) fits beside it on an SM.
__global__ void __maxnreg__(48)
    stream(const uint4* buf, const int* list, const int* off, int* claimed, int* done, uint32_t* sink, int epoch,
           long long* clk) {
    extern __shared__ char hold[];
    __shared__ int mine;
    const uint32_t me = sm_id();
    if (threadIdx.x == 0) mine = me < gridDim.x && atomicExch(claimed + me, epoch) != epoch;
    __syncthreads();
    if (!mine) return;
    const long long c0 = clock64();
    const unsigned long long t0 = global_ns();
    const int b = off[me], e = off[me + 1];
    constexpr int PER = GRAIN / 16;            // uint4s a granule
    const int sub = threadIdx.x / PER;         // which of 4 granules an iteration reads
    const int word = threadIdx.x % PER;
    uint4 a0 = {0, 0, 0, 0}, a1 = a0, a2 = a0, a3 = a0;
    int i = b + sub;
    for (; i + 12 < e; i += 16) {
        const uint4 v0 = __ldcg(buf + size_t(list[i]) * PER + word);
        const uint4 v1 = __ldcg(buf + size_t(list[i + 4]) * PER + word);
        const uint4 v2 = __ldcg(buf + size_t(list[i + 8]) * PER + word);
        const uint4 v3 = __ldcg(buf + size_t(list[i + 12]) * PER + word);
        a0.x ^= v0.x; a0.y ^= v0.y; a0.z ^= v0.z; a0.w ^= v0.w;
        a1.x ^= v1.x; a1.y ^= v1.y; a1.z ^= v1.z; a1.w ^= v1.w;
        a2.x ^= v2.x; a2.y ^= v2.y; a2.z ^= v2.z; a2.w ^= v2.w;
        a3.x ^= v3.x; a3.y ^= v3.y; a3.z ^= v3.z; a3.w ^= v3.w;
    }
    for (; i < e; i += 4) {
        const uint4 v = __ldcg(buf + size_t(list[i]) * PER + word);
        a0.x ^= v.x; a0.y ^= v.y; a0.z ^= v.z; a0.w ^= v.w;
    }
    a0.x ^= a1.x ^ a2.x ^ a3.x; a0.y ^= a1.y ^ a2.y ^ a3.y; a0.z ^= a1.z ^ a2.z ^ a3.z; a0.w ^= a1.w ^ a2.w ^ a3.w;
    const uint32_t acc = a0.x ^ a0.y ^ a0.z ^ a0.w;  // every byte read feeds it: no load is narrowed
    if (acc == 0x9e3779b9u) sink[0] = acc;
    __syncthreads();
    if (threadIdx.x == 0) {
        clk[2 * me] = clock64() - c0;
        clk[2 * me + 1] = (long long)(global_ns() - t0);
        atomicAdd(done, 1);
    }
    hold[0] = 0;
}

// Phase 5. One block of 8 warps per SM beside the stream's block: bf16 mma.sync (m16n8k16, fp32
// sums) on operands that change every step, 8 independent sums a warp so the tensor pipe never
// waits, and no memory traffic. The launch has several blocks per SM, and the first block on an SM
// claims it (taken[s]; burners counts them), the others leave at once, as the scheduler may place
// two on one SM and none on another. It stops when *stop is set (a device word the host's copy
// writes) or after limit_ns, whichever is first: never a hang.
__global__ void __launch_bounds__(256, 1) burn(const volatile int* stop, unsigned long long limit_ns, uint32_t* sink,
                                               unsigned long long* ran_ns, int* taken, int* burners, int mma) {
    __shared__ int mine;
    if (threadIdx.x == 0) {
        mine = atomicExch(taken + sm_id(), 1) == 0;
        if (mine) atomicAdd(burners, 1);
    }
    __syncthreads();
    if (!mine) return;
    uint32_t a[4], b[2];
    for (int i = 0; i < 4; ++i) a[i] = (mix32(threadIdx.x * 8 + i) & 0x807f807fu) | 0x3f003f00u;  // +-[0.5, 1)
    for (int i = 0; i < 2; ++i) b[i] = (mix32(threadIdx.x * 8 + 4 + i) & 0x807f807fu) | 0x3f003f00u;
    float c[8][4] = {};
    const unsigned long long t0 = global_ns();
    for (;;) {
#pragma unroll 1
        for (int r = 0; r < 256 * mma; ++r) {
#pragma unroll
            for (int j = 0; j < 8; ++j)
                asm volatile(
                    "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                    "{%0,%1,%2,%3};"
                    : "+f"(c[j][0]), "+f"(c[j][1]), "+f"(c[j][2]), "+f"(c[j][3])
                    : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
            a[0] ^= 0x00010001u;  // operands that toggle bits, as real data does
            a[2] ^= 0x00020002u;
        }
        if (!mma) __nanosleep(1000);
        if (*stop || global_ns() - t0 > limit_ns) break;
    }
    float sum = 0.f;
    for (int j = 0; j < 8; ++j) sum += c[j][0] + c[j][1] + c[j][2] + c[j][3];
    if (sum == 1.2345f) sink[0] = 1;
    if (threadIdx.x == 0) atomicMax(ran_ns, global_ns() - t0);
}

// The median of the SMs' clock rates over a launch, MHz, from stream's clk words.
inline double median_mhz(const long long* clk_d, int sms, double* block_ms = nullptr) {
    std::vector<long long> c(2 * size_t(sms));
    CHECK(cudaMemcpy(c.data(), clk_d, c.size() * 8, cudaMemcpyDeviceToHost));
    std::vector<double> mhz, ms;
    for (int s = 0; s < sms; ++s)
        if (c[2 * s + 1] > 0) {
            mhz.push_back(1e3 * double(c[2 * s]) / double(c[2 * s + 1]));
            ms.push_back(double(c[2 * s + 1]) * 1e-6);
        }
    if (mhz.empty()) return 0.0;
    std::sort(mhz.begin(), mhz.end());
    std::sort(ms.begin(), ms.end());
    if (block_ms) *block_ms = ms[ms.size() / 2];
    return mhz[mhz.size() / 2];
}

// Phase 4: the GEMM's way of reading weights. One block per SM: a producer thread fills a ring of
// STAGES shared-memory stages by TMA, each stage one K block (64 bf16 columns) of a unit of
// TILE_ROWS weight rows (a row is one 4 KB granule, H = 2048 bf16), as a gate/up tile's B operand
// is loaded; four consumer warps wait for each stage and free it (no MMA: only the loads are
// timed). A unit's rows are contiguous (one box of 64 x 128 per stage, today's load) or listed
// (128 boxes of 64 x 1, one per row: the gather a tile of rows chosen by home would need).
constexpr int TILE_ROWS = 128;
constexpr int KBLK = 64;                                // bf16 columns a stage
constexpr int STAGES = 8;
constexpr int STAGE_BYTES = TILE_ROWS * KBLK * 2;       // 16 KB
constexpr int KBLOCKS = GRAIN / (KBLK * 2);             // 32 stages a unit
constexpr int CONSUMER_WARPS = 4;
constexpr int TMA_SMEM = STAGES * STAGE_BYTES + 1024;   // + room to align the ring to 1 KB (128 B swizzle)

__device__ bool wait_parity(uint64_t* bar, uint32_t parity) {
    const long long start = clock64();
    while (true) {
        uint32_t ok;
        asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                     : "=r"(ok) : "r"(smem_u32(bar)), "r"(parity) : "memory");
        if (ok) return true;
        if (clock64() - start > WAIT_CYCLES) return false;
    }
}

__global__ void __launch_bounds__(32 * (CONSUMER_WARPS + 1), 1)
    tma_stream(const __grid_constant__ CUtensorMap map, int box_rows, int issuers, const int* rows, const int* units,
               const int* off, int* claimed, int* done, int* failed, uint32_t* checksum, int epoch, int check) {
    extern __shared__ char raw[];
    char* ring = reinterpret_cast<char*>((uintptr_t(raw) + 1023) & ~uintptr_t(1023));
    __shared__ __align__(8) uint64_t full[STAGES], empty[STAGES];
    __shared__ int mine;
    const uint32_t me = sm_id();
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (threadIdx.x == 0) {
        mine = me < gridDim.x && atomicExch(claimed + me, epoch) != epoch;
        for (int s = 0; s < STAGES; ++s) {
            asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_u32(full + s)));
            asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(empty + s)), "r"(CONSUMER_WARPS));
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    if (!mine) return;
    const int b = off[me], n_stages = (off[me + 1] - b) * KBLOCKS;
    uint32_t sum = 0;
    bool ok = true;
    if (warp == CONSUMER_WARPS) {
        // Lane 0 waits for a free stage and arms its barrier; the first `issuers` lanes then issue
        // the stage's boxes between them (one lane, or the whole warp: whether one thread's issue
        // rate or the TMA unit bounds one-row boxes).
        for (int n = 0; n < n_stages && ok; ++n) {
            const int s = n % STAGES;
            if (lane == 0) {
                if (n >= STAGES) ok = wait_parity(empty + s, ((n / STAGES) & 1) ^ 1);
                if (ok)
                    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(full + s)),
                                 "r"(STAGE_BYTES) : "memory");
            }
            ok = __shfl_sync(0xffffffffu, ok, 0);
            if (!ok || lane >= issuers) continue;
            const int* r = rows + size_t(units[b + n / KBLOCKS]) * TILE_ROWS;
            const int col = (n % KBLOCKS) * KBLK;
            for (int j = lane * box_rows; j < TILE_ROWS; j += issuers * box_rows)  // one box, or one a row
                asm volatile(
                    "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];"
                    ::"r"(smem_u32(ring + s * STAGE_BYTES + j * KBLK * 2)), "l"(&map), "r"(col), "r"(r[j]),
                    "r"(smem_u32(full + s)) : "memory");
        }
    } else {
        for (int n = 0; n < n_stages && ok; ++n) {
            const int s = n % STAGES;
            if (!(ok = wait_parity(full + s, (n / STAGES) & 1))) break;
            if (check) {  // position-weighted, so a box that landed elsewhere in the stage changes it
                const uint32_t* w = reinterpret_cast<const uint32_t*>(ring + s * STAGE_BYTES);
                for (int i = threadIdx.x; i < STAGE_BYTES / 4; i += 32 * CONSUMER_WARPS) sum += w[i] * uint32_t(i + 1);
            }
            __syncwarp();
            if (lane == 0) asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_u32(empty + s)) : "memory");
        }
    }
    if (!ok) atomicExch(failed, 1);
    if (check && sum) atomicAdd(checksum, sum);
    __syncthreads();
    if (threadIdx.x == 0) atomicAdd(done, 1);
}

__global__ void fill(uint32_t* w, size_t n) {
    for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
        w[i] = mix32(uint32_t(i));
}

struct Lists {
    std::vector<int> list, off;
};

// Deal each SM's granules: pick(s) gives the pool SM s draws from and its place among the SMs that share it.
template <class Pick>
Lists deal(int sms, int reuse, Pick pick) {
    std::vector<std::vector<int>> own(sms);
    for (int s = 0; s < sms; ++s) {
        const auto [pool, at, of] = pick(s);
        for (size_t k = at; k < pool->size(); k += of) own[s].push_back((*pool)[k]);
    }
    Lists l;
    l.off.push_back(0);
    for (int s = 0; s < sms; ++s) {
        const auto [pool, at, of] = pick(s);
        // The partner: the next SM drawing from the same pool, so a re-read stays in that pool's class.
        int p = s;
        for (int t = 1; t <= sms; ++t) {
            const int c = (s + t) % sms;
            if (std::get<0>(pick(c)) == pool) {
                p = c;
                break;
            }
        }
        for (size_t k = 0; k < own[s].size(); ++k) {
            l.list.push_back(own[s][k]);
            if (reuse > 1 && k < own[p].size()) l.list.push_back(own[p][k]);
        }
        l.off.push_back(int(l.list.size()));
    }
    return l;
}

int main(int argc, char** argv) {
    const size_t mib = argc > 1 ? std::strtoul(argv[1], nullptr, 10) : 1024;
    const size_t grains = mib * (size_t(1) << 20) / GRAIN;
    if (grains < size_t(CHUNK_GRAINS) || grains % CHUNK_GRAINS) {  // before any GPU work
        std::printf("usage: %s [MiB: a multiple of 8]\n", argv[0]);
        return 2;
    }
    int sms = 0;
    CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    char *raw = nullptr, *probe_raw = nullptr;
    CHECK(cudaMalloc(&raw, grains * GRAIN + (2 << 20)));
    CHECK(cudaMemset(raw, 0x5a, grains * GRAIN + (2 << 20)));
    char* buf = reinterpret_cast<char*>((uintptr_t(raw) + (2 << 20) - 1) & ~uintptr_t((2 << 20) - 1));
    CHECK(cudaMalloc(&probe_raw, size_t(sms) * PROBE_GRAINS * GRAIN));
    int *flag, *seen, *rank_d, *claimed, *done;
    uint32_t *lat_d, *sink;
    CHECK(cudaMalloc(&flag, 4));
    CHECK(cudaMalloc(&seen, sms * 4));
    CHECK(cudaMalloc(&rank_d, sms * 4));
    CHECK(cudaMalloc(&claimed, sms * 4));
    CHECK(cudaMalloc(&done, 4));
    CHECK(cudaMalloc(&sink, 4));
    CHECK(cudaMalloc(&lat_d, size_t(std::max(sms * PROBE_GRAINS, CHUNK_GRAINS * 2)) * 4));
    for (auto k : {(const void*)map_sms, (const void*)map_grains, (const void*)stream})
        CHECK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM));

    // Phase 1.
    CHECK(cudaMemset(flag, 0, 4));
    CHECK(cudaMemset(seen, 0, sms * 4));
    CHECK(cudaMemset(lat_d, 0, size_t(sms) * PROBE_GRAINS * 4));
    map_sms<<<sms, 32, SMEM>>>(probe_raw, flag, lat_d, seen, sink, 0u);
    CHECK(cudaGetLastError());
    CHECK(cudaDeviceSynchronize());
    std::vector<uint32_t> lat(size_t(sms) * PROBE_GRAINS);
    std::vector<int> seen_h(sms), part(sms, -1), rank(sms, -1);
    CHECK(cudaMemcpy(lat.data(), lat_d, lat.size() * 4, cudaMemcpyDeviceToHost));
    CHECK(cudaMemcpy(seen_h.data(), seen, sms * 4, cudaMemcpyDeviceToHost));
    int nb = 0, na = 1, missing = 0;
    part[0] = 0;
    std::printf("phase 1: SMs of SM 0's partition (A) and of the other (B), by the far share of %d lines:\n",
                PROBE_GRAINS);
    std::string a_ids = " 0", b_ids;
    for (int s = 1; s < sms; ++s) {
        if (!seen_h[s] || lat[s * PROBE_GRAINS] == 0xffffffffu || lat[s * PROBE_GRAINS] == 0) {
            ++missing;
            continue;
        }
        int far = 0;
        for (int i = 0; i < PROBE_GRAINS; ++i) far += lat[s * PROBE_GRAINS + i] > FAR_CYCLES;
        part[s] = far * 4 > PROBE_GRAINS ? 1 : 0;  // B sees about half far, A none
        (part[s] ? b_ids : a_ids) += " " + std::to_string(s);
        if (part[s]) rank[s] = nb++; else ++na;
    }
    std::printf("  A (%d SMs):%s\n  B (%d SMs):%s\n  not seen: %d\n", na, a_ids.c_str(), nb, b_ids.c_str(), missing);
    if (nb == 0 || missing) {
        std::printf("cannot map the granules: %s\n", nb ? "an SM ran no block" : "no SM sees far lines");
        return 1;
    }

    // Phase 2.
    CHECK(cudaMemcpy(rank_d, rank.data(), sms * 4, cudaMemcpyHostToDevice));
    std::vector<uint8_t> home(grains);  // 1: homed in B
    std::vector<uint32_t> clat(CHUNK_GRAINS * 2);
    size_t disagree = 0, unmapped = 0;
    for (size_t c = 0; c < grains / CHUNK_GRAINS; ++c) {
        CHECK(cudaMemset(flag, 0, 4));
        CHECK(cudaMemset(lat_d, 0, CHUNK_GRAINS * 2 * 4));
        map_grains<<<sms, 32, SMEM>>>(buf + c * CHUNK_GRAINS * GRAIN, CHUNK_GRAINS, rank_d, nb, flag, lat_d, sink, 0u);
        CHECK(cudaGetLastError());
        CHECK(cudaMemcpy(clat.data(), lat_d, clat.size() * 4, cudaMemcpyDeviceToHost));
        for (int g = 0; g < CHUNK_GRAINS; ++g) {
            const uint32_t f = clat[2 * g], l = clat[2 * g + 1];
            unmapped += f == 0;
            disagree += (f > FAR_CYCLES) != (l > FAR_CYCLES);
            home[c * CHUNK_GRAINS + g] = f <= FAR_CYCLES;
        }
    }
    size_t in_b = 0;
    for (auto h : home) in_b += h;
    const size_t per_page = (2 << 20) / GRAIN;
    size_t same = 0, complement = 0, other = 0;
    for (size_t p = 1; p < grains / per_page; ++p) {
        size_t eq = 0;
        for (size_t g = 0; g < per_page; ++g) eq += home[p * per_page + g] == home[g];
        if (eq * 100 >= per_page * 98) ++same;
        else if (eq * 100 <= per_page * 2) ++complement;
        else ++other;
    }
    std::printf("phase 2: %zu granules of 4 KB, %.3f homed in B; first and last line disagree in %zu, "
                "%zu not timed\n  2 MB pages beside the first: %zu the same pattern, %zu its complement, %zu other\n",
                grains, double(in_b) / grains, disagree, unmapped, same, complement, other);
    if (unmapped) return 1;

    // Phase 3.
    std::vector<int> all(grains), pool[2];
    for (size_t g = 0; g < grains; ++g) {
        all[g] = int(g);
        pool[home[g]].push_back(int(g));
    }
    std::vector<int> at_in(sms);
    {
        int ia = 0, ib = 0;
        for (int s = 0; s < sms; ++s) at_in[s] = part[s] ? ib++ : ia++;
    }
    const int count[2] = {na, nb};
    int* list_d = nullptr;
    int* off_d = nullptr;
    CHECK(cudaMalloc(&list_d, grains * 2 * 4));
    CHECK(cudaMalloc(&off_d, (sms + 1) * 4));
    CHECK(cudaMemset(claimed, 0, sms * 4));
    cudaEvent_t e0, e1;
    CHECK(cudaEventCreate(&e0));
    CHECK(cudaEventCreate(&e1));
    int epoch = 0;
    std::printf("phase 3: one block per SM, 1024 threads; GB/s into the SMs (median of 11), "
                "and the slowest SM's share of the bytes against an even one\n");
    long long* clk_d = nullptr;
    CHECK(cudaMalloc(&clk_d, size_t(sms) * 2 * 8));
    // Times each mode's stream at one reuse: 14 launches, the first 3 untimed, the median kept.
    auto streams = [&](std::initializer_list<const char*> modes, int reuse) {
        for (const char* mode : modes) {
            const std::string m = mode;
            const Lists l = deal(sms, reuse, [&](int s) -> std::tuple<const std::vector<int>*, int, int> {
                if (m == "mixed") return {&all, s, sms};
                const int p = m == "near" ? part[s] : 1 - part[s];
                // "far": the SMs of one partition deal the other's granules among themselves.
                return {&pool[p], at_in[s], count[part[s]]};
            });
            CHECK(cudaMemcpy(list_d, l.list.data(), l.list.size() * 4, cudaMemcpyHostToDevice));
            CHECK(cudaMemcpy(off_d, l.off.data(), (sms + 1) * 4, cudaMemcpyHostToDevice));
            size_t most = 0;
            for (int s = 0; s < sms; ++s) most = std::max(most, size_t(l.off[s + 1] - l.off[s]));
            std::vector<float> ms;
            double mhz = 0.0, block_ms = 0.0;
            for (int it = 0; it < 14; ++it) {
                CHECK(cudaMemset(done, 0, 4));
                ++epoch;
                CHECK(cudaEventRecord(e0));
                stream<<<sms, 1024, SMEM>>>(reinterpret_cast<const uint4*>(buf), list_d, off_d, claimed, done, sink,
                                            epoch, clk_d);
                const Launched run = finish_launch(e0, e1, done, nullptr);
                if (run.done != sms) {
                    std::printf("  %s reuse %d: %d of %d SMs ran\n", mode, reuse, run.done, sms);
                    break;
                }
                if (it >= 3) ms.push_back(run.ms);
                if (it == 13) mhz = median_mhz(clk_d, sms, &block_ms);
            }
            if (ms.empty()) continue;
            std::sort(ms.begin(), ms.end());
            const double t = ms[ms.size() / 2] * 1e-3, bytes = double(l.list.size()) * GRAIN;
            std::printf("  %-5s reuse %d: %8.3f ms  %7.0f GB/s  (%.2f GB; slowest SM %.2fx even; SMs at %.0f MHz, "
                        "a block %.3f ms)\n", mode, reuse, t * 1e3, bytes / t * 1e-9, bytes * 1e-9,
                        double(most) * sms / l.list.size(), mhz, block_ms);
        }
    };
    for (int reuse = 1; reuse <= 2; ++reuse) streams({"mixed", "near", "far"}, reuse);

    // Phase 5: the same streams beside a burner block on every SM: first one that only sleeps
    // between polls (what a resident block costs the stream by itself), then one that runs MMAs.
    // The word that stops it is device memory, written by a copy on a third stream: polls of mapped
    // host memory from every SM (a first version) starved the stream's loads a hundredfold.
    CHECK(cudaFuncSetAttribute(burn, cudaFuncAttributePreferredSharedMemoryCarveout, cudaSharedmemCarveoutMaxShared));
    for (int mma = 0; mma <= 1; ++mma) {
        int* stop_h = nullptr;  // pinned: its copy runs while the burners do
        int* stop_d = nullptr;
        CHECK(cudaMallocHost(&stop_h, 4));
        *stop_h = 1;
        CHECK(cudaMalloc(&stop_d, 4));
        CHECK(cudaMemset(stop_d, 0, 4));
        cudaStream_t side, copier;
        CHECK(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking));
        CHECK(cudaStreamCreateWithFlags(&copier, cudaStreamNonBlocking));
        unsigned long long* ran_d = nullptr;
        int *taken_d = nullptr, *burners_d = nullptr;
        CHECK(cudaMalloc(&ran_d, 8));
        CHECK(cudaMalloc(&taken_d, sms * 4));
        CHECK(cudaMalloc(&burners_d, 4));
        CHECK(cudaMemset(ran_d, 0, 8));
        CHECK(cudaMemset(taken_d, 0, sms * 4));
        CHECK(cudaMemset(burners_d, 0, 4));
        CHECK(cudaDeviceSynchronize());
        const unsigned long long limit_ns = 10ull * 1000000000ull;  // a stream that cannot sit beside it waits this long
        // (An SM keeps the shared-memory size of the blocks it holds: the burner asks for the most,
        // or its SM would keep too little for the stream's 200 KB.)
        burn<<<sms * 8, 256, 0, side>>>(stop_d, limit_ns, sink, ran_d, taken_d, burners_d, mma);
        CHECK(cudaGetLastError());
        // Let the clock settle under the burners' power before the first timed stream.
        const auto start = std::chrono::steady_clock::now();
        while (std::chrono::steady_clock::now() - start < std::chrono::milliseconds(500)) {}
        int burners = 0;
        CHECK(cudaMemcpy(&burners, burners_d, 4, cudaMemcpyDeviceToHost));  // (the legacy stream: not the burners')
        std::printf("phase 5%s: phase 3's streams beside a block of 8 warps %s, on %d of %d SMs\n", mma ? "b" : "a",
                    mma ? "of back-to-back bf16 mma.sync" : "that sleeps between polls", burners, sms);
        for (int reuse = 1; reuse <= 2; ++reuse) streams({"mixed", "near", "far"}, reuse);
        CHECK(cudaMemcpyAsync(stop_d, stop_h, 4, cudaMemcpyHostToDevice, copier));
        CHECK(cudaStreamSynchronize(copier));
        CHECK(cudaStreamSynchronize(side));
        CHECK(cudaGetLastError());
        unsigned long long ran = 0;
        CHECK(cudaMemcpy(&ran, ran_d, 8, cudaMemcpyDeviceToHost));
        std::printf("  the burners ran %.0f ms%s\n", ran * 1e-6,
                    ran >= limit_ns ? ": to their limit, so the streams did not run beside them (figures void)" : "");
        CHECK(cudaStreamDestroy(side));
        CHECK(cudaStreamDestroy(copier));
        CHECK(cudaFreeHost(stop_h));
        for (void* p : {(void*)stop_d, (void*)ran_d, (void*)taken_d, (void*)burners_d}) CHECK(cudaFree(p));
    }
    // Phase 4.
    fill<<<sms * 4, 1024>>>(reinterpret_cast<uint32_t*>(buf), grains * GRAIN / 4);
    CHECK(cudaGetLastError());
    static_assert(KBLK == 64, "rows_map's box is 64 columns wide");
    CUtensorMap maps[2];  // a box of TILE_ROWS rows, a box of one row
    for (int m = 0; m < 2; ++m)
        if (!rows_map(maps + m, buf, GRAIN / 2, grains, GRAIN, m ? 1 : TILE_ROWS)) return 1;
    CHECK(cudaFuncSetAttribute(tma_stream, cudaFuncAttributeMaxDynamicSharedMemorySize, TMA_SMEM));
    // Rows in unit order: contiguous units first (row g is granule g), then partition A's homed rows,
    // then B's, each cut to whole units.
    std::vector<int> rows_h(all), unit_pool[3];
    const int contiguous_units = int(grains / TILE_ROWS);
    for (int u = 0; u < contiguous_units; ++u) unit_pool[2].push_back(u);
    for (int p = 0; p < 2; ++p) {
        const size_t whole = pool[p].size() / TILE_ROWS * TILE_ROWS;
        for (size_t k = 0; k < whole; k += TILE_ROWS) {
            unit_pool[p].push_back(int(rows_h.size() / TILE_ROWS));
            rows_h.insert(rows_h.end(), pool[p].begin() + k, pool[p].begin() + k + TILE_ROWS);
        }
    }
    int *rows_d, *failed;
    uint32_t* checksum;
    CHECK(cudaMalloc(&rows_d, rows_h.size() * 4));
    CHECK(cudaMemcpy(rows_d, rows_h.data(), rows_h.size() * 4, cudaMemcpyHostToDevice));
    CHECK(cudaMalloc(&failed, 4));
    CHECK(cudaMalloc(&checksum, 4));
    CHECK(cudaMemset(failed, 0, 4));
    std::printf("phase 4: units of %d weight rows of 4 KB, a producer thread's TMA into %d stages of 16 KB, "
                "%d consumer warps (no MMA); GB/s into the SMs (median of 11)\n", TILE_ROWS, STAGES, CONSUMER_WARPS);
    uint32_t sums[3] = {0, 0, 0};  // one box, a box a row by one lane, by 32 lanes
    for (int reuse = 1; reuse <= 2; ++reuse) {
        for (const char* mode : {"contiguous, one box", "contiguous, a box a row", "contiguous, a row, 32 lanes",
                                 "near-homed, a box a row"}) {
            const std::string m = mode;
            const bool near = m[0] == 'n';
            const int box_rows = m.find("a row") != std::string::npos ? 1 : TILE_ROWS;
            const int issuers = m.find("32 lanes") != std::string::npos ? 32 : 1;
            const Lists l = deal(sms, reuse, [&](int s) -> std::tuple<const std::vector<int>*, int, int> {
                if (!near) return {&unit_pool[2], s, sms};
                return {&unit_pool[part[s]], at_in[s], count[part[s]]};
            });
            CHECK(cudaMemcpy(list_d, l.list.data(), l.list.size() * 4, cudaMemcpyHostToDevice));
            CHECK(cudaMemcpy(off_d, l.off.data(), (sms + 1) * 4, cudaMemcpyHostToDevice));
            std::vector<float> ms;
            for (int it = 0; it < 15; ++it) {
                const int check = it == 0;  // the first launch checksums what landed, untimed
                CHECK(cudaMemset(done, 0, 4));
                CHECK(cudaMemset(checksum, 0, 4));
                ++epoch;
                CHECK(cudaEventRecord(e0));
                tma_stream<<<sms, 32 * (CONSUMER_WARPS + 1), TMA_SMEM>>>(maps[box_rows == 1], box_rows, issuers, rows_d, list_d,
                                                                         off_d, claimed, done, failed, checksum,
                                                                         epoch, check);
                const Launched run = finish_launch(e0, e1, done, failed);
                if (run.done != sms || run.gave_up) {
                    std::printf("  %s reuse %d: %d of %d SMs ran%s\n", mode, reuse, run.done, sms,
                                run.gave_up ? ", a wait gave up" : "");
                    return 1;
                }
                if (check && !near && reuse == 1) CHECK(cudaMemcpy(sums + (box_rows == 1 ? (issuers == 1 ? 1 : 2) : 0), checksum, 4, cudaMemcpyDeviceToHost));
                if (it >= 4) ms.push_back(run.ms);
            }
            std::sort(ms.begin(), ms.end());
            const double t = ms[ms.size() / 2] * 1e-3, bytes = double(l.list.size()) * TILE_ROWS * GRAIN;
            std::printf("  %-28s reuse %d: %8.3f ms  %7.0f GB/s  (%.2f GB)\n", mode, reuse, t * 1e3, bytes / t * 1e-9,
                        bytes * 1e-9);
        }
    }
    std::printf("  boxes of a row land as one box does (the same position-weighted checksum): %s (%08x, %08x, %08x)\n",
                sums[0] == sums[1] && sums[0] == sums[2] ? "yes" : "NO", sums[0], sums[1], sums[2]);
    return 0;
}
