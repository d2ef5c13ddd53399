/* llama_nll: teacher-forced per-token negative log-likelihoods of a token sequence under a GGUF model,
 * computed by llama.cpp itself (libllama), so that llama.cpp's rows of ortlean's quality tables are
 * measured by its own engine on exactly the tokens the ONNX rows are scored on.
 *
 *   llama_nll MODEL.gguf IDS.bin WINDOW THREADS [PREFIX.bin] > NLL.bin
 *
 * PREFIX.bin (optional): int32 token ids put before every window as context only (the tokenizer's
 * beginning-of-sequence token: Gemma's <bos>), as runtime.perplexity's prefix.
 * IDS.bin: little-endian int32 token ids, scored in consecutive windows of WINDOW tokens (a last,
 * shorter window too); each window is one fresh sequence (the cache is cleared) decoded in one batch
 * with logits at every position, and token i + 1 of the window is scored by the logits at i — the
 * windows of ortlean's runtime.perplexity. Writes one little-endian float64 NLL per scored token to
 * stdout (sum over windows of WINDOW - 1 values). Built by models/llamacpp.py against Debian's
 * libllama-dev headers and run through the fetched loader like the other llama.cpp tools.
 */
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ggml-backend.h"
#include "llama.h"

static bool no_progress(float progress, void *data) {
  (void)progress;
  (void)data;
  return true;
}

static void quiet(enum ggml_log_level level, const char *text, void *data) {
  (void)data;
  if (level >= GGML_LOG_LEVEL_ERROR) fputs(text, stderr);
}

int main(int argc, char **argv) {
  if (argc != 5 && argc != 6) {
    fprintf(stderr, "usage: %s MODEL.gguf IDS.bin WINDOW THREADS [PREFIX.bin] > NLL.bin\n", argv[0]);
    return 2;
  }
  int32_t pre[64];
  int np = 0;
  if (argc == 6) {
    FILE *pf = fopen(argv[5], "rb");
    if (!pf) {
      fprintf(stderr, "llama_nll: cannot open %s\n", argv[5]);
      return 2;
    }
    np = (int)fread(pre, 4, 64, pf);
    fclose(pf);
  }
  const int window = atoi(argv[3]), threads = atoi(argv[4]);
  if (window < 2 || threads < 1) {
    fprintf(stderr, "llama_nll: WINDOW must be >= 2 and THREADS >= 1\n");
    return 2;
  }
  FILE *f = fopen(argv[2], "rb");
  if (!f) {
    fprintf(stderr, "llama_nll: cannot open %s\n", argv[2]);
    return 2;
  }
  fseek(f, 0, SEEK_END);
  const long bytes = ftell(f);
  fseek(f, 0, SEEK_SET);
  const int n = (int)(bytes / 4);
  int32_t *ids = malloc(sizeof(int32_t) * (n > 0 ? n : 1));
  if (!ids || fread(ids, 4, n, f) != (size_t)n) {
    fprintf(stderr, "llama_nll: cannot read %d ids from %s\n", n, argv[2]);
    return 2;
  }
  fclose(f);

  llama_log_set(quiet, NULL);
  ggml_backend_load_all();
  llama_backend_init();
  struct llama_model_params mp = llama_model_default_params();
  mp.progress_callback = no_progress;
  struct llama_model *model = llama_model_load_from_file(argv[1], mp);
  if (!model) {
    fprintf(stderr, "llama_nll: cannot load %s\n", argv[1]);
    return 1;
  }
  struct llama_context_params cp = llama_context_default_params();
  cp.n_ctx = window + np;
  cp.n_batch = window + np;
  cp.n_ubatch = window + np;
  cp.n_seq_max = 1;
  cp.n_threads = threads;
  cp.n_threads_batch = threads;
  struct llama_context *ctx = llama_init_from_model(model, cp);
  if (!ctx) {
    fprintf(stderr, "llama_nll: cannot create a context of %d tokens\n", window);
    return 1;
  }
  const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
  for (int i = 0; i < n; ++i) {
    if (ids[i] < 0 || ids[i] >= n_vocab) {
      fprintf(stderr, "llama_nll: token id %d at %d outside the model's vocabulary of %d\n", ids[i], i, n_vocab);
      return 2;
    }
  }
  for (int i = 0; i < np; ++i) {
    if (pre[i] < 0 || pre[i] >= n_vocab) {
      fprintf(stderr, "llama_nll: prefix token id %d outside the model's vocabulary of %d\n", pre[i], n_vocab);
      return 2;
    }
  }
  struct llama_batch batch = llama_batch_init(window + np, 0, 1);
  for (int w0 = 0; w0 + 1 < n; w0 += window) {
    const int len = (n - w0 < window) ? n - w0 : window;
    if (len < 2) break;
    llama_memory_clear(llama_get_memory(ctx), true);
    batch.n_tokens = np + len;
    for (int i = 0; i < np + len; ++i) {
      batch.token[i] = i < np ? pre[i] : ids[w0 + i - np];
      batch.pos[i] = i;
      batch.n_seq_id[i] = 1;
      batch.seq_id[i][0] = 0;
      batch.logits[i] = i >= np;
    }
    if (llama_decode(ctx, batch) != 0) {
      fprintf(stderr, "llama_nll: llama_decode failed on the window at %d\n", w0);
      return 1;
    }
    for (int i = 0; i + 1 < len; ++i) {
      const float *lg = llama_get_logits_ith(ctx, np + i);
      double m = lg[0];
      for (int v = 1; v < n_vocab; ++v) m = lg[v] > m ? lg[v] : m;
      double s = 0.0;
      for (int v = 0; v < n_vocab; ++v) s += exp((double)lg[v] - m);
      const double nll = m + log(s) - (double)lg[ids[w0 + i + 1]];
      fwrite(&nll, sizeof nll, 1, stdout);
    }
  }
  llama_batch_free(batch);
  llama_free(ctx);
  llama_model_free(model);
  free(ids);
  return 0;
}
