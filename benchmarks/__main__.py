"""Run every benchmark, then write benchmarks/RESULTS.md from benchmarks/results/*.json.

    pip install -r benchmarks/requirements.txt
    python -m benchmarks                         # all of them (about two hours on a 2-core CPU)
    python -m benchmarks --only trainers         # one or more, comma-separated
    python -m benchmarks --report-only           # RESULTS.md from the results already there

Each benchmark is its own script (and process), run one after the other so they do not compete
for the machine; `gpu` runs only where CUDA is available. Nothing here times anything itself.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks import describe, protocol_of

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
BENCHMARKS = (
    "data_path",
    "preprocess",
    "checkpoint",
    "trainers",
    "compile",
    "compile_presets",
    "memory_format",
    "expected_time",
    "flip_rule",
    "cloud_head",
    "predict",
    "selection",
    "stability",
    "radiometry",
    "atmosphere",
    "adaptation",
    "ledger",
    "gpu",
)


def run(names: list[str]) -> None:
    import torch

    for name in names:
        if name == "gpu" and not torch.cuda.is_available():
            print("gpu: skipped, no CUDA GPU here (its results file, if any, is kept)", flush=True)
            continue
        print(f"== {name}", flush=True)
        t0 = time.perf_counter()
        r = subprocess.run([sys.executable, str(HERE / f"{name}.py")], cwd=HERE.parent)
        if r.returncode != 0:
            sys.exit(f"benchmark {name} failed (exit {r.returncode}); RESULTS.md not rewritten")
        print(f"== {name}: {time.perf_counter() - t0:.0f} s", flush=True)


def load(results: Path, name: str) -> dict | None:
    path = results / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def fmt(x: float, digits: int = 2) -> str:
    return f"{x:.{digits}f}"


def data_path_md(d: dict) -> list[str]:
    r, c2, c4 = d["research_loader_2_flights"], d["cached_loader_2_flights"], d["cached_loader_4_flights"]
    return [
        f"Machine: {describe(d['machine'])}. Frames {d['frame']}.",
        "",
        "| loader | samples/s | peak RSS, 2 flights | peak RSS, 4 flights |",
        "|---|---|---|---|",
        f"| reopen HDF5 + preprocess per sample | {fmt(r['samples_per_s'], 1)} | {r['peak_rss_mb']:.0f} MB | "
        "- |",
        f"| preprocessed cache | {fmt(c2['samples_per_s'], 0)} | {c2['peak_rss_mb']:.0f} MB | "
        f"{c4['peak_rss_mb']:.0f} MB |",
        "",
        f"Cache over research loader: {d['throughput_ratio']:.1f}x (target "
        f"{d['targets']['throughput_ratio']}); "
        f"peak RSS 4 vs 2 flights: {d['peak_rss_ratio_4_vs_2_flights']:.2f}x (target flat).",
    ]


def checkpoint_md(d: dict) -> list[str]:
    s, o, r = d["stall_per_save"], d["run_overhead"], d["resume_startup"]
    med = r["seconds_to_first_step_median"]
    return [
        f"Machine: {describe(d['machine'])}, {d.get('setting', 'local disk, CPU training')}.",
        "",
        "| measure | result | target |",
        "|---|---|---|",
        f"| loop stall per save, asynchronous ({s['parameters']:,} parameters + AdamW, "
        f"{s['checkpoint_mb']:.1f} MB) | {s['async_stall_ms_median']:.1f} ms | |",
        f"| the same, synchronous | {s['sync_stall_ms_median']:.1f} ms ({s['sync_over_async']:.1f}x) | |",
        f"| checkpoint overhead of a demo run at every_steps=100 (sum of stalls / wall time) | "
        f"{o['every_steps_100']['overhead_percent']:.2f}% | at most 0.5% |",
        f"| process start to first step, resumed early in an epoch, over a fresh start | "
        f"{r['resume_early_over_fresh']:.2f}x ({med['resume_early']:.2f} s vs {med['fresh']:.2f} s) | at "
        "most 1.2x |",
        f"| the same, resumed late in an epoch | {r['resume_late_over_fresh']:.2f}x "
        f"({med['resume_late']:.2f} s) "
        "| at most 1.2x |",
    ]


def trainers_md(d: dict) -> list[str]:
    m, s, o = d["machine"], d["summary"], d["per_step_overhead"]
    names = {
        "bare": "bare hand-written loop",
        "cloudml": "CloudML Trainer, defaults",
        "lightning": "Lightning `Trainer` + `ModelCheckpoint(every_n_train_steps=100)`",
    }
    lines = [
        f"Machine: {describe(m)}. {d['optimizer_steps']} optimizer steps ({d['epochs']} epochs), "
        f"{d['repeats']} "
        "interleaved repeats, each run its own process.",
        "",
        "| | training part, median (spread) | x bare | training part, best run | x bare | "
        "whole process, median (spread) | x bare |",
        "|---|---|---|---|---|---|---|",
    ]
    for k, label in names.items():
        row = s[k]
        best = row.get("train_s_best")
        lines.append(
            f"| {label} | {fmt(row['train_s_median'])} s ({fmt(row['train_s_spread'])}) | "
            f"{fmt(row.get('train_vs_bare', 1.0), 3)} | "
            + (f"{fmt(best)} s | {fmt(row.get('train_best_vs_bare', 1.0), 3)} | " if best else "- | - | ")
            + f"{fmt(row['process_s_median'])} s ({fmt(row['process_s_spread'])}) | "
            f"{fmt(row.get('process_vs_bare', 1.0), 3)} |"
        )
    lines += [
        "",
        f"Per-step overhead of the CloudML trainer, measured directly (one process, {o['pairs']} "
        f"alternating pairs of epochs over the same preloaded batches): {o['overhead_ms_per_step']:.2f} ms "
        f"on a {o['bare_step_ms']:.0f} ms step, {o['overhead_ratio']:.3f}x; ratio per pair: median "
        f"{o['pair_ratio_median']:.3f}, quartiles {o['pair_ratio_q1']:.3f}..{o['pair_ratio_q3']:.3f} "
        "(target: at most 1.03x).",
    ]
    r = d.get("resume")
    if r:
        lines += [
            "",
            f"Resume: saves every {r['every_steps']} steps, SIGKILL at step {r['killed_at_step']} "
            "(mid-epoch 2), the same command again:",
            "",
            "| | launch to first step, fresh | launch to first step, resumed | final weights vs "
            "uninterrupted |",
            "|---|---|---|---|",
        ]
        for k in ("cloudml", "lightning"):
            x = r[k]
            same = "bit-identical" if x["bit_identical"] else f"differ, max abs diff {x['max_abs_diff']:.3g}"
            lines.append(
                f"| {names[k].split(' +')[0].split(',')[0]} | {fmt(x['fresh_to_first_step_s'])} s | "
                f"{fmt(x['resumed_to_first_step_s'])} s | {same} |"
            )
    return lines


def before_after_md(d: dict) -> list[str]:
    b, a = d["before"], d["after"]

    def side(x: dict) -> str:
        quartiles = f"{x['ratio_q1']:.3f}..{x['ratio_q3']:.3f}"
        return f"median {x['ratio_median']:.3f}, quartiles {quartiles} ({x['pairs']} pairs)"

    return [
        f"Machine: {describe(d['machine'])}. The per-step overhead above (a CloudML epoch over a bare epoch "
        "of the same preloaded batches, pair by pair), for the trainer of "
        f"{b['revision']} ({b['commit'][:7]}) and of {a['commit'][:7]}, "
        f"in {d['rounds']} alternating processes each "
        "(`python benchmarks/trainers.py --before REV`):",
        "",
        f"- before: {side(b)}",
        f"- after: {side(a)}",
        "",
        f"The medians differ by {d['median_difference']:+.3f}, against a spread (the wider interquartile "
        f"range) of {d['spread']:.3f}: "
        + ("worse than its own spread." if d["worse_than_spread"] else "no worse than its own spread."),
    ]


def compile_md(d: dict) -> list[str]:
    names = {"region": "frame encoder (CloudML)", "whole": "whole model"}
    lines = [
        f"Machine: {describe(d['machine'])}; inductor cache {d['inductor_cache']}. Each row: eager and "
        "compiled steps alternating in one process (forward, backward, AdamW).",
        "",
        "| model | checkpointing | compiled | eager step | compiled step | speed vs eager | cold compile | "
        "pays off after | kept for backward, eager / compiled | graphs, breaks |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for key in ("demo", "full", "cuda_demo", "cuda_full"):
        runs = d.get(key)
        if not runs:
            continue
        for name, r in runs.items():
            variant, ckpt = name.split("_")
            if "failed" in r:
                lines.append(f"| {key} | {ckpt} | {names[variant]} | failed: {r['failed']} |||||||")
                continue
            channels = "/".join(map(str, r["channels"]))
            model = f"{key} ({channels}, {r['frame'][0]} x {r['frame'][1]}, batch {r['batch']})"
            pays = "never" if r["break_even_steps"] is None else f"{r['break_even_steps']:,} steps"
            lines.append(
                f"| {model} | {'on' if ckpt == 'ckpt' else 'off'} | {names[variant]} | "
                f"{r['eager_step_ms']:.0f} ms | {r['step_ms']:.0f} ms | {r['speed_vs_eager']:.2f}x | "
                f"{r['compile_s']:.0f} s | {pays} | {r['eager_saved_for_backward_mb']:.1f} / "
                f"{r['saved_for_backward_mb']:.1f} MB | {r['graphs']}, {r['graph_breaks']} |"
            )
    modes = d.get("cuda_modes")
    if modes:
        lines += [
            "",
            "CUDA compile modes (full model, frame encoder compiled):",
            "",
            "| mode | result |",
            "|---|---|",
        ]
        for k, r in modes.items():
            said = (
                f"refused by the config: {r['refused_by_config']}"
                if "refused_by_config" in r
                else f"failed: {r['failed']}"
                if "failed" in r
                else f"{r['speed_vs_eager']:.2f}x eager, {r['compile_s']:.0f} s compile, "
                f"peak {r.get('peak_allocated_gib', 0):.2f} GiB"
            )
            lines.append(f"| {k} | {said} |")
    return lines


def compile_presets_md(d: dict) -> list[str]:
    """Each preset's compiled and eager steps, whole epochs through the Trainer, compiles cold and warm."""
    s, r = d["summary"], d["raw"]
    frame = " x ".join(map(str, d["frame"]))
    minutes = f"{d['run_minutes']:.0f} min in all." if "run_minutes" in d else "The run was cut short."
    lines = [
        f"Machine: {describe(d['machine'])}, torch threads {d['machine']['torch_threads']} (whether it "
        f"was shared with other work: the notes). Frames {frame} for every preset; each preset's channels "
        "and checkpointing, its batch reduced (below); the frame encoder compiled as CloudML does. Steps: "
        f"eager and compiled alternating on one batch, {d['blocks']} blocks of {d['pairs_per_block']} pairs "
        f"(ratio: median of the blocks, range over the blocks). Epochs: {d['epochs']} tiny epochs of the "
        "real Trainer on demo flights at that frame (setup excluded; validation and checkpoints included), "
        f"inductor cache {d['epochs_inductor_cache']}. Cold compile: an empty inductor cache; warm: a fresh "
        f"process on the same cache. {minutes}",
        "",
        "| preset | channels, checkpointing, batch | eager steps/s | compiled steps/s | compiled / eager "
        "(range) | epochs, compiled / eager speed (after the first) | compile cold / warm | break-even "
        "steps, cold / warm |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, x in s.items():
        st = r[name]["steps"]
        ckpt = "on" if st["gradient_checkpointing"] else "off"
        after = x["epochs_ratio_after_first"]
        epochs = (
            "not run"
            if x["epochs_ratio"] is None
            else f"{x['epochs_ratio']:.2f}x ({'-' if after is None else f'{after:.2f}x'})"
        )
        be = " / ".join(
            "never" if x[k] is None else f"{x[k]:,}"
            for k in ("break_even_steps_cold", "break_even_steps_warm")
        )
        lines.append(
            f"| {name} | {'/'.join(map(str, st['channels']))}, {ckpt}, {st['batch']} | "
            f"{fmt(x['eager_steps_per_s'])} | {fmt(x['compiled_steps_per_s'])} | "
            f"{x['step_ratio']:.2f}x ({x['step_ratio_min']:.2f}-{x['step_ratio_max']:.2f}) | "
            f"{epochs} | "
            f"{x['compile_cold_s']:.0f} s / {x['compile_warm_s']:.0f} s | {be} |"
        )
    notes = [f"- {n}" for n in d.get("notes", [])]
    return lines + ["", *notes, *compile_decisions_md(d.get("decisions", {}))]


def memory_format_md(d: dict) -> list[str]:
    """channels_last against the default format in training, per device and model, and the choice."""
    lines = [
        f"Machine: {describe(d['machine'])}. Each model's training step (the real network, AdamW, the "
        "device's precision) in both formats, alternating round by round after a warm-up step; the "
        f"trainer takes channels_last where the median speed-up over the models is at least {d['use_at']}.",
        "",
        "| device | model | frame, batch | default steps/s | channels_last steps/s | speed-up (range) | "
        "outputs differ by |",
        "|---|---|---|---|---|---|---|",
    ]
    for device, models in d["models"].items():
        for name, m in models.items():
            lines.append(
                f"| {device} | {name} ({'/'.join(map(str, m['channels']))}) | "
                f"{' x '.join(map(str, m['frame']))}, {m['batch']} | {fmt(m['steps_per_s']['contiguous'])} | "
                f"{fmt(m['steps_per_s']['channels_last'])} | {m['speedup']:.2f}x "
                f"({m['speedup_range'][0]:.2f}-{m['speedup_range'][1]:.2f}) | "
                f"{m['max_output_difference']:.1e} km |"
            )
    lines.append("")
    for device, c in d["channels_last"].items():
        lines.append(
            f"- On a {device}: median speed-up {c['speedup']:.2f}x, so training takes "
            f"{'channels_last' if c['use'] else 'the default format'}."
        )
    return lines


def expected_time_md(d: dict) -> list[str]:
    """The picker's expected epoch, estimated in several fresh processes, against the epochs the run took."""
    epochs = d["measured_epoch_s"]
    lines = [
        f"Machine: {describe(d['machine'])}. {d['config']}: the expectation made before the run as the "
        f"picker makes it, {d['repeats']} times, each in a fresh process as a user's kernel makes it "
        f"({d['steps_per_epoch']} steps and {d['validation_batches']} validation batches per epoch), then "
        f"the run in a process of its own: its epochs took {min(epochs):.1f}-{max(epochs):.1f} s, median "
        f"{statistics.median(epochs):.1f} s.",
        "",
        "| estimate | step timed | expected epoch | expected / median | expected / median after the first | "
        f"within {d['within']:.0%} |",
        "|---|---|---|---|---|---|",
    ]
    for i, e in enumerate(d["estimates"], 1):
        after = e["expected_over_median_after_first"]
        lines.append(
            f"| {i} | {e['step_s']:.3f} s ({e['source']}) | {e['expected_epoch_s']:.1f} s | "
            f"{e['expected_over_median']:.2f} | {'-' if after is None else f'{after:.2f}'} | "
            f"{'yes' if abs(e['expected_over_median'] - 1) <= d['within'] else 'no'} |"
        )
    verdict = "all within" if d["within_25_percent"] else "not all within"
    lines += [
        "",
        f"Expected / median from {min(r['expected_over_median'] for r in d['estimates']):.2f} to "
        f"{max(r['expected_over_median'] for r in d['estimates']):.2f}: {verdict} {d['within']:.0%}.",
    ]
    return lines + ([""] + [f"- {note}" for note in d["notes"]] if d.get("notes") else [])


def compile_decisions_md(dec: dict) -> list[str]:
    """The decisions the numbers above support, each with its rule."""
    yes = lambda v: "yes" if v else "no"  # noqa: E731
    lines = []
    if "C_compiled" in dec:
        c = dec["C_compiled"]
        lines.append(f"- Preset C compiled: {yes(c['yes'])} ({c['rule']}).")
    if "demo_compiled_on_cpu" in dec:
        c = dec["demo_compiled_on_cpu"]
        lines.append(
            f"- The demo compiled on the CPU: {yes(c['yes'])} ({c['rule']}; a demo run is "
            f"{c['demo_run_steps']} steps)."
        )
    if "B_cost" in dec:
        c = dec["B_cost"]
        lines.append(
            f"- Preset B, eager by design: {c['b_eager_over_a_compiled_samples']:.2f}x A's compiled "
            f"samples/s (batches as above); compiling B would step "
            f"{c['b_compiled_over_b_eager_steps']:.2f}x faster."
        )
    return lines


def cloud_head_md(d: dict) -> list[str]:
    runs = d["runs"]
    num = lambda m, k: "-" if not m or m.get(k) is None else fmt(m[k], 3)  # noqa: E731
    lines = [
        f"Machine: {describe(d['machine'])}. Each row the full demo run ({d['config']}), its test flight; "
        f"{protocol_of(d)}.",
        "",
        "| variant-seed | height R2 | height MAE km | cloud accuracy | cloud F1 | cloud ROC-AUC | BT "
        "threshold accuracy "
        "| epochs' time s | whole run s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in runs.items():
        m = r.get("cloud_model")
        bt = (
            r.get("cloud_bt_threshold") if m else None
        )  # without a cloud output the val set has no clear frame
        height = not name.startswith("cloud_only")
        lines.append(
            f"| {name} | {fmt(r['r2'], 3) if height else '-'} | {fmt(r['mae_km'], 3) if height else '-'} | "
            f"{num(m, 'accuracy')} | {num(m, 'f1')} | {num(m, 'roc_auc')} | {num(bt, 'accuracy')} | "
            f"{r['epoch_seconds']:.0f} | {r['seconds']:.0f} |"
        )
    return lines + [
        "",
        "Height MAE over height-only (mean over seeds): probe "
        f"{d['height_mae_probe_over_height_only']:.2f}x, "
        f"joint {d['height_mae_joint_over_height_only']:.2f}x. Cloud accuracy probe - joint: "
        f"{d['cloud_accuracy_probe_minus_joint']:+.3f}; joint - cloud-only: "
        f"{d['cloud_accuracy_joint_minus_cloud_only']:+.3f}. Whole run, probe / height-only: "
        f"{d['time_probe_over_height_only']:.2f}x; epochs' time, joint / the two separate models: "
        f"{d['time_joint_over_two_models']:.2f}x.",
    ]


def flip_rule_md(d: dict) -> list[str]:
    words = {
        "old_rule": "ground azimuth, flip a -> 360 - a (before issue 17)",
        "ground_heading": "ground azimuth, flip a -> 2 heading - a",
        "relative": "azimuth relative to the heading, flip r -> -r (default)",
        "no_flip": "default, no flip",
    }
    lines = [
        f"Machine: {describe(d['machine'])}. The demo run ({d['config']}) on turning demo flights; the test "
        f"flight's metrics of the best model, each run its own seed; {protocol_of(d)}.",
        "",
        "| flip rule | seed | R2 | MAE km | RMSE km |",
        "|---|---|---|---|---|",
    ]
    for r in d["runs"]:
        lines.append(
            f"| {words[r['variant']]} | {r['seed']} | {r['r2']:.3f} | {r['mae_km']:.4f} | {r['rmse_km']:.4f} "
            "|"
        )
    return lines + ["", f"Mean RMSE, old rule over the relative rule: {d['old_over_new_rmse']:.2f}x."]


def gpu_md(d: dict | None) -> list[str]:
    if d is None:
        return [
            "Not measured: no CUDA GPU was available where these results were made. `python "
            "benchmarks/gpu.py` on a GPU machine writes results/gpu.json."
        ]
    if "compile" not in d:  # a file of the first gpu.py (presets only)
        return gpu_presets_md(d)
    return [
        f"Device: {d['device']}, torch {d['torch']}, Python {d['machine']['python']}, "
        "standing for a Colab T4: "
        f"memory capped at {d['memory_cap_gib']} GiB, {d['standing_for_t4']}; frames {d['frame'][0]} x "
        f"{d['frame'][1]}, T = {d['temporal_frames']}. **What transfers to a T4**: the memory under the cap "
        "(the same kernels allocate the same tensors; a T4 also holds the CUDA context, about 0.3-0.5 GiB, "
        "outside the cap). Speed, time to compile and the allocator's caching do not transfer: a T4 has "
        "about 1/15 of this GPU's fp16 rate; T4 figures elsewhere stay estimates.",
        "",
        *gpu_presets_md(d),
        "",
        *gpu_compile_md(d),
        "",
        *gpu_precision_md(d["precision"]),
        "",
        *gpu_memory_md(d["memory"]),
        "",
        *gpu_predict_resume_md(d["predict"], d["resume"]),
        *gpu_t4_md(d),
    ]


def failed_md(item: dict) -> list[str]:
    return [f"Not complete: {item['failed']}."] if "failed" in item else []


def gpu_presets_md(d: dict) -> list[str]:
    lines = [
        "| preset | batch | compiled | estimated peak | allocated (/ est.) | reserved (/ est.) | "
        "reserved - est. "
        "(stated overhead) | time to first step | steps/s | share of peak FLOP/s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, p in d["presets"].items():
        if not isinstance(p, dict) or "batch_size" not in p:
            continue
        if "peak_allocated_gib" not in p:
            lines.append(f"| {name} | {p['batch_size']} | {p.get('out_of_memory', 'not measured')} |||||||")
            continue
        lines.append(
            f"| {name.replace('_', ' ')} | {p['batch_size']} | {'yes' if p['torch_compile'] else 'no'} | "
            f"{p['estimated_peak_gib']:.2f} GiB | {p['peak_allocated_gib']:.2f} GiB "
            f"({p['allocated_over_estimate']:.2f}) | {p['peak_reserved_gib']:.2f} GiB "
            f"({p['reserved_over_estimate']:.2f}) "
            f"| {p['reserved_minus_estimate_gib']:.2f} GiB "
            f"({p.get('stated_overhead_gib', float('nan')):.2f}) | "
            f"{p.get('time_to_first_step_s', float('nan')):.1f} s | {p['steps_per_s']:.2f} | "
            f"{p.get('fraction_of_peak_flops', float('nan')):.1%} |"
        )
    return lines + failed_md(d["presets"])


def gpu_compile_md(d: dict) -> list[str]:
    lines = [
        "Preset A (checkpointing, compile `default`) through the real Trainer, 3 epochs of synthetic "
        "flights in "
        "the real layout, validation after each:",
        "",
        "| run | epoch 1 | epoch 2 | epoch 3 | steps/s, epochs 2-3 | graphs, recompiles, breaks, "
        "fall-back after "
        "each epoch | compiling |",
        "|---|---|---|---|---|---|---|",
    ]
    runs = [("compiled, inductor cache empty", d["compile"].get("compiled"))]
    runs += [("compiled, inductor cache warm", d.get("compile_warm_cache", {}).get("compiled"))]
    runs += [("eager", d["compile"].get("eager"))]
    for name, r in runs:
        if not r:
            continue
        epochs = [f"{e['train_s']:.1f} s ({e['steps']} steps)" for e in r["epochs"]]
        after = "; ".join(
            f"{c['graphs']}, {c['recompiles']}, {c['graph_breaks']}, {c['fallback'] or 'none'}"
            for c in r["compile_after_each_epoch"]
        )
        compiling = f"{r['compile_at_end']['compile_s']:.1f} s" if r["compile_at_end"]["active"] else "-"
        lines.append(
            f"| {name} | {' | '.join(epochs)} | {r['steps_per_s_after_epoch_1']:.2f} | "
            f"{after if r['compile_at_end']['active'] else '-'} | {compiling} |"
        )
    reasons = (d["compile"].get("compiled") or {}).get("recompile_reasons")
    if reasons:
        lines += [
            "",
            "Dynamo's reasons for the recompiles (each once, in epoch 1): " + "; ".join(reasons) + ".",
        ]
    if "compiled_over_eager_steps_per_s" in d["compile"]:
        lines += [
            "",
            "Compiled over eager steps/s through the Trainer: "
            f"{d['compile']['compiled_over_eager_steps_per_s']:.2f}x.",
        ]
    return lines + failed_md(d["compile"])


def gpu_precision_md(p: dict) -> list[str]:
    if "fp16_grad_scaler" not in p:
        return failed_md(p) or ["fp16 against fp32: not measured."]
    a, b = p["fp16_grad_scaler"], p["fp32"]
    return [
        f"fp16 with a GradScaler against fp32, {p['model']}:",
        "",
        "| precision | steps | non-finite losses | steps skipped by the scaler | first loss | "
        "mean loss, last tenth "
        "| steps/s |",
        "|---|---|---|---|---|---|---|",
        f"| fp16 + GradScaler | {a['steps']} | {a['non_finite_losses']} | {a['skipped_by_scaler']} | "
        f"{p['first_loss']['fp16']:.4f} | {p['mean_loss_last_tenth']['fp16']:.4f} | {a['steps_per_s']:.2f} |",
        f"| fp32 | {b['steps']} | {b['non_finite_losses']} | - | {p['first_loss']['fp32']:.4f} | "
        f"{p['mean_loss_last_tenth']['fp32']:.4f} | {b['steps_per_s']:.2f} |",
    ]


def gpu_memory_md(m: dict) -> list[str]:
    lines = [
        "The batch probe (`train.batch_size: auto`, a 15% margin) against the largest batch whose real "
        "step fits "
        "under the cap (eager, as the probe runs):",
        "",
        "| preset | probe: fixed + per sample | probe's batch | largest that fits | probe / largest |",
        "|---|---|---|---|---|",
    ]
    for name in ("A", "B"):
        r = m.get(name)
        if r:
            pr = r["probe"]
            lines.append(
                f"| {name} | {pr['fixed_gib']:.2f} + {pr['per_sample_gib']:.3f} GiB | "
                f"{pr['recommended_batch']} | "
                f"{r['largest_fitting_batch']} | {r['probe_over_largest']:.2f} |"
            )
    o = m.get("forced_oom")
    if o:
        lines += [
            "",
            f"Out of memory forced in the real Trainer (preset B, batch {o['batch_size']}, cap "
            f"{o['memory_cap_gib']} GiB): training recovered {'yes' if o['training_recovered'] else 'NO'} "
            f"(micro-batches of {o['micro_batch_size']}, {o['oom_recoveries']} recovery, batch size still "
            f"{o['batch_size_after']}, {o['step']} of {o['optimizer_steps_expected']} optimizer steps); "
            "evaluation "
            f"recovered {'yes' if o['evaluation_recovered'] else 'NO'} (its batch "
            f"{o['eval_batch_size_at_start']} -> "
            f"{o['eval_batch_size']}, the training batch unchanged).",
        ]
    return lines + failed_md(m)


def gpu_predict_resume_md(p: dict, r: dict) -> list[str]:
    lines = [
        f"Whole flights ({p.get('model', '')}):",
        "",
        "| path | frames | frames/s | a 12,000-frame flight |",
    ]
    lines.append("|---|---|---|---|")
    for path in ("per_frame", "per_frame_cl"):
        if path in p:
            x = p[path]
            name = "each frame once" + (", channels_last" if path.endswith("cl") else "")
            lines.append(
                f"| {name} | {x['frames']} | {x['frames_per_s']:.0f} | {x['flight_12000_min']:.1f} min |"
            )
    lines += failed_md(p) + [""]
    if "bit_identical" in r:
        f = r["final_state"]
        worst = max(f["model"]["max_abs_diff"], f["optimizer"]["max_abs_diff"])
        lines.append(
            f"Kill and resume ({r['determinism']}): killed by SIGKILL "
            f"{'yes' if r['killed_by_sigkill'] else 'no'}; final weights and optimizer state against the "
            f"uninterrupted run: {'bit-identical' if r['bit_identical'] else 'different'} (model "
            f"{f['model']['equal_bits']} of {f['model']['tensors']} tensors equal, optimizer "
            f"{f['optimizer']['equal_bits']} of {f['optimizer']['tensors']}, max abs diff {worst:.3g}); "
            f"evaluation {'equal' if r['evaluation_equal'] else 'different'}." + repeat_words(r)
        )
    return lines + failed_md(r)


SPEED_VARIANTS = (
    ("channels_last", "channels_last"),
    ("cudnn_benchmark", "cudnn.benchmark"),
    ("deterministic", "train.deterministic"),
    ("compiled", "compiled"),
)


def gpu_t4_md(d: dict) -> list[str]:
    """The items a T4 projection needs (gpu_t4.py), where measured; an item found not valid says why."""
    if "speed" not in d:
        return []
    lines = ["", "The measurements a T4 projection needs (`--only t4`, gpu_t4.py):", ""]
    c = d.get("context", {})
    if "total_gib" in c:
        lines += [
            "- CUDA outside PyTorch's allocator (outside the cap): "
            f"{c['outside_allocator_after_start_gib']:.2f} GiB once started, "
            f"{c['outside_allocator_with_cudnn_cublas_gib']:.2f} GiB with cuDNN and cuBLAS "
            "loaded (this GPU's CUDA; a T4's differs).",
        ]
    g = d.get("graphs", {})
    if "crashed" in g:
        lines += [
            "- CUDA graphs (compile `reduce-overhead`) around the checkpointed encoder, which the config "
            "refuses: "
            + (f"crashed ({g['error']})." if g["crashed"] else f"ran, {g['steps_per_s']:.2f} steps/s.")
        ]
    for name in ("profile", "epoch", "predict_2cpu"):
        if "not_valid" in d.get(name, {}):
            lines.append(f"- `{name}`: not valid, not shown: {d[name]['not_valid']}.")
    lines += [
        "",
        "| preset | eager steps/s | " + " | ".join(f"{words} / eager" for _, words in SPEED_VARIANTS) + " |",
        "|---|---|" + "---|" * len(SPEED_VARIANTS),
    ]
    for preset in ("A", "B", "C"):
        r = d["speed"].get(preset)
        if isinstance(r, dict) and "eager_steps_per_s" in r:
            ratios = [f"{r[f'{key}_over_eager']:.2f}x" if f"{key}_over_eager" in r else "-" for key, _ in
                      SPEED_VARIANTS]  # fmt: skip
            lines.append(f"| {preset} | {r['eager_steps_per_s']:.2f} | {' | '.join(ratios)} |")
    return lines + failed_md(d["speed"])


def repeat_words(r: dict) -> str:
    """The resume item's second uninterrupted run, in words (results written before it had none)."""
    if "uninterrupted_runs_identical" not in r:
        return ""
    if isinstance(r["uninterrupted_runs_identical"], str):  # the smoke's: not run, the resume being identical
        return f" A second uninterrupted run: {r['uninterrupted_runs_identical']}."
    again = "bit-identical" if r["uninterrupted_runs_identical"] else "different"
    either = "one of them" if r["bit_identical_to_either"] else "neither"
    return (
        f" A second uninterrupted run: {again} to the first (the resumed run is bit-identical to {either})."
    )


def preprocess_md(d: dict) -> list[str]:
    c, s, p, x = d["cache_build"], d["predict_stream"], d["predict"], d["extrapolated_12000_frames"]
    rate = lambda r: f"{r['frames_per_s']:.1f}"  # noqa: E731
    lines = [
        f"Machine: {describe(d['machine'])}; {d['cores']} cores this process may use. Frames {d['frame']}.",
        "",
        "| stage | 1 process, frames/s | all cores, frames/s | ratio | 12,000 frames, all cores |",
        "|---|---|---|---|---|",
        f"| cache build | {rate(c['1_process'])} | {rate(c['all_cores'])} | {c['ratio']:.2f}x | "
        f"{x['cache_all_cores_min']:.1f} min (1 process: {x['cache_1_process_min']:.1f} min) |",
        f"| predict's frame stream (read + preprocess) | {rate(s['1_process'])} | {rate(s['all_cores'])} | "
        f"{s['ratio']:.2f}x | {x['preprocess_stream_all_cores_min']:.1f} min |",
        f"| predict on the CPU, {p['all_cores']['model']} | {rate(p['1_process'])} | {rate(p['all_cores'])} "
        "| "
        f"{p['ratio']:.2f}x | {x['predict_cpu_all_cores_min']:.0f} min (the network alone: "
        f"{p['model_only']['frames_per_s']:.1f} frames/s) |",
        "",
        "Each rate is the median of alternated rounds (frames/s, 1 process / all cores): cache build "
        + " / ".join(str(c.get("rounds_frames_per_s", {}).get(k, "-")) for k in ("1_process", "all_cores"))
        + "; frame stream "
        + " / ".join(str(s.get("rounds_frames_per_s", {}).get(k, "-")) for k in ("1_process", "all_cores"))
        + f". Target: at least 0.8 x the cores ({0.8 * d['cores']:.1f}x here) for the CPU path. Predict on "
        "the CPU is the network's speed: the workers run below it (nice 10) and take nothing from it.",
        "",
        "| flight length, frames | cache build: main process peak RSS | largest worker | predict stream: "
        "main "
        "| largest worker |",
        "|---|---|---|---|---|",
    ]
    for n, r in c["rss_by_flight_length"].items():
        t = s["rss_by_flight_length"][n]
        lines.append(
            f"| {n} | {r['main_peak_rss_mb']:.0f} MB | {r['worker_peak_rss_mb']:.0f} MB | "
            f"{t['main_peak_rss_mb']:.0f} MB | {t['worker_peak_rss_mb']:.0f} MB |"
        )
    g = d.get("gpu")
    lines += [
        "",
        (
            f"GPU ({d['machine'].get('gpu')}): the torch backend's CLAHE stream {rate(g['stream_gpu'])} "
            "frames/s, "
            f"predict {rate(g['predict'])} frames/s ({g['predict']['model']}): a 12,000-frame flight in "
            f"{x['predict_gpu_min']:.1f} min (target under 2)."
            if g
            else "GPU path (the torch backend on CUDA): not measured, no CUDA GPU where these results were "
            "made."
        ),
    ]
    lines += torch_clahe_md(d.get("torch_clahe"))
    lines += [
        "",
        "| kornia against scikit-image, frames as cached (z-scored units) | max abs | mean abs | 99th pct | "
        "correlation |",
        "|---|---|---|---|---|",
    ]
    for name, r in d["kornia_vs_skimage"].items():
        lines.append(
            f"| {name.replace('_', ' ')} | {r['max_abs']:.3f} | {r['mean_abs']:.4f} | {r['p99_abs']:.3f} | "
            f"{r['correlation']:.4f} |"
        )
    words = {
        "trained_skimage": "trained and evaluated on scikit-image frames",
        "trained_kornia": "trained and evaluated on kornia frames",
        "trained_skimage_evaluated_on_kornia": "trained on scikit-image, evaluated on kornia frames",
    }
    lines += ["", f"The demo's numbers below were {protocol_of({})}.", ""]
    lines += ["| demo, the flight held out | R2 | MAE km | RMSE km |", "|---|---|---|---|"]
    for k, r in d["demo_held_out"].items():
        lines.append(f"| {words[k]} | {r['r2']:.3f} | {r['mae_km']:.4f} | {r['rmse_km']:.4f} |")
    return lines


def torch_clahe_md(t: dict | None) -> list[str]:
    """The torch backend's CLAHE (data/clahe.py) beside scikit-image's on the CPU, and their difference."""
    if not t:
        return []
    return [
        "",
        f"| CLAHE alone, {t['frames']} frames of {t['frame']}, on the CPU | frames/s | max abs difference to "
        "scikit-image ([0, 1]) | float16 values as cached that differ |",
        "|---|---|---|---|",
        f"| scikit-image, 1 process | {t['skimage_1_process_frames_per_s']:.1f} | - | - |",
        f"| torch backend (data/clahe.py), {t['torch_threads']} threads | "
        f"{t['torch_cpu_frames_per_s']:.1f} | {t['max_abs_difference']:.1e} | "
        f"{t['cached_values_differing']:,} of {t['cached_values']:,} |",
        "",
        "The torch backend is for the GPU (data.preprocess_device auto or cuda where there is one); its GPU "
        "speed is not measured: no CUDA GPU where these results were made.",
    ]


def predict_md(d: dict) -> list[str]:
    words = {
        "per_window": "each window through the network (previous release)",
        "per_frame": "each frame encoded once (CloudML)",
        "per_frame_cl": "each frame encoded once, channels_last",
    }
    lines = [
        f"Machine: {describe(d['machine'])}. Whole processes (start, reading, preprocessing by the worker "
        "processes, the model), the paths alternated over rounds; T = 5; random (seeded) weights.",
        "",
        "| device | model | frames | path | whole process, frames/s | x previous | prediction alone, "
        "frames/s "
        "| x previous | a 12,000-frame flight | max difference |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for device in ("cpu", "cuda"):
        for name, r in (d.get(device) or {}).items():
            label = {"demo": "demo (16/32/64, 64 x 96)", "full": "preset B (64/128/256, 440 x 640)"}[name]
            for path, words_ in words.items():
                x = r[path]
                lines.append(
                    f"| {device} | {label} | {r['frames']} | {words_} | "
                    f"{x['whole_process_frames_per_s']:.2f} | "
                    f"{x.get('whole_process_speedup', 1.0):.2f}x | {x['predict_frames_per_s']:.2f} | "
                    f"{x.get('predict_speedup', 1.0):.2f}x | {x['flight_12000_min']:.1f} min | "
                    f"{x['max_diff_km_vs_per_window']:.1e} km |"
                )
    cl = d.get("channels_last", {})
    lines += [
        "",
        "channels_last, each frame encoded once, whole process over contiguous: "
        + "; ".join(
            f"{dev} {c['speedup']:.2f}x ({'used' if c['use'] else 'not used'})" for dev, c in cl.items()
        )
        + ". The library follows this file: channels_last where it paid (at least 1.05x), on that kind of "
        "device.",
        ""
        if "cuda" in d
        else "CUDA: not measured, no GPU where these results were made (channels_last stays off "
        "there, and a 12,000-frame flight on a T4 is not measured).",
    ]
    return lines


def selection_md(d: dict) -> list[str]:
    """The demo's test skill as a run reports it, against what choosing on the test flight reported."""
    pct = lambda v: "-" if v is None else f"{v:.0%}"  # noqa: E731
    lines = [
        f"Machine: {describe(d['machine'])}. The demo ({d['config']}, demo flights of generator version "
        f"{d.get('demo_generator', 2)}), one run per seed keeping every epoch's weights; both columns are "
        "the same training, chosen where each protocol chose.",
        "",
        "| seed | test R2, untouched (0.3) | test R2, chosen on it (0.2) | optimism (R2) | test MAE km, "
        "untouched "
        "(95% over time blocks) | training mean MAE km | every epoch's test R2 (min / max) | 90% intervals' "
        "coverage on the test flight: calibrated on validation / on the test flight |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in d["runs"]:
        c, iv = r["interval_coverage_on_test"], r["mae_interval_km"]
        lines.append(
            f"| {r['seed']} | {fmt(r['untouched']['r2'], 3)} | {fmt(r['chosen_on_test']['r2'], 3)} | "
            f"{r['optimism_r2']:+.3f} | {fmt(r['untouched']['mae_km'], 3)} ({fmt(iv[0], 3)}-{fmt(iv[1], 3)}) "
            "| "
            f"{fmt(r['baseline']['mae_km'], 3)} | {fmt(min(r['epoch_test_r2']), 2)} / "
            f"{fmt(max(r['epoch_test_r2']), 2)} | {pct(c['calibrated_on_validation'])} / "
            f"{pct(c['calibrated_on_the_test_flight'])} |"
        )
    return lines + [
        "",
        f"Mean optimism of choosing on the test flight: {d['mean_optimism_r2']:+.3f} R2 (spread "
        f"{d['std_optimism_r2']:.3f} over {len(d['runs'])} seeds); untouched test R2 "
        f"{d['mean_untouched_r2']:.3f}, "
        f"chosen on it {d['mean_chosen_on_test_r2']:.3f}.",
    ]


SUITE_RUNS = {
    "fresh_clone": "README's test command by `bash .ci/run` in a fresh clone",
    "full": "README's test command",
    "quick": 'the quick subset, `-m "not slow"`',
    "coverage": "README's test command under coverage.py",
}


def suite_md(d: dict) -> list[str]:
    """The test suite's time and coverage, commit by commit (benchmarks/suite.py)."""
    m = d.get("machine", {})
    lines = [
        f"Machine: {m.get('cpu')}, {m.get('cores')} cores, torch {m.get('torch')}, Python {m.get('python')}. "
        "Issue 64 asks for README's test command in 15 minutes and the quick subset in 3 on a quiet 2-core "
        "machine. Each run's conditions are in its `measured` note.",
        "",
        "| commit | run | tests | pytest time | failed | Colab twin: its tests; its environment "
        "| line / branch coverage |",
        "|---|---|---|---|---|---|---|",
    ]
    last = None
    for commit, runs in d.get("commits", {}).items():
        for kind, r in runs.items():
            twin = r.get("files_s", {}).get("tests/test_colab_twin.py")
            env = r.get("notes", {}).get("seconds")
            cov = r.get("coverage")
            lines.append(
                f"| {commit} | {SUITE_RUNS.get(kind, kind)} | {r.get('tests', '')} | "
                f"{r['pytest_s'] / 60:.1f} min | {len(r.get('failed', []))} | "
                + (f"{twin / 60:.1f} min; {env:.0f} s" if twin and env is not None else "")
                + " | "
                + (f"{cov['line_pct']:.2f} % / {cov['branch_pct']:.2f} %" if cov else "")
                + " |"
            )
            if kind in ("fresh_clone", "full"):
                last = (commit, r)
    if last:
        commit, r = last
        top = ", ".join(f"{k.removeprefix('tests/')} {v:.0f}" for k, v in list(r["files_s"].items())[:10])
        lines += ["", f"Where {commit}'s whole run spent its time (seconds, the ten costliest files): {top}."]
    return lines


def defects_md(d: dict) -> list[str]:
    """The ten slowest tests of 0a8a03d, each with its defect put back (benchmarks/defects.py)."""
    lines = [
        f"Machine: {describe(d['machine'])}. Commit {d['commit']}: {d['what']}; {d['minutes']} min in all, "
        "two at a time.",
        "",
        "| test | the defect put back | failed | what it said | seconds |",
        "|---|---|---|---|---|",
    ]
    for r in d["runs"]:
        said = r["said"].replace("|", "/")
        said = said if len(said) <= 160 else said[:157] + "..."
        lines.append(
            f"| `{r['test'].split('::')[-1]}` | {r['defect']} | {'yes' if r['failed'] else '**no**'} | "
            f"{said} | {r['seconds']:.0f} |"
        )
    return lines


def radiometry_md(d: dict) -> list[str]:
    """Leave-one-flight-out on the demo: the network with and without radiometry against every baseline."""
    s, runs = d["summary"], d["runs"]
    variants = list(s)
    flights = list(runs[0]["folds"])
    baselines = {"mean": "training mean", "linear": "linear on brightness", "trees": "trees on brightness"}

    def per_flight(variant: str, method: str, key: str) -> list[float]:
        mine = [r for r in runs if r["variant"] == variant]
        return [float(np.mean([r["folds"][f][method][key] for r in mine])) for f in flights]

    lines = [
        f"Machine: {describe(d['machine'])}. The demo's five flights (generator version "
        f"{d['demo_generator']}), each the test flight once (nested: its epoch chosen on validation data of "
        f"its own training flights), {d['epochs']} epochs per fold, seeds {', '.join(map(str, d['seeds']))}; "
        f"{d['minutes']} min in all. The network's numbers are the mean over seeds; the baselines do not "
        "depend on the seed.",
        "",
        "| test MAE km (R2) | " + " | ".join(flights) + " | mean of flights (+- spread over seeds) |",
        "|---" * (len(flights) + 2) + "|",
    ]
    rows = [(f"network, data.radiometry {v}", v, "model") for v in variants]
    rows += [(f"baseline: {label}", variants[0], m) for m, label in baselines.items()]
    for label, variant, method in rows:
        mae, r2 = per_flight(variant, method, "mae_km"), per_flight(variant, method, "r2")
        overall = s[variant]["mean_over_folds"][method]
        spread = (
            f" +- {fmt(overall['mae_km']['spread_over_seeds'], 3)}" if method == "model" else ""
        ) + f" ({fmt(overall['r2']['mean'], 2)})"
        lines.append(
            f"| {label} | "
            + " | ".join(f"{fmt(a, 3)} ({fmt(b, 2)})" for a, b in zip(mae, r2))
            + f" | {fmt(overall['mae_km']['mean'], 3)}{spread} |"
        )
    lines += [
        "",
        "| data.radiometry | MAE skill against each flight's best baseline (mean +- spread over seeds) | "
        f"flights where the best baseline does at least as well (in how many of {len(d['seeds'])} seeds) | "
        "validation R2 spread over the last 3 epochs | test R2 spread over seeds, per flight |",
        "|---|---|---|---|---|",
    ]
    for variant, v in s.items():
        lost = ", ".join(f"{n} ({k})" for n, k in v["baseline_at_least_as_good"].items() if k) or "none"
        spread = ", ".join(f"{n} {fmt(x, 2)}" for n, x in v["test_r2_spread_over_seeds"].items())
        skill = v["skill_vs_best_baseline"]
        lines.append(
            f"| {variant} | {skill['mean']:+.2f} +- {fmt(skill['spread_over_seeds'], 2)} | {lost} | "
            f"{fmt(v['validation_r2_spread_last_epochs'], 3)} | {spread} |"
        )
    best = s[variants[0]]["best_baseline"]
    return lines + [
        "",
        "Each flight's best baseline: " + ", ".join(f"{n} {baselines[best[n]]}" for n in flights) + ".",
    ]


def adaptation_md(d: dict) -> list[str]:
    """A few labels of each demo test flight: the network and the best adapted baseline per N, and whose
    intervals hold on a flight never seen."""
    s, iv = d["summary"], d["intervals"]
    lines = [
        f"Machine: {describe(d['machine'])}. The demo's five flights (generator version "
        f"{d['demo_generator']}, with its ERA5 files), each the test flight once (nested), "
        f"{d['epochs']} epochs per fold, seeds {', '.join(map(str, d['seeds']))}; "
        f"{d['seconds'] / 60:.0f} min in all. On each test flight the fold's network has its head "
        f"fine-tuned on the first N labels in time ({d['adaptation']['steps']} steps), the baselines get "
        "the same N labels (their mean error removed), and every N is scored on the same labels after the "
        "largest block and a gap. Mean over the flights of each seed, +- the spread over seeds.",
        "",
        "| N labels | network MAE km | network R2 | best adapted baseline MAE km | network against it "
        "(better / level / worse, flight-seeds) | interval coverage (90% target) |",
        "|---|---|---|---|---|---|",
    ]

    def cell(x: dict | None, digits: int) -> str:
        return "n/a" if not x else f"{fmt(x['mean'], digits)} +- {fmt(x['spread_over_seeds'], digits)}"

    for n, p in s.items():
        c = p["calls"]
        coverage = "none (fewer than 20 labels)" if p["coverage"] is None else f"{p['coverage']:.0%}"
        lines.append(
            f"| {n} | {cell(p['network_mae_km'], 3)} | {cell(p['network_r2'], 2)} | "
            f"{cell(p['best_baseline_mae_km'], 3)} | {c['better']} / {c['level']} / {c['worse']} | "
            f"{coverage} |"
        )
    first, last = s[min(s, key=int)], s[max(s, key=int)]
    net0, net1 = first["network_mae_km"]["mean"], last["network_mae_km"]["mean"]
    base1 = last["best_baseline_mae_km"]["mean"]
    lines += [
        "",
        f"With {max(s, key=int)} labels the network's MAE goes from {net0:.3f} to {net1:.3f} km; the best "
        f"adapted baseline's is {base1:.3f} km: "
        + (
            "the baselines stay ahead."
            if base1 < net1
            else "the network is ahead of them on average (the calls above say where beyond noise)."
        ),
        "",
        "| intervals on a flight never seen, calibrated on | mean coverage | lowest | mean width km | "
        "flight-seeds short of 90% beyond binomial noise |",
        "|---|---|---|---|---|",
    ]
    for kind, words in (
        ("own_validation", "the fold's validation data (as a single run)"),
        ("across_flights", "the other folds' test flights (crossval, `predict --calibration`)"),
    ):
        k = iv[kind]
        lines.append(
            f"| {words} | {fmt(k['mean_coverage'], 2)} | {fmt(k['lowest_coverage'], 2)} | "
            f"{fmt(k['mean_width_km'], 2)} | {k['short_beyond_noise']} of {k['flight_seeds']} |"
        )
    return lines


def atmosphere_md(d: dict) -> list[str]:
    """Leave-one-flight-out on the demo with its ERA5: the network on the frames, on the atmosphere, on both,
    beside every baseline, and whether the frames add anything to the atmosphere."""
    from cloudml_lib.science.baselines import SHORT

    s, runs = d["summary"], d["runs"]
    settings = list(s)
    flights = list(runs[0]["folds"])

    def per_flight(setting: str, method: str, key: str) -> list[float]:
        mine = [r for r in runs if r["setting"] == setting and method in r["folds"][flights[0]]]
        return [float(np.mean([r["folds"][f][method][key] for r in mine])) for f in flights]

    lines = [
        f"Machine: {describe(d['machine'])}. The demo's five flights (generator version "
        f"{d['demo_generator']}, with its ERA5 files), each the test flight once (nested: its epoch chosen "
        f"on validation data of its own training flights), {d['epochs']} epochs per fold, seeds "
        f"{', '.join(map(str, d['seeds']))}; {d['minutes']} min in all. The network's numbers are the mean "
        "over seeds (+- their spread); the baselines do not depend on the seed.",
        "",
        "| test MAE km (R2) | " + " | ".join(flights) + " | mean of flights |",
        "|---" * (len(flights) + 2) + "|",
    ]
    rows = [(f"network, data.atmosphere {v}", v, "model") for v in settings]
    baselines = [m for m in s[settings[0]]["mean_over_folds"] if m != "model"]
    rows += [(f"baseline: {SHORT.get(m, m)}", settings[0], m) for m in baselines]
    for label, setting, method in rows:
        mae, r2 = per_flight(setting, method, "mae_km"), per_flight(setting, method, "r2")
        overall = s[setting]["mean_over_folds"][method]
        spread = f" +- {fmt(overall['mae_km']['spread_over_seeds'], 3)}" if method == "model" else ""
        lines.append(
            f"| {label} | "
            + " | ".join(f"{fmt(a, 3)} ({fmt(b, 2)})" for a, b in zip(mae, r2))
            + f" | {fmt(overall['mae_km']['mean'], 3)}{spread} ({fmt(overall['r2']['mean'], 2)}) |"
        )
    n = len(d["seeds"])
    lines += [
        "",
        "| test flight | the best without the frames (MAE km, per seed) | the best with them | seeds in "
        "which the frames add nothing |",
        "|---|---|---|---|",
    ]
    names = {
        **SHORT,
        "network none": "network on the frames",
        "network with_frames": "network on frames + atmosphere",
        "network alone": "network on the atmosphere",
    }

    def best(rows: list[dict], key: str) -> str:  # each seed's best, said once where every seed agrees
        said = [f"{names.get(r[key][0], r[key][0])} {fmt(r[key][1], 3)}" for r in rows]
        return said[0] if len(set(said)) == 1 else "; ".join(said)

    for flight, v in d["images"].items():
        a, b = best(v["by_seed"], "frameless"), best(v["by_seed"], "with_frames")
        lines.append(f"| {flight} | {a} | {b} | {v['frames_add_nothing_in_seeds']} of {n} |")
    return lines


def stability_md(d: dict) -> list[str]:
    """The test score from epoch to epoch and seed to seed, with and without the weights' average."""
    lines = [
        f"Machine: {describe(d['machine'])}. The demo ({d['config']}, generator version "
        f"{d['demo_generator']}, 05Mar25 the test flight), seeds {', '.join(map(str, d['seeds']))}, every "
        "epoch's validated weights scored afterwards (a benchmark may look at the test flight each epoch; a "
        "run never does).",
        "",
        "| weights validated and kept | test R2 of the chosen epoch (mean +- spread over seeds) | "
        f"test MAE km | test R2 spread over the last {d['last_epochs']} epochs | validation R2 spread over "
        f"the last {d['last_epochs']} epochs | test R2 change per epoch | validation R2 change per epoch |",
        "|---|---|---|---|---|---|---|",
    ]
    for setting, v in d["summary"].items():
        c = v["chosen_test_r2"]
        lines.append(
            f"| {setting} | {fmt(c['mean'], 3)} +- {fmt(c['spread_over_seeds'], 3)} | "
            f"{fmt(v['chosen_test_mae_km'], 3)} | {fmt(v['test_r2_spread_last_epochs'], 3)} | "
            f"{fmt(v['validation_r2_spread_last_epochs'], 3)} | {fmt(v['test_r2_change_per_epoch'], 3)} | "
            f"{fmt(v['validation_r2_change_per_epoch'], 3)} |"
        )
    lines += ["", "| weights | seed | chosen epoch | every epoch's test R2 |", "|---|---|---|---|"]
    for r in d["runs"]:
        lines.append(
            f"| {r['setting']} | {r['seed']} | {r['chosen_epoch']} | "
            + " ".join(fmt(v, 2) for v in r["test_r2_by_epoch"])
            + " |"
        )
    return lines


def ledger_md(d: dict) -> list[str]:
    """A metrics line's append with the ledger's content record and without it."""
    m = d["ms_per_line_median"]
    return [
        f"Machine: {describe(d['machine'])}. `append_text` of a step record into a claimed run folder, "
        f"{d['blocks']} alternating blocks of {d['lines_per_block']} lines per variant "
        "(`benchmarks/ledger.py`).",
        "",
        "| ledger | ms per metrics line (median of blocks) |",
        "|---|---|",
        f"| names and contents (this release) | {fmt(m['with_content'], 3)} |",
        f"| names only (the fingerprint switched off) | {fmt(m['names_only'], 3)} |",
        "",
        f"Ratio: {fmt(d['with_content_over_names_only'], 2)}.",
    ]


def write_report(results: Path = RESULTS, out: Path = HERE / "RESULTS.md") -> Path:
    sections = [
        ("Data path: the cached loader against the research loader", "data_path", data_path_md),
        ("Preprocessing on every core and the GPU: cache build and predict", "preprocess", preprocess_md),
        ("Checkpoints: stall, overhead, resume start-up", "checkpoint", checkpoint_md),
        ("Trainers: CloudML, a bare loop and PyTorch Lightning", "trainers", trainers_md),
        ("The trainer before and after a change, side by side", "trainer_before_after", before_after_md),
        ("torch.compile against eager", "compile", compile_md),
        ("torch.compile against eager, preset by preset, on the CPU", "compile_presets", compile_presets_md),
        ("Training in channels_last memory format", "memory_format", memory_format_md),
        ("The first expected time against what the epochs take", "expected_time", expected_time_md),
        ("The azimuth flip rule on turning flights", "flip_rule", flip_rule_md),
        ("Cloud / no-cloud: a probe, a joint model or a second model", "cloud_head", cloud_head_md),
        ("Whole flights: each frame encoded once against each window", "predict", predict_md),
        ("Choosing on the test flight: the optimism of CloudML 0.2's protocol", "selection", selection_md),
        ("Steady training: the weights' moving average", "stability", stability_md),
        ("Radiometry and the baselines that see the temperature", "radiometry", radiometry_md),
        ("The flight's atmosphere: do the frames add anything?", "atmosphere", atmosphere_md),
        ("A few labels of a new flight, and intervals on a flight never seen", "adaptation", adaptation_md),
        ("The ledger's content record: a metrics line's cost", "ledger", ledger_md),
        ("The test suite: its time and its coverage", "suite", suite_md),
        ("The slowest tests with their defects put back", "defects", defects_md),
    ]
    lines = [
        "# Benchmark results",
        "",
        "Written by `python -m benchmarks` from `benchmarks/results/*.json` (each file names its machine). "
        "Ratios are measured side by side in one run; no number here is typed by hand.",
        "",
    ]
    for title, name, render in sections:
        d = load(results, name)
        lines += [
            f"## {title}",
            "",
            *(render(d) if d else [f"Not run yet: `python benchmarks/{name}.py`."]),
            "",
        ]
    lines += [
        "## GPU: presets, compile, fp16, memory, predict and resume",
        "",
        *gpu_md(load(results, "gpu")),
        "",
    ]
    out.write_text("\n".join(lines))
    return out


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks")
    p.add_argument("--only", help=f"comma-separated, from {', '.join(BENCHMARKS)}")
    p.add_argument(
        "--report-only", action="store_true", help="only rewrite RESULTS.md from the results files"
    )
    args = p.parse_args()
    names = args.only.split(",") if args.only else list(BENCHMARKS)
    unknown = [n for n in names if n not in BENCHMARKS]
    if unknown:
        p.error(f"unknown benchmark(s) {', '.join(unknown)}; choose from {', '.join(BENCHMARKS)}")
    if not args.report_only:
        run(names)
    print(f"wrote {write_report()}")


if __name__ == "__main__":
    main()
