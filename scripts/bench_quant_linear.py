"""The quantized linear layers' kernels by row count: where PyTorch's weight-only kernels
stop paying and heterospec_cpu.dequant_gemm takes over (runtime/models/quant_linear.py's
MANY_ROWS), against the bf16 matmul the layers would run unquantized.

One pass = every linear layer of the model once, in the model's order, on inputs of M rows
(so weights come from memory as in a real step, not from cache). Per M and path, the median
pass of --repeats, the paths interleaved within each repeat:
  - pytorch: aten._weight_int4pack_mm_for_cpu / _weight_int8pack_mm at every row count;
  - dequant_gemm: this project's kernel at every row count;
  - default: what the layers run (PyTorch's up to MANY_ROWS rows, dequant_gemm above);
  - bf16: the same weights dequantized to bf16, oneDNN-prepacked where the CPU allows (what
    --quantization none runs).

    python -m scripts.bench_quant_linear                      # the default model
    python -m scripts.bench_quant_linear --model models/qwen2.5-coder-1.5b-instruct.gguf
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from runtime.models.loader import load_model
from runtime.models.quant_linear import MANY_ROWS, QuantizedLinear, float_linear, linear_kernels
from scripts.harness import Report, add_results_args, fmt, log

PATHS = ("pytorch", "dequant_gemm", "default", "bf16")


def quantized_layers(model) -> list[QuantizedLinear]:
    return [m for m in model.modules() if isinstance(m, QuantizedLinear)]


def run_pass(layers, inputs, path: str, bf16_layers) -> float:
    """Seconds for every layer once on its input of M rows."""
    start = time.perf_counter()
    for i, layer in enumerate(layers):
        x = inputs[layer.in_features]
        if path == "bf16":
            bf16_layers[i](x)
        else:
            layer(x)
    return time.perf_counter() - start


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--rows", default="1,8,16,24,32,64,128,512", help="row counts M (comma-separated)")
    parser.add_argument("--repeats", type=int, default=7)
    add_results_args(parser, "bench_quant_linear")
    args = parser.parse_args(argv)
    rows = [int(r) for r in args.rows.split(",")]

    model = load_model(args.model, "bfloat16", torch.device("cpu"), "auto")[0]
    layers = quantized_layers(model)
    default_rows = {layer.many_rows for layer in layers}
    if default_rows == {None}:
        raise SystemExit("no layer runs dequant_gemm here (the kernel did not build, or no bf16 int4/int8 layers)")
    log(f"{len(layers)} quantized layers; dequantizing to bf16 for the bf16 path ...")
    with torch.inference_mode():
        bf16_layers = [float_linear(layer.dequantize().to(torch.bfloat16), None) for layer in layers]

    def with_path(path: str) -> None:
        for layer in layers:
            if layer.many_rows is not None or path != "default":
                layer.many_rows = {"pytorch": None, "dequant_gemm": 0, "default": MANY_ROWS}.get(path)

    report = Report(args.name, "bench_quant_linear: quantized linear kernels by row count", "scripts.bench_quant_linear",
                    argv, args)
    report.line(f"model {args.model}, bf16 activations; layers: {linear_kernels(model)}")
    report.line(f"one pass = all {len(layers)} quantized linear layers once, in order; median of {args.repeats} "
                f"interleaved passes; {torch.get_num_threads()} threads; MANY_ROWS = {MANY_ROWS}")
    report.line()
    table, data = [], {}
    with torch.inference_mode():
        for m in rows:
            inputs = {k: torch.randn(m, k, dtype=torch.bfloat16) for k in {layer.in_features for layer in layers}}
            times = {p: [] for p in PATHS}
            for p in PATHS:  # warm-up
                with_path(p)
                run_pass(layers, inputs, p, bf16_layers)
            for _ in range(args.repeats):
                for p in PATHS:
                    with_path(p)
                    times[p].append(run_pass(layers, inputs, p, bf16_layers))
            ms = {p: statistics.median(t) * 1e3 for p, t in times.items()}
            data[m] = ms
            best = min(ms["pytorch"], ms["dequant_gemm"])
            table.append([m, fmt(ms["pytorch"], ".2f"), fmt(ms["dequant_gemm"], ".2f"), fmt(ms["default"], ".2f"),
                          fmt(ms["bf16"], ".2f"), f"{ms['pytorch'] / ms['default']:.2f}x",
                          f"{ms['bf16'] / ms['default']:.2f}x", f"{best / ms['default']:.2f}"])
            log(f"M={m}: " + ", ".join(f"{p} {v:.2f} ms" for p, v in ms.items()))
        with_path("default")
    report.table(["rows M", "pytorch ms", "dequant_gemm ms", "default ms", "bf16 ms", "default speed-up over pytorch",
                  "default speed-up over bf16", "best / default"], table)
    report.data = {"rows": data, "many_rows": MANY_ROWS, "model": args.model}
    report.write()


if __name__ == "__main__":
    main()
