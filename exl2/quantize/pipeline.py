"""`exl2 convert`: the whole conversion as resumable stages (spec EXL2.md §3.1).

begin → initial_embeddings → sensitivity → measure_quant → optimize → tokens_cal → embeddings → quant → compile →
finished (with -om: the measurement is written and the job stops before optimize). The job file records the stage; within the long stages the hidden states are
saved together with the results so far, so an interrupted run continues from the last saved block. A finished -om
job continues with the quantization when run again without -om.
"""
from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import torch

from exl2.errors import ConfigError, ModelLoadError
from exl2.formats.writer import atomic_write_text
from exl2.models.registry import read_config, spec_from_config
from exl2.models.rope import RopeOverride
from exl2.quantize import job as J
from exl2.quantize.blocks import SourceModel, Slot, advances, slots as model_slots
from exl2.quantize.calibration import builtin_calibration, random_rows, user_calibration
from exl2.quantize.compile import compile_model
from exl2.quantize.measure import measure_slot
from exl2.quantize.optimize import choose_strategy
from exl2.quantize.progress import Reporter
from exl2.quantize.qparams import QPARAMS_HEAD, table
from exl2.quantize.quantize import calibration_perplexity, quantize_head, quantize_slot
from exl2.quantize.sensitivity import rows_for, sensitivity_pass

BUILTIN_ROWS, BUILTIN_MEASURE_ROWS = 115, 19      # exllamav2's built-in set sizes
FILE_ROWS, FILE_MEASURE_ROWS = 100, 16            # exllamav2's -r / -mr defaults for -c data
STATE_SAVE_BYTES = 512 * 2 ** 20                  # states larger than this are saved at most every SAVE_SECONDS
SAVE_SECONDS = 120.0
PARALLEL = ".parallel_decoder"                     # exllamav2's measurement key suffix of a parallel layer

# Settings that invalidate a measurement when changed, and those that only invalidate the quant pass/compile.
_MEASURE_KEYS = ("in_dir", "cal_dataset", "measurement_rows", "measurement_length", "measurement", "seed",
                 "rope_scale", "rope_alpha")
_QUANT_KEYS = ("bits", "head_bits", "rows", "length")
_COMPILE_KEYS = ("compile_full", "shard_size")


@dataclass
class ConvertSettings:
    """The flags of `exl2 convert` (exllamav2's names and defaults)."""

    in_dir: str
    out_dir: str
    compile_full: Optional[str] = None
    bits: float = 4.125
    head_bits: int = 6
    cal_dataset: Optional[str] = None
    rows: Optional[int] = None
    length: int = 2048
    measurement_rows: Optional[int] = None
    measurement_length: int = 2048
    measurement: Optional[str] = None
    output_measurement: Optional[str] = None
    shard_size: int = 8192
    no_resume: bool = False
    device: Optional[str] = None
    seed: int = 0
    tokens_per_batch: Optional[int] = None
    objective: str = "auto"
    # RoPE of the calibration forwards (exllamav2's -rs/-ra; the output's config.json keeps the model's own)
    rope_scale: Optional[float] = None
    rope_alpha: Optional[float] = None

    def job_settings(self) -> dict:
        d = asdict(self)
        for k in ("no_resume", "device", "tokens_per_batch", "out_dir"):
            d.pop(k)
        return d


def _resolve(p: Optional[str]) -> Optional[str]:
    return str(Path(p).expanduser().resolve()) if p else None


def validate(s: ConvertSettings) -> ConvertSettings:
    """Check flags and normalise paths; raises ConfigError with one sentence."""
    if s.head_bits not in QPARAMS_HEAD:
        raise ConfigError(f"-hb must be one of 2, 3, 4, 5, 6, 8, not {s.head_bits}.")
    if not 1.0 <= s.bits <= 16.0:
        raise ConfigError(f"-b must be a bitrate between 2 and 8, not {s.bits}.")
    for flag, v in (("-r", s.rows), ("-mr", s.measurement_rows)):
        if v is not None and v < 1:
            raise ConfigError(f"{flag} must be at least 1.")
    for flag, v in (("-l", s.length), ("-ml", s.measurement_length)):
        if v < 2:
            raise ConfigError(f"{flag} must be at least 2 tokens.")
    if s.shard_size < 0:
        raise ConfigError("-ss must be 0 (unlimited) or a positive number of megabytes.")
    if s.output_measurement and s.compile_full:
        raise ConfigError("-om (measure only) and -cf (compile a model) cannot be combined.")
    if s.output_measurement and s.measurement:
        raise ConfigError("-om (measure only) and -m (reuse a measurement) cannot be combined.")
    if not Path(s.in_dir).is_dir() or not (Path(s.in_dir) / "config.json").is_file():
        raise ModelLoadError(f"The source model directory {s.in_dir} does not exist or has no config.json.")
    if s.compile_full and Path(s.compile_full).resolve() == Path(s.in_dir).resolve():
        raise ConfigError("-cf must not be the source directory: the source files would be overwritten.")
    if s.cal_dataset and not Path(s.cal_dataset).is_file():
        raise ConfigError(f"The calibration file {s.cal_dataset} does not exist.")
    if s.measurement and not Path(s.measurement).is_file():
        raise ConfigError(f"The measurement file {s.measurement} does not exist.")
    s.in_dir, s.out_dir = _resolve(s.in_dir), _resolve(s.out_dir)
    s.compile_full, s.cal_dataset = _resolve(s.compile_full), _resolve(s.cal_dataset)
    s.measurement, s.output_measurement = _resolve(s.measurement), _resolve(s.output_measurement)
    return s


def check_input_widths(spec) -> None:
    """EXL2 packs each matrix's input rows in groups of 32 (the format and exllamav2's kernels need it): a model
    with a projection whose input width is not a multiple of 32 is refused before any work."""
    widths = {"hidden_size": spec.hidden_size, "intermediate_size": spec.intermediate_size}
    if spec.mla is not None:
        widths.update(kv_lora_rank=spec.mla.kv_lora_rank, attention_output=spec.num_heads * spec.mla.v_head_dim)
        if spec.mla.q_lora_rank:
            widths["q_lora_rank"] = spec.mla.q_lora_rank
    else:
        widths["attention_output"] = spec.num_heads * spec.head_dim
    if spec.moe is not None:
        widths.update(moe_intermediate_size=spec.moe.expert_dim, shared_expert_intermediate_size=spec.moe.shared_dim)
    widths.update({f"layer {i} intermediate_size": layer.dense_dim for i, layer in enumerate(spec.layers)
                   if layer.dense_dim})
    bad = next(((name, w) for name, w in widths.items() if w and w % 32), None)
    if bad is not None:
        raise ConfigError(f"{spec.arch} cannot be converted to EXL2: its {bad[0]} is {bad[1]}, and EXL2 needs every "
                          "projection's input width to be a multiple of 32.")


def read_measurement(path: Path | str) -> dict:
    """The `measurement` dict of a measurement.json written by exllamav2 or by us."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        raise ConfigError(f"{path} is not a readable measurement.json.") from None
    m = data.get("measurement") if isinstance(data, dict) else None
    if not isinstance(m, dict):
        raise ConfigError(f"{path} has no \"measurement\" object; it is not a measurement.json.")
    out = {}
    for key, entry in m.items():   # exllamav2's parallel layers (Cohere): one entry holding both blocks
        if key.endswith(PARALLEL) and isinstance(entry, dict):
            layer = key[: -len(PARALLEL)]
            out[layer + ".self_attn"], out[layer + ".mlp"] = entry.get("attn"), entry.get("mlp")
        else:
            out[key] = entry
    return out


def measurement_json(measurement: dict, slots: list[Slot], parallel: bool = False) -> dict:
    """exllamav2's file layout: block entries (a parallel layer's two in one `parallel_decoder` entry, as exllamav2
    measures it), then the unmeasured norm/head, and the index of the last module."""
    if parallel:
        out = {f"model.layers.{a.layer}{PARALLEL}": {"attn": measurement[a.key], "mlp": measurement[m.key]}
               for a, m in zip(slots[::2], slots[1::2])}
    else:
        out = {s.key: measurement[s.key] for s in slots}
    out["model.norm.norm"] = None
    out["lm_head.linear"] = None
    return {"measurement": out, "last_module_idx": len(out)}


def decoder_numel(model: SourceModel, slots: list[Slot]) -> int:
    """Parameter count of the 2·L decoder blocks (projections with outputs padded to 32, plus their norms) (§3.7)."""
    src, spec = model.src, model.spec
    total = 0
    after_attn, before_mlp, after_mlp = spec.sandwich_names
    for s in slots:
        p = f"model.layers.{s.layer}."
        if s.kind == "attn":
            prefixes = [p + "self_attn.", p + "input_layernorm."]
            if spec.sandwich_norm:
                prefixes.append(p + after_attn + ".")
        else:
            norms = [before_mlp, after_mlp] if spec.sandwich_norm else ["post_attention_layernorm"]
            prefixes = [p + spec.mlp_key + "."] + [p + n + "." for n in norms if n]
        for name in src.keys():
            if name.startswith(tuple(prefixes)):
                shape = src.shape(name)
                if len(shape) == 2 and name.endswith(".weight") and "norm" not in name.rsplit(".", 2)[-2]:
                    total += -(-shape[0] // 32) * 32 * shape[1]
                else:
                    n = 1
                    for d in shape:
                        n *= d
                    total += n
    return total


class Converter:
    """Runs (or resumes) one conversion job."""

    def __init__(self, settings: ConvertSettings, reporter: Optional[Reporter] = None):
        self.s = validate(settings)
        self.ui = reporter or Reporter()
        self.work = Path(self.s.out_dir)
        dev = self.s.device or ("cuda" if torch.cuda.is_available() else "cpu")
        if dev.startswith("cuda") and not torch.cuda.is_available():
            raise ConfigError("--device cuda was requested but no CUDA GPU is available.")
        self.device = torch.device(dev)
        self.dtype = torch.float32
        self.tpb = self.s.tokens_per_batch or (16384 if self.device.type == "cuda" else 8192)
        cfg = read_config(self.s.in_dir)
        self.spec = spec_from_config(cfg, RopeOverride(self.s.rope_scale, self.s.rope_alpha))
        check_input_widths(self.spec)
        self.model = SourceModel(self.s.in_dir, self.spec, self.device, self.dtype)
        self.slots = model_slots(self.spec)
        self._tokenizer = None
        self._last_save = 0.0

    # -- plumbing ------------------------------------------------------------------------------------------------

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from exl2.generation.tokenizer import Tokenizer
            self._tokenizer = Tokenizer.from_dir(self.s.in_dir)
        return self._tokenizer

    def _open_job(self) -> J.Job:
        if self.s.no_resume:
            J.clear_work_dir(self.work)
        job = J.Job.load(self.work)
        new = self.s.job_settings()
        if job is None:
            job = J.Job.new(self.work, new)
            job.save()
            return job
        old = job.data["settings"]
        changed = [k for k in new if old.get(k) != new[k]]
        if any(k in _MEASURE_KEYS for k in changed):
            k = next(k for k in changed if k in _MEASURE_KEYS)
            raise ConfigError(f"The working directory {self.work} holds a job with a different {k} "
                              f"({old.get(k)!r}); pass -nr to start over or choose another -o.")
        stage = J.STAGES.index(job.progress)
        measured = "measurement" in job.data
        if measured and self.s.output_measurement:
            pass                                       # run() only writes the file; the job stays where it is
        elif measured and job.progress == "finished" and "strategy" not in job.data:
            job.data["progress"] = "optimize"          # an -om job, now asked for the whole conversion
        elif any(k in _QUANT_KEYS for k in changed) and stage > J.STAGES.index("optimize"):
            self.ui.info("settings changed: reusing the measurement, redoing the quantization")
            job.data["progress"] = "optimize"
        elif any(k in _COMPILE_KEYS for k in changed) and stage > J.STAGES.index("compile"):
            job.data["progress"] = "compile"
        if job.progress != "begin":
            self.ui.info(f"resuming job in {self.work} at stage {job.progress}")
        job.data["settings"] = new
        job.save()
        return job

    def _calibration(self, rows: Optional[int], length: int, measure: bool) -> tuple[torch.Tensor, str]:
        vocab = min(self.spec.vocab_size, self.tokenizer.vocab_size or self.spec.vocab_size)
        if self.s.cal_dataset:
            n = rows or (FILE_MEASURE_ROWS if measure else FILE_ROWS)
            cal, warning = user_calibration(self.s.cal_dataset, self.tokenizer, n, length)
            if warning:
                self.ui.warn(warning)
        else:
            n = rows or (BUILTIN_MEASURE_ROWS if measure else BUILTIN_ROWS)
            cal = builtin_calibration(self.tokenizer, n, length, vocab, self.s.seed + (1 if measure else 0))
        if length > 2048 and not measure:
            self.ui.warn(f"-l {length} is longer than 2048 tokens; this needs a lot of memory")
        return cal.ids, cal.dataset

    def _save_states(self, states: torch.Tensor, stage: str, next_slot: int, results: dict, force: bool) -> None:
        big = states.numel() * states.element_size() > STATE_SAVE_BYTES
        if big and not force and time.monotonic() - self._last_save < SAVE_SECONDS:
            return
        J.save_tensors(self.work / J.STATES_FILE, {"states": states},
                       {"stage": stage, "next": next_slot, "results": results})
        self._last_save = time.monotonic()

    def _load_states(self, stage: str) -> tuple[torch.Tensor, int, dict]:
        path = self.work / J.STATES_FILE
        if not path.is_file():
            raise ConfigError(f"{path} is missing; pass -nr to start over.")
        tensors, meta = J.load_tensors(path)
        if meta.get("stage") != stage:
            raise ConfigError(f"{path} does not belong to stage {stage}; pass -nr to start over.")
        return self._placed(tensors["states"].clone()), int(meta["next"]), meta.get("results", {})

    def _placed(self, states: torch.Tensor) -> torch.Tensor:
        """The hidden states on the GPU when three copies fit in a third of its free memory: every block runs over
        all of them several times (once per measured option), and copying them from host memory each time costs
        more than the block itself."""
        if self.device.type != "cuda":
            return states
        free, _ = torch.cuda.mem_get_info(self.device)
        return states.to(self.device) if 9 * states.numel() * states.element_size() < free else states

    def _embed_all(self, ids: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            out = torch.empty((ids.shape[0], ids.shape[1], self.spec.hidden_size), dtype=self.dtype)
            for r in range(ids.shape[0]):
                out[r] = self.model.embed(ids[r:r + 1])[0].cpu()
        return out

    # -- stages --------------------------------------------------------------------------------------------------

    def run(self) -> dict:
        """Run to the end (or to the measurement with -om); returns a summary dict."""
        from exl2.kernels.backend import force_torch

        t0 = time.monotonic()
        job = self._open_job()
        summary: dict = {"stage_seconds": {}}
        # The PyTorch twins of the kernels, even on CUDA: fp32 everywhere and autograd for the sensitivity pass.
        with force_torch():
            while job.progress != "finished":
                if self.s.output_measurement and "measurement" in job.data:
                    self._write_measurement(job.data["measurement"])
                    if job.progress == "optimize":     # a measure-only job ends here; run again without -om
                        job.advance("finished")        # to continue with the quantization
                    break
                stage, t = job.progress, time.monotonic()
                getattr(self, "_stage_" + stage)(job, summary)
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                times = summary["stage_seconds"]       # this run's time per stage (a resumed stage: its rest)
                times[stage] = times.get(stage, 0.0) + time.monotonic() - t
        summary["seconds"] = time.monotonic() - t0
        summary["strategy_summary"] = job.data.get("strategy_summary")
        return summary

    def _stage_begin(self, job: J.Job, summary: dict) -> None:
        if self.s.measurement:
            m = read_measurement(self.s.measurement)
            missing = [s.key for s in self.slots if not m.get(s.key)]
            if missing:
                raise ConfigError(f"{self.s.measurement} has no entry for {missing[0]}; it was made for another model.")
            self.ui.info(f"using the measurement in {self.s.measurement}")
            job.advance("optimize", measurement={s.key: m[s.key] for s in self.slots})
            return
        ids, dataset = self._calibration(self.s.measurement_rows, self.s.measurement_length, measure=True)
        J.save_tensors(self.work / J.CAL_FILE, {"measure_ids": ids}, {"measure_dataset": dataset})
        self.ui.info(f"measurement calibration: {ids.shape[0]} rows × {ids.shape[1]} tokens ({dataset})")
        job.advance("initial_embeddings")

    def _stage_initial_embeddings(self, job: J.Job, summary: dict) -> None:
        ids = J.load_tensors(self.work / J.CAL_FILE, ["measure_ids"])[0]["measure_ids"]
        states = self._embed_all(ids)
        J.save_tensors(self.work / J.STATES_FILE, {"states": states}, {"stage": "sensitivity", "next": 0})
        job.advance("sensitivity")

    def _stage_sensitivity(self, job: J.Job, summary: dict) -> None:
        states_file, sens_file = self.work / J.STATES_FILE, self.work / J.SENS_FILE
        if sens_file.is_file() and states_file.is_file() and J.read_meta(states_file).get("stage") == "measure":
            job.advance("measure_quant")               # killed after saving, before the job file said so
            return
        states, _, _ = self._load_states("sensitivity")
        n = rows_for(states.shape[0], states.shape[1], self.spec.hidden_size, len(self.slots))
        with self.ui.stage("sensitivity", 2 * self.spec.num_layers) as tick:
            grads = sensitivity_pass(self.model, self.slots, states[:n], self.device, self.s.seed,
                                     lambda: tick(1))
        J.save_tensors(self.work / J.SENS_FILE, {f"g.{i}": g for i, g in grads.items()}, {"rows": n})
        J.save_tensors(self.work / J.STATES_FILE, {"states": states}, {"stage": "measure", "next": 0, "results": {}})
        job.advance("measure_quant")

    def _stage_measure_quant(self, job: J.Job, summary: dict) -> None:
        states, start, results = self._load_states("measure")
        sens = self.work / J.SENS_FILE
        total = sum(len(table(s.kind)) for s in self.slots)
        done = sum(len(results.get(s.key, [])) for s in self.slots[:start])
        layer = None
        with self.ui.stage("measurement", total, done) as tick:
            for slot in self.slots[start:]:
                if layer is None or layer.idx != slot.layer:
                    layer = self.model.layer(slot.layer)
                grads = None
                if sens.is_file():
                    grads = self._placed(J.load_tensors(sens, [f"g.{slot.index}"])[0][f"g.{slot.index}"])
                options, states = measure_slot(self.model, layer, slot, states, self.device, self.tpb, grads,
                                               lambda: tick(1))
                results[slot.key] = options
                last = slot.index == len(self.slots) - 1
                self._save_states(states, "measure", slot.index + 1, results, force=last)
        self._save_measurement(self.work / J.MEASUREMENT_FILE, results)
        job.advance("optimize", measurement=results)

    def _save_measurement(self, path: Path, measurement: dict) -> None:
        data = measurement_json(measurement, self.slots, self.spec.parallel_block)
        atomic_write_text(path, json.dumps(data, indent=4))

    def _write_measurement(self, measurement: dict) -> None:
        """-om: copy the measurement where asked (a file, or measurement.json inside a directory)."""
        target = Path(self.s.output_measurement)
        path = target / J.MEASUREMENT_FILE if target.is_dir() else target
        self._save_measurement(path, measurement)
        self.ui.info(f"measurement written to {path}")

    def _stage_optimize(self, job: J.Job, summary: dict) -> None:
        numel = decoder_numel(self.model, self.slots)
        strategy, info = choose_strategy(job.data["measurement"], [s.key for s in self.slots], numel, self.s.bits,
                                         self.s.objective)
        self.ui.info(f"optimizer ({info['objective']}): {info['bpw']:.4f} bpw of {self.s.bits} target, "
                     f"max block error {info['max_rfn']:.4f}")
        job.advance("tokens_cal", strategy=strategy, strategy_summary=info)

    def _stage_tokens_cal(self, job: J.Job, summary: dict) -> None:
        ids, dataset = self._calibration(self.s.rows, self.s.length, measure=False)
        existing = J.load_tensors(self.work / J.CAL_FILE)[0] if (self.work / J.CAL_FILE).is_file() else {}
        existing["quant_ids"] = ids
        J.save_tensors(self.work / J.CAL_FILE, existing, {"quant_dataset": dataset})
        self.ui.info(f"quantization calibration: {ids.shape[0]} rows × {ids.shape[1]} tokens ({dataset})")
        job.advance("embeddings", calibration={"rows": int(ids.shape[0]), "length": int(ids.shape[1]),
                                               "dataset": dataset})

    def _stage_embeddings(self, job: J.Job, summary: dict) -> None:
        ids = J.load_tensors(self.work / J.CAL_FILE, ["quant_ids"])[0]["quant_ids"]
        states = self._embed_all(ids)
        J.save_tensors(self.work / J.STATES_FILE, {"states": states}, {"stage": "quant", "next": 0, "results": {}})
        job.advance("quant")

    def _stage_quant(self, job: J.Job, summary: dict) -> None:
        states, start, results = self._load_states("quant")
        if 0 < start < len(self.slots) and not advances(self.spec, self.slots[start - 1]):
            start -= 1      # a parallel layer's MLP block runs its quantized attention: quantize that again first
        strategy = job.data["strategy"]
        layer = None
        with self.ui.stage("quantization", len(self.slots) + 1, start) as tick:
            for slot in self.slots[start:]:
                if layer is None or layer.idx != slot.layer:
                    layer = self.model.layer(slot.layer)
                results[slot.key] = quantize_slot(self.model, layer, slot, strategy[slot.key], states, self.device,
                                                  self.tpb, self.work)
                tick(1)
                self._save_states(states, "quant", slot.index + 1, results, force=False)
            layer = None
            head_err, norm, head = quantize_head(self.model, states, self.s.head_bits, self.device, self.tpb,
                                                 self.work)
            tick(1)
        ids = J.load_tensors(self.work / J.CAL_FILE, ["quant_ids"])[0]["quant_ids"]
        n = max(1, min(16, ids.shape[0] - (0 if self.s.cal_dataset else random_rows(ids.shape[0]))))
        ppl = calibration_perplexity(self.model, norm, head, states[:n], ids[:n], self.device)
        self.ui.info(f"calibration perplexity (quant): {ppl:.4f}")
        summary["calibration_perplexity"] = ppl
        job.advance("compile", rfn_error=results, head_rfn_error=head_err, calibration_perplexity=ppl)

    def _stage_compile(self, job: J.Job, summary: dict) -> None:
        cal = job.data.get("calibration") or {"rows": 0, "length": self.s.length, "dataset": "(default)"}
        qc = {"bits": self.s.bits, "head_bits": self.s.head_bits, "calibration": cal}
        out = self.s.compile_full
        compile_model(self.s.in_dir, self.work, out, qc, self.s.shard_size)
        self.ui.info(f"compiled model written to {out or self.work}")
        job.advance("finished")


def convert(settings: ConvertSettings, reporter: Optional[Reporter] = None) -> dict:
    return Converter(settings, reporter).run()
