"""How fast can a decode step's attention read its KV cache here? Paged decode attention against
a bare read of the very same blocks in the same order (one integer add per 8 bytes),
and against the contiguous read the roofline takes as this machine's bandwidth.

    python bench/attention_read_probe.py --repeats 9

The cache is the roofline's (the default model's geometry, batch 32 x context 400 in shuffled
blocks on 2 MB pages). Each block is one contiguous run of block_size tokens (all heads' K and
V), so the read walks runs of a few tens of KB in random order; the hardware prefetchers start
over at each run. The bare read is compiled here from the C++ below (a compiler is needed, as
for the kernels), with and without software prefetches of the token one block ahead. All three
figures come from one process, measured in turn, round after round.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
from torch.utils.cpp_extension import load_inline

from pdserve.bench.engine_bench import dtype_name, make_engine
from pdserve.bench.roofline import attention_inputs, attention_step, memory_bandwidth, timed
from pdserve.engine.engine_config import EngineConfig

READ_SOURCE = r"""
#include <ATen/Parallel.h>

// Reads every byte of each sequence's tokens in block-table order, the sequences split over the
// threads as equal runs (the kernel splits by tokens, the same split for equal lengths);
// `ahead` > 0 prefetches (into L2) the token that many positions later.
double read_blocks(torch::Tensor kv, torch::Tensor tables, torch::Tensor lens, int64_t ahead) {
  auto t = tables.to(torch::kInt64).contiguous();
  auto l = lens.to(torch::kInt64).contiguous();
  const int64_t batch = t.size(0), max_blocks = t.size(1), block_size = kv.size(1);
  const int64_t token_bytes = kv.numel() * kv.element_size() / (kv.size(0) * block_size);
  const uint8_t* base = static_cast<const uint8_t*>(kv.data_ptr());
  std::vector<uint64_t> sums(batch);
  auto token = [&](const int64_t* table, int64_t i) {
    return base + (table[i / block_size] * block_size + i % block_size) * token_bytes;
  };
  at::parallel_for(0, batch, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n = l.data_ptr<int64_t>()[b];
      const int64_t* table = t.data_ptr<int64_t>() + b * max_blocks;
      uint64_t acc = 0;  // integer adds: the compiler vectorizes them, as it may not reorder float ones
      for (int64_t i = 0; i < n; ++i) {
        if (ahead > 0 && i + ahead < n) {
          const uint8_t* later = token(table, i + ahead);
          for (int64_t o = 0; o < token_bytes; o += 64) __builtin_prefetch(later + o, 0, 2);
        }
        const uint64_t* words = reinterpret_cast<const uint64_t*>(token(table, i));
        for (int64_t w = 0; w < token_bytes / 8; ++w) acc += words[w];
      }
      sums[b] = acc;
    }
  });
  uint64_t total = 0;
  for (uint64_t s : sums) total += s;
  return static_cast<double>(total);
}
"""


def build_reader():
    """The bare read, compiled once into torch's extension cache."""
    return load_inline(
        "pdserve_attention_read_probe",
        cpp_sources=[READ_SOURCE],
        functions=["read_blocks"],
        extra_cflags=["-O3", "-march=native", "-fopenmp"],
        extra_ldflags=["-fopenmp"],
    )


def run(args: argparse.Namespace) -> dict:
    reader = build_reader()
    engine = make_engine(args.dtype, args.threads, **({"block_size": args.block_size} if args.block_size else {}))
    inputs = attention_inputs(engine)
    block_size = engine.kv_layout.block_size

    def read(ahead: int):
        return lambda: [reader.read_blocks(kv, inputs.block_tables, inputs.context_lens, ahead) for kv in inputs.caches]

    methods = {"attention": attention_step(engine, inputs), "read": read(0), "read_prefetched": read(block_size)}
    for fn in methods.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in methods}
    bandwidths = []
    for _ in range(args.repeats):
        for name, fn in methods.items():
            times[name].append(timed(fn))
        bandwidths.append(memory_bandwidth())
    gb_s = {name: inputs.kv_bytes / statistics.median(t) / 1e9 for name, t in times.items()}
    contiguous = statistics.median(bandwidths) / 1e9
    return {
        "bench": "attention_read_probe",
        "dtype": dtype_name(engine),
        "threads": torch.get_num_threads(),
        "block_size": block_size,
        "kv_mb": round(inputs.kv_bytes / 1e6, 1),
        "contiguous_read_gb_s": round(contiguous, 1),
        **{f"{name}_gb_s": round(value, 1) for name, value in gb_s.items()},
        "attention_fraction_of_contiguous": round(gb_s["attention"] / contiguous, 3),
        "attention_fraction_of_read": round(gb_s["attention"] / max(gb_s["read"], gb_s["read_prefetched"]), 3),
        "read_fraction_of_contiguous": round(max(gb_s["read"], gb_s["read_prefetched"]) / contiguous, 3),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--block-size", type=int, default=None, help="KV cache block size (default: the engine's)")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    if args.block_size is not None:
        try:
            EngineConfig(block_size=args.block_size)
        except ValueError as e:
            parser.error(f"--block-size: {e}")
    print(json.dumps(run(args), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
