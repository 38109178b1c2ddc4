// Standalone whole-model forward (no Python): the logits of every position of a token list
// through the engine, written as raw float32 [n_tokens, n_vocab] for tests/test_arm_qemu.py to
// compare against the x86 forward of the same GGUF. TENSORFOLD_ISA caps the kernels' ISA.
//
//   tf_model_check MODEL.gguf OUT.f32 THREADS TOKEN_ID...
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <vector>

#include "core/cpu_features.h"
#include "engine/engine.h"

int main(int argc, char** argv) {
  if (argc < 5) {
    std::fprintf(stderr, "usage: %s MODEL.gguf OUT.f32 THREADS TOKEN_ID...\n", argv[0]);
    return 2;
  }
  try {
    tf::EngineOptions opts;
    opts.backend = "cpu";
    opts.threads = std::atoi(argv[3]);
    opts.context = 256;
    opts.kv_tokens = 256;
    opts.max_seqs = 1;
    opts.memory_budget = -1;  // under qemu the host's free memory says nothing useful
    std::vector<int32_t> ids;
    for (int i = 4; i < argc; ++i) ids.push_back(int32_t(std::atoi(argv[i])));
    tf::Engine eng(argv[1], opts);
    const int64_t vocab = eng.config().n_vocab;
    std::vector<float> out(ids.size() * size_t(vocab));
    eng.logits(ids, out.data());
    FILE* f = std::fopen(argv[2], "wb");
    if (!f || std::fwrite(out.data(), 4, out.size(), f) != out.size()) {
      std::fprintf(stderr, "cannot write %s\n", argv[2]);
      return 1;
    }
    std::fclose(f);
    std::printf("backend %s isa %s tokens %zu vocab %lld\n", eng.backend_name().c_str(), tf::isa_name(tf::best_isa()),
                ids.size(), (long long)vocab);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  return 0;
}
