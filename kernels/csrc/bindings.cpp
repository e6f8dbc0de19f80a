#include "ops.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "paged decode attention (CPU)");
  m.def("pack_weights", &pack_weights, "pack quantized weights into the quant_linear layout");
  m.def("quant_linear", &quant_linear, "x @ W^T with int8/int4 packed weights");
  m.def("has_vnni", &has_vnni, "whether the AVX512-VNNI path is compiled in");
  m.def("rms_norm", &rms_norm, "RMSNorm");
  m.def("add_rms_norm", &add_rms_norm, "residual += x, then RMSNorm of the residual");
  m.def("silu_mul", &silu_mul, "silu(gate) * up");
  m.def("rope_write_kv", &rope_write_kv, "RoPE on q and k in place, then k and v into the cache");
}
