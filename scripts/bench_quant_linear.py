"""The quantized linear layers' kernels by row count: PyTorch's weight-only kernels against
this project's heterospec_cpu.quant_linear in each of its regimes (runtime/models/quant_linear.py:
default_many_rows picks where its bf16 GEMM takes over), against the bf16 matmul the layers
would run unquantized.

One pass = every linear layer of the model once, in the model's order, on inputs of M rows
(so weights come from memory as in a real step, not from cache). Per M and path, the median
pass of --repeats, the paths interleaved within each repeat:
  - pytorch: aten._weight_int4pack_mm_for_cpu / _weight_int8pack_mm (the model loaded a
    second time with this project's kernel switched off);
  - int8 dots: quant_linear's few-rows regime at every row count (int8 activations; AVX-512 VNNI or AVX2);
  - bf16 gemm: quant_linear's many-rows regime at every row count (tiles dequantized to bf16);
  - default: what the layers run on this CPU;
  - bf16: the same weights dequantized to bf16, oneDNN-prepacked where the CPU allows (what
    --quantization none runs where the CPU has bf16 math);
  - float32: the same weights dequantized to float32, on float32 inputs (what --dtype float32
    runs, and --dtype auto on CPUs with neither bf16 math nor the kernel's vector code).

    python -m scripts.bench_quant_linear                      # the default model
    python -m scripts.bench_quant_linear --model models/qwen2.5-coder-1.5b-instruct.gguf
"""
from __future__ import annotations

import argparse
import statistics
import time
from unittest import mock

import torch

from runtime.models import quant_linear
from runtime.models.loader import load_model
from runtime.models.quant_linear import NO_GEMM, QuantizedLinear, default_many_rows, float_linear, linear_kernels
from scripts.harness import Report, add_results_args, fmt, log

PATHS = ("pytorch", "int8 dots", "bf16 gemm", "default", "bf16", "float32")
MANY_ROWS = {"int8 dots": NO_GEMM, "bf16 gemm": 0}


def quantized_layers(model) -> list[QuantizedLinear]:
    return [m for m in model.modules() if isinstance(m, QuantizedLinear)]


def run_pass(layers, inputs, path: str, other_layers) -> float:
    """Seconds for every layer once on its input of M rows."""
    start = time.perf_counter()
    for i, layer in enumerate(layers):
        x = inputs[layer.in_features]
        if path in other_layers:
            other_layers[path][i](x)
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
    default_rows = [layer.many_rows for layer in layers]
    if set(default_rows) == {None}:
        raise SystemExit("no layer runs heterospec_cpu.quant_linear here (the kernel did not build, or no bf16 "
                         "int4/int8 layers)")
    with mock.patch.object(quant_linear, "has_vector_kernel", lambda: False):
        pytorch_model = load_model(args.model, "bfloat16", torch.device("cpu"), "auto")[0]
    log(f"{len(layers)} quantized layers; dequantizing to bf16 for the bf16 path ...")
    with torch.inference_mode():
        other_layers = {"pytorch": quantized_layers(pytorch_model),
                        "bf16": [float_linear(layer.dequantize().to(torch.bfloat16), None) for layer in layers],
                        "float32": [float_linear(layer.dequantize().float(), None) for layer in layers]}

    def with_path(path: str) -> None:
        for layer, rows in zip(layers, default_rows):
            if rows is not None:
                layer.many_rows = MANY_ROWS.get(path, rows)

    report = Report(args.name, "bench_quant_linear: quantized linear kernels by row count", "scripts.bench_quant_linear",
                    argv, args)
    report.line(f"model {args.model}, bf16 activations (float32 for the float32 path); layers: "
                f"{linear_kernels(model)}")
    rows_default = default_many_rows()
    report.line(f"one pass = all {len(layers)} quantized linear layers once, in order; median of {args.repeats} "
                f"interleaved passes; {torch.get_num_threads()} threads; default: the bf16 GEMM above "
                + ("no row count (no AMX)" if rows_default >= NO_GEMM else f"{rows_default} rows"))
    report.line()
    table, data = [], {}
    with torch.inference_mode():
        for m in rows:
            bf16 = {k: torch.randn(m, k, dtype=torch.bfloat16) for k in {layer.in_features for layer in layers}}
            inputs = {p: {k: x.float() for k, x in bf16.items()} if p == "float32" else bf16 for p in PATHS}
            times = {p: [] for p in PATHS}
            for p in PATHS:  # warm-up
                with_path(p)
                run_pass(layers, inputs[p], p, other_layers)
            for _ in range(args.repeats):
                for p in PATHS:
                    with_path(p)
                    times[p].append(run_pass(layers, inputs[p], p, other_layers))
            ms = {p: statistics.median(t) * 1e3 for p, t in times.items()}
            data[m] = ms
            table.append([m, *(fmt(ms[p], ".2f") for p in PATHS), f"{ms['pytorch'] / ms['default']:.2f}x",
                          f"{ms['bf16'] / ms['default']:.2f}x", f"{ms['float32'] / ms['default']:.2f}x",
                          f"{min(ms['int8 dots'], ms['bf16 gemm']) / ms['default']:.2f}"])
            log(f"M={m}: " + ", ".join(f"{p} {v:.2f} ms" for p, v in ms.items()))
        with_path("default")
    report.table(["rows M", *(f"{p} ms" for p in PATHS), "default speed-up over pytorch",
                  "default speed-up over bf16", "default speed-up over float32", "best regime / default"], table)
    report.data = {"rows": data, "default_many_rows": rows_default, "model": args.model}
    report.write()


if __name__ == "__main__":
    main()
