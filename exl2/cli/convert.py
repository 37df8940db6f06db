"""`exl2 convert`: quantize a Hugging Face model to EXL2 at a target bitrate (exllamav2's convert.py flags)."""
from __future__ import annotations


def register(sub) -> None:
    p = sub.add_parser(
        "convert", help="quantize a Hugging Face model to EXL2",
        description="Quantize a Hugging Face model directory to EXL2 at a target average bitrate. The job is "
                    "resumable: run the same command again after an interruption to continue.")
    p.add_argument("-i", "--in_dir", required=True, help="source model directory (config.json, tokenizer, safetensors)")
    p.add_argument("-o", "--out_dir", required=True, help="working directory (and output directory without -cf)")
    p.add_argument("-cf", "--compile_full", default=None,
                   help="write a complete model directory here (weights, tokenizer and config files)")
    p.add_argument("-b", "--bits", type=float, default=4.125, help="target average bits per weight (default 4.125)")
    p.add_argument("-hb", "--head_bits", type=int, default=6, choices=[2, 3, 4, 5, 6, 8],
                   help="bits for the output layer lm_head (default 6)")
    p.add_argument("-c", "--cal_dataset", default=None,
                   help="calibration data: .parquet (text column), .jsonl or .txt (default: built-in mix)")
    p.add_argument("-r", "--dataset_rows", dest="rows", type=int, default=None,
                   help="calibration rows for the quantization pass (default 100 with -c, 115 built-in)")
    p.add_argument("-mr", "--measurement_rows", type=int, default=None,
                   help="calibration rows for the measurement pass (default 16 with -c, 19 built-in)")
    p.add_argument("-l", "--length", type=int, default=2048, help="tokens per row, quantization pass (default 2048)")
    p.add_argument("-ml", "--measurement_length", type=int, default=2048,
                   help="tokens per row, measurement pass (default 2048)")
    p.add_argument("-m", "--measurement", default=None,
                   help="reuse this measurement.json (ours or exllamav2's) and skip the measurement pass")
    p.add_argument("-om", "--output_measurement", default=None,
                   help="only measure: write measurement.json here (a file or a directory) and stop")
    p.add_argument("-ss", "--shard_size", type=int, default=8192, help="max shard size in MB, 0 = unlimited (default 8192)")
    p.add_argument("-nr", "--no_resume", action="store_true", help="start over: delete this job's files in -o first")
    p.add_argument("-res", "--resume", action="store_true", help="resume (the default whenever -o holds a job)")
    p.add_argument("-fst", "--fast_safetensors", action="store_true", help=argparse_suppress())
    p.add_argument("--device", default=None, choices=["cpu", "cuda"], help="where to run (default: cuda if available)")
    p.add_argument("--seed", type=int, default=0, help="seed for the built-in calibration set and sampling (default 0)")
    p.add_argument("-rs", "--rope_scale", type=float, default=None,
                   help="linear RoPE scaling for the calibration forwards (the output keeps config.json's)")
    p.add_argument("-ra", "--rope_alpha", type=float, default=None,
                   help="NTK RoPE alpha for the calibration forwards (the output keeps config.json's)")
    p.add_argument("-so", "--status_output", action="store_true",
                   help="progress as JSON lines on stdout (stage, done, total; messages, warnings), no bars")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bars or messages")
    p.set_defaults(func=run)


def argparse_suppress():
    import argparse

    return argparse.SUPPRESS


def run(args) -> int:
    from exl2.quantize.pipeline import ConvertSettings, convert
    from exl2.quantize.progress import Reporter, StatusReporter

    settings = ConvertSettings(
        in_dir=args.in_dir, out_dir=args.out_dir, compile_full=args.compile_full, bits=args.bits,
        head_bits=args.head_bits, cal_dataset=args.cal_dataset, rows=args.rows, length=args.length,
        measurement_rows=args.measurement_rows, measurement_length=args.measurement_length,
        measurement=args.measurement, output_measurement=args.output_measurement, shard_size=args.shard_size,
        no_resume=args.no_resume, device=args.device, seed=args.seed, rope_scale=args.rope_scale,
        rope_alpha=args.rope_alpha)
    ui = StatusReporter() if args.status_output else Reporter(quiet=args.quiet)
    if not 2.0 <= args.bits <= 8.0:
        ui.warn(f"-b {args.bits} is outside the useful range of 2 to 8 bits per weight")
    try:
        summary = convert(settings, ui)
    except OSError as e:
        from exl2.errors import Exl2Error

        where = f" ({e.filename})" if getattr(e, "filename", None) else ""
        raise Exl2Error(f"A file could not be read or written{where}: {e.strerror or e}.") from None
    ui.info(f"done in {summary['seconds']:.1f} s")
    return 0
