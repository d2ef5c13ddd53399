// OpenBLAS (scipy-openblas32, prefixed symbols) used single-threaded: parallelism comes from
// ORT's intra-op pool, each task calls sgemm on its own block.
#pragma once
#include <cstdint>

namespace ortlean {
namespace blas {

// Sets OpenBLAS to one thread (once per process; called at registration).
void init();

// Row-major C[M,N] = alpha * op(A) . op(B) + beta * C
void sgemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda,
           const float* B, int64_t ldb, float beta, float* C, int64_t ldc);

}  // namespace blas
}  // namespace ortlean
