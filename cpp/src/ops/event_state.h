// The per-sequence state of a stateful EventGatedMatMul node (event mode or kwta_duty > 1), the
// graph I/O pair past_event.<node> -> present_event.<node> (float32 [B, S], one row a sequence).
// Layout of a row (DEVELOPERS.md, custom_ops/reference/gating.py):
//   header [8]: initialised (0/1), step, event disabled (0/1), last gap, 4 reserved
//   x_ref [K]    the input the cached output belongs to
//   y_cache [N]  the output for x_ref
//   age [nb]     steps since each block was refreshed
//   kwta [nb]    the KWTA block mask kept between duty-cycle steps (0/1)
#pragma once
#include <algorithm>
#include <cstdint>
#include <cstring>

namespace ortlean {

// Step counters and ages are float32 in the state: exact up to 2^24, the bound of kwta_duty,
// event_gap_every and event_age_max.
constexpr int64_t kMaxSteps = int64_t{1} << 24;

struct EventStateLayout {
  static constexpr int64_t kHeader = 8;
  int64_t K = 0, N = 0, nb = 0;

  int64_t x_ref() const { return kHeader; }
  int64_t y_cache() const { return kHeader + K; }
  int64_t age() const { return kHeader + K + N; }
  int64_t kwta() const { return kHeader + K + N + nb; }
  int64_t size() const { return kHeader + K + N + 2 * nb; }  // S
};

// One sequence's state row.
class EventState {
 public:
  EventState(float* row, const EventStateLayout& L) : p_(row), L_(&L) {}

  bool initialised() const { return p_[0] == 1.0f; }
  bool disabled() const { return p_[2] != 0.0f; }
  int64_t advance() { return step_of(p_[1] += 1.0f); }  // next step number
  void disable() { p_[2] = 1.0f; }
  void set_last_gap(float g) { p_[3] = g; }
  // A new sequence after its prefill: initialised at step 0, cache = (x, y) of its last token,
  // ages 0 (the disabled flag and the KWTA mask are left as they are).
  void start(const float* x, const float* y) {
    p_[0] = 1.0f;
    p_[1] = 0.0f;
    std::memcpy(x_ref(), x, sizeof(float) * static_cast<size_t>(L_->K));
    std::memcpy(y_cache(), y, sizeof(float) * static_cast<size_t>(L_->N));
    std::fill(age(), age() + L_->nb, 0.0f);
  }

  float* x_ref() const { return p_ + L_->x_ref(); }
  float* y_cache() const { return p_ + L_->y_cache(); }
  float* age() const { return p_ + L_->age(); }
  float* kwta() const { return p_ + L_->kwta(); }

 private:
  // the counter as an integer; a malformed state (negative, NaN, huge) reads as 0 or saturates
  static int64_t step_of(float f) { return f >= 0.0f ? (f < 9.0e18f ? static_cast<int64_t>(f) : int64_t{1} << 62) : 0; }

  float* p_;
  const EventStateLayout* L_;
};

}  // namespace ortlean
