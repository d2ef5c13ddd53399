#include "scratch.h"

namespace ortlean {

Scratch& outer_scratch() {
  thread_local Scratch s;
  return s;
}
Scratch& task_scratch() {
  thread_local Scratch s;
  return s;
}
Scratch& gemm_scratch() {
  thread_local Scratch s;
  return s;
}

}  // namespace ortlean
