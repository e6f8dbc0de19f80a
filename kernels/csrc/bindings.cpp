#include "decoder_stack.h"
#include "ops.h"

// The kernels release the GIL: the worker's event loop (gRPC streams, KV transfers) keeps
// running while the engine thread computes.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, py::arg("q"), py::arg("kv"), py::arg("block_tables"),
        py::arg("context_lens"), py::arg("scale"), py::arg("kv_format"), py::arg("num_kv_heads"), py::arg("path") = -1,
        py::call_guard<py::gil_scoped_release>(), "paged decode attention (CPU)");
  m.def("attention_paths", &attention_paths, "paged_decode_attention's paths compiled in: 0 portable, 1 AVX2, 2 AVX-512");
  m.def("pack_weights", &pack_weights, py::call_guard<py::gil_scoped_release>(), "pack quantized weights into the quant_linear layout");
  m.def("quant_linear", &quant_linear, py::call_guard<py::gil_scoped_release>(), "x @ W^T + bias with int8/int4 packed weights");
  m.def("has_prefill_attention", &has_prefill_attention, "whether prefill_attention serves this head_dim here");
  m.def("prefill_attention", &prefill_attention, py::call_guard<py::gil_scoped_release>(), "causal prefill attention");
  m.def("quant_paths", &quant_paths, "quant_linear's paths compiled in: 0 portable, 1 AVX2, 2 AVX512-VNNI");
  m.def("dense_dtypes", &dense_dtypes, "dense_linear's weight dtypes compiled in here");
  m.def("dense_bf16_widened", &dense_bf16_widened, "whether bf16 weights are widened to fp32 (no bf16 products here)");
  m.def("pack_dense", &pack_dense, py::call_guard<py::gil_scoped_release>(), "pack a bf16 or fp32 weight for dense_linear");
  m.def("unpack_dense", &unpack_dense, py::call_guard<py::gil_scoped_release>(), "the weight pack_dense packed");
  m.def("dense_linear", &dense_linear, py::call_guard<py::gil_scoped_release>(), "x @ W^T + bias, bf16 or fp32, few rows");
  m.def("rms_norm", &rms_norm, py::call_guard<py::gil_scoped_release>(), "RMSNorm");
  m.def("add_rms_norm", &add_rms_norm, py::call_guard<py::gil_scoped_release>(), "residual += x, then RMSNorm of the residual");
  m.def("silu_mul", &silu_mul, py::call_guard<py::gil_scoped_release>(), "silu(gate) * up");
  m.def("copy_rows_hashed", &copy_rows_hashed, py::arg("src"), py::arg("src_slots"), py::arg("dst") = py::none(),
        py::arg("dst_slots") = py::none(), py::arg("stream") = false, py::call_guard<py::gil_scoped_release>(),
        "XXH64 of each 1 KiB chunk of token rows, copied into other rows on the way");
  m.def("race_noise_", &race_noise_, py::call_guard<py::gil_scoped_release>(), "seeded sampling's Exponential(1) noise, keyed per row");
  m.def("rope_write_kv", &rope_write_kv, py::call_guard<py::gil_scoped_release>(), "RoPE on q and k in place, then k and v into the cache");

  using Stack = DecoderStack;
  py::class_<Stack::Linear>(m, "StackLinear")
      .def_static("quantized", &Stack::Linear::quantized)
      .def_static("packed", &Stack::Linear::packed_dense)
      .def_static("dense", &Stack::Linear::dense);
  py::class_<Stack::Layer>(m, "StackLayer")
      .def(py::init<torch::Tensor, Stack::Linear, Stack::Linear, torch::Tensor, Stack::Linear, Stack::Linear>());
  py::class_<Stack>(m, "DecoderStack")
      .def(py::init<std::vector<Stack::Layer>, torch::Tensor, double, torch::Tensor, torch::Tensor, int64_t, int64_t,
                    int64_t, int64_t>())
      .def("forward", &Stack::forward, py::call_guard<py::gil_scoped_release>());
}
