// llama.cpp's logits for given token ids, through its public C API (llama.h), for bench/llama_cpp.py's parity
// check: on the same weights in fp32 (experts dense), llama.cpp's K3 must give k3x's logits, so that the rows
// beside it compare one model.
//
//   llama_cpp_logits MODEL.gguf THREADS PROMPT_LEN < ids (int32, binary) > logits (float32, binary)
//
// The first PROMPT_LEN ids are one batch from an empty context (logits at every position), each id after them a
// one-token step on that context (its logits), as k3x's batch interface runs a prefill and decode steps. Writes
// (number of ids) x n_vocab floats. Exit status 1 with a message on stderr on any failure. The context keeps its
// cache in fp32 and runs attention without flash attention: with llama.cpp's defaults (an f16 cache, flash
// attention where the backend has it, both in f16) an MLA layer alone moved the logits by ~1e-3 on k3-bench.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "ggml.h"
#include "llama.h"

namespace {

int fail(const char* what) {
  std::fprintf(stderr, "llama_cpp_logits: %s\n", what);
  return 1;
}

// ids[first, first + n) at positions first.. as one batch, each position's logits appended to out
bool decode(llama_context* ctx, const std::vector<llama_token>& ids, int first, int n, int n_vocab,
            std::vector<float>& out) {
  llama_batch batch = llama_batch_init(n, 0, 1);
  for (int i = 0; i < n; ++i) {
    batch.token[i] = ids[first + i];
    batch.pos[i] = first + i;
    batch.n_seq_id[i] = 1;
    batch.seq_id[i][0] = 0;
    batch.logits[i] = 1;
  }
  batch.n_tokens = n;
  const bool ok = llama_decode(ctx, batch) == 0;
  for (int i = 0; ok && i < n; ++i) {
    const float* l = llama_get_logits_ith(ctx, i);
    out.insert(out.end(), l, l + n_vocab);
  }
  llama_batch_free(batch);
  return ok;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 4) return fail("usage: llama_cpp_logits MODEL.gguf THREADS PROMPT_LEN < ids > logits");
  const int threads = std::atoi(argv[2]), prompt = std::atoi(argv[3]);
  std::vector<llama_token> ids;
  for (int32_t id; std::fread(&id, sizeof id, 1, stdin) == 1;) ids.push_back(id);
  if (prompt < 1 || prompt > int(ids.size())) return fail("PROMPT_LEN outside 1 .. the number of ids");

  llama_backend_init();
  llama_model* model = llama_model_load_from_file(argv[1], llama_model_default_params());
  if (!model) return fail("the model did not load");
  llama_context_params cp = llama_context_default_params();
  cp.n_ctx = cp.n_batch = cp.n_ubatch = uint32_t(ids.size());
  cp.n_threads = cp.n_threads_batch = threads;
  cp.type_k = cp.type_v = GGML_TYPE_F32;
  cp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_DISABLED;
  llama_context* ctx = llama_init_from_model(model, cp);
  if (!ctx) return fail("no context");
  const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));

  std::vector<float> out;
  bool ok = decode(ctx, ids, 0, prompt, n_vocab, out);
  for (int i = prompt; ok && i < int(ids.size()); ++i) ok = decode(ctx, ids, i, 1, n_vocab, out);
  llama_free(ctx);
  llama_model_free(model);
  if (!ok) return fail("llama_decode failed");
  return std::fwrite(out.data(), sizeof(float), out.size(), stdout) == out.size() ? 0 : fail("short write");
}
