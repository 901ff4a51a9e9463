// Sluice's native Llama step: the whole decoder stack (and the lm_head) as one call each, the GIL released.
// The family's variants are options of the same step, not copies of it: per model (embedding scale, attention
// scale, GeGLU instead of SwiGLU, final logit soft-cap) and per layer (q/k norms per head, post-attention and
// post-MLP norms, the layer's own rope tables, a sliding window): Qwen 3 and Gemma 3 beside Llama.
//
// Weights: the layers' linears on the GGUF file's own grids (the Q4 layout for Q4_0 / Q4_1 / Q4_K, with fifth bits for
// Q5_0 / Q5_1 / Q5_K, the Q6 layout for Q6_K, the Q8 layer layout for Q8_0; a linear's parts may differ), Q8_0 (int8,
// per 32-group scale) for
// the token embedding and lm_head.
// Activations are float32; the KV cache is the runner's (bf16 or float32, [blocks][KVH][block_size][D]),
// written and read in place through block tables. Kernels are compiled four times (AVX-512, AVX2+FMA with AVX-VNNI,
// AVX2+FMA, baseline x86-64) and chosen at run time from the CPU's features.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <utility>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include <immintrin.h>

#include "vector_types.inc"
#include "isa_variants.inc"

namespace {

#include "dispatch.inc"
#include "linears.inc"

// For the kernel benchmark: the multiply-adds of `iterations` turns of the register-only dot2 loop on every thread
// of the pool (as the GEMMs run), and the sum of a float32 tensor read once (a streaming read).
// is_int8: the int8 kernels' instruction instead (vpdpbusd, pmaddubsw; the int16 one where int8 runs on it).
int64_t madd_peak(int64_t iterations, bool is_int8) {
  const int threads = at::get_num_threads();
  std::vector<int64_t> done(threads, 0);
  const Kernels& kern = kernels();
  at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; t++)
      done[t] = (is_int8 ? kern.madd_peak_i8 : kern.madd_peak)(iterations, (int)(t + iterations) & 7);
  });
  int64_t total = 0;
  for (int64_t d : done) total += d;
  return total;
}

double read_stream(at::Tensor x) {
  check_f32(x, "x");
  TORCH_CHECK(x.numel() % 64 == 0, "read_stream: a multiple of 64 floats");
  const int64_t n = x.numel(), chunk = 1 << 20;
  const float* p = x.data_ptr<float>();
  std::vector<double> parts((n + chunk - 1) / chunk);
  at::parallel_for(0, (int64_t)parts.size(), 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; c++) parts[c] = kernels().read_stream(p + c * chunk, std::min(chunk, n - c * chunk));
  });
  double total = 0;
  for (double v : parts) total += v;
  return total;
}

// Greedy tokens of logits [R, V] float32: torch.argmax(logits, dim=-1) in one pass a row. Rows may lie further
// apart than V (the first V columns of a model's padded vocabulary).
at::Tensor argmax_rows(at::Tensor logits) {
  TORCH_CHECK(logits.scalar_type() == at::kFloat && logits.dim() == 2 && logits.size(1) > 0 &&
                  logits.size(1) < (1 << 30) && logits.stride(1) == 1 && logits.stride(0) >= logits.size(1),
              "argmax_rows: logits [R, V] float32, each row contiguous");
  const int64_t R = logits.size(0), V = logits.size(1), ld = logits.stride(0);
  at::Tensor tokens = at::empty({R}, at::kLong);
  const float* x = logits.data_ptr<float>();
  int64_t* out = tokens.data_ptr<int64_t>();
  const Kernels& kern = kernels();
  at::parallel_for(0, R, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; r++) out[r] = kern.argmax_row(x + r * ld, (int)V);
  });
  return tokens;
}

// One token per row of logits [R, V] float32: softmax of logits / temperatures[r], top_p[r] by rejection over
// uniforms[r] (in (0, 1], one per round). -1 for a row whose every round was rejected (the caller sorts it).
at::Tensor sample_rows(at::Tensor logits, at::Tensor temperatures, at::Tensor top_p, at::Tensor uniforms) {
  check_f32(logits, "logits");
  check_f32(temperatures, "temperatures");
  check_f32(top_p, "top_p");
  check_f32(uniforms, "uniforms");
  TORCH_CHECK(logits.dim() == 2 && logits.size(1) > 0 && logits.size(1) < (1 << 30), "sample_rows: logits [R, V]");
  const int64_t R = logits.size(0), V = logits.size(1);
  TORCH_CHECK(temperatures.numel() == R && top_p.numel() == R && uniforms.dim() == 2 && uniforms.size(0) == R &&
                  uniforms.size(1) > 0, "sample_rows: temperatures [R], top_p [R], uniforms [R, rounds]");
  const float *x = logits.data_ptr<float>(), *t = temperatures.data_ptr<float>(), *p = top_p.data_ptr<float>();
  const float* u = uniforms.data_ptr<float>();
  const int rounds = (int)uniforms.size(1);
  for (int64_t r = 0; r < R; r++) {
    TORCH_CHECK(t[r] > 0.0f && std::isfinite(t[r]) && p[r] >= 0.0f, "sample_rows: temperature above 0, top_p >= 0");
    for (int k = 0; k < rounds; k++)
      TORCH_CHECK(u[r * rounds + k] > 0.0f && u[r * rounds + k] <= 1.0f, "sample_rows: uniforms in (0, 1]");
  }
  at::Tensor tokens = at::empty({R}, at::kLong);
  int64_t* out = tokens.data_ptr<int64_t>();
  const Kernels& kern = kernels();
  at::parallel_for(0, R, 1, [&](int64_t r0, int64_t r1) {
    std::vector<float> w(V), bsum((V + 255) / 256);
    for (int64_t r = r0; r < r1; r++)
      out[r] = kern.sample_row(x + r * V, (int)V, t[r], p[r], u + r * rounds, rounds, w.data(), bsum.data());
  });
  return tokens;
}

// Attention alone, as the step runs it for decodes: q [T, heads, D] float32; k, v caches in the step's layout,
// [blocks, KVH, block_size, D] (float32 or bfloat16); block_tables [T, max_blocks] int32; lengths [T] int64: token i
// attends to keys 0 .. lengths[i] - 1 of its table. One task per (token, KV head). Returns [T, heads, D].
at::Tensor attention(at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor tables, at::Tensor lengths) {
  check_f32(q, "q");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 4 && k.sizes() == v.sizes() && k.scalar_type() == v.scalar_type() &&
                  k.is_contiguous() && v.is_contiguous(), "attention: q [T, heads, D], k and v [blocks, KVH, bs, D]");
  TORCH_CHECK(k.scalar_type() == at::kFloat || k.scalar_type() == at::kBFloat16, "attention: float32 or bf16 cache");
  const int64_t T = q.size(0), heads = q.size(1), D = q.size(2), KVH = k.size(1), bs = k.size(2);
  TORCH_CHECK(k.size(3) == D && (D == 16 || D == 32 || D == 64 || D == 128 || D == 256) && heads % KVH == 0, "attention: shapes");
  TORCH_CHECK(tables.scalar_type() == at::kInt && tables.is_contiguous() && tables.dim() == 2 && tables.size(0) == T,
              "attention: block_tables [T, max_blocks] int32");
  TORCH_CHECK(lengths.scalar_type() == at::kLong && lengths.numel() == T, "attention: lengths [T] int64");
  const int64_t* len = lengths.data_ptr<int64_t>();
  const int* table = tables.data_ptr<int>();
  int64_t max_len = 1;
  for (int64_t i = 0; i < T; i++) {
    TORCH_CHECK(len[i] >= 1 && len[i] <= tables.size(1) * bs, "attention: length out of range");
    max_len = std::max(max_len, len[i]);
  }
  for (int64_t i = 0; i < tables.numel(); i++)
    TORCH_CHECK(table[i] >= 0 && table[i] < k.size(0), "attention: block id");
  at::Tensor out = at::empty_like(q);
  const Kernels& kern = kernels();
  const int G = (int)(heads / KVH), Lp = (int)((max_len + 15) / 16 * 16);
  const int64_t head_stride = bs * D, block_stride = KVH * bs * D;
  const float scale = 1.0f / std::sqrt((float)D);
  at::parallel_for(0, T * KVH, 1, [&](int64_t w0, int64_t w1) {
    std::vector<float> scores((size_t)MAX_HEADS_PER_PASS * Lp);
    for (int64_t w = w0; w < w1; w++) {
      const int64_t i = w / KVH, kh = w % KVH;
      const float* qh = q.data_ptr<float>() + (i * heads + kh * G) * D;
      float* o = out.data_ptr<float>() + (i * heads + kh * G) * D;
      const int* tab = table + i * tables.size(1);
      if (k.scalar_type() == at::kBFloat16)
        kern.attend_bf16(qh, G, (int)D, (const unsigned short*)k.data_ptr() + kh * head_stride,
                         (const unsigned short*)v.data_ptr() + kh * head_stride, tab, (int)bs, block_stride, 0,
                         (int)len[i], true, scale, scores.data(), o);
      else
        kern.attend_f32(qh, G, (int)D, k.data_ptr<float>() + kh * head_stride, v.data_ptr<float>() + kh * head_stride,
                        tab, (int)bs, block_stride, 0, (int)len[i], true, scale, scores.data(), o);
    }
  });
  return out;
}

#include "native_llama.inc"
#include "pack_blocks.inc"

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  using release = py::call_guard<py::gil_scoped_release>;
  m.def("isa", &isa);
  m.def("set_isa", &set_isa);
  m.def("linear", &linear, py::arg("x"), py::arg("parts"), py::arg("n"), py::arg("is_int8") = false, release());
  m.def("q8_linear", &q8_linear, py::arg("x"), py::arg("qs"), py::arg("scale"), py::arg("n"),
        py::arg("is_int8") = false, release());
  m.def("madd_peak", &madd_peak, py::arg("iterations"), py::arg("is_int8") = false, release());
  m.def("read_stream", &read_stream, release());
  m.def("attention", &attention, release());
  m.def("sample_rows", &sample_rows, release());
  m.def("argmax_rows", &argmax_rows, release());
  // each releases the GIL itself, once it has the blocks' buffer
  m.def("pack_q4_k", &pack_q4_k);
  m.def("pack_q4_legacy", &pack_q4_legacy);
  m.def("pack_q6_k", &pack_q6_k);
  m.def("pack_q8_0", &pack_q8_0);
  py::class_<NativeLlama>(m, "NativeLlama")
      .def(py::init<int64_t, int64_t, int64_t, int64_t, int64_t, double, int64_t, at::Tensor, at::Tensor, at::Tensor,
                    at::Tensor, at::Tensor, at::Tensor, at::Tensor>())
      .def("add_layer", &NativeLlama::add_layer)
      .def("set_model_options", &NativeLlama::set_model_options)
      .def("set_precision", &NativeLlama::set_precision)
      .def("set_layer_options", &NativeLlama::set_layer_options)
      .def("set_kv_caches", &NativeLlama::set_kv_caches)
      .def("forward", &NativeLlama::forward, release())
      .def("logits", &NativeLlama::logits, release());
}
