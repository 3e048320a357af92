"""CUDA C versions of the delta table kernels (`weight_transfer.kernels.delta`), compiled at
first use by NVRTC through CuPy; imports cupy on load.

Same tables, same bitmap, same output bytes as the Triton kernels in `_delta_triton_jit`
(count: rows [new, old, numel, row0]; encode: rows [new, index, values, offsets, row0,
staged, 0, 0]; apply: rows [dst, offsets, index, values, numel, 0, 0, 0]; `first` the runs'
first global chunk; one block per chunk, its run found by binary search). What CUDA C gives
that Triton does not expose: warp shuffles and votes, shared memory and block scans. So:

* the count of a whole chunk reads both sides with 16-byte loads, builds the change bitmap
  with a few shuffles, and, while the new values are still in registers, stages the chunk's
  first `STAGE` changes (index, value, in index order: one block scan per step) in per-chunk
  slots, written out by the whole block from shared memory; it stores a step's bitmap words
  only once the chunk's changes reach `STAGE` (the encode never reads the words before);
* the encode copies a whole chunk's staged changes to their place in the patch (16-byte
  stores at any output alignment); the changes past them, and every change of a partial /
  unaligned chunk (counted by the masked kernel), come from the bitmap: a block scan puts the
  positions of the set bits in shared memory and the block writes the entries together,
  gathering the changed values. A count by these kernels must be encoded by them (their
  bitmap is partial);
* apply scatters a chunk's entries (one block per chunk, as the Triton kernel).

Scratch beyond the bitmap (1/8 byte per element, as under Triton): `STAGE` slots of
2 + element bytes per whole chunk (12.5% of a BF16 batch's bytes, 18.75% of FP8 bytes).
Measured against the Triton kernels in `benchmarks/probes/gpu_delta_cuda_probe.py`
(docs/delta.md).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import cupy
import numpy as np
import torch

__all__ = ["CHUNK", "STAGE", "Staging", "apply_rows", "count_rows", "encode_rows", "stage_rows"]

CHUNK = 65536
STAGE = 4096
"""Changes per chunk the count stages for the encode (beyond them it gathers from the bitmap):
6.25% of a chunk."""
_COUNT_THREADS = 512
_ENCODE_THREADS = 256
_APPLY_THREADS = 256

_SOURCE = r"""
#define CHUNK 65536
#define WORDS (CHUNK / 32)
#ifndef COUNT_UNROLL
#define COUNT_UNROLL 4
#endif
#ifndef COUNT_BOUND
#define COUNT_BOUND 512
#endif
#ifndef STAGE
#define STAGE 4096
#endif
#ifndef COUNT_STORE
#define COUNT_STORE 1
#endif
#ifndef ENCODE_VEC
#define ENCODE_VEC 1
#endif
#ifndef COUNT_VEC
#define COUNT_VEC 1
#endif
#ifndef LAZY_BITS
#define LAZY_BITS 1
#endif
#define ENCODE_THREADS 256
typedef long long i64;
typedef unsigned int u32;

__device__ __forceinline__ i64 find_run(const i64* first, i64 num_runs, i64 pid) {
    i64 lo = 0, hi = num_runs;
    while (hi - lo > 1) {
        i64 mid = (lo + hi) >> 1;
        if (first[mid] <= pid) lo = mid; else hi = mid;
    }
    return lo;
}

// Sum over the block; the result is valid in thread 0.
__device__ __forceinline__ u32 block_sum(u32 v, u32* smem) {
    for (int s = 16; s > 0; s >>= 1) v += __shfl_xor_sync(0xffffffffu, v, s);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (lane == 0) smem[warp] = v;
    __syncthreads();
    u32 t = 0;
    if (warp == 0) {
        t = lane < (int)(blockDim.x >> 5) ? smem[lane] : 0u;
        for (int s = 16; s > 0; s >>= 1) t += __shfl_xor_sync(0xffffffffu, t, s);
    }
    return t;
}

// One bit per element of a 16-byte vector (element j: bit j) where x and y differ.
template <int E>
__device__ __forceinline__ u32 diff_bits(uint4 x, uint4 y) {
    const u32 d[4] = {x.x ^ y.x, x.y ^ y.y, x.z ^ y.z, x.w ^ y.w};
    u32 m = 0;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        if (E == 4) {
            m |= (u32)(d[k] != 0u) << k;
        } else if (E == 2) {
            m |= ((u32)((d[k] & 0xffffu) != 0u) | ((u32)((d[k] >> 16) != 0u) << 1)) << (2 * k);
        } else {
#pragma unroll
            for (int q = 0; q < 4; ++q)
                m |= (u32)(((d[k] >> (8 * q)) & 0xffu) != 0u) << (4 * k + q);
        }
    }
    return m;
}

// Exclusive scan of one value per thread over the block (NW warps); *total gets the sum.
// Ends with the block synchronized; the caller synchronizes before `warp_tot` is reused.
template <typename S, int NW>
__device__ __forceinline__ S block_scan(S p, S* warp_tot, S* total) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    S x = p;
#pragma unroll
    for (int s = 1; s < 32; s <<= 1) {
        const S t = __shfl_up_sync(0xffffffffu, x, s);
        if (lane >= s) x += t;
    }
    if (lane == 31) warp_tot[warp] = x;
    __syncthreads();
    if (warp == 0) {
        S y = lane < NW ? warp_tot[lane] : (S)0;
#pragma unroll
        for (int s = 1; s < 32; s <<= 1) {
            const S t = __shfl_up_sync(0xffffffffu, y, s);
            if (lane >= s) y += t;
        }
        if (lane < NW) warp_tot[lane] = y;
    }
    __syncthreads();
    *total = warp_tot[NW - 1];
    return x - p + (warp ? warp_tot[warp - 1] : (S)0);
}

// Output words 0..3 of a 32-byte window w shifted down by 4 * WS + bs / 8 bytes.
template <int WS>
__device__ __forceinline__ uint4 shifted(const u32 (&w)[8], int bs) {
    return make_uint4(__funnelshift_r(w[WS], w[WS + 1], bs),
                      __funnelshift_r(w[WS + 1], w[WS + 2], bs),
                      __funnelshift_r(w[WS + 2], w[WS + 3], bs),
                      __funnelshift_r(w[WS + 3], w[WS + 4], bs));
}

// n bytes from src (16-byte aligned) to dst (any address), by the whole block: 16-byte loads,
// 16-byte stores at dst's 16-byte aligned addresses (each vector assembled from two source
// vectors by funnel shifts, the shift being the same for the whole block), and the bytes
// before and after them one by one. Reads only the source vectors that hold its n bytes.
__device__ __forceinline__ void copy_to(unsigned char* __restrict__ dst,
                                        const unsigned char* __restrict__ src, u32 n) {
    u32 head = (u32)((16u - ((unsigned long long)dst & 15u)) & 15u);
    if (head > n) head = n;
    if (threadIdx.x < head) dst[threadIdx.x] = src[threadIdx.x];
    const u32 nvec = (n - head) >> 4;
    const uint4* s = reinterpret_cast<const uint4*>(src);
    uint4* o = reinterpret_cast<uint4*>(dst + head);
    const int ws = (int)(head >> 2), bs = (int)(head & 3u) * 8;
    for (u32 v = threadIdx.x; v < nvec; v += blockDim.x) {
        const uint4 a = s[v];
        // The second vector holds bytes of the window only when head > 0 (and then it holds
        // at least one of the n bytes, so it is read within the source).
        const uint4 b = head ? s[v + 1] : make_uint4(0u, 0u, 0u, 0u);
        const u32 w[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
        uint4 r;
        switch (ws) {
            case 0: r = shifted<0>(w, bs); break;
            case 1: r = shifted<1>(w, bs); break;
            case 2: r = shifted<2>(w, bs); break;
            default: r = shifted<3>(w, bs); break;
        }
        o[v] = r;
    }
    const u32 done = head + (nvec << 4);
    if (threadIdx.x < n - done) dst[done + threadIdx.x] = src[done + threadIdx.x];
}

// Element j of a 16-byte vector of E-byte elements, as an unsigned integer.
template <int E>
__device__ __forceinline__ u32 lane_of(uint4 x, int j) {
    const u32 w[4] = {x.x, x.y, x.z, x.w};
    const u32 word = w[(j * E) >> 2];
    if (E == 4) return word;
    return (word >> (((j * E) & 3) * 8)) & ((1u << (8 * E)) - 1u);
}

// Whole chunks at 16-byte aligned addresses: 16-byte loads, COUNT_UNROLL vectors of each side
// in flight per thread. Writes the chunk's count and change bitmap and, while the new values
// are in registers, stages its first STAGE changes in index order (16-bit index, value) in the
// row's staging slots, so that the encode copies them instead of gathering them again: one
// block scan per step, of the step's COUNT_UNROLL per-vector counts packed in 16-bit fields,
// places them in shared memory, and the block writes them out together.
template <int E, typename T>
__device__ __forceinline__ void count_full(const i64* runs, const i64* first, i64 num_runs,
                                           i64* counts, u32* wbits, unsigned short* sidx,
                                           unsigned char* sval) {
    constexpr int V = 16 / E;        // elements per vector
    constexpr int NV = CHUNK / V;    // vectors per chunk
    constexpr int TPW = 32 / V;      // threads whose bits make one bitmap word
    constexpr int U = COUNT_UNROLL;
    constexpr int NW = COUNT_BOUND / 32;
    static_assert(U * 16 <= 64, "per-vector counts are packed in 16-bit fields of a u64");
    __shared__ unsigned long long warp_tot[32];
    __shared__ __align__(16) unsigned short s_idx[STAGE > 0 ? STAGE : 1];
    __shared__ __align__(16) T s_val[STAGE > 0 ? STAGE : 1];
    const i64 pid = blockIdx.x;
    const i64 run = find_run(first, num_runs, pid);
    const i64 local = pid - first[run];
    const i64* r = runs + run * 4;
    const uint4* a = reinterpret_cast<const uint4*>(r[0]) + local * NV;
    const uint4* b = reinterpret_cast<const uint4*>(r[1]) + local * NV;
    const i64 g = r[3] + local;
    u32* words = wbits + g * WORDS;
    // The chunk's staging row: a launch counts the whole chunks of one element size, run after
    // run, so its blocks number exactly those rows (`stage_rows`).
    const i64 sg = pid;
    unsigned short* stage_i = sidx + sg * STAGE;
    T* stage_v = reinterpret_cast<T*>(sval) + sg * STAGE;
    const int lane = threadIdx.x & 31;
    u32 done = 0;  // changes of the steps before (the same in every thread)
    for (int base = 0; base < NV; base += COUNT_BOUND * U) {
        uint4 x[U], y[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int v = base + u * COUNT_BOUND + threadIdx.x;
            x[u] = __ldcs(a + v);
            y[u] = __ldcs(b + v);
        }
        u32 m[U], wd[U];
        unsigned long long packed = 0;
#pragma unroll
        for (int u = 0; u < U; ++u) {
            m[u] = diff_bits<E>(x[u], y[u]);
            packed |= (unsigned long long)__popc(m[u]) << (16 * u);
            u32 w = m[u] << ((lane % TPW) * V);
#pragma unroll
            for (int s = 1; s < TPW; s <<= 1) w |= __shfl_xor_sync(0xffffffffu, w, s);
            wd[u] = w;
            const int v = base + u * COUNT_BOUND + threadIdx.x;
            if (!LAZY_BITS && COUNT_STORE && lane % TPW == 0) words[v / TPW] = w;
        }
        unsigned long long tot;
        const unsigned long long ex = block_scan<unsigned long long, NW>(packed, warp_tot, &tot);
        u32 step = 0;
#pragma unroll
        for (int u = 0; u < U; ++u) step += (u32)((tot >> (16 * u)) & 0xffffu);
        // LAZY_BITS: the bitmap words of a step only once the chunk's changes reach STAGE
        // (the encode copies the first STAGE from staging and reads the bitmap only past the
        // last of them; words of earlier steps are never read).
        if (LAZY_BITS && COUNT_STORE && done + step >= (u32)STAGE && lane % TPW == 0) {
#pragma unroll
            for (int u = 0; u < U; ++u) words[(base + u * COUNT_BOUND + threadIdx.x) / TPW] = wd[u];
        }
        if (STAGE > 0 && step != 0 && done < STAGE) {
            // This step's first STAGE - done changes: into shared memory by the scan, then to
            // the row's slots by the whole block (consecutive threads, consecutive slots).
            u32 before = 0;
#pragma unroll
            for (int u = 0; u < U; ++u) {
                u32 pos = before + (u32)((ex >> (16 * u)) & 0xffffu);
                u32 bits = m[u];
                const int e0 = (base + u * COUNT_BOUND + threadIdx.x) * V;
                while (bits && done + pos < STAGE) {
                    const int j = __ffs(bits) - 1;
                    s_idx[pos] = (unsigned short)(e0 + j);
                    s_val[pos] = (T)lane_of<E>(x[u], j);
                    ++pos;
                    bits &= bits - 1;
                }
                before += (u32)((tot >> (16 * u)) & 0xffffu);
            }
            __syncthreads();
            const u32 n = min(step, (u32)STAGE - done);
#if COUNT_VEC
            copy_to(reinterpret_cast<unsigned char*>(stage_i + done),
                    reinterpret_cast<const unsigned char*>(s_idx), n * 2u);
            copy_to(reinterpret_cast<unsigned char*>(stage_v + done),
                    reinterpret_cast<const unsigned char*>(s_val), n * (u32)sizeof(T));
#else
            for (u32 j = threadIdx.x; j < n; j += COUNT_BOUND) {
                stage_i[done + j] = s_idx[j];
                stage_v[done + j] = s_val[j];
            }
#endif
        }
        done += step;
        __syncthreads();
    }
    if (threadIdx.x == 0) counts[g] = (i64)done;
}

// Any other chunk (a run's partial last chunk, every chunk of an unaligned run): one element
// per thread, bitmap words from warp votes; words past the run's end are written as 0.
template <typename T>
__device__ __forceinline__ void count_part(const i64* runs, const i64* first, i64 num_runs,
                                           i64* counts, u32* wbits) {
    __shared__ u32 smem[32];
    const i64 pid = blockIdx.x;
    const i64 run = find_run(first, num_runs, pid);
    const i64 local = pid - first[run];
    const i64* r = runs + run * 4;
    const T* a = reinterpret_cast<const T*>(r[0]) + local * CHUNK;
    const T* b = reinterpret_cast<const T*>(r[1]) + local * CHUNK;
    const i64 nelem = r[2] - local * CHUNK;
    const i64 g = r[3] + local;
    u32* words = wbits + g * WORDS;
    const int lane = threadIdx.x & 31;
    u32 acc = 0;
#pragma unroll 4
    for (int e0 = 0; e0 < CHUNK; e0 += blockDim.x) {
        const int e = e0 + threadIdx.x;
        const bool ne = e < nelem && a[e] != b[e];
        const u32 w = __ballot_sync(0xffffffffu, ne);
        if (lane == 0) {
            words[e >> 5] = w;
            acc += __popc(w);
        }
    }
    const u32 t = block_sum(acc, smem);
    if (threadIdx.x == 0) counts[g] = (i64)t;
}

// Word wi of a chunk's bitmap with the bits of elements below `lo` cleared (they were
// staged; under LAZY_BITS the words below lo's were never written).
__device__ __forceinline__ u32 above(u32 w, int wi, u32 lo) {
    const int lw = (int)(lo >> 5);
    return wi < lw ? 0u : (wi == lw ? (w & (0xffffffffu << (lo & 31u))) : w);
}

// Chunk `local` of run [new, index, values, offsets, row0, staged, srow0, 0]: offsets[local +
// 1] (and offsets[0] = 0 by chunk 0), then its changed elements in index order. A whole chunk
// (`local` < `staged`) has its first STAGE changes in staging row srow0 + local: they are
// copied (16-byte stores), and the rest, past the last staged element, come from the bitmap.
// Other chunks come from the bitmap alone. From the bitmap: the set bits' positions are
// placed in shared memory by a block scan, then the block writes the entries together
// (consecutive threads: consecutive entries, gathers of the changed values in order); at
// most SLOTS entries take one pass (each thread owns 8 consecutive words), more take 8
// passes of 256 words (one per thread).
template <typename T>
__device__ __forceinline__ void encode(const i64* runs, const i64* first, i64 num_runs,
                                       const i64* counts, const i64* excl, const u32* wbits,
                                       const unsigned short* sidx, const unsigned char* sval) {
    constexpr int SLOTS = ENCODE_THREADS * 32;
    constexpr int PER = WORDS / ENCODE_THREADS;  // words per thread (8)
    __shared__ u32 warp_tot[32];
    __shared__ unsigned short slot[SLOTS];
    const i64 pid = blockIdx.x;
    const i64 run = find_run(first, num_runs, pid);
    const i64 local = pid - first[run];
    const i64* r = runs + run * 8;
    const T* __restrict__ src = reinterpret_cast<const T*>(r[0]) + local * CHUNK;
    short* __restrict__ index = reinterpret_cast<short*>(r[1]);
    T* __restrict__ values = reinterpret_cast<T*>(r[2]);
    i64* offsets = reinterpret_cast<i64*>(r[3]);
    const i64 row0 = r[4];
    const i64 g = row0 + local;
    const i64 start = excl[g] - excl[row0];
    const i64 cnt = counts[g];
    if (threadIdx.x == 0) {
        offsets[local + 1] = start + cnt;
        if (local == 0) offsets[0] = 0;
    }
    if (cnt == 0) return;
    i64 base = start;  // where the bitmap's entries go
    u32 lo = 0;        // the bitmap's elements below this one were staged
    if (STAGE > 0 && local < r[5]) {
        const i64 sg = r[6] + local;
        const unsigned short* si = sidx + sg * STAGE;
        const T* sv = reinterpret_cast<const T*>(sval) + sg * STAGE;
        const u32 ns = cnt < STAGE ? (u32)cnt : (u32)STAGE;
#if ENCODE_VEC
        // Rows start 16-byte aligned (STAGE * 2 and STAGE * sizeof(T) bytes apart).
        copy_to(reinterpret_cast<unsigned char*>(index + start),
                reinterpret_cast<const unsigned char*>(si), ns * 2u);
        copy_to(reinterpret_cast<unsigned char*>(values + start),
                reinterpret_cast<const unsigned char*>(sv), ns * (u32)sizeof(T));
#else
        // One entry per thread (2-byte and element-size stores), for comparison in probes.
#pragma unroll 4
        for (u32 j = threadIdx.x; j < ns; j += ENCODE_THREADS) {
            index[start + j] = (short)si[j];
            values[start + j] = sv[j];
        }
#endif
        if (cnt <= STAGE) return;
        lo = (u32)si[STAGE - 1] + 1u;
        base = start + STAGE;
    }
    const u32* row = wbits + g * WORDS;
    u32 total;
    if (cnt - (base - start) <= SLOTS) {
        const uint4* wv = reinterpret_cast<const uint4*>(row) + threadIdx.x * 2;
        const uint4 w0 = wv[0], w1 = wv[1];
        u32 w[PER] = {w0.x, w0.y, w0.z, w0.w, w1.x, w1.y, w1.z, w1.w};
        u32 p = 0;
#pragma unroll
        for (int k = 0; k < PER; ++k) {
            w[k] = above(w[k], threadIdx.x * PER + k, lo);
            p += __popc(w[k]);
        }
        u32 q = block_scan<u32, ENCODE_THREADS / 32>(p, warp_tot, &total);
#pragma unroll
        for (int k = 0; k < PER; ++k) {
            u32 bits = w[k];
            const int at = (threadIdx.x * PER + k) * 32;
            while (bits) {
                slot[q++] = (unsigned short)(at + __ffs(bits) - 1);
                bits &= bits - 1;
            }
        }
        __syncthreads();
        for (u32 j = threadIdx.x; j < total; j += ENCODE_THREADS) {
            const unsigned e = slot[j];
            index[base + j] = (short)e;
            values[base + j] = src[e];
        }
        return;
    }
    u32 w[PER];
#pragma unroll
    for (int k = 0; k < PER; ++k) {
        const int wi = k * ENCODE_THREADS + threadIdx.x;
        w[k] = above(row[wi], wi, lo);
    }
#pragma unroll 1
    for (int k = 0; k < PER; ++k) {
        u32 q = block_scan<u32, ENCODE_THREADS / 32>(__popc(w[k]), warp_tot, &total);
        if (total != 0) {
            u32 bits = w[k];
            const int at = (k * ENCODE_THREADS + threadIdx.x) * 32;
            while (bits) {
                slot[q++] = (unsigned short)(at + __ffs(bits) - 1);
                bits &= bits - 1;
            }
            __syncthreads();
            for (u32 j = threadIdx.x; j < total; j += ENCODE_THREADS) {
                const unsigned e = slot[j];
                index[base + j] = (short)e;
                values[base + j] = src[e];
            }
        }
        base += total;
        __syncthreads();
    }
}

// Chunk `local` of run [dst, offsets, index, values, numel, ...]: dst[index[j]] = values[j]
// for its entries; an index past the run's end is dropped.
template <typename T>
__device__ __forceinline__ void apply(const i64* runs, const i64* first, i64 num_runs) {
    const i64 pid = blockIdx.x;
    const i64 run = find_run(first, num_runs, pid);
    const i64 local = pid - first[run];
    const i64* r = runs + run * 8;
    T* dst = reinterpret_cast<T*>(r[0]) + local * CHUNK;
    const i64* offsets = reinterpret_cast<const i64*>(r[1]);
    const unsigned short* index = reinterpret_cast<const unsigned short*>(r[2]);
    const T* values = reinterpret_cast<const T*>(r[3]);
    i64 nelem = r[4] - local * CHUNK;
    if (nelem > CHUNK) nelem = CHUNK;
    const i64 start = offsets[local];
    i64 count = offsets[local + 1] - start;
    if (count > CHUNK) count = CHUNK;
    for (i64 j = threadIdx.x; j < count; j += blockDim.x) {
        const unsigned idx = index[start + j];
        if (idx < nelem) dst[idx] = values[start + j];
    }
}

#define COUNT_ARGS const i64* runs, const i64* first, i64 num_runs, i64* counts, u32* wbits, \
    unsigned short* sidx, unsigned char* sval
#define ENCODE_ARGS const i64* runs, const i64* first, i64 num_runs, const i64* counts, \
    const i64* excl, const u32* wbits, const unsigned short* sidx, const unsigned char* sval
#define KERNELS(E, T) \
extern "C" __global__ void __launch_bounds__(COUNT_BOUND) count_full_##E(COUNT_ARGS) { \
    count_full<E, T>(runs, first, num_runs, counts, wbits, sidx, sval); } \
extern "C" __global__ void __launch_bounds__(512) count_part_##E(COUNT_ARGS) { \
    count_part<T>(runs, first, num_runs, counts, wbits); } \
extern "C" __global__ void __launch_bounds__(256) encode_##E(ENCODE_ARGS) { \
    encode<T>(runs, first, num_runs, counts, excl, wbits, sidx, sval); } \
extern "C" __global__ void __launch_bounds__(256) apply_##E(const i64* runs, const i64* first, \
    i64 num_runs) { apply<T>(runs, first, num_runs); }

KERNELS(1, unsigned char)
KERNELS(2, unsigned short)
KERNELS(4, unsigned int)
"""


class _StreamHandle:
    """A torch stream as CUDA's stream protocol gives it to CuPy (`Stream.from_external`)."""

    def __init__(self, handle: int) -> None:
        self._handle = handle

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self._handle)


@functools.cache
def _module(device_index: int, defines: tuple[tuple[str, int], ...] = ()) -> Any:
    """The kernels compiled for one device (`defines`: macros of the source, for probes)."""
    macros = {"STAGE": STAGE, "COUNT_BOUND": _COUNT_THREADS, **dict(defines)}
    options = ("-std=c++17", *(f"-D{k}={v}" for k, v in macros.items()))
    with cupy.cuda.Device(device_index):
        mod = cupy.RawModule(code=_SOURCE, options=options)
        mod.compile()
    return mod


@functools.cache
def _kernel(device_index: int, defines: tuple[tuple[str, int], ...], name: str) -> Any:
    return _module(device_index, defines).get_function(name)


@functools.lru_cache(maxsize=64)
def _stream(handle: int) -> Any:
    """CuPy's view of a torch stream (by its handle; streams live as long as the process
    typically, and a handle seen again is the same stream or one made in its place)."""
    return cupy.cuda.Stream.from_external(_StreamHandle(handle))


def _launch(
    device: torch.device,
    name: str,
    grid: int,
    threads: int,
    ptrs: tuple[int, ...],
    num_runs: int,
    defines: tuple[tuple[str, int], ...] = (),
) -> None:
    """Launch kernel `name` on `device`'s current torch stream: `grid` blocks of `threads`,
    arguments (table, first, num_runs, *rest) with `ptrs` = (table, first, *rest)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    kernel = _kernel(index, defines, name)
    args: tuple[Any, ...] = (np.uint64(ptrs[0]), np.uint64(ptrs[1]), np.int64(num_runs))
    args += tuple(np.uint64(p) for p in ptrs[2:])
    with cupy.cuda.Device(index), _stream(int(torch.cuda.current_stream(device).cuda_stream)):
        kernel((grid,), (threads,), args)


@dataclasses.dataclass(frozen=True, slots=True)
class Staging:
    """`STAGE` slots per whole chunk of one element size: the changes the count staged, as
    16-bit indices and values (2 + `value_bytes` bytes per slot). Rows are numbered over the
    whole chunks of this element size only (`stage_rows`)."""

    index: torch.Tensor
    values: torch.Tensor
    value_bytes: int

    @classmethod
    def new(cls, device: torch.device, rows: int, value_bytes: int) -> Staging:
        """Uninitialized slots for `rows` whole chunks."""
        return cls(
            index=torch.empty(rows * STAGE, dtype=torch.int16, device=device),
            values=torch.empty(rows * STAGE * value_bytes, dtype=torch.uint8, device=device),
            value_bytes=value_bytes,
        )

    def args(self) -> tuple[int, int]:
        """The kernels' staging arguments: indices, values."""
        return (self.index.data_ptr(), self.values.data_ptr())


def stage_rows(whole: np.ndarray) -> np.ndarray:
    """Each run's first staging row, given its whole chunks (`whole`, runs of one element
    size): the exclusive prefix sum."""
    out = np.zeros(whole.size, dtype=np.int64)
    np.cumsum(whole[:-1], out=out[1:])
    return out


def count_rows(
    device: torch.device,
    runs: torch.Tensor,
    first: torch.Tensor,
    num_runs: int,
    grid: int,
    counts: torch.Tensor,
    wbits: torch.Tensor,
    *,
    esize: int,
    full: bool,
    staging: Staging | None,
) -> None:
    """`count_runs_kernel` over `grid` chunks: rows [new, old, numel, row0] (`runs`, int64 on
    the device), `first` the runs' first chunk (num_runs + 1 entries). Whole chunks (`full`)
    also stage their first `STAGE` changes in `staging`, chunk j of the launch in row j (so a
    table of whole chunks of one element size, the rows `stage_rows` numbers)."""
    name = f"count_{'full' if full else 'part'}_{esize}"
    ptrs: tuple[int, ...] = (runs.data_ptr(), first.data_ptr(), counts.data_ptr())
    ptrs += (wbits.data_ptr(),)
    ptrs += staging.args() if staging is not None else (0, 0)
    _launch(device, name, grid, _COUNT_THREADS, ptrs, num_runs)


def encode_rows(
    device: torch.device,
    runs: torch.Tensor,
    first: torch.Tensor,
    num_runs: int,
    grid: int,
    counts: torch.Tensor,
    excl: torch.Tensor,
    wbits: torch.Tensor,
    *,
    esize: int,
    staging: Staging | None,
) -> None:
    """`encode_runs_kernel`: rows [new, index, values, offsets, row0, staged, srow0, 0],
    `staged` the run's chunks that `count_rows` counted as whole and `srow0` their first
    staging row in `staging` (their staged changes are copied)."""
    _launch(
        device,
        f"encode_{esize}",
        grid,
        _ENCODE_THREADS,
        (
            runs.data_ptr(),
            first.data_ptr(),
            counts.data_ptr(),
            excl.data_ptr(),
            wbits.data_ptr(),
        )
        + (staging.args() if staging is not None else (0, 0)),
        num_runs,
    )


def apply_rows(
    device: torch.device,
    runs: torch.Tensor,
    first: torch.Tensor,
    num_runs: int,
    grid: int,
    *,
    esize: int,
) -> None:
    """`apply_runs_kernel`: rows [dst, offsets, index, values, numel, 0, 0, 0]."""
    _launch(
        device,
        f"apply_{esize}",
        grid,
        _APPLY_THREADS,
        (runs.data_ptr(), first.data_ptr()),
        num_runs,
    )
