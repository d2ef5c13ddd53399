#include "blas.h"

#include <cblas.h>  // scipy_openblas32: declares scipy_cblas_* / scipy_openblas_*

#include <mutex>

namespace ortlean {
namespace blas {

void init() {
  static std::once_flag once;
  std::call_once(once, [] { scipy_openblas_set_num_threads(1); });
}

void sgemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda,
           const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  scipy_cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans,
                    static_cast<blasint>(M), static_cast<blasint>(N), static_cast<blasint>(K), alpha, A,
                    static_cast<blasint>(lda), B, static_cast<blasint>(ldb), beta, C, static_cast<blasint>(ldc));
}

}  // namespace blas
}  // namespace ortlean
