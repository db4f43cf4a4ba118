// Would serving a tile's token rows once per cluster (TMA multicast) make the 160-row tiles faster?
//
//     nvcc -gencode arch=compute_90a,code=sm_90a -O3 -std=c++17 -o l2_multicast benchmarks/l2_multicast.cu
//     ./l2_multicast [rounds]
//
// Why: at T = 1024 the single launch (E64 K8 H2048 I1024) runs 160-row swapped gate/up tiles, and
// each of an M tile's 8 column tiles reads the same 160 x rows: 335 MB of the call's 1.31 GB
// through L2 (docs/perf.md, "Where a 160-row tile's time goes"). A tile's time fits
// W / 35.6 GB/s + A / 63 GB/s per SM (W its weight bytes, A its token rows' bytes), so the rows
// cost about a quarter of it. A TMA multicast over a cluster of the CTAs that share an M tile
// would have L2 serve each row once per cluster, but every SM of the cluster still takes the
// bytes in. Which of the two bounds the rows' cost decides whether the multicast (a cluster
// launch, the x rows copied in dispatch order first: cp.async cannot multicast) is worth
// building into the kernel; this program measures it on the tile's own loads and MMAs.
//
// One CTA per SM, as the kernel: warp 0 of warpgroup 0 issues a tile's TMA loads into 4 stages
// of 52 KB (a K block of 64: the gate and up weight boxes of 128 x 64 and the 160 x 64 token
// rows), and two consumer warpgroups each run the tile's wgmma on their 64 weight rows
// (m64n160k16: gate and up, 160 fp32 accumulators a thread), then free the stage. No
// epilogue. The 512 tiles of E64's gate/up phase (64 M tiles x 8 column tiles of 128) are dealt
// so that the CTAs that share an M tile run it together. Modes:
//   weights only   the token rows never loaded: the floor if they were free
//   rows gathered  every CTA gathers its 160 rows from x by cp.async, 16 B a thread, as the kernel
//                  does (routing drawn as 8 distinct experts a token, padding rows read row 0)
//   rows each      every CTA loads all 160 rows by TMA (one box) from a dispatch-ordered copy
//   half rows      every CTA loads only the first 80 rows (the MMAs as before): half the bytes both
//                  out of L2 and into each SM, the control that tells the multicast's two bounds apart
//                  (a multicast over 2 halves only what L2 serves)
//   multicast      each of the cluster's C CTAs loads 160 / C rows and multicasts them to all C
//   rows pushed    each CTA of a pair gathers its 80 rows by cp.async and, once its four producer
//                  warps' copies of a stage landed, pushes them into the peer's stage (cp.async.bulk
//                  between the two CTAs' shared memory), as the pairs experiment did (measured
//                  slower and removed: docs/perf.md)
// Each mode with the MMAs and without (only the loads), at clusters of 1, 2 and 4 CTAs, all on one
// grid (the CTAs that clusters of 4 can fill), so the modes differ in their loads alone.
// Prints the median of the timed launches, a tile's time on one SM, the SM clock (clock64 over
// globaltimer on the CTAs), and the bytes into the SMs and out of L2 a second.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "tile_probe.cuh"

constexpr int TOK = 160;                                  // token rows a tile (the T = 1024 band)
constexpr int WROWS = 128;                                // gate rows a tile, and as many up rows
constexpr int KBLK = 64;                                  // bf16 columns a stage (128 B: one swizzle row)
constexpr int HID = 2048;                                 // K of the gate/up GEMM
constexpr int INTER = 1024;                               // gate rows an expert
constexpr int KB = HID / KBLK;                            // stages a tile
constexpr int M_TILES = 64;                               // experts, one M tile each at T = 1024
constexpr int N_TILES = INTER / WROWS;                    // column tiles an M tile
constexpr int TILES = M_TILES * N_TILES;
constexpr int STAGES = 4;
constexpr int A_STAGE = TOK * KBLK * 2;                   // 20 KB of token rows
constexpr int W_BOX = WROWS * KBLK * 2;                   // 16 KB: the gate box, or the up box
constexpr int STAGE_BYTES = A_STAGE + 2 * W_BOX;          // 52 KB, a multiple of 1 KB (the swizzle's period)
constexpr int SMEM = STAGES * STAGE_BYTES + 1024;         // + room to align the ring to 1 KB
constexpr int THREADS = 384;                              // producer warpgroup + 2 consumer warpgroups
constexpr int CONSUMER_WARPS = 8;
constexpr int TOKENS = 1024;                             // x's rows (T)
constexpr int TOPK = 8;

// A run of this CTA's shared memory into the same address of the peer's, completing its bytes on the
// peer's mbarrier at bar's address (the destination and the barrier both mapped to the peer).
__device__ __forceinline__ void push_to_peer(uint32_t local, uint32_t bytes, uint64_t* bar, uint32_t peer) {
    asm volatile(
        "{ .reg .b32 d, m;\n"
        "mapa.shared::cluster.u32 d, %0, %3;\n"
        "mapa.shared::cluster.u32 m, %2, %3;\n"
        "cp.async.bulk.shared::cluster.shared::cta.mbarrier::complete_tx::bytes [d], [%0], %1, [m]; }"
        ::"r"(local), "r"(bytes), "r"(smem_u32(bar)), "r"(peer) : "memory");
}

// The same box into the same offset of every CTA in mask, each CTA's barrier at bar's offset told.
__device__ __forceinline__ void tma_multicast(const CUtensorMap* map, uint32_t dst, uint64_t* bar, int col, int row,
                                              uint16_t mask) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
        " [%0], [%1, {%2, %3}], [%4], %5;"
        ::"r"(dst), "l"(map), "r"(col), "r"(row), "r"(smem_u32(bar)), "h"(mask) : "memory");
}

// One launch of a mode. timing[cta] = {globaltimer at start, at end, clock64 at start, at end}.
__global__ void __launch_bounds__(THREADS, 1)
    tile_stream(const __grid_constant__ CUtensorMap wmap, const __grid_constant__ CUtensorMap amap, int csize,
                int multicast, int load_a, int mma, int gather, const uint16_t* x, const int* row_token, int* failed, int* done, float* sink, long long* timing) {
    extern __shared__ char raw[];
    char* ring = reinterpret_cast<char*>((uintptr_t(raw) + 1023) & ~uintptr_t(1023));
    __shared__ __align__(8) uint64_t full[STAGES], empty[STAGES];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, wg = threadIdx.x / 128;
    long long t0 = 0, c0 = 0;
    if (threadIdx.x == 0) {
        t0 = (long long)global_ns();
        c0 = clock64();
    }
    uint32_t rank = 0;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
    // A stage is free once every consumer warp that reads it has let it go: this CTA's, and with a
    // multicast every CTA's of the cluster, since this CTA's loads land in all of them.
    const int releases = CONSUMER_WARPS * (multicast ? csize : 1);
    // A stage is full once its TMA bytes landed and, when gathering, each producer warp arrived.
    const int fills = 1 + (gather ? 4 : 0);
    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; ++s) {
            asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(full + s)), "r"(fills));
            asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(empty + s)), "r"(releases));
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    if (csize > 1) cluster_sync();  // no CTA loads into a peer before the peer's barriers exist
    // Cluster c takes units c, c + clusters, ...; a unit is C column tiles of one M tile, one a CTA.
    const int cluster = blockIdx.x / csize, clusters = gridDim.x / csize, per_m = N_TILES / csize;
    const int units = M_TILES * per_m;
    const int n_stages = cluster < units ? (units - cluster + clusters - 1) / clusters * KB : 0;
    bool ok = true;
    float total = 0.f;
    if (wg == 0) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 56;");
        if (gather) {
            // Thread t copies the 16-byte chunk t % 8 of rows t / 8 + 16 j into its swizzled place (the
            // chunk's index XOR the row's within its 8-row group: the 128 B swizzle, as TMA writes);
            // each warp arrives on a stage's full barrier once its copies landed, one stage late (the
            // kernel's gather_lag 1), after the async-proxy fence wgmma's reads need.
            // Pushed (a pair, multicast): this CTA gathers only its half of the rows, and thread 0 pushes
            // them into the peer's stage once all four warps' copies of the stage landed (bar.sync 1).
            const int chunk = threadIdx.x % 8, row0 = threadIdx.x / 8;
            const bool push = multicast && csize == 2;
            const int j0 = push ? int(rank) * (TOK / 32) : 0, j1 = push ? j0 + TOK / 32 : TOK / 16;
            const uint32_t half = TOK / 2 * KBLK * 2;  // bytes of a half of a stage's rows
            // A stage's gathers done: this warp's copies landed and fenced for wgmma's reads, its
            // arrival, and in a pair the push of this CTA's half (once every warp's copies landed).
            auto release = [&](int stage) {
                asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
                __syncwarp();
                if (lane == 0)
                    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_u32(full + stage)) : "memory");
                if (push) {
                    asm volatile("bar.sync 1, 128;" ::: "memory");
                    if (threadIdx.x == 0)
                        push_to_peer(smem_u32(ring + stage * STAGE_BYTES) + rank * half, half, full + stage, rank ^ 1);
                }
            };
            int inflight = 0;
            for (int n = 0; n < n_stages; ++n) {
                const int s = n % STAGES, kb = n % KB, u = cluster + n / KB * clusters;
                const int m = u / per_m, nt = u % per_m * csize + int(rank);
                if (n >= STAGES) {
                    const bool freed = wait_parity(empty + s, ((n / STAGES) & 1) ^ 1);
                    if (!(ok = __all_sync(0xffffffffu, freed))) break;
                }
                const uint32_t stage = smem_u32(ring + s * STAGE_BYTES);
                if (warp == 0 && lane == 0) {
                    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(full + s)),
                                 "r"(2 * W_BOX + (push ? half : 0)) : "memory");
                    tma_load_once(&wmap, stage + A_STAGE, full + s, kb * KBLK, m * 2 * INTER + nt * WROWS);
                    tma_load_once(&wmap, stage + A_STAGE + W_BOX, full + s, kb * KBLK, m * 2 * INTER + INTER + nt * WROWS);
                }
#pragma unroll
                for (int j = j0; j < j1; ++j) {
                    const int r = row0 + 16 * j, tok = max(row_token[m * TOK + r], 0);
                    const uint16_t* src = x + size_t(tok) * HID + kb * KBLK + chunk * 8;
                    const uint32_t dst = stage + r * 128 + ((chunk ^ (r & 7)) * 16);
                    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
                }
                asm volatile("cp.async.commit_group;" ::: "memory");
                if (++inflight > 1) {
                    asm volatile("cp.async.wait_group 1;" ::: "memory");
                    release((n + STAGES - 1) % STAGES);
                    --inflight;
                }
            }
            if (ok && inflight) {  // the last stage
                asm volatile("cp.async.wait_group 0;" ::: "memory");
                release((n_stages - 1) % STAGES);
            }
        } else if (warp == 0 && lane == 0) {
            const uint32_t a_rows = multicast ? TOK / csize : TOK;
            const uint32_t bytes = 2 * W_BOX + (load_a ? A_STAGE / load_a : 0);  // what lands here, from anyone
            for (int n = 0; n < n_stages; ++n) {
                const int s = n % STAGES, kb = n % KB, u = cluster + n / KB * clusters;
                const int m = u / per_m, nt = u % per_m * csize + int(rank);
                if (n >= STAGES && !(ok = wait_parity(empty + s, ((n / STAGES) & 1) ^ 1))) break;
                asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(full + s)),
                             "r"(bytes) : "memory");
                const uint32_t stage = smem_u32(ring + s * STAGE_BYTES);
                tma_load_once(&wmap, stage + A_STAGE, full + s, kb * KBLK, m * 2 * INTER + nt * WROWS);  // gate
                tma_load_once(&wmap, stage + A_STAGE + W_BOX, full + s, kb * KBLK, m * 2 * INTER + INTER + nt * WROWS);  // up
                if (load_a && multicast)
                    tma_multicast(&amap, stage + rank * a_rows * KBLK * 2, full + s, kb * KBLK, m * TOK + rank * a_rows,
                                  uint16_t((1u << csize) - 1));
                else if (load_a)
                    tma_load(&amap, stage, full + s, kb * KBLK, m * TOK);
            }
        }
    } else {
        asm volatile("setmaxnreg.inc.sync.aligned.u32 224;");
        const int cw = wg - 1;  // this warpgroup's 64 gate rows and 64 up rows of the tile's 128
        float g[80], up[80];
#pragma unroll
        for (int i = 0; i < 80; ++i) g[i] = up[i] = 0.f;
        for (int n = 0; n < n_stages; ++n) {
            const int s = n % STAGES, kb = n % KB;
            // One verdict a warp: its wgmma and the arrival below need every lane.
            const bool landed = wait_parity(full + s, (n / STAGES) & 1);
            if (!(ok = __all_sync(0xffffffffu, landed))) break;
            if (mma) {
                const uint32_t stage = smem_u32(ring + s * STAGE_BYTES);
                asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
                for (int k = 0; k < KBLK / 16; ++k) {
                    const uint64_t rows = sw128_desc(stage + k * 32);
                    const int acc = kb > 0 || k > 0;
                    wgmma_m64n160k16(g, sw128_desc(stage + A_STAGE + cw * 64 * 128 + k * 32), rows, acc);
                    wgmma_m64n160k16(up, sw128_desc(stage + A_STAGE + W_BOX + cw * 64 * 128 + k * 32), rows, acc);
                }
                asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
                asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
                if (kb == KB - 1) {  // the tile's accumulators, folded so that nothing is dead
#pragma unroll
                    for (int i = 0; i < 80; ++i) total += g[i] * up[i];
                }
            }
            __syncwarp();
            if (lane == 0) {
                if (multicast) {
                    for (int r = 0; r < csize; ++r) {  // every CTA whose loads land in this stage
                        uint32_t remote;
                        asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(smem_u32(empty + s)), "r"(r));
                        asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];" ::"r"(remote) : "memory");
                    }
                } else {
                    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_u32(empty + s)) : "memory");
                }
            }
        }
    }
    if (!ok) atomicExch(failed, 1);
    if (total == 1.2345f) sink[0] = total;  // never true in practice; keeps the MMAs' results live
    __syncthreads();
    if (csize > 1) cluster_sync();  // no CTA leaves while a peer may still load into it or arrive on it
    if (threadIdx.x == 0) {
        const long long t1 = (long long)global_ns();
        const long long c1 = clock64();
        timing[blockIdx.x * 4 + 0] = t0;
        timing[blockIdx.x * 4 + 1] = t1;
        timing[blockIdx.x * 4 + 2] = c0;
        timing[blockIdx.x * 4 + 3] = c1;
        atomicAdd(done, 1);
    }
}

struct Mode {
    const char* name;
    int csize, multicast;
    int load_a;  // the token rows: 0 not loaded, 1 all 160, 2 the first 80
    int mma, gather;
};

int main(int argc, char** argv) {
    const int rounds = argc > 1 ? std::atoi(argv[1]) : 11;
    if (argc > 2 || rounds < 1 || rounds > 1000) {
        std::printf("usage: %s [rounds: timed launches a mode, 1..1000, default 11]\n", argv[0]);
        return 2;
    }
    cudaDeviceProp prop;
    CHECK(cudaGetDeviceProperties(&prop, 0));
    if (prop.major != 9) {
        std::printf("needs a Hopper GPU (sm_90), found sm_%d%d\n", prop.major, prop.minor);
        return 2;
    }
    const int sms = prop.multiProcessorCount;
    const size_t w_elems = size_t(M_TILES) * 2 * INTER * HID, a_elems = size_t(M_TILES) * TOK * HID;
    uint16_t *w, *a;
    CHECK(cudaMalloc(&w, w_elems * 2));  // 512 MiB: E64's gate and up weights, streamed from HBM
    CHECK(cudaMalloc(&a, a_elems * 2));  // 40 MiB: 160 token rows an expert, in dispatch order
    uint16_t* x;
    CHECK(cudaMalloc(&x, size_t(TOKENS) * HID * 2));  // 4 MiB: the tokens' rows, gathered by cp.async
    fill<<<sms * 4, 1024>>>(w, w_elems);
    fill<<<sms * 4, 1024>>>(a, a_elems);
    fill<<<sms * 4, 1024>>>(x, size_t(TOKENS) * HID);
    // Routing: each token to TOPK distinct experts (a fixed hash), an expert's rows in token order,
    // cut at TOK (about 2.5 standard deviations above the mean of 128) and padded with -1.
    std::vector<int> row_token_h(size_t(M_TILES) * TOK, -1), rows_of(M_TILES, 0);
    uint32_t state = 12345u;
    for (int t = 0; t < TOKENS; ++t) {
        std::vector<int> picked;
        while (int(picked.size()) < TOPK) {
            state = state * 1664525u + 1013904223u;
            const int e = int(state >> 16) % M_TILES;
            if (std::find(picked.begin(), picked.end(), e) == picked.end()) picked.push_back(e);
        }
        for (int e : picked)
            if (rows_of[e] < TOK) row_token_h[size_t(e) * TOK + rows_of[e]++] = t;
    }
    int* row_token;
    CHECK(cudaMalloc(&row_token, row_token_h.size() * 4));
    CHECK(cudaMemcpy(row_token, row_token_h.data(), row_token_h.size() * 4, cudaMemcpyHostToDevice));
    CHECK(cudaGetLastError());

    static_assert(KBLK == 64, "rows_map's box is 64 columns wide");
    CUtensorMap wmap, amap[3];  // token-row boxes of 160, 80 and 40 rows (clusters of 1, 2, 4)
    if (!rows_map(&wmap, w, HID, size_t(M_TILES) * 2 * INTER, HID * 2, WROWS)) return 1;
    for (int c = 0; c < 3; ++c)
        if (!rows_map(amap + c, a, HID, size_t(M_TILES) * TOK, HID * 2, TOK >> c)) return 1;
    CHECK(cudaFuncSetAttribute(tile_stream, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM));

    // One grid for every mode: the CTAs that clusters of 4 fill (a cluster stays inside a GPC).
    cudaLaunchConfig_t cfg = {};
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeClusterDimension;
    cfg.blockDim = dim3(THREADS);
    cfg.dynamicSmemBytes = SMEM;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    int grid = sms / 4 * 4;
    for (int c : {2, 4}) {
        attr[0].val.clusterDim.x = c;
        attr[0].val.clusterDim.y = attr[0].val.clusterDim.z = 1;
        cfg.gridDim = dim3(sms / c * c);
        int n = 0;
        CHECK(cudaOccupancyMaxActiveClusters(&n, tile_stream, &cfg));
        std::printf("clusters of %d: %d resident (%d CTAs)\n", c, n, n * c);
        grid = std::min(grid, n * c / 4 * 4);
    }
    if (grid < 4) {
        std::printf("no grid of clusters of 4 fits\n");
        return 1;
    }
    ProbeLaunches pl(grid, 4);
    const std::vector<long long>& tim = pl.tim;

    const Mode modes[] = {
        {"weights only", 1, 0, 0, 1, 0}, {"rows gathered", 1, 0, 1, 1, 1}, {"rows each", 1, 0, 1, 1, 0},
        {"half rows", 1, 0, 2, 1, 0},    {"rows each", 2, 0, 1, 1, 0},     {"multicast", 2, 1, 1, 1, 0},
        {"rows each", 4, 0, 1, 1, 0},    {"multicast", 4, 1, 1, 1, 0},     {"weights only", 1, 0, 0, 0, 0},
        {"rows gathered", 1, 0, 1, 0, 1}, {"rows each", 1, 0, 1, 0, 0},    {"half rows", 1, 0, 2, 0, 0},
        {"multicast", 2, 1, 1, 0, 0},    {"multicast", 4, 1, 1, 0, 0},     {"rows gathered", 2, 0, 1, 1, 1},
        {"rows pushed", 2, 1, 1, 1, 1},  {"rows pushed", 2, 1, 1, 0, 1},
    };
    std::printf("E64 gate/up tiles at T = 1024: %d tiles of %d token rows x %d gate + %d up rows, K %d, on %d CTAs "
                "(%.2f tiles a CTA); median of %d launches\n", TILES, TOK, WROWS, WROWS, HID, grid,
                double(TILES) / grid, rounds);
    int real = 0;
    for (int v : row_token_h) real += v >= 0;
    std::printf("routing: %d of %d rows hold a token (%.1f%%)\n", real, int(row_token_h.size()), 100.0 * real / row_token_h.size());
    std::printf("%-13s %7s %4s %9s %10s %8s %14s %14s\n", "mode", "cluster", "MMA", "ms", "us a tile", "SM MHz",
                "into SMs GB/s", "out of L2 GB/s");
    for (const Mode& md : modes) {
        attr[0].val.clusterDim.x = md.csize;
        cfg.gridDim = dim3(grid);
        const CUtensorMap& am = amap[md.multicast ? (md.csize == 2 ? 1 : 2) : md.load_a == 2 ? 1 : 0];
        std::vector<float> ms;
        std::vector<double> mhz;
        const auto launch = [&] {
            CHECK(cudaLaunchKernelEx(&cfg, tile_stream, wmap, am, md.csize, md.multicast, md.load_a, md.mma,
                                     md.gather, x, row_token, pl.failed, pl.done, pl.sink, pl.timing));
        };
        const bool ok = pl.run(md.name, md.csize, grid, rounds, launch, [&](float t) {
            ms.push_back(t);
            double cycles = 0, ns = 0;
            for (int c = 0; c < grid; ++c) {
                ns += double(tim[c * 4 + 1] - tim[c * 4 + 0]);
                cycles += double(tim[c * 4 + 3] - tim[c * 4 + 2]);
            }
            mhz.push_back(ns > 0 ? cycles / ns * 1e3 : 0);
        });
        if (!ok) return 1;
        std::vector<float> sorted = ms;
        std::sort(sorted.begin(), sorted.end());
        const float t = sorted[sorted.size() / 2];
        std::sort(mhz.begin(), mhz.end());
        const double rows = md.load_a ? double(TILES) * KB * A_STAGE / md.load_a : 0;  // into the SMs
        const double into = double(TILES) * KB * 2 * W_BOX + rows;
        const double out = double(TILES) * KB * 2 * W_BOX + rows / (md.multicast ? md.csize : 1);
        std::printf("%-13s %7d %4s %9.3f %10.2f %8.0f %14.0f %14.0f\n", md.name, md.csize, md.mma ? "yes" : "no", t,
                    t * 1e3 * grid / TILES, mhz[mhz.size() / 2], into / (t * 1e-3) * 1e-9, out / (t * 1e-3) * 1e-9);
    }
    return 0;
}
