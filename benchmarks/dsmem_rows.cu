// Would the down tiles be cheaper if h stayed in a cluster's shared memory instead of going through L2?
//
//     nvcc -gencode arch=compute_90a,code=sm_90a -O3 -std=c++17 -o dsmem_rows benchmarks/dsmem_rows.cu
//     ./dsmem_rows [rounds]
//
// Why: at T = 1024 the single launch (E64 K8 H2048 I1024) stores h (the SwiGLU output) to global
// memory from its gate/up tiles and each of the 8 down tiles of an M tile reads all of its 160 h
// rows back through L2 (168 MB of the call's 1.31 GB into the SMs). The rows cost an SM what L2
// bytes cost it (docs/perf.md, "Sharing a tile's token rows between CTAs"): about 5 us of an 18.6
// us down tile. A cluster of 8 CTAs that runs one expert's 8 gate/up tiles and then its 8 down
// tiles could keep each CTA's 128 h columns (40 KB) in its own shared memory, and each down tile
// would take a K block's h rows from the peer that computed them (distributed shared memory, over
// the SMs' network inside a GPC) instead of from L2. That pays only if those bytes cost an SM less
// than L2's do, and only by more than the SMs a grid of 8-CTA clusters leaves idle; this program
// measures both on the down tiles' own loads and MMAs before anything is built.
//
// One CTA per SM, as the kernel: warp 0 of warpgroup 0 issues the weight TMA loads into a ring of 3
// or 4 stages of 52 KB (a K block of 64: two 128 x 64 boxes of the tile's 256 output rows and the
// 160 x 64 h rows), and two consumer warpgroups run m64n160k16 wgmma on their 2 x 64 weight rows
// (160 fp32 accumulators a thread), then free the stage. No epilogue. The 512 down tiles of E64
// (64 M tiles x 8 column tiles of 256 output rows, K 1024) are dealt so that the CTAs of a cluster
// share an M tile, one column tile each. h rows:
//   weights only   never loaded: the floor if they were free
//   h by TMA       one box of 160 rows a stage from a global h in dispatch order, as the kernel does
//   h from peers   CTA r holds h columns 128 r .. 128 r + 127 of its M tile in shared memory (40 KB,
//                  laid out as TMA's boxes are); the producer warpgroup copies each stage's 20 KB from
//                  the peer that holds that K block (ld.shared::cluster, 16 B a thread, into the stage),
//                  then fences for wgmma's reads and arrives; "rotated" starts CTA r at K block 2 r so
//                  that the 8 CTAs read 8 different peers at a time
//   h from self    the same copies from this CTA's own 40 KB: the copy's cost without the network
// The ring has 3 stages where the 40 KB are held (3 x 52 + 40 KB fit, 4 x 52 + 40 do not). The modes
// run on the full grid (one CTA an SM) and on the grid clusters of 8 can fill, with and without the
// MMAs.
//
// And a second question the first run raised (h by TMA cost a down tile 0.3-0.9 us in clusters of 8
// against 2.0 us on the same grid without clusters): do the CTAs that share an M tile read its rows
// more cheaply when they run as one cluster, inside one GPC, than apart? Both kinds of tile (gate/up
// tiles: K 2048, the gate and up boxes, 160 x rows by TMA from a copy in dispatch order, which the
// launch's gathered rows cost as much as), each with and without its rows, on the full grid, on the
// clusters' grid without clusters, in clusters of 8 whose CTAs share an M tile (grouped) and in
// clusters of 8 whose CTAs take 8 different M tiles (apart), in three interleaved passes.
// Prints the median launch, a tile's time on one SM (each CTA's span over its tiles, median over the
// CTAs) and the SM clock.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "tile_probe.cuh"

constexpr int TOK = 160;                                  // token rows a tile (the T = 1024 band)
constexpr int WROWS = 128;                                // output rows a box; a tile has two
constexpr int KBLK = 64;                                  // bf16 columns a stage (128 B: one swizzle row)
constexpr int HID = 2048;                                 // the down GEMM's output rows an expert; gate/up's K
constexpr int INTER = 1024;                               // K of the down GEMM; gate rows an expert
constexpr int COLS = HID;                                 // the buffers' columns (a down tile uses the first INTER)
constexpr int W_ROWS_M = HID;                             // weight rows an expert: 2048 down rows, or gate + up
constexpr int M_TILES = 64;                               // experts, one M tile each at T = 1024
constexpr int N_TILES = HID / (2 * WROWS);                // column tiles an M tile: 8
constexpr int TILES = M_TILES * N_TILES;
constexpr int CLUSTER = 8;                                // the CTAs that hold one expert's h together
constexpr int A_STAGE = TOK * KBLK * 2;                   // 20 KB of h rows a stage
constexpr int W_BOX = WROWS * KBLK * 2;                   // 16 KB
constexpr int STAGE_BYTES = A_STAGE + 2 * W_BOX;          // 52 KB, a multiple of 1 KB (the swizzle's period)
constexpr int SLICE = (INTER / CLUSTER / KBLK) * A_STAGE; // 40 KB: 128 h columns of 160 rows
constexpr int SLICE_AT = 3 * STAGE_BYTES;                 // after a ring of 3 stages
constexpr int SMEM = std::max(4 * STAGE_BYTES, SLICE_AT + SLICE) + 1024;  // + room to align to 1 KB
constexpr int THREADS = 384;                              // producer warpgroup + 2 consumer warpgroups
constexpr int CONSUMER_WARPS = 8;
constexpr int CHUNKS = A_STAGE / 16 / 128;                // 16 B copies a producer thread makes a stage: 10

static_assert(HID == 2 * INTER && INTER / KBLK % CLUSTER == 0 && CHUNKS * 16 * 128 == A_STAGE,
              "the slices and copies divide evenly");

enum Rows { NONE = 0, TMA = 1, PEERS = 2, SELF = 3 };

// 16 bytes of CTA rank's shared memory at this CTA's address addr (rank may be this CTA).
__device__ __forceinline__ uint4 load_cluster(uint32_t addr, uint32_t rank) {
    uint4 v;
    asm volatile(
        "{ .reg .b32 a; mapa.shared::cluster.u32 a, %4, %5;\n"
        "ld.shared::cluster.v4.u32 {%0, %1, %2, %3}, [a]; }"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr), "r"(rank) : "memory");
    return v;
}

__device__ __forceinline__ void store_shared(uint32_t addr, uint4 v) {
    asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(addr), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
                 : "memory");
}

// One launch of a mode. timing[cta] = {globaltimer at start, at end, clock64 at start, at end, tiles}.
__global__ void __launch_bounds__(THREADS, 1)
    down_tiles(const __grid_constant__ CUtensorMap wmap, const __grid_constant__ CUtensorMap hmap, const uint16_t* h,
               int gateup, int csize, int spread, int stages, int rows, int rotate, int mma, int* failed, int* done,
               float* sink, long long* timing) {
    extern __shared__ char raw[];
    char* ring = reinterpret_cast<char*>((uintptr_t(raw) + 1023) & ~uintptr_t(1023));
    __shared__ __align__(8) uint64_t full[4], empty[4];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, wg = threadIdx.x / 128;
    uint32_t rank = 0;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
    const bool copies = rows == PEERS || rows == SELF;
    const uint32_t slice = smem_u32(ring + SLICE_AT);
    if (copies) {
        // This CTA's 128 h columns of an M tile (expert 0's rows: what is in them does not matter
        // here), as two TMA boxes of 160 x 64 would lay them out: row r's 16 B chunk c at
        // r * 128 + (c ^ (r % 8)) * 16.
        for (int i = threadIdx.x; i < SLICE / 16; i += THREADS) {
            const int blk = i / (A_STAGE / 16), r = i % (A_STAGE / 16) / 8, c = i % 8;
            const uint16_t* src = h + size_t(r) * COLS + (int(rank) * 2 + blk) * KBLK + c * 8;
            store_shared(slice + blk * A_STAGE + r * 128 + ((c ^ (r & 7)) * 16), *reinterpret_cast<const uint4*>(src));
        }
    }
    if (threadIdx.x == 0) {
        for (int s = 0; s < stages; ++s) {
            asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(full + s)), "r"(copies ? 5 : 1));
            asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(empty + s)), "r"(CONSUMER_WARPS));
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    if (csize > 1) cluster_sync();  // every peer's slice written before anyone reads it
    long long t0 = 0, c0 = 0;
    if (threadIdx.x == 0) {
        t0 = (long long)global_ns();
        c0 = clock64();
    }
    // Grouped: cluster c takes units c, c + clusters, ...; a unit is csize column tiles of one M tile, one a
    // CTA, so the CTAs that share an M tile run it together. Spread: CTA b takes tiles b, b + grid, ..., tile t
    // being column tile t / M_TILES of M tile t % M_TILES, so those CTAs are far apart (other clusters).
    const int KB = gateup ? HID / KBLK : INTER / KBLK;  // stages a tile
    const int cluster = spread ? blockIdx.x : blockIdx.x / csize, clusters = spread ? gridDim.x : gridDim.x / csize;
    const int per_m = spread ? N_TILES : N_TILES / csize;
    const int units = M_TILES * per_m;
    const int n_units = cluster < units ? (units - cluster + clusters - 1) / clusters : 0;
    const int n_stages = n_units * KB;
    // The K block a tile's step n reads: rotated, CTA r starts at the block its peer r holds.
    auto kblock = [&](int n) { return rotate ? (n % KB + 2 * int(rank)) % KB : n % KB; };
    bool ok = true;
    float total = 0.f;
    if (wg == 0) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 56;");
        if (copies || (warp == 0 && lane == 0)) {
            for (int n = 0; n < n_stages; ++n) {
                const int s = n % stages, kb = kblock(n), u = cluster + n / KB * clusters;
                const int m = spread ? u % M_TILES : u / per_m;
                const int nt = spread ? u / M_TILES : u % per_m * csize + int(rank);
                if (n >= stages) {
                    const bool freed = wait_parity(empty + s, ((n / stages) & 1) ^ 1);
                    if (!(ok = copies ? __all_sync(0xffffffffu, freed) : freed)) break;
                }
                const uint32_t stage = smem_u32(ring + s * STAGE_BYTES);
                if (warp == 0 && lane == 0) {
                    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(full + s)),
                                 "r"(2 * W_BOX + (rows == TMA ? A_STAGE : 0)) : "memory");
                    // The tile's two boxes: gate and up rows nt * 128 of the expert, or its output rows nt * 256.
                    const int wrow = m * W_ROWS_M + nt * (gateup ? WROWS : 2 * WROWS);
                    tma_load_once(&wmap, stage + A_STAGE, full + s, kb * KBLK, wrow);
                    tma_load_once(&wmap, stage + A_STAGE + W_BOX, full + s, kb * KBLK, wrow + (gateup ? INTER : WROWS));
                    if (rows == TMA) tma_load(&hmap, stage, full + s, kb * KBLK, m * TOK);
                }
                if (copies) {
                    // The K block's 20 KB from the CTA that holds it, in two rounds of 5 loads in flight.
                    const uint32_t owner = rows == PEERS ? uint32_t(kb / 2) : rank;
                    const uint32_t src = slice + (kb % 2) * A_STAGE;
#pragma unroll
                    for (int half = 0; half < 2; ++half) {
                        uint4 v[CHUNKS / 2];
#pragma unroll
                        for (int j = 0; j < CHUNKS / 2; ++j)
                            v[j] = load_cluster(src + (threadIdx.x + 128 * (half * CHUNKS / 2 + j)) * 16, owner);
#pragma unroll
                        for (int j = 0; j < CHUNKS / 2; ++j)
                            store_shared(stage + (threadIdx.x + 128 * (half * CHUNKS / 2 + j)) * 16, v[j]);
                    }
                    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // wgmma reads what we stored
                    __syncwarp();
                    if (lane == 0)
                        asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_u32(full + s)) : "memory");
                }
            }
        }
    } else {
        asm volatile("setmaxnreg.inc.sync.aligned.u32 224;");
        const int cw = wg - 1;  // this warpgroup's 64 rows of each of the tile's two 128-row boxes
        float lo[80], hi[80];
#pragma unroll
        for (int i = 0; i < 80; ++i) lo[i] = hi[i] = 0.f;
        for (int n = 0; n < n_stages; ++n) {
            const int s = n % stages;
            const bool landed = wait_parity(full + s, (n / stages) & 1);
            if (!(ok = __all_sync(0xffffffffu, landed))) break;
            if (mma) {
                const uint32_t stage = smem_u32(ring + s * STAGE_BYTES);
                asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
                for (int k = 0; k < KBLK / 16; ++k) {
                    const uint64_t hrows = sw128_desc(stage + k * 32);
                    const int acc = n % KB > 0 || k > 0;
                    wgmma_m64n160k16(lo, sw128_desc(stage + A_STAGE + cw * 64 * 128 + k * 32), hrows, acc);
                    wgmma_m64n160k16(hi, sw128_desc(stage + A_STAGE + W_BOX + cw * 64 * 128 + k * 32), hrows, acc);
                }
                asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
                asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
                if (n % KB == KB - 1) {  // the tile's accumulators, folded so that nothing is dead
#pragma unroll
                    for (int i = 0; i < 80; ++i) total += lo[i] * hi[i];
                }
            }
            __syncwarp();
            if (lane == 0)
                asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_u32(empty + s)) : "memory");
        }
    }
    if (!ok) atomicExch(failed, 1);
    if (total == 1.2345f) sink[0] = total;  // never true in practice; keeps the MMAs' results live
    __syncthreads();
    if (threadIdx.x == 0) {
        timing[blockIdx.x * 5 + 1] = (long long)global_ns();
        timing[blockIdx.x * 5 + 3] = clock64();
        timing[blockIdx.x * 5 + 0] = t0;
        timing[blockIdx.x * 5 + 2] = c0;
        timing[blockIdx.x * 5 + 4] = n_units;
    }
    if (csize > 1) cluster_sync();  // no CTA leaves while a peer may still read its slice
    if (threadIdx.x == 0) atomicAdd(done, 1);
}

struct Mode {
    const char* name;
    int gateup, csize, spread, full_grid, stages, rows, rotate, mma;
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
    // One weight buffer serves both kinds of tile: an expert's 2048 rows are its down rows or its gate and up rows.
    const size_t w_elems = size_t(M_TILES) * W_ROWS_M * COLS, h_elems = size_t(M_TILES) * TOK * COLS;
    uint16_t *w, *h;
    CHECK(cudaMalloc(&w, w_elems * 2));  // 512 MiB: E64's gate and up (or down) weights, streamed from HBM
    CHECK(cudaMalloc(&h, h_elems * 2));  // 40 MiB: 160 token rows an expert in dispatch order (x's, or h's)
    fill<<<sms * 4, 1024>>>(w, w_elems);
    fill<<<sms * 4, 1024>>>(h, h_elems);
    CHECK(cudaGetLastError());
    CUtensorMap wmap, hmap;
    if (!rows_map(&wmap, w, COLS, size_t(M_TILES) * W_ROWS_M, COLS * 2, WROWS)) return 1;
    if (!rows_map(&hmap, h, COLS, size_t(M_TILES) * TOK, COLS * 2, TOK)) return 1;
    CHECK(cudaFuncSetAttribute(down_tiles, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM));

    cudaLaunchConfig_t cfg = {};
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = CLUSTER;
    attr[0].val.clusterDim.y = attr[0].val.clusterDim.z = 1;
    cfg.blockDim = dim3(THREADS);
    cfg.dynamicSmemBytes = SMEM;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    cfg.gridDim = dim3(sms / CLUSTER * CLUSTER);
    int n8 = 0;
    CHECK(cudaOccupancyMaxActiveClusters(&n8, down_tiles, &cfg));
    const int grid8 = n8 * CLUSTER;
    std::printf("%s, %d SMs; clusters of %d: %d resident (%d CTAs)\n", prop.name, sms, CLUSTER, n8, grid8);
    if (n8 < 1) return 1;
    ProbeLaunches pl(sms, 5);
    const std::vector<long long>& tim = pl.tim;

    // Whether the CTAs that share an M tile read its rows more cheaply as one cluster (one GPC) than apart, for
    // both kinds of tile, in three interleaved passes; then h from the peers' shared memory (down tiles).
    const Mode compare[] = {
        {"weights only", 0, 1, 0, 1, 4, NONE, 0, 1}, {"rows by TMA", 0, 1, 0, 1, 4, TMA, 0, 1},
        {"weights only", 0, 1, 0, 0, 4, NONE, 0, 1}, {"rows by TMA", 0, 1, 0, 0, 4, TMA, 0, 1},
        {"weights only", 0, 8, 0, 0, 4, NONE, 0, 1}, {"rows by TMA", 0, 8, 0, 0, 4, TMA, 0, 1},
        {"weights only", 0, 8, 1, 0, 4, NONE, 0, 1}, {"rows by TMA", 0, 8, 1, 0, 4, TMA, 0, 1},
        {"weights only", 1, 1, 0, 1, 4, NONE, 0, 1}, {"rows by TMA", 1, 1, 0, 1, 4, TMA, 0, 1},
        {"weights only", 1, 1, 0, 0, 4, NONE, 0, 1}, {"rows by TMA", 1, 1, 0, 0, 4, TMA, 0, 1},
        {"weights only", 1, 8, 0, 0, 4, NONE, 0, 1}, {"rows by TMA", 1, 8, 0, 0, 4, TMA, 0, 1},
        {"weights only", 1, 8, 1, 0, 4, NONE, 0, 1}, {"rows by TMA", 1, 8, 1, 0, 4, TMA, 0, 1},
    };
    const Mode peers[] = {
        {"weights only", 0, 8, 0, 0, 3, NONE, 0, 1},  {"rows by TMA", 0, 8, 0, 0, 3, TMA, 0, 1},
        {"h from peers", 0, 8, 0, 0, 3, PEERS, 0, 1}, {"h from peers", 0, 8, 0, 0, 3, PEERS, 1, 1},
        {"h from self", 0, 8, 0, 0, 3, SELF, 0, 1},   {"weights only", 0, 8, 0, 0, 3, NONE, 0, 0},
        {"rows by TMA", 0, 8, 0, 0, 3, TMA, 0, 0},    {"h from peers", 0, 8, 0, 0, 3, PEERS, 1, 0},
        {"h from self", 0, 8, 0, 0, 3, SELF, 0, 0},
    };
    std::printf("E64 at T = 1024, %d tiles of each kind: down tiles of %d h rows x %d output rows, K %d; gate/up "
                "tiles of %d x rows x %d gate + %d up rows, K %d; median of %d launches\n", TILES, TOK, 2 * WROWS,
                INTER, TOK, WROWS, WROWS, HID, rounds);
    std::printf("%-13s %-7s %7s %-7s %5s %6s %7s %4s %9s %10s %8s\n", "mode", "tiles", "cluster", "sharers", "CTAs",
                "stages", "rotated", "MMA", "ms", "us a tile", "SM MHz");
    auto run = [&](const Mode& md) {
        const int grid = md.full_grid ? sms : grid8;
        attr[0].val.clusterDim.x = md.csize;
        cfg.gridDim = dim3(grid);
        std::vector<float> ms, per_tile, mhz;
        const auto launch = [&] {
            CHECK(cudaLaunchKernelEx(&cfg, down_tiles, wmap, hmap, (const uint16_t*)h, md.gateup, md.csize,
                                     md.spread, md.stages, md.rows, md.rotate, md.mma, pl.failed, pl.done, pl.sink,
                                     pl.timing));
        };
        const bool ok = pl.run(md.name, md.csize, grid, rounds, launch, [&](float t) {
            ms.push_back(t);
            std::vector<float> each;
            double cycles = 0, ns = 0;
            for (int c = 0; c < grid; ++c) {
                const double span = double(tim[c * 5 + 1] - tim[c * 5 + 0]);
                if (tim[c * 5 + 4] > 0) each.push_back(float(span / tim[c * 5 + 4] * 1e-3));
                ns += span;
                cycles += double(tim[c * 5 + 3] - tim[c * 5 + 2]);
            }
            std::sort(each.begin(), each.end());
            per_tile.push_back(each.empty() ? 0.f : each[each.size() / 2]);
            mhz.push_back(ns > 0 ? float(cycles / ns * 1e3) : 0.f);
        });
        if (!ok) return false;
        auto median = [](std::vector<float> v) {
            std::sort(v.begin(), v.end());
            return v[v.size() / 2];
        };
        std::printf("%-13s %-7s %7d %-7s %5d %6d %7s %4s %9.3f %10.2f %8.0f\n", md.name,
                    md.gateup ? "gate/up" : "down", md.csize, md.spread ? "apart" : "grouped", grid, md.stages,
                    md.rotate ? "yes" : "no", md.mma ? "yes" : "no", median(ms), median(per_tile), median(mhz));
        return true;
    };
    for (int pass = 0; pass < 3; ++pass) {
        std::printf("pass %d\n", pass + 1);
        for (const Mode& md : compare)
            if (!run(md)) return 1;
    }
    std::printf("h from the peers' shared memory\n");
    for (const Mode& md : peers)
        if (!run(md)) return 1;
    return 0;
}
