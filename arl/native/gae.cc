// Masked generalised advantage estimation as a C++ loop over each row, called from
// compiled JAX programs through XLA's FFI (a custom call: no host round trip).
//
// The recursion is the one of `arl.algorithms.gae` (`_gae_scan`), operation for
// operation, with the carry update as two fused multiply-adds where the host has them
// (as XLA:CPU contracts the scan's, in most contexts). Per block of time steps, three
// passes: (1) each token's carry update as decay * carry + drive, element-wise; (2) the
// carry chain backwards in time, one FMA per token, several rows interleaved so their
// independent chains hide the FMA latency; (3) advantages and returns from each token's
// incoming carry, element-wise. Passes 1 and 3 vectorise; no branch depends on the agent
// mask (~70 % true, unpredictable: a branch on it cost more than the recurrence).
//
// Arguments (row-major; the last axis is time, every leading axis a row):
//   rewards, values f32[..., T]; mask pred[..., T]; bootstrap f32[...];
//   ends pred[..., T] and boundary_value f32[..., T] (read by the `Boundaries` entry
//   point only; the other takes empty buffers); gamma and gamma_lam f32, one value per
//   group of consecutive rows (one value in all, or one per vmapped instance).
// Results: advantages, returns f32[..., T].

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kLanes = 4;         // rows interleaved in the carry chain
constexpr int64_t kBlock = 2048;  // time steps per block
// Scratch arrays kBlock + 16 floats apart: at a multiple of 4 kB apart the chain's stores
// and loads alias in the store buffer and it ran 3-4x slower.
constexpr int64_t kScratchStride = kBlock + 16;

inline float Select(bool pick_first, float first, float second) {
  uint32_t a, b;
  std::memcpy(&a, &first, sizeof a);
  std::memcpy(&b, &second, sizeof b);
  const uint32_t keep = 0u - static_cast<uint32_t>(pick_first);
  const uint32_t bits = (a & keep) | (b & ~keep);
  float out;
  std::memcpy(&out, &bits, sizeof out);
  return out;
}

inline float MultiplyAdd(float a, float b, float c) {
#if defined(__FMA__) || defined(__aarch64__)
  return std::fma(a, b, c);
#else
  return a * b + c;
#endif
}

// Pass 1. Off the mask the carry passes through (1 * carry + 0, exact); an episode end
// replaces a token's incoming carry by gamma * boundary_value (`reset`).
template <bool kBoundaries>
void DecayAndDrive(int64_t n, const float* __restrict rewards,
                   const float* __restrict values, const uint8_t* __restrict mask,
                   const float* __restrict boundary_value, float gamma, float gamma_lam,
                   float* __restrict decay, float* __restrict drive,
                   float* __restrict reset) {
  for (int64_t j = 0; j < n; ++j) {
    const bool agent = mask[j] != 0;
    const float update = MultiplyAdd(gamma, values[j], gamma_lam * (rewards[j] - values[j]));
    decay[j] = agent ? gamma_lam : 1.0f;
    drive[j] = agent ? update : 0.0f;
    if (kBoundaries) reset[j] = gamma * boundary_value[j];
  }
}

// Pass 3.
void AdvantagesAndReturns(int64_t n, const float* __restrict rewards,
                          const float* __restrict values, const uint8_t* __restrict mask,
                          const float* __restrict carry_in, float* __restrict advantages,
                          float* __restrict returns) {
  for (int64_t j = 0; j < n; ++j) {
    const bool agent = mask[j] != 0;
    const float advantage = (rewards[j] - values[j]) + carry_in[j];
    advantages[j] = agent ? advantage : 0.0f;
    returns[j] = agent ? advantage + values[j] : 0.0f;
  }
}

struct Rows {
  const float* rewards;
  const float* values;
  const uint8_t* mask;
  const uint8_t* ends;
  const float* boundary_value;
  const float* bootstrap;
  float* advantages;
  float* returns;
  int64_t length;
};

// kRows consecutive rows from `first`, sharing gamma, backwards through time in blocks.
template <bool kBoundaries, int kRows>
void RowGroup(const Rows& rows, int64_t first, float gamma, float gamma_lam,
              float* scratch) {
  float* decay[kRows];
  float* drive[kRows];
  float* reset[kRows];
  float* carry_in[kRows];
  float carry[kRows];
  for (int k = 0; k < kRows; ++k) {
    decay[k] = scratch + (4 * k + 0) * kScratchStride;
    drive[k] = scratch + (4 * k + 1) * kScratchStride;
    reset[k] = scratch + (4 * k + 2) * kScratchStride;
    carry_in[k] = scratch + (4 * k + 3) * kScratchStride;
    carry[k] = gamma * rows.bootstrap[first + k];
  }
  for (int64_t end = rows.length; end > 0; end -= kBlock) {
    const int64_t start = end > kBlock ? end - kBlock : 0, n = end - start;
    for (int k = 0; k < kRows; ++k) {
      const int64_t offset = (first + k) * rows.length + start;
      DecayAndDrive<kBoundaries>(n, rows.rewards + offset, rows.values + offset,
                                 rows.mask + offset,
                                 kBoundaries ? rows.boundary_value + offset : nullptr, gamma,
                                 gamma_lam, decay[k], drive[k], reset[k]);
    }
    // Pass 2.
    for (int64_t j = n - 1; j >= 0; --j) {
      for (int k = 0; k < kRows; ++k) {
        if (kBoundaries) {
          carry[k] = Select(rows.ends[(first + k) * rows.length + start + j] != 0,
                            reset[k][j], carry[k]);
        }
        carry_in[k][j] = carry[k];
        carry[k] = MultiplyAdd(decay[k][j], carry[k], drive[k][j]);
      }
    }
    for (int k = 0; k < kRows; ++k) {
      const int64_t offset = (first + k) * rows.length + start;
      AdvantagesAndReturns(n, rows.rewards + offset, rows.values + offset,
                           rows.mask + offset, carry_in[k], rows.advantages + offset,
                           rows.returns + offset);
    }
  }
}

template <bool kBoundaries>
ffi::Error MaskedGae(ffi::Buffer<ffi::F32> rewards, ffi::Buffer<ffi::F32> values,
                     ffi::Buffer<ffi::PRED> mask, ffi::Buffer<ffi::F32> bootstrap,
                     ffi::Buffer<ffi::PRED> ends, ffi::Buffer<ffi::F32> boundary_value,
                     ffi::Buffer<ffi::F32> gamma, ffi::Buffer<ffi::F32> gamma_lam,
                     ffi::ResultBuffer<ffi::F32> advantages,
                     ffi::ResultBuffer<ffi::F32> returns) {
  const auto dims = rewards.dimensions();
  if (dims.size() == 0) return ffi::Error::InvalidArgument("rewards must have a time axis");
  if (rewards.element_count() == 0) return ffi::Error::Success();
  const int64_t length = dims.back();
  const int64_t rows = static_cast<int64_t>(rewards.element_count()) / length;
  const int64_t groups = static_cast<int64_t>(gamma.element_count());
  if (groups == 0 || rows % groups != 0 ||
      static_cast<int64_t>(gamma_lam.element_count()) != groups ||
      static_cast<int64_t>(bootstrap.element_count()) != rows) {
    return ffi::Error::InvalidArgument("inconsistent GAE argument shapes");
  }
  const Rows data{rewards.typed_data(),
                  values.typed_data(),
                  reinterpret_cast<const uint8_t*>(mask.typed_data()),
                  kBoundaries ? reinterpret_cast<const uint8_t*>(ends.typed_data()) : nullptr,
                  kBoundaries ? boundary_value.typed_data() : nullptr,
                  bootstrap.typed_data(),
                  advantages->typed_data(),
                  returns->typed_data(),
                  length};
  std::vector<float> scratch(4 * kLanes * kScratchStride);
  const int64_t rows_per_group = rows / groups;
  for (int64_t group = 0; group < groups; ++group) {
    const float g = gamma.typed_data()[group], gl = gamma_lam.typed_data()[group];
    int64_t row = group * rows_per_group;
    const int64_t group_end = row + rows_per_group;
    for (; row + kLanes <= group_end; row += kLanes) {
      RowGroup<kBoundaries, kLanes>(data, row, g, gl, scratch.data());
    }
    for (; row < group_end; ++row) RowGroup<kBoundaries, 1>(data, row, g, gl, scratch.data());
  }
  return ffi::Error::Success();
}

}  // namespace

#define ARL_MASKED_GAE_BINDING                                                           \
  ffi::Ffi::Bind()                                                                     \
      .Arg<ffi::Buffer<ffi::F32>>()  /* rewards */                                     \
      .Arg<ffi::Buffer<ffi::F32>>()  /* values */                                      \
      .Arg<ffi::Buffer<ffi::PRED>>() /* mask */                                        \
      .Arg<ffi::Buffer<ffi::F32>>()  /* bootstrap */                                   \
      .Arg<ffi::Buffer<ffi::PRED>>() /* ends */                                        \
      .Arg<ffi::Buffer<ffi::F32>>()  /* boundary_value */                              \
      .Arg<ffi::Buffer<ffi::F32>>()  /* gamma */                                       \
      .Arg<ffi::Buffer<ffi::F32>>()  /* gamma_lam */                                   \
      .Ret<ffi::Buffer<ffi::F32>>()  /* advantages */                                  \
      .Ret<ffi::Buffer<ffi::F32>>()  /* returns */

XLA_FFI_DEFINE_HANDLER_SYMBOL(ArlMaskedGae, MaskedGae<false>, ARL_MASKED_GAE_BINDING);
XLA_FFI_DEFINE_HANDLER_SYMBOL(ArlMaskedGaeBoundaries, MaskedGae<true>,
                              ARL_MASKED_GAE_BINDING);
